"""Typed errors. Every message names the thing that is wrong (file, key, step, field) and the fix.

The CLI prints ``str(err)`` on one line and exits with status 2 for any ``MoecompressError``;
tracebacks are reserved for bugs.
"""

from __future__ import annotations


class MoecompressError(Exception):
    """Base class of every error moecompress raises on bad input."""

    exit_code = 2

    def __str__(self) -> str:
        # Messages are one line by contract; user input (paths, keys) may carry newlines.
        return super().__str__().replace("\r", "\\r").replace("\n", "\\n")


class CheckpointError(MoecompressError):
    """A checkpoint directory, shard or index is missing, unreadable or inconsistent."""


class AdapterError(MoecompressError):
    """A checkpoint does not match what the adapter of its ``model_type`` expects."""


class LayoutError(MoecompressError):
    """A weight layout cannot do what was asked (write as stock, wrong shapes, ...)."""


class OutputExistsError(MoecompressError):
    """The output directory exists and overwriting was not requested."""


class RecipeError(MoecompressError):
    """A recipe is malformed or impossible: the message names the step index, step name and field."""


class PassError(MoecompressError):
    """A pass cannot run on this layer with this configuration (found in the dry run or at run time)."""


class MissingStatError(MoecompressError):
    """A pass asked for a calibration statistic that was not collected."""


class ResumeError(MoecompressError):
    """``--resume`` cannot continue: no partial run, or it belongs to a different recipe."""


class MethodError(MoecompressError):
    """A method cannot meet its settings on this input (a ratio, a rank, a group count): raised by the
    pure maths of :mod:`moecompress.methods`; the engine adds the step and layer to the message."""


class RoutingError(MoecompressError):
    """A routing policy asked of a loaded model is malformed or cannot apply (no stored similarity)."""


class MissingExtraError(MoecompressError):
    """A step or command needs an optional dependency that is not installed; the message names the
    ``pip install "moecompress[extra]"`` that brings it."""


class LockedError(MoecompressError):
    """Another run is writing the same output (or computing the same statistics) right now."""


class CacheError(MoecompressError):
    """A statistics-cache file cannot be written, or changed or broke while a run used it."""


class WriteError(MoecompressError):
    """The output (or the cache) cannot be written: disk full, read-only, a rename that is refused."""


class Interrupted(MoecompressError):
    """The run was interrupted (Ctrl-C); the message says what was kept for ``--resume``."""

    exit_code = 130


class CalibrationError(MoecompressError):
    """A calibration source, its files, the tokenizer or the sampling arguments are unusable."""
