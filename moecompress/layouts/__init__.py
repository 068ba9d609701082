"""Weight layouts: how one projection (gate, up or down) of a bank of experts is stored.

One file per layout; :data:`LAYOUTS` is the explicit table of every layout kind, by the ``kind`` name
written in ``config.json`` (``docs/format.md``). Loading reads it; nothing registers itself.
"""

from __future__ import annotations

from moecompress.layouts.base import Layout, member_slots
from moecompress.layouts.codebook import Codebook
from moecompress.layouts.dense import Dense
from moecompress.layouts.lowrank import LowRank
from moecompress.layouts.ragged import Ragged
from moecompress.layouts.rtn import RTN
from moecompress.layouts.tucker import Tucker

LAYOUTS: dict[str, type[Layout]] = {
    cls.kind: cls for cls in (Dense, Ragged, LowRank, Tucker, Codebook, RTN)
}
"""Layout classes by ``kind`` (the on-disk name)."""

__all__ = ["LAYOUTS", "RTN", "Codebook", "Dense", "Layout", "LowRank", "Ragged", "Tucker", "member_slots"]
