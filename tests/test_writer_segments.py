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


def test_a_segmented_tensor_past_the_shard_size_ends_in_its_own_shard(tmp_path):
    """Ending the last unfinished tensor of an over-full shard must not finish that shard first (the
    tensor's bytes are in it): the DeepSeek-V3 chunked heapr write failed this way."""
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(8, 16, generator=g)
    w = ShardWriter(tmp_path / "a", max_shard_size=100)
    w.add("small", torch.ones(4))
    for a in range(0, 8, 2):
        w.append("fused", fused[a : a + 2])
        w.add(f"e.{a}", torch.full((3,), float(a)))
    w.end("fused", fused.shape)
    w.add("after", torch.zeros(2))
    w.commit()
    got = {}
    for shard in sorted((tmp_path / "a").glob("*.safetensors")):
        got.update(load_file(str(shard)))
    assert torch.equal(got["fused"], fused) and torch.equal(got["e.6"], torch.full((3,), 6.0))
    assert sorted(got) == sorted(["small", "fused", "after"] + [f"e.{a}" for a in range(0, 8, 2)])
