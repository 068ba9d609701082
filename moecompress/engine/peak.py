"""This process's resident memory now and at its peak, for the run report and the benchmarks.

Linux: ``VmRSS`` and ``VmHWM`` of ``/proc/self/status``. ``VmHWM`` is the process's own high-water mark
(reset by ``exec``, and by :func:`reset_peak_rss`); ``ru_maxrss`` is not: Linux carries it across
``fork`` and ``exec``, so a child started by a large parent reports the parent's peak. Elsewhere both
fall back to ``ru_maxrss``. Standard library only, so that a benchmark can load this file by path in an
interpreter without moecompress (``benchmarks/peer_speed.py``'s peer side).
"""

from __future__ import annotations

import resource
import sys


def _status_bytes(key: str) -> int | None:
    """``key`` (``VmRSS``, ``VmHWM``) of ``/proc/self/status`` in bytes; ``None`` where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux and BSD


def peak_rss_bytes() -> int:
    """This process's peak resident memory in bytes (``VmHWM``; ``ru_maxrss`` off Linux)."""
    hwm = _status_bytes("VmHWM")
    return _maxrss_bytes() if hwm is None else hwm


def rss_bytes() -> int:
    """This process's current resident memory in bytes (``VmRSS``; off Linux, the peak so far)."""
    rss = _status_bytes("VmRSS")
    return _maxrss_bytes() if rss is None else rss


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current resident memory (Linux ``clear_refs``); ``False`` where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
