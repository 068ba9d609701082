"""The streaming shard writer: files byte-identical to safetensors' own, shards on disk as they fill,
tensors written in pieces, the journal's state/restore, atomic commit/abort."""

from __future__ import annotations

import json
import random
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moecompress.errors import CheckpointError, OutputExistsError
from moecompress.io.writer import ShardWriter

DTYPES = [
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
    torch.complex64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint64, torch.uint32,
    torch.uint16, torch.uint8, torch.bool,
]  # fmt: skip


def _random_tensors(seed: int, n: int) -> dict[str, torch.Tensor]:
    """``n`` tensors of every dtype (random bytes), shapes with zeros and scalars, shuffled names."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        dt = DTYPES[i % len(DTYPES)]
        rank = rnd.randint(1 if dt == torch.float4_e2m1fn_x2 else 0, 3)
        shape = [
            rnd.choice([0, 1, 2, 3, 7]) if rnd.random() < 0.2 else rnd.randint(1, 9) for _ in range(rank)
        ]
        size = torch.empty((), dtype=dt).element_size()
        raw = torch.randint(0, 256, [*shape, size], dtype=torch.uint8, generator=g)
        t = (raw[..., 0] > 127) if dt == torch.bool else raw.view(dt).reshape(shape)
        out[f"model.{rnd.choice('abcxyz')}.{rnd.randint(0, 99)}.w{i}"] = t
    out["model.ünïcode.weight"] = torch.arange(6, dtype=torch.float32)
    out["model.view"] = torch.arange(100, dtype=torch.bfloat16)[10:30]  # a view of a larger storage
    out["model.transposed"] = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    return out


def _reference(tensors: dict[str, torch.Tensor], path: Path) -> bytes:
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return path.read_bytes()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_shard_is_byte_identical_to_save_file_whatever_the_order(tmp_path, seed):
    tensors = _random_tensors(seed, 60)
    items = list(tensors.items())
    random.Random(seed).shuffle(items)  # the writer gets them in any order; the file does not change
    with ShardWriter(tmp_path / "out") as w:
        for name, t in items:
            w.add(name, t)
        out = w.commit()
    got = (out / "model.safetensors").read_bytes()
    assert got == _reference(tensors, tmp_path / "ref.safetensors")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            got_t, want = f.get_tensor(name), t.contiguous()
            assert got_t.shape == want.shape and got_t.dtype == want.dtype, name
            assert torch.equal(got_t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644


def test_shards_are_cut_at_max_shard_size_and_each_equals_save_file(tmp_path):
    tensors = {f"layer.{i}.w": torch.full((100,), float(i), dtype=torch.float32) for i in range(10)}
    with ShardWriter(tmp_path / "out", max_shard_size=1000) as w:  # two 400-byte tensors per shard
        w.add_many(tensors)
        out = w.commit()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 4000
    shards = sorted(out.glob("model-*.safetensors"))
    assert [p.name for p in shards] == [f"model-{k:05d}-of-00005.safetensors" for k in range(1, 6)]
    for k, shard in enumerate(shards):
        names = [f"layer.{i}.w" for i in (2 * k, 2 * k + 1)]
        assert {n for n, f in index["weight_map"].items() if f == shard.name} == set(names)
        ref = _reference({n: tensors[n] for n in names}, tmp_path / f"ref{k}.safetensors")
        assert shard.read_bytes() == ref
    assert not list(out.glob("part-*")) and not list(tmp_path.glob(".out.tmp-*"))


def test_tensor_bytes_are_on_disk_as_soon_as_they_are_added(tmp_path):
    w = ShardWriter(tmp_path / "out", max_shard_size="1MB")
    t = torch.randn(1000)
    w.add("a", t)
    w.add("b", torch.zeros(10, dtype=torch.bfloat16))
    (data,) = w.tmp_dir.glob("part-*.data")
    assert w.buffered_bytes == 4020 == data.stat().st_size
    assert data.read_bytes()[:4000] == t.numpy().tobytes()
    w.make_room(10**6)  # would overflow: the shard is finished now
    assert w.buffered_bytes == 0 and not list(w.tmp_dir.glob("part-*.data"))
    assert load_file(str(w.tmp_dir / "part-00000.safetensors"))["a"].equal(t)
    w.abort()
    assert not tmp_path.joinpath("out").exists() and not list(tmp_path.iterdir())


def test_a_tensor_written_in_pieces_equals_the_whole(tmp_path):
    bank = torch.randn(8, 6, 5).to(torch.bfloat16)  # a stacked expert bank, written 3 experts at a time
    other = torch.arange(7, dtype=torch.int64)
    with ShardWriter(tmp_path / "whole") as w:
        w.add_many({"bank": bank, "other": other})
        whole = w.commit()
    with ShardWriter(tmp_path / "pieces") as w:
        w.add_pieces("bank", torch.bfloat16, (8, 6, 5), (bank[i : i + 3] for i in range(0, 8, 3)))
        w.add("other", other)
        pieces = w.commit()
    assert (pieces / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    ("pieces", "match"),
    [
        ([torch.zeros(2, 5)], r"pieces hold 40 bytes, \[3, 5\] torch.float32 needs 60"),
        ([torch.zeros(2, 5), torch.zeros(2, 5)], r"pieces hold more than \[3, 5\]"),
        (
            [torch.zeros(3, 5, dtype=torch.float16)],
            "a piece is of dtype torch.float16, expected torch.float32",
        ),
        ([torch.zeros(1, 5), torch.empty(2, 5, device="meta")], "a piece is on the meta device"),
    ],
)
def test_bad_pieces_write_nothing(tmp_path, pieces, match):
    before = torch.randn(4)
    w = ShardWriter(tmp_path / "out")
    w.add("before", before)
    with pytest.raises(CheckpointError, match=match):
        w.add_pieces("bad", torch.float32, (3, 5), iter(pieces))
    assert w.buffered_bytes == 16
    w.add("after", torch.ones(2))
    out = w.commit()
    ref = _reference({"before": before, "after": torch.ones(2)}, tmp_path / "ref.safetensors")
    assert (out / "model.safetensors").read_bytes() == ref


def test_refusals(tmp_path):
    w = ShardWriter(tmp_path / "out")
    w.add("a", torch.zeros(2))
    with pytest.raises(CheckpointError, match="'a' written twice"):
        w.add("a", torch.zeros(2))
    with pytest.raises(CheckpointError, match="'m' is on the meta device"):
        w.add("m", torch.empty(3, device="meta"))
    with pytest.raises(CheckpointError, match=r"safetensors cannot store dtype torch\.complex128"):
        w.add("c", torch.zeros(2, dtype=torch.complex128))
    with pytest.raises(CheckpointError, match="__metadata__"):
        w.add("__metadata__", torch.zeros(2))
    w.abort()
    with pytest.raises(CheckpointError, match="no tensors were written"):
        ShardWriter(tmp_path / "empty").commit()
    (tmp_path / "exists").mkdir()
    with pytest.raises(OutputExistsError, match="already exists"):
        ShardWriter(tmp_path / "exists")


def test_state_and_restore_drop_unfinished_and_later_shards(tmp_path):
    tensors = {f"t{i}": torch.full((50,), float(i)) for i in range(9)}  # 200 bytes each
    clean = ShardWriter(tmp_path / "clean", max_shard_size=600)
    clean.add_many(tensors)
    clean.commit()

    staged = tmp_path / "staged"
    w = ShardWriter(staged, max_shard_size=600, staged=True)
    for i in range(3):
        w.add(f"t{i}", tensors[f"t{i}"])
    w.flush()
    journal = json.loads(json.dumps(w.state()))  # the journal's copy: one finished shard
    assert journal == {"shards": [["t0", "t1", "t2"]], "total_size": 600}
    for i in range(3, 8):  # a crash: a later finished shard and an unfinished data file are left
        w.add(f"t{i}", tensors[f"t{i}"])
    assert w.state() == {"shards": [["t0", "t1", "t2"], ["t3", "t4", "t5"]], "total_size": 1200}
    assert {p.name for p in staged.glob("part-*")} == {
        "part-00000.safetensors", "part-00001.safetensors", "part-00002.data",
    }  # fmt: skip
    del w  # (the crashed process)

    again = ShardWriter(staged, max_shard_size=600, staged=True)
    again.restore(journal)
    assert {p.name for p in staged.glob("part-*")} == {"part-00000.safetensors"}
    assert again.buffered_bytes == 0
    for i in range(3, 9):
        again.add(f"t{i}", tensors[f"t{i}"])
    again.commit()
    for name in ("model.safetensors.index.json", *(f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3))):
        assert (staged / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name
    assert not list(staged.glob("part-*"))


def test_transformers_loads_a_checkpoint_written_in_shards(tmp_path):
    from transformers import AutoModelForCausalLM

    from moecompress.testing import save_tiny

    src = tmp_path / "src"
    save_tiny("qwen3_moe", src, fused=True)
    (shard,) = src.glob("*.safetensors")
    state = load_file(str(shard))
    with ShardWriter(tmp_path / "dst", max_shard_size="100KB") as w:
        for name in sorted(state):
            t = state[name]
            if t.dim() == 3:  # stacked experts: chunk by chunk
                w.add_pieces(name, t.dtype, t.shape, t.split(3))
            else:
                w.add(name, t)
        dst = w.commit()
    shutil.copy(src / "config.json", dst / "config.json")
    assert len(list(dst.glob("model-*.safetensors"))) > 1
    a = AutoModelForCausalLM.from_pretrained(src).state_dict()
    b = AutoModelForCausalLM.from_pretrained(dst).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_without_copy_file_range_the_shard_is_the_same(tmp_path, monkeypatch):
    import errno
    import os

    def unsupported(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    tensors = _random_tensors(7, 30)
    monkeypatch.setattr("moecompress.io.shard_format._COPY_CHUNK", 5)  # many short copies
    monkeypatch.setattr(os, "copy_file_range", unsupported)
    with ShardWriter(tmp_path / "out") as w:
        w.add_many(tensors)
        out = w.commit()
    assert (out / "model.safetensors").read_bytes() == _reference(tensors, tmp_path / "ref.safetensors")


def test_load_buffer_views_the_tensors_of_safetensors_bytes_without_copying():
    """What a rank receives: every tensor equal to safetensors' ``load`` of the same bytes (dtype, shape,
    values), each a view into the buffer; an unaligned tensor falls back to ``load``."""
    from safetensors.torch import load, save

    from moecompress.io.shard_format import load_buffer

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=g), "i": torch.arange(7), "b": torch.randn(4, generator=g).bfloat16(),
               "m": torch.tensor([True, False, True]), "q": torch.randn(2, 2, generator=g).to(torch.float8_e4m3fn),
               "e": torch.zeros(0, 4), "u": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g)}  # fmt: skip
    raw = save(tensors)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    got, want = load_buffer(buf), load(raw)
    assert got.keys() == want.keys() == tensors.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
        if got[k].numel():
            assert buf.data_ptr() <= got[k].data_ptr() < buf.data_ptr() + len(buf), k
    shifted = torch.frombuffer(bytearray(b"\0" + raw), dtype=torch.uint8)[1:]  # every offset odd
    moved = load_buffer(shifted)
    assert all(torch.equal(moved[k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items())


def _other_process_file(path: Path, tensors: list[torch.Tensor]) -> list[int]:
    """What another rank does (``wire.UnitFiles``): the tensors' bytes one after another in a file of its
    own; their offsets."""
    offsets, off = [], 0
    with open(path, "wb") as f:
        for t in tensors:
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            offsets.append(off)
            f.write(raw)
            off += len(raw)
    return offsets


@pytest.mark.parametrize("seed", [0, 1])
def test_bytes_from_adopted_files_make_the_same_shards(tmp_path, seed):
    """Tensors whose bytes another process wrote (added or appended as segments from its files) make the
    file byte-identical to safetensors' own, and each adopted file is deleted once its bytes are in a
    shard (at release when the shard is finished already, else at the shard's flush)."""
    tensors = {k: v for k, v in _random_tensors(seed, 40).items() if v.dtype != torch.float4_e2m1fn_x2}
    names = list(tensors)
    rnd = random.Random(seed)
    fused = torch.arange(24 * 5, dtype=torch.bfloat16).reshape(24, 5)  # an [E, ...] tensor in 3 segments
    ref = dict(tensors, **{"model.fused": fused})
    files = []
    with ShardWriter(tmp_path / "out", max_shard_size=600) as w:
        for k in range(0, len(names), 7):
            mine = names[k : k + 7]
            if rnd.random() < 0.5:  # this one is written here
                for n in mine:
                    w.add(n, tensors[n])
                continue
            path = tmp_path / f"unit{k}.data"
            seg = fused[8 * len(files) : 8 * len(files) + 8] if len(files) < 3 else None
            offs = _other_process_file(path, [tensors[n] for n in mine] + ([seg] if seg is not None else []))
            w.adopt(path)
            for n, o in zip(mine, offs, strict=False):
                w.add_from(n, tensors[n].dtype, tensors[n].shape, path, o)
            if seg is not None:
                w.append_from("model.fused", torch.bfloat16, path, offs[-1], seg.numel() * 2)
            w.release(path)
            files.append(path)
        for j in range(len(files), 3):  # the segments no other process wrote
            w.append("model.fused", fused[8 * j : 8 * j + 8])
        w.end("model.fused", fused.shape)
        assert len(files) >= 2
        out = w.commit()
    assert not any(p.exists() for p in files)
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(str(f)))
    raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731 (random bytes hold NaNs)
    assert sorted(got) == sorted(ref)
    assert all(got[n].shape == ref[n].shape and torch.equal(raw(got[n]), raw(ref[n])) for n in ref)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
    for f in sorted(out.glob("*.safetensors")):  # every shard as save_file writes its tensors
        with safe_open(str(f), "pt") as s:
            mine = {n: s.get_tensor(n) for n in s.keys()}
        assert f.read_bytes() == _reference(mine, tmp_path / "ref.safetensors")


def test_an_adopted_files_bytes_count_towards_the_shard_size(tmp_path):
    a, b = torch.ones(100, dtype=torch.float32), torch.zeros(100, dtype=torch.float32)
    path = tmp_path / "u.data"
    offs = _other_process_file(path, [a, b])
    with ShardWriter(tmp_path / "out", max_shard_size=500) as w:
        w.adopt(path)
        w.add_from("a", a.dtype, a.shape, path, offs[0])
        assert w.buffered_bytes == 400
        w.add_from("b", b.dtype, b.shape, path, offs[1])  # 800 > 500: "a" is finished first
        assert w.buffered_bytes == 400 and path.exists()
        w.release(path)
        assert path.exists()  # "b" is not in a shard yet
        out = w.commit()
    assert not path.exists()
    assert len(list(out.glob("model-*.safetensors"))) == 2


def test_an_adopted_file_too_short_or_missing_is_one_line_and_abort_deletes_it(tmp_path):
    path = tmp_path / "u.data"
    _other_process_file(path, [torch.ones(4)])
    with ShardWriter(tmp_path / "out") as w:
        with pytest.raises(CheckpointError, match=r"cannot read .*missing\.data"):
            w.adopt(tmp_path / "missing.data")
        with pytest.raises(CheckpointError, match="is not adopted"):
            w.add_from("x", torch.float32, [4], path, 0)
        w.adopt(path)
        with pytest.raises(CheckpointError, match=r"holds no bytes 8\.\.24"):
            w.add_from("x", torch.float32, [4], path, 8)
        assert not w.written("x")
        w.add_from("x", torch.float32, [4], path, 0)
    assert not path.exists() and not (tmp_path / "out").exists()


def test_punch_drops_exactly_the_range_it_is_given(tmp_path):
    """A scratch file's copied bytes are punched out (read as zeros); the bytes around them, in the same
    4 KiB blocks too, stay. Where the file system cannot punch, ``_punch`` says so and changes nothing."""
    import os
    import sys

    from moecompress.io.shard_format import _fallocate, _punch

    data = bytes(random.Random(3).getrandbits(8) for _ in range(3 * 4096 + 123))
    path = tmp_path / "scratch.data"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        a, b = 1000, 2 * 4096 + 77  # a whole block inside, partial blocks at both ends
        punched = _punch(fd, a, b - a)
        assert not _punch(fd, 5, 0)
    finally:
        os.close(fd)
    got = path.read_bytes()
    assert len(got) == len(data)
    if sys.platform.startswith("linux"):
        assert _fallocate() is not None
    want = data[:a] + bytes(b - a) + data[b:] if punched else data
    assert got == want


def test_every_copied_range_is_punched_once_after_it_is_copied(tmp_path, monkeypatch):
    """Finishing a shard punches each range of its data file and of its adopted files out once, after the
    range is in the shard (the shard stays save_file's)."""
    from moecompress.io import writer as writer_mod
    from moecompress.io.shard_format import _punch

    calls = []

    def spy(fd, start, count):
        calls.append((fd, start, count))
        return _punch(fd, start, count)

    monkeypatch.setattr(writer_mod, "_punch", spy)
    tensors = _random_tensors(5, 30)
    names = list(tensors)
    path = tmp_path / "unit.data"
    offs = _other_process_file(path, [tensors[n] for n in names[:10]])
    with ShardWriter(tmp_path / "out") as w:
        w.adopt(path)
        for n, o in zip(names[:10], offs, strict=True):
            w.add_from(n, tensors[n].dtype, tensors[n].shape, path, o)
        w.release(path)
        for n in names[10:]:
            w.add(n, tensors[n])
        out = w.commit()
    assert (out / "model.safetensors").read_bytes() == _reference(tensors, tmp_path / "ref.safetensors")
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    assert sorted(c for _, _, c in calls if c) == sorted(s for s in sizes if s)
    real = [c for c in calls if c[2]]  # empty tensors share offsets
    assert len(set(real)) == len(real) and len({fd for fd, _, _ in real}) == 2
