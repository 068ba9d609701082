"""``ShardWriter.append``/``end``: a tensor written in segments, with other tensors added in between,
gives the file ``safetensors.torch.save_file`` writes; unfinished or short tensors are refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from moecompress.errors import CheckpointError
from moecompress.io.writer import ShardWriter


def test_segments_interleaved_equal_save_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(6, 4, 3, generator=g).to(torch.bfloat16)
    codes = torch.randint(0, 255, (6, 5), dtype=torch.uint8, generator=g)
    per = {f"e.{i}.w": torch.randn(2, 3, generator=g) for i in range(6)}
    w = ShardWriter(tmp_path / "a")
    for a in range(0, 6, 4):  # chunks of experts: per-expert tensors and pieces of the fused ones
        for i in range(a, min(a + 4, 6)):
            w.add(f"e.{i}.w", per[f"e.{i}.w"])
        w.append("fused", fused[a : a + 4])
        w.append("codes", codes[a : a + 4])
    assert sorted(w.pending) == ["codes", "fused"]
    w.end("fused", fused.shape)
    w.end("codes", codes.shape)
    w.add("router", torch.ones(6, 3))
    w.commit()
    save_file({"fused": fused, "codes": codes, "router": torch.ones(6, 3), **per}, str(tmp_path / "b.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert torch.equal(load_file(str(tmp_path / "a" / "model.safetensors"))["fused"], fused)


def test_unfinished_or_short_segments_are_refused(tmp_path):
    w = ShardWriter(tmp_path / "a", max_shard_size=16)
    w.append("x", torch.zeros(4))
    w.add("y", torch.zeros(8))  # over the shard size: no shard is finished while x is unfinished
    with pytest.raises(CheckpointError, match="unfinished"):
        w.flush()
    with pytest.raises(CheckpointError, match="needs"):
        w.end("x", [5])
    with pytest.raises(CheckpointError, match="dtype"):
        w.append("z", torch.zeros(1))
        w.append("z", torch.zeros(1, dtype=torch.int64))
