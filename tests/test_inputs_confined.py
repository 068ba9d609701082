"""Nothing outside the model folder is read, copied or pushed (issue 22, the input side).

Index entries and symlinks are confined to the checkpoint directory (a Hub cache snapshot may link
into its repo's ``blobs/``); malformed index content is one line naming the file; an output carries
only the allow-listed non-weight files; a push uploads only what moecompress writes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import moecompress
from moecompress.cli import main
from moecompress.errors import CheckpointError
from moecompress.hub import push as push_mod
from moecompress.io import reader as reader_mod
from moecompress.io.checkpoint import is_model_file
from moecompress.io.reader import INDEX_NAME
from moecompress.testing import save_tiny

TOKENIZER = {
    "tokenizer.json": '{"version": "1.0"}',
    "tokenizer_config.json": '{"model_max_length": 8}',
    "special_tokens_map.json": "{}",
    "tokenizer.model": "sp",
    "chat_template.jinja": "{{ messages }}",
    "LICENSE": "Apache-2.0",
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny sharded Qwen3-MoE checkpoint, built once; tests copy it."""
    path = tmp_path_factory.mktemp("base") / "ckpt"
    save_tiny("qwen3_moe", path, max_shard_size="100KB")
    assert len(set(json.loads((path / INDEX_NAME).read_text())["weight_map"].values())) > 2
    return path


@pytest.fixture
def ckpt(base, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(base, dst)
    return dst


@pytest.fixture
def opened(monkeypatch) -> list[Path]:
    """Every path ``safe_open`` is asked to open, resolved."""
    seen: list[Path] = []
    real = reader_mod.safe_open

    def recording(path, *args, **kwargs):
        seen.append(Path(path).resolve())
        return real(path, *args, **kwargs)

    monkeypatch.setattr(reader_mod, "safe_open", recording)
    return seen


def _index(path: Path) -> dict:
    return json.loads((path / INDEX_NAME).read_text())


def _point_first_shard_at(path: Path, entry: str) -> tuple[str, list[str]]:
    """Rewrite the index so the first shard's tensors are listed under ``entry``."""
    index = _index(path)
    first = sorted(set(index["weight_map"].values()))[0]
    names = [k for k, v in index["weight_map"].items() if v == first]
    index["weight_map"].update(dict.fromkeys(names, entry))
    (path / INDEX_NAME).write_text(json.dumps(index))
    return first, names


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "etc_passwd"])
def test_index_entry_outside_is_refused_unopened(ckpt, tmp_path, opened, kind):
    other = tmp_path / "other"
    other.mkdir()
    first = sorted(set(_index(ckpt)["weight_map"].values()))[0]
    shutil.copy(ckpt / first, other / first)  # a valid shard outside: the old reader compressed it
    entry = {
        "dotdot": f"../other/{first}",
        "absolute": str(other / first),
        "etc_passwd": "../../../../etc/passwd",
    }[kind]
    _point_first_shard_at(ckpt, entry)
    with pytest.raises(CheckpointError) as err:
        moecompress.open_checkpoint(ckpt)
    text = _one_line(err)
    assert str(ckpt / INDEX_NAME) in text and repr(entry) in text
    assert opened == []  # no shard at all was opened, the outside one least of all


def test_symlinked_shard_leaving_the_folder_is_refused(ckpt, tmp_path, opened):
    outside = tmp_path / "elsewhere.safetensors"
    first = sorted(set(_index(ckpt)["weight_map"].values()))[0]
    shutil.move(ckpt / first, outside)
    (ckpt / first).symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as err:
        moecompress.open_checkpoint(ckpt)
    assert first in _one_line(err) and INDEX_NAME in str(err.value)
    assert outside.resolve() not in opened


def test_symlinked_shard_inside_the_folder_is_read(ckpt):
    first = sorted(set(_index(ckpt)["weight_map"].values()))[0]
    (ckpt / "store").mkdir()
    shutil.move(ckpt / first, ckpt / "store" / "blob")
    (ckpt / first).symlink_to(Path("store") / "blob")
    c = moecompress.open_checkpoint(ckpt)
    assert first in c.reader.shards
    some = next(k for k in c.reader.keys if c.reader._shard_of[k] == first)
    assert c.reader.get(some).shape == c.reader.shape(some)


def test_hub_cache_snapshot_with_blob_symlinks_opens(base, tmp_path, opened):
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(base.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    c = moecompress.open_checkpoint(snap)
    layer = c.read_layer(c.moe_layer_indices[0])
    assert layer.experts.gate.shape[0] == c.config.num_experts
    assert all((repo / "blobs").resolve() in p.parents for p in opened)
    assert [p.name for p in c.non_weight_files()] == ["generation_config.json"]
    assert c.skipped_files() == []


def test_hub_cache_snapshot_link_leaving_the_repo_is_refused(base, tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "rev"
    (repo / "blobs").mkdir(parents=True)
    shutil.copytree(base, snap)
    first = sorted(set(_index(snap)["weight_map"].values()))[0]
    shutil.move(snap / first, tmp_path / "loose.safetensors")
    (snap / first).symlink_to(Path("..") / ".." / ".." / ".." / "loose.safetensors")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        moecompress.open_checkpoint(snap)


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        '"weight_map"',
        '{"metadata": {}}',
        '{"weight_map": []}',
        '{"weight_map": {}}',
        '{"weight_map": {"model.embed_tokens.weight": 3}}',
        '{"weight_map": {"model.embed_tokens.weight": null}}',
        '{"weight_map": {"model.embed_tokens.weight": ""}}',
        '{"weight_map": {"": "model-00001-of-00011.safetensors"}}',
        '{"weight_map": {"model.embed_tokens.weight": ["a.safetensors"]}}',
        "{not json",
    ],
)
def test_malformed_index_is_one_line(ckpt, content, capsys):
    (ckpt / INDEX_NAME).write_text(content)
    with pytest.raises(CheckpointError) as err:
        moecompress.open_checkpoint(ckpt)
    text = _one_line(err)
    assert str(ckpt / INDEX_NAME) in text and "re-save" in text
    assert main(["info", str(ckpt)]) == 2
    printed = capsys.readouterr().err.strip()
    assert printed.startswith("error: ") and "\n" not in printed and "Traceback" not in printed


def test_config_json_leaving_the_folder_is_refused(ckpt, tmp_path):
    shutil.move(ckpt / "config.json", tmp_path / "config.json")
    (ckpt / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json links outside"):
        moecompress.open_checkpoint(ckpt)


# ------------------------------------------------------------------------------ what is copied
def _add_input_files(path: Path, tmp_path: Path) -> Path:
    for name, text in TOKENIZER.items():
        (path / name).write_text(text)
    (path / "credentials.json").write_text('{"token": "hf_SECRET"}')
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    (path / "notes.txt").symlink_to(secret)
    (path / "LICENSE.md").symlink_to(secret)  # an allowed name, but it leaves the folder
    (path / "original").mkdir()
    (path / "original" / "consolidated.safetensors").write_text("x")
    return secret


def test_non_weight_files_is_an_allow_list(ckpt, tmp_path):
    _add_input_files(ckpt, tmp_path)
    c = moecompress.open_checkpoint(ckpt)
    assert [p.name for p in c.non_weight_files()] == sorted([*TOKENIZER, "generation_config.json"])
    assert c.skipped_files() == ["LICENSE.md", "credentials.json", "notes.txt", "original/"]
    assert "credentials.json" in [p.name for p in c.non_weight_files(["credentials.json"])]
    assert "credentials.json" not in c.skipped_files(["credentials.json"])
    assert is_model_file("LICENSE-MIT") and is_model_file("spiece.model") and is_model_file("cl100k.tiktoken")
    assert not is_model_file("licensed_credentials.json") and not is_model_file("LICENSE.safetensors")


@pytest.mark.parametrize(
    "name, why",
    [
        ("missing.json", "is not a file"),
        ("original/consolidated.safetensors", "path separator"),
        ("original", "is not a file"),
        ("config.json", "weight, index or config.json"),
        (INDEX_NAME, "weight, index or config.json"),
        ("model-00001-of-00011.safetensors", "weight, index or config.json"),
        ("notes.txt", "links outside"),
    ],
)
def test_bad_extra_names_are_one_line(ckpt, tmp_path, name, why):
    _add_input_files(ckpt, tmp_path)
    c = moecompress.open_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=why) as err:
        c.non_weight_files([name])
    assert repr(name) in _one_line(err) and str(ckpt) in str(err.value)


@pytest.fixture(scope="module")
def run_out(base, tmp_path_factory) -> Path:
    """``apply`` (identity) on an input folder with a credentials file and an outside symlink."""
    root = tmp_path_factory.mktemp("run")
    src = root / "in"
    shutil.copytree(base, src)
    _add_input_files(src, root)
    out = root / "out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        moecompress.apply(
            {
                "model": str(src),
                "output": str(out),
                "calibration": {"source": "random", "samples": 4, "seq_len": 8},
                "steps": [{"identity": {}}],
            },
            progress=False,
        )
    finally:
        torch.set_num_threads(threads)
    return out


def test_apply_copies_only_allowed_files(run_out):
    names = {p.name for p in run_out.iterdir()}
    assert set(TOKENIZER) <= names and "generation_config.json" in names
    assert not names & {"credentials.json", "notes.txt", "LICENSE.md", "original"}
    assert not any(p.is_symlink() for p in run_out.rglob("*"))
    assert all(b"outside" not in p.read_bytes() for p in run_out.rglob("*") if p.is_file())


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a dry run must not create a Hub client")

    monkeypatch.setattr(push_mod, "HfApi", refuse)


def test_push_dry_run_lists_only_what_moecompress_writes(run_out, tmp_path, no_network, capsys):
    out = tmp_path / "out"
    shutil.copytree(run_out, out)
    (out / "credentials.json").write_text('{"token": "hf_SECRET"}')
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    (out / "notes.txt").symlink_to(secret)
    (out / "LICENSE.md").symlink_to(secret)
    (out / "steps" / "x.json").write_text("{}")
    (out / "linked").symlink_to(tmp_path, target_is_directory=True)
    assert main(["push", str(out), "--repo-id", "me/x", "--dry-run"]) == 0
    summary = json.loads(capsys.readouterr().out)
    files = set(summary["files"])
    assert set(TOKENIZER) <= files and {"config.json", "recipe.yaml", "report.json", "README.md"} <= files
    assert any(f.startswith("steps/") and f.endswith("report.md") for f in files)
    assert not files & {"credentials.json", "notes.txt", "LICENSE.md", "steps/x.json"}
    assert not any(f.startswith("linked") for f in files)
    assert {"credentials.json", "notes.txt", "LICENSE.md", "steps/x.json", "linked/"} <= set(
        summary["skipped"]
    )
    preview = Path(summary["folder"])
    on_disk = {p.relative_to(preview).as_posix() for p in preview.rglob("*") if p.is_file()}
    assert on_disk == files and not any(p.is_symlink() for p in preview.rglob("*"))
    assert all(b"outside" not in (preview / f).read_bytes() for f in on_disk)
    assert os.listdir(out) and (out / "credentials.json").exists()  # the folder itself is untouched
