"""Model card and Hub push, offline: the card's metadata and body, the exact upload set, the dry-run
folder, the client calls (a fake ``HfApi``) and that a token never reaches a file or the output."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
import yaml
from huggingface_hub.utils import filter_repo_objects

import moecompress
from moecompress.cli import main
from moecompress.errors import CheckpointError, MoecompressError, OutputExistsError
from moecompress.hub import card as card_mod
from moecompress.hub import push as push_mod
from moecompress.hub.card import base_repo_id, card_inputs, front_matter, model_card, write_model_card
from moecompress.hub.push import HubError, check_repo_id, push, upload_files
from moecompress.testing import save_tiny

TOKEN = "hf_SECRET123"
BASE_CARD = "---\nlicense: apache-2.0\nlanguage: [en]\n---\n\n# tiny base\n"
JUNK = [".moecompress-cache/x", ".out.partial/model.safetensors", ".hidden", "journal.json", "w.partial"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real tiny run (analyze + identity) whose base directory has a README with a license."""
    root = tmp_path_factory.mktemp("run")
    base = root / "base"
    save_tiny("qwen3_moe", base)
    (base / "README.md").write_text(BASE_CARD)
    out = root / "out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest, and immune to a busy machine
    try:
        moecompress.apply(
            {
                "model": str(base),
                "output": str(out),
                "calibration": {"source": "random", "samples": 4, "seq_len": 8},
                "steps": [{"analyze": {}}, {"identity": {}}],
            },
            progress=False,
        )
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture
def out(run_dir, tmp_path) -> Path:
    """A private copy of the run output with junk a push must leave out."""
    dst = tmp_path / "out"
    shutil.copytree(run_dir, dst)
    for rel in JUNK:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        (dst / rel).write_text("junk")
    return dst


class FakeApi:
    """Records what push asks of the Hub client; ``fail`` makes upload_folder raise."""

    calls: ClassVar[list] = []
    fail: ClassVar[Exception | None] = None

    def __init__(self, token=None, **kwargs):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, *, private=None, exist_ok=False, **kwargs):
        self.calls.append(("create_repo", repo_id, {"private": private, "exist_ok": exist_ok, **kwargs}))

    def upload_folder(self, *, folder_path, repo_id, allow_patterns=None, **kwargs):
        self.calls.append(("upload_folder", folder_path, repo_id, allow_patterns))
        if self.fail is not None:
            raise self.fail
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0123")


@pytest.fixture
def fake_api(monkeypatch):
    cls = type("Fake", (FakeApi,), {"calls": [], "fail": None})
    monkeypatch.setattr(push_mod, "HfApi", cls)
    return cls


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a dry run must not create a Hub client")

    monkeypatch.setattr(push_mod, "HfApi", refuse)


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _expected(folder: Path) -> set[str]:
    return {f for f in _tree(folder) if f not in JUNK}


# ------------------------------------------------------------------------------------------------ card
def test_card_of_a_real_run(run_dir):
    report = json.loads((run_dir / "report.json").read_text())
    text = model_card(run_dir, **card_inputs(run_dir))
    meta = front_matter(text)
    assert text.startswith("---\n")
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["license"] == "apache-2.0"  # from the base directory's README.md
    assert meta["tags"] == ["moe", "moecompress"]  # analyze/identity are no step kind
    assert "base_model" not in meta and "base_model_relation" not in meta  # local base
    summary = next(line for line in text.splitlines() if line.startswith("A Mixture-of-Experts"))
    assert "local checkpoint directory (`base`)" in summary and str(run_dir.parent) not in summary
    assert "base model was a local directory" in text
    for s in report["steps"]:
        row = next(line for line in text.splitlines() if line.startswith(f"| {s['step']} | `{s['name']}`"))
        assert f"{s['params_before']:,} → {s['params_after']:,}" in row
        assert "582.00 KiB → 582.00 KiB" in row and s["bytes_before"] == 582 * 1024
    assert "- source: `random`" in text and "4 sequences × 8 tokens = 32 tokens" in text
    recipe = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(recipe) == report["recipe"]
    assert "loads with plain transformers" in text and "AutoModelForCausalLM.from_pretrained" in text
    assert "received no calibration tokens" in text  # run warnings
    written = (run_dir / "README.md").read_text()  # the card `apply` wrote
    loads = [line for line in written.splitlines() if "from_pretrained(" in line]
    assert loads and all(f'from_pretrained("{run_dir.name}"' in line for line in loads), loads
    assert "Base architecture: `qwen3_moe` (Qwen3MoeForCausalLM)" in written  # the class is named where it belongs


RUN = {
    "recipe": {"model": "Qwen/Qwen3-30B-A3B", "calibration": {"source": "builtin"}, "steps": []},
    "model": "Qwen/Qwen3-30B-A3B",
    "moecompress_version": "0.1.0",
    "warnings": [],
}


def _run(*names: str) -> dict:
    steps = [
        {
            "step": i,
            "name": n,
            "params_before": 100,
            "params_after": 50,
            "bytes_before": 400,
            "bytes_after": 200,
        }
        for i, n in enumerate(names, 1)
    ]
    return {**RUN, "steps": steps}


@pytest.mark.parametrize(
    "names, relation, kinds",
    [
        (
            ("analyze", "heapr", "namex", "mystery", "codequant"),
            "quantized",
            ["pruned", "merged", "quantized"],
        ),
        (("tdmoe", "rtn"), "quantized", ["decomposed", "quantized"]),
        (("heapr", "namex"), "finetune", ["pruned", "merged"]),
        (("identity",), "finetune", []),
    ],
)
def test_relation_and_tags(tmp_path, monkeypatch, names, relation, kinds):
    monkeypatch.chdir(tmp_path)  # no local directory named Qwen/...
    text = model_card(tmp_path / "o", run=_run(*names))
    meta = front_matter(text)
    assert meta["base_model"] == "Qwen/Qwen3-30B-A3B"
    assert meta["base_model_relation"] == relation
    assert meta["tags"] == ["moe", "moecompress", *kinds]
    assert "license" not in meta  # no base card
    assert f"`base_model_relation: {relation}`" in text
    assert "100 → 50 (-50.0 %)" in text


def test_license_and_base_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    other = "---\nlicense: other\nlicense_name: qwen\nlicense_link: https://x/LICENSE\n---\nbody"
    meta = front_matter(model_card(tmp_path, run=_run("heapr"), base_card=other))
    assert (meta["license"], meta["license_name"], meta["license_link"]) == (
        "other",
        "qwen",
        "https://x/LICENSE",
    )
    assert "license" not in front_matter(model_card(tmp_path, run=_run(), base_card="# no header\n"))
    assert base_repo_id("/cache/hub/models--Qwen--Qwen3-30B-A3B/snapshots/abc123") == "Qwen/Qwen3-30B-A3B"
    assert base_repo_id("./Qwen/Qwen3") is None and base_repo_id("/data/x") is None
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert base_repo_id("org/name") is None  # an existing local path wins, as in resolve_checkpoint_dir


def test_evaluation_experts_loadability(tmp_path):
    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}
    ev = {
        "texts": ["/home/someone/data/wiki.txt"],
        "token_source": "text",
        "seq_len": 256,
        "windows": 4,
        "tokens": 1020,
        "perplexity": 9.5,
        "base_perplexity": 9.0,
        "kl": 0.031,
        "top1_agreement": 0.91,
        "tokens_per_second": 1000.0,
        "base_tokens_per_second": 800.0,
    }
    run = {**_run("heapr"), "experts_kept": {"0": [0, 2, 5], "1": 6}}
    text = model_card(tmp_path, run=run, base_config=cfg, evaluation=ev, loadability="moecompress")
    assert "| base | 9 | — | — | 800 | +0 |" in text
    assert "| this model | 9.5 | 0.031 | 0.91 | 1000 | +0.5 |" in text
    assert "`wiki.txt`" in text and "/home/someone" not in text
    assert "| 0 | 3 of 8 (0, 2, 5) |" in text and "| 1 | 6 of 8 |" in text
    assert "pip install moecompress" in text and "import moecompress" in text and "vLLM" in text
    rows = {
        "rows": [{"model": "base", "perplexity": 2.0}, {"model": "pruned", "perplexity": 2.5}],
        "set": "x",
    }
    assert "| pruned | 2.5 | +0.5 |" in model_card(tmp_path, run=_run(), evaluation=rows)
    plain = model_card(tmp_path, run=_run())
    assert "## Evaluation" not in plain and "## Experts kept" not in plain and "vLLM" not in plain
    with pytest.raises(ValueError, match="loadability"):
        model_card(tmp_path, run=_run(), loadability="vllm")
    assert (
        card_mod.infer_loadability({"quantization_config": {"quant_method": "compressed-tensors"}}) == "stock"
    )
    assert card_mod.infer_loadability({"quantization_config": {"quant_method": "codequant"}}) == "moecompress"
    assert card_mod.infer_loadability({"moecompress": {"loadability": "moecompress"}}) == "moecompress"


def test_write_model_card_is_atomic(tmp_path):
    path = write_model_card(tmp_path, run=_run("heapr"), name="qwen3-pruned")
    assert "# qwen3-pruned\n" in path.read_text() and 'from_pretrained("qwen3-pruned"' in path.read_text()
    assert path == tmp_path / "README.md" and front_matter(path.read_text())["tags"][-1] == "pruned"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]


# ------------------------------------------------------------------------------------------------ push
def test_dry_run_is_the_upload_folder(out, no_network):
    before = _tree(out)
    expected = _expected(out)
    # the run wrote its own card (not the base model's), inheriting the base card's license
    assert before["README.md"] != BASE_CARD.encode()
    assert front_matter(before["README.md"].decode())["license"] == "apache-2.0"
    assert set(upload_files(out)) == expected
    res = push(out, "me/tiny", dry_run=True)
    staging = out.parent / "out.push-preview"
    assert res["dry_run"] is True and res["folder"] == str(staging) and res["card"] == "existing"
    assert set(res["files"]) == expected
    # what is left out is listed, hidden folders once; a run's own output leaves nothing else out
    assert res["skipped"] == sorted(
        [".hidden", ".moecompress-cache/", ".out.partial/", "journal.json", "w.partial"]
    )
    assert set(_tree(staging)) == set(res["files"])  # nothing hidden, cached or partial
    assert res["bytes"] == sum(len(b) for b in _tree(staging).values())
    assert all(_tree(staging)[f] == before[f] for f in expected)
    card = (staging / "README.md").read_text()
    assert "moecompress" in front_matter(card)["tags"] and front_matter(card)["license"] == "apache-2.0"
    assert _tree(out) == before  # the original is untouched
    with pytest.raises(OutputExistsError, match="already exists"):
        push(out, "me/tiny", dry_run=True)
    other = push(out, "me/tiny", dry_run=True, staging=out.parent / "preview2")
    assert other["files"] == res["files"]
    with pytest.raises(HubError, match="inside"):
        push(out, "me/tiny", dry_run=True, staging=out / "steps" / "p")
    assert not list(out.parent.glob(".*.tmp"))

    (out / "README.md").unlink()  # no card at all: generated into the copy only
    res = push(out, "me/tiny", dry_run=True, staging=out.parent / "preview3")
    assert res["card"] == "generated" and "README.md" in res["files"]
    assert not (out / "README.md").exists()


def test_existing_readme_is_kept(out, no_network):
    (out / "README.md").write_text("---\nlicense: mit\n---\nmine\n")
    res = push(out, "me/tiny", dry_run=True)
    assert res["card"] == "existing"
    assert (Path(res["folder"]) / "README.md").read_text() == "---\nlicense: mit\n---\nmine\n"


def test_push_calls_the_client(out, fake_api):
    res = push(out, "me/tiny", private=True, token="tok")
    init, create, upload = fake_api.calls
    assert init == ("init", "tok")
    assert create == ("create_repo", "me/tiny", {"private": True, "exist_ok": True})
    assert upload[:3] == ("upload_folder", str(out), "me/tiny")
    # huggingface_hub's own filter over the folder keeps exactly the listed files
    on_disk = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()]
    assert sorted(filter_repo_objects(on_disk, allow_patterns=upload[3])) == res["files"]
    assert set(res["files"]) == _expected(out) and res["card"] == "existing"
    assert "moecompress" in front_matter((out / "README.md").read_text())["tags"]  # card written first
    assert res["commit_url"].endswith("/me/tiny/commit/0123") and res["private"] is True


def test_token_is_never_written_or_printed(out, tmp_path, fake_api, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["push", str(out), "--repo-id", "me/tiny"]) == 0
    assert fake_api.calls[0] == ("init", TOKEN)  # handed to the client, and only there
    assert main(["push", str(out), "--repo-id", "me/tiny", "--dry-run"]) == 0
    fake_api.fail = RuntimeError(f"401 Client Error for token {TOKEN}\nAuthorization: Bearer {TOKEN}")
    fake_api.fail.response = SimpleNamespace(status_code=401)
    assert main(["push", str(out), "--repo-id", "me/tiny"]) == 2
    printed = capsys.readouterr()
    assert TOKEN not in printed.out + printed.err
    assert json.loads(printed.out.split("\n}\n")[0] + "\n}")["repo_id"] == "me/tiny"
    err = printed.err.strip().splitlines()
    assert (
        len(err) == 1 and err[0].startswith("error: push to 'me/tiny' failed") and "authentication" in err[0]
    )
    for root, _, names in os.walk(tmp_path):
        for name in names:
            assert TOKEN.encode() not in (Path(root) / name).read_bytes(), Path(root) / name


@pytest.mark.parametrize(
    "bad", ["bad", "a/b/c", "me/", "/x", "me/a--b", "me/x..y", "me/-x", "me/x.git", "me/a b"]
)
def test_bad_repo_id_is_one_line_exit_2(out, bad, capsys, no_network):
    assert main(["push", str(out), "--repo-id", bad, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: repo id") and "owner/name" in err
    assert check_repo_id("me/qwen3-30b.pruned_v1") == "me/qwen3-30b.pruned_v1"


def test_bad_folders(tmp_path, fake_api):
    with pytest.raises(HubError, match="not a directory"):
        push(tmp_path / "nope", "me/x")
    (tmp_path / "d").mkdir()
    with pytest.raises(HubError, match=r"no config\.json"):
        push(tmp_path / "d", "me/x")
    (tmp_path / "d" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no report\.json"):
        push(tmp_path / "d", "me/x")
    fake_api.fail = ConnectionError("Failed to resolve 'huggingface.co'")
    (tmp_path / "d" / "README.md").write_text("card")
    with pytest.raises(MoecompressError, match="could not be reached") as info:
        push(tmp_path / "d", "me/x")
    assert "\n" not in str(info.value)
    assert [c[0] for c in fake_api.calls] == ["init", "create_repo", "upload_folder"]


def test_a_copied_base_card_is_regenerated(out, no_network):
    (out / "README.md").write_text(BASE_CARD)  # e.g. an output written by an older moecompress
    res = push(out, "me/tiny", dry_run=True, staging=out.parent / "preview-regen")
    assert res["card"] == "regenerated"
    card = (out.parent / "preview-regen" / "README.md").read_text()
    assert card != BASE_CARD and "moecompress" in front_matter(card)["tags"]
    assert (out / "README.md").read_text() == BASE_CARD
