"""Compression passes, one file each, registered in :mod:`moecompress.registry` on import.

Add a pass by creating a module here and importing it below.
"""

from moecompress.passes import analyze, identity

__all__ = ["analyze", "identity"]
