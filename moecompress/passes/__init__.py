"""Compression passes, one file each; registered with the recipe engine's pass registry."""
