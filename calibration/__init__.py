"""Calibration sources and statistics capture (installed as ``moecompress.calibration``).

``load_token_ids`` turns a recipe's calibration ``source`` (``builtin``, ``file:PATH``, ``hf:NAME``,
``random``) into deterministic ``[samples, seq_len]`` token-id windows with a held-out ``eval`` split;
``source_fingerprint`` is the matching cache key. The statistics-capture modules of this package are
imported by name.
"""

from .sources import CalibrationError, load_token_ids, source_fingerprint

__all__ = ["CalibrationError", "load_token_ids", "source_fingerprint"]
