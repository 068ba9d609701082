"""Checkpoint I/O: streaming shard reader, atomic sharding writer, Hub resolution."""

from moecompress.io.hub import resolve_checkpoint_dir
from moecompress.io.outputs import check_output_dir, parse_size
from moecompress.io.reader import ShardReader
from moecompress.io.writer import ShardWriter

__all__ = ["ShardReader", "ShardWriter", "check_output_dir", "parse_size", "resolve_checkpoint_dir"]
