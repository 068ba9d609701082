"""Loading checkpoints written by moecompress (stock or compressed) as transformers models."""

from moecompress.runtime.loading import load

__all__ = ["load"]
