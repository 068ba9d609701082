"""Compression passes, one file each, registered in :mod:`moecompress.registry` on import.

Add a pass by creating a module here and importing it below.
"""

from moecompress.passes import ablate, analyze, identity, super_experts

__all__ = ["ablate", "analyze", "identity", "super_experts"]
