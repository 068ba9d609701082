"""Evaluation: KL / top-1 / perplexity on the held-out split, deterministic windows, CLI and errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from tiny import save_tiny
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moecompress.calibration.builtin_text import builtin_texts
from moecompress.cli import main as cli_main
from moecompress.errors import MoecompressError
from moecompress.runtime.loading import load
from moecompress.tools.evaluation import _windows, evaluate, held_out_ids

SHARED = Path(__file__).resolve().parents[2] / "shared"
VOCAB = 300
SEQ = 32  # tiny models have max_position_embeddings = 64
MARK = "QUOKKAZEBRA"


def _tokenizer(model_dir: Path) -> None:
    """A byte-level BPE trained on the builtin text (as in test_calibration_sources.py)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([text for _, text in builtin_texts()], trainer=trainer)
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    out = {"base": root / "base", "other": root / "other", "notok": root / "notok"}
    save_tiny("qwen3_moe", out["base"], vocab_size=VOCAB)
    save_tiny("qwen3_moe", out["other"], vocab_size=VOCAB, seed=1)
    save_tiny("qwen3_moe", out["notok"], vocab_size=VOCAB)
    _tokenizer(out["base"])
    shutil.copy(out["base"] / "tokenizer.json", out["other"] / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A 50,000-character file whose marker words sit only in its last 2% (the eval split)."""
    filler = "\n\n".join(text for _, text in builtin_texts())[:49_000]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(filler + (f" {MARK}" * 100)[:1000])
    return path


def run(model, **kw):
    return evaluate(model, **{"seq_len": SEQ, "max_tokens": 16 * SEQ, **kw})


def _stable(result: dict) -> dict:
    """The result without its timings."""
    return {
        k: v for k, v in result.items() if k not in ("seconds", "tokens_per_second", "base_tokens_per_second")
    }


def test_model_against_itself(dirs):
    r = run(dirs["base"], against=dirs["base"])
    assert r["kl"] == 0.0 and r["top1_agreement"] == 1.0
    assert r["perplexity"] == r["base_perplexity"] and r["loss"] == r["base_loss"]
    assert r["windows"] == 16 and r["tokens"] == 16 * (SEQ - 1) and r["seq_len"] == SEQ
    assert r["texts"] == ["builtin"] and r["dtype"] == "float32" and r["against"] == str(dirs["base"])
    assert 1 < r["perplexity"] < 2 * VOCAB and r["tokens_per_second"] > 0
    json.dumps(r, allow_nan=False)


def test_perturbed_model_has_positive_kl(dirs):
    r = run(dirs["other"], against=dirs["base"], batch_size=3)  # 16 windows: a ragged last batch
    assert r["kl"] > 1e-3 and 0 <= r["top1_agreement"] < 1
    assert r["perplexity"] != r["base_perplexity"]
    alone = run(dirs["base"])
    assert math.isclose(r["base_perplexity"], alone["perplexity"], rel_tol=1e-6)  # batch 3 vs 4
    assert "kl" not in alone and alone["against"] is None


def test_perplexity_equals_transformers_loss_on_the_same_windows(dirs, corpus):
    """Rebuild the windows independently (tokenizers library) and compare with model(ids, labels=ids)."""
    text = corpus.read_text()
    held_out = text[len(text) - len(text) // 50 :]
    ids = torch.tensor(Tokenizer.from_file(str(dirs["base"] / "tokenizer.json")).encode(held_out).ids)
    fit, n = ids.numel() // SEQ, 6
    assert fit > n  # the windows are a spread-out subset, not the first n
    windows = torch.stack([ids[(i * fit // n) * SEQ :][:SEQ] for i in range(n)])
    model = load(dirs["base"])
    with torch.no_grad():
        loss = torch.stack([model(w[None], labels=w[None]).loss for w in windows]).mean()
    r = run(dirs["base"], texts=[corpus], max_tokens=n * SEQ + SEQ // 2, batch_size=4)
    assert r["windows"] == n and r["split_tokens"] == ids.numel()
    assert math.isclose(r["perplexity"], math.exp(float(loss)), rel_tol=1e-5)


def test_windows_are_deterministic_disjoint_and_spread_out(dirs):
    ids = torch.arange(1000)
    w = _windows(ids, 10, 250)
    assert w.shape == (25, 10) and w.unique().numel() == 250
    assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(25, 9, dtype=torch.int64))  # contiguous
    assert torch.equal(w[:, 0] % 10, torch.zeros(25, dtype=torch.int64)) and int(w[-1, 0]) == 960
    assert _windows(ids, 10, 10**6).shape == (100, 10)  # short split: all of it
    assert _stable(run(dirs["base"], against=dirs["other"])) == _stable(
        run(dirs["base"], against=dirs["other"])
    )


def test_text_files_use_only_the_held_out_split(dirs, corpus, tmp_path):
    decode = Tokenizer.from_file(str(dirs["base"] / "tokenizer.json")).decode
    ids = held_out_ids([corpus], dirs["base"])
    assert MARK in decode(ids.tolist()) and "QUOKKA" not in decode(
        held_out_ids(["builtin"], dirs["base"]).tolist()
    )
    assert len(decode(ids.tolist())) == 1000  # exactly the last 2% of 50,000 characters
    by_path = run(dirs["base"], texts=[str(corpus)], max_tokens=4 * SEQ)
    assert (
        by_path["perplexity"] == run(dirs["base"], texts=[f"file:{corpus}"], max_tokens=4 * SEQ)["perplexity"]
    )
    assert by_path["texts"] == [str(corpus)]
    (tmp_path / "a.txt").write_text(corpus.read_text())
    (tmp_path / "b.txt").write_text("\n".join(t for _, t in builtin_texts()[:12]))
    both = _stable(run(dirs["base"], texts=[tmp_path / "a.txt", tmp_path / "b.txt"], max_tokens=8 * SEQ))
    by_dir = _stable(run(dirs["base"], texts=[tmp_path], max_tokens=8 * SEQ))  # a directory: sorted *.txt
    assert both.pop("texts") != by_dir.pop("texts") and both == by_dir
    assert both["split_tokens"] > by_path["split_tokens"]


def test_loaded_models_and_package_level_call(dirs):
    import moecompress as mc

    model, base = load(dirs["base"]), load(dirs["other"])
    r = mc.evaluate(model, against=base, seq_len=SEQ, max_tokens=4 * SEQ)
    p = run(dirs["base"], against=dirs["other"], max_tokens=4 * SEQ)
    assert (r["perplexity"], r["kl"], r["top1_agreement"]) == (p["perplexity"], p["kl"], p["top1_agreement"])
    assert r["model"] == str(dirs["base"]) and not model.training


def test_random_tokens_need_no_tokenizer(dirs):
    r = run(dirs["notok"], against=dirs["notok"], token_source="random")
    assert r["kl"] == 0.0 and r["windows"] == 16 and r["texts"] == [] and r["token_source"] == "random"


def test_cli_prints_json_and_writes_it(dirs, corpus, tmp_path, capsys):
    out = tmp_path / "eval.json"
    argv = ["eval", str(dirs["other"]), "--against", str(dirs["base"]), "--text", str(corpus)]
    argv += ["--text", str(corpus), "--seq-len", str(SEQ), "--max-tokens", "128", "--batch-size", "2"]
    assert cli_main([*argv, "--json", str(out), "-q"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["texts"] == [str(corpus)] * 2 and printed["windows"] == 4 and printed["kl"] > 0
    assert {"perplexity", "tokens", "tokens_per_second", "top1_agreement", "base_perplexity"} <= set(printed)


def _cli_error(argv, capsys) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_errors_are_one_line(dirs, tmp_path, capsys):
    assert "does not exist" in _cli_error(["eval", str(tmp_path / "nope"), "-q"], capsys)
    err = _cli_error(["eval", str(dirs["notok"]), "--text", str(tmp_path), "-q"], capsys)
    assert "no tokenizer files" in err and "--text cannot help" in err and str(dirs["notok"]) in err
    err = _cli_error(["eval", str(dirs["base"]), "--against", str(tmp_path / "nope"), "-q"], capsys)
    assert "nope does not exist" in err
    assert "missing.txt does not exist" in _cli_error(
        ["eval", str(dirs["base"]), "--text", str(tmp_path / "missing.txt"), "-q"], capsys
    )
    assert "exceeds max_position_embeddings = 64" in _cli_error(["eval", str(dirs["base"]), "-q"], capsys)
    err = _cli_error(["eval", str(dirs["base"]), "--seq-len", "32", "--max-tokens", "16"], capsys)
    assert "less than one window" in err
    err = _cli_error(["eval", str(dirs["base"]), "--seq-len", "32", "--batch-size", "0"], capsys)
    assert "batch_size must be an integer >= 1" in err
    (tmp_path / "short.txt").write_text("a few words " * 10)
    err = _cli_error(["eval", str(dirs["base"]), "--text", str(tmp_path / "short.txt"), "-q"], capsys)
    assert "held-out split has only" in err
    with pytest.raises(MoecompressError, match="pass tokenizer=DIR"):
        run(torch.nn.Linear(2, 2))
    with pytest.raises(MoecompressError, match="token_source must be one of text, random"):
        run(dirs["base"], token_source="wiki")


@pytest.mark.shared
def test_shared_reference_model_against_itself():
    model = SHARED / "data" / "models" / "ref-qwen3moe"
    text = SHARED / "data" / "corpus" / "python_docs.txt"
    if not ((model / "tokenizer.json").is_file() and text.is_file()):
        pytest.skip("../shared reference data is absent")
    r = evaluate(model, against=model, texts=[text], max_tokens=2048, seq_len=256)
    assert r["kl"] == 0.0 and r["top1_agreement"] == 1.0 and r["tokens"] == 8 * 255
    assert r["perplexity"] == r["base_perplexity"] and 1 < r["perplexity"] < 200


def test_hf_text_source_gives_the_same_evaluation_as_the_file(dirs, corpus):
    pytest.importorskip("datasets")
    by_file = _stable(run(dirs["base"], texts=[str(corpus)], max_tokens=4 * SEQ))
    by_hf = _stable(run(dirs["base"], texts=[f"hf:text:{corpus}"], max_tokens=4 * SEQ))
    assert by_hf.pop("texts") == [f"hf:text:{corpus}"] and by_file.pop("texts") == [str(corpus)]
    assert by_hf == by_file and by_hf["windows"] == 4


def test_task_arguments_need_tasks(dirs):
    with pytest.raises(MoecompressError, match=r"pass tasks=\[...\] \(--tasks\) too"):
        run(dirs["base"], limit=3)
    with pytest.raises(MoecompressError, match="tasks must name lm-eval tasks"):
        run(dirs["base"], tasks=[])
