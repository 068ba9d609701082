"""The ``builtin`` calibration text: docstrings of a fixed list of Python standard-library modules.

It exists on every machine with no download, so quickstarts and tests calibrate offline. It is real
English and technical prose (about 0.6 MB, roughly 150k tokens with a typical 32k-150k BPE vocabulary).

One text per module, in sorted module order: the module docstring, then the docstrings of its public
classes and functions (sorted by name) and of the public methods each class defines itself. Docstrings
are cleaned with :func:`inspect.getdoc` / :func:`inspect.cleandoc` and repeated ones are dropped within
a module. The text varies slightly across Python versions (and ``os.path`` across platforms); the
calibration fingerprint hashes the text itself, so caches never mix versions. A module that cannot be
imported on this interpreter is skipped.
"""

from __future__ import annotations

import importlib
import inspect

BUILTIN_MODULES: tuple[str, ...] = tuple(
    sorted(
        (
            "abc", "argparse", "ast", "base64", "bisect", "calendar", "codecs", "collections",
            "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
            "difflib", "doctest", "email", "enum", "fnmatch", "fractions", "functools", "getopt",
            "graphlib", "heapq", "html.parser", "http.client", "inspect", "io", "ipaddress",
            "itertools", "json", "logging", "mimetypes", "numbers", "operator", "os.path", "pathlib",
            "pprint", "queue", "random", "re", "sched", "shlex", "shutil", "statistics", "string",
            "struct", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "types",
            "typing", "unittest", "urllib.parse", "uuid", "warnings", "weakref",
        )
    )
)  # fmt: skip


def builtin_texts() -> list[tuple[str, str]]:
    """Return ``[(module_name, text), ...]`` in sorted module order; deterministic for one interpreter."""
    texts = []
    for name in BUILTIN_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a stripped-down interpreter; the fingerprint still covers what we used
            continue
        text = _module_text(module)
        if text:
            texts.append((name, text))
    return texts


def _module_text(module) -> str:
    parts: list[str] = []
    seen: set[str] = set()

    def add(doc: str | None) -> None:
        if doc and doc.strip() and doc not in seen:
            seen.add(doc)
            parts.append(doc.strip())

    add(inspect.getdoc(module))
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        add(inspect.getdoc(obj))
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                doc = getattr(member, "__doc__", None)
                if not attr.startswith("_") and inspect.isroutine(member) and isinstance(doc, str):
                    add(inspect.cleandoc(doc))
    return "\n\n".join(parts)
