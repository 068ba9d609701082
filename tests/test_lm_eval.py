"""lm-evaluation-harness on loaded models: bundled offline tasks, task YAML dirs, the wiring, CLI and card."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest
import torch
from tiny import save_tiny
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moecompress.calibration import sources, tokenizing
from moecompress.calibration.builtin_text import builtin_texts
from moecompress.cli import main as cli_main
from moecompress.errors import MissingExtraError, MoecompressError
from moecompress.runtime.loading import load
from moecompress.tools import lm_eval as mlm
from moecompress.tools.evaluation import evaluate

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

SHARED = Path(__file__).resolve().parents[2] / "shared"
VOCAB, SEQ = 300, 32  # tiny models have max_position_embeddings = 64
TASKS = ["moecompress_nextword", "moecompress_continuation"]


# --- the bundled task data and the code that built it -------------------------------------------------

FILES = ("devil.txt", "jargon.txt", "kjv.txt", "python_docs.txt")
PER_FILE, CONTEXT_WORDS = 50, 24
WORD = re.compile(r"[A-Za-z]{3,}")


def build_tasks(corpus: Path) -> tuple[list[dict], list[dict]]:
    """The bundled documents from the held-out split (last 2 %) of the corpus files; deterministic."""
    nextword, continuation = [], []
    for name in FILES:
        text = sources._split_text((corpus / name).read_text(encoding="utf-8"), "eval")
        spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
        vocab = sorted({w for s, e in spans if WORD.fullmatch(w := text[s:e])})
        ok = [
            i
            for i in range(CONTEXT_WORDS, len(spans))
            if WORD.fullmatch(text[slice(*spans[i])]) and text[spans[i - 1][1] : spans[i][0]] == " "
        ]
        rng = random.Random(f"moecompress:{name}")
        for k, i in enumerate(sorted(rng.sample(ok, 2 * PER_FILE))):
            context, word = text[spans[i - CONTEXT_WORDS][0] : spans[i - 1][1]], text[slice(*spans[i])]
            if k % 2 == 0:
                choices = [word, *rng.sample([w for w in vocab if w.lower() != word.lower()], 3)]
                rng.shuffle(choices)
                doc = {"source": name, "context": context, "choices": choices, "label": choices.index(word)}
                nextword.append(doc)
            else:
                continuation.append({"source": name, "context": context, "target": word})
    return nextword, continuation


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (mlm.TASK_DATA / name).read_text().splitlines()]


def test_bundled_task_data_is_well_formed():
    nextword, continuation = _jsonl("nextword.jsonl"), _jsonl("continuation.jsonl")
    assert len(nextword) == len(continuation) == PER_FILE * len(FILES)
    for doc in nextword:
        assert len(doc["choices"]) == len({c.lower() for c in doc["choices"]}) == 4
        assert 0 <= doc["label"] < 4 and WORD.fullmatch(doc["choices"][doc["label"]])
        assert len(doc["context"].split()) == CONTEXT_WORDS
    assert all(WORD.fullmatch(d["target"]) and len(d["context"].split()) == CONTEXT_WORDS for d in continuation)
    labels = [d["label"] for d in nextword]
    assert min(labels.count(i) for i in range(4)) > len(labels) // 8  # shuffled, not always one slot


@pytest.mark.shared
def test_bundled_task_data_is_what_the_builder_makes_from_the_corpus():
    corpus = SHARED / "data" / "corpus"
    if not all((corpus / f).is_file() for f in FILES):
        pytest.skip("../shared corpus is absent")
    nextword, continuation = build_tasks(corpus)
    assert nextword == _jsonl("nextword.jsonl") and continuation == _jsonl("continuation.jsonl")
    for doc in nextword[:20]:  # the true next word follows the context in the held-out text
        text = sources._split_text((corpus / doc["source"]).read_text(), "eval")
        assert f"{doc['context']} {doc['choices'][doc['label']]}" in text


# --- tiny models with a tokenizer ----------------------------------------------------------------------


def _tokenizer(model_dir: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([text for _, text in builtin_texts()], trainer=trainer)
    tok.save(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lm") / "tiny"
    save_tiny("qwen3_moe", d, vocab_size=VOCAB)
    _tokenizer(d)
    return d


def _perturbed(directory: Path) -> torch.nn.Module:
    """The model of ``directory`` changed in memory only: a reload from disk would give other logits."""
    model = load(directory)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.add_(torch.randn(emb.shape, generator=gen) * emb.std())
    return model


def _our_loglikelihood(model, tok, context: str, continuation: str, max_length: int) -> float:
    """log p(continuation | context) from ``model`` directly, tokenised and truncated as lm-eval does."""
    whole = tok.encode(context + continuation, add_special_tokens=False)
    cont = whole[len(tok.encode(context, add_special_tokens=False)) :]
    inp = whole[-(max_length + 1) :][:-1]
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([inp])).logits[0].float().log_softmax(-1)
    picked = logp[len(inp) - len(cont) :].gather(-1, torch.tensor(cont)[:, None])
    return float(picked.sum())


def _count_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_harness_scores_exactly_our_loaded_model(tiny_dir):
    from lm_eval.api.instance import Instance

    model, tok = _perturbed(tiny_dir), tokenizing._load_tokenizer(tiny_dir)
    calls = _count_forwards(model)
    lm = mlm.wrap(model, tok)
    assert lm.model is model and lm.max_length == 64
    docs = _jsonl("nextword.jsonl")[:3]
    pairs = [(d["context"], " " + c) for d in docs for c in d["choices"]]
    requests = [Instance("loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    theirs = [ll for ll, _ in lm.loglikelihood(requests)]
    assert calls[0] > 0
    ours = [_our_loglikelihood(model, tok, c, x, 64) for c, x in pairs]
    assert theirs == pytest.approx(ours, abs=1e-4)
    fresh = load(tiny_dir)  # what a harness reloading the path would score: it must differ
    other = [_our_loglikelihood(fresh, tok, c, x, 64) for c, x in pairs]
    assert max(abs(a - b) for a, b in zip(theirs, other)) > 1e-2


def test_evaluate_runs_the_bundled_tasks_on_the_loaded_model(tiny_dir):
    model, tok = _perturbed(tiny_dir), tokenizing._load_tokenizer(tiny_dir)
    limit = 12
    r = evaluate(model, tokenizer=tiny_dir, seq_len=SEQ, max_tokens=2 * SEQ, tasks=TASKS, limit=limit)
    assert set(r["tasks"]) == set(TASKS) and r["task_harness"]["limit"] == limit and "perplexity" in r
    nextword, continuation = r["tasks"]["moecompress_nextword"], r["tasks"]["moecompress_continuation"]
    assert nextword["samples"] == continuation["samples"] == limit
    assert 0 <= continuation["exact_match,first-word"] <= 1 and 0 <= nextword["acc_norm"] <= 1
    hits = 0  # acc recomputed from our model's own logits on the first `limit` documents
    for doc in _jsonl("nextword.jsonl")[:limit]:
        lls = [_our_loglikelihood(model, tok, doc["context"], " " + c, 64) for c in doc["choices"]]
        hits += int(max(range(4), key=lls.__getitem__) == doc["label"])
    assert nextword["acc"] == hits / limit
    calls = _count_forwards(model)
    again = evaluate(model, tokenizer=tiny_dir, seq_len=SEQ, max_tokens=SEQ, tasks=TASKS[:1], limit=limit)
    assert calls[0] > 1 and again["tasks"]["moecompress_nextword"] == nextword  # deterministic


def test_task_dir_yaml_configs_run_offline(tiny_dir, tmp_path):
    data = mlm.TASK_DATA / "nextword.jsonl"
    (tmp_path / "mine.yaml").write_text(
        "task: my_nextword\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\nmetadata:\n  version: 1.0\n"
    )
    model = load(tiny_dir)
    kw = {"tokenizer": tiny_dir, "seq_len": SEQ, "max_tokens": SEQ, "limit": 10}
    mine = evaluate(model, tasks="my_nextword", task_dir=tmp_path, **kw)["tasks"]["my_nextword"]
    bundled = evaluate(model, tasks=["moecompress_nextword"], **kw)["tasks"]["moecompress_nextword"]
    assert mine["acc"] == bundled["acc"] and mine["samples"] == 10


def _cli_error(argv, capsys) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_cli_tasks_in_json_and_model_card(tiny_dir, tmp_path, capsys):
    import moecompress as mc

    out = tmp_path / "out"
    mc.apply(str(Path(__file__).resolve().parents[1] / "recipes" / "identity.yaml"), [f"model={tiny_dir}", f"output={out}", "calibration.source=random"],
             progress=False)  # fmt: skip
    base_card = (out / "README.md").read_text() if (out / "README.md").is_file() else ""
    argv = ["eval", str(out), "--against", str(tiny_dir), "--tasks", ",".join(TASKS), "--limit", "3"]
    argv += ["--seq-len", str(SEQ), "--max-tokens", str(2 * SEQ), "--card", "--json", str(tmp_path / "e.json"), "-q"]
    assert cli_main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "e.json").read_text())
    assert printed["tasks"] == printed["base_tasks"]  # identity: the same weights
    assert printed["tasks"]["moecompress_nextword"]["samples"] == 3 and printed["kl"] == 0.0
    card = (out / "README.md").read_text()
    assert card != base_card and "moecompress_nextword acc" in card and "lm-evaluation-harness" in card
    acc = printed["tasks"]["moecompress_nextword"]["acc"]
    front = card.split("---\n")[1]
    import yaml

    index = yaml.safe_load(front)["model-index"][0]["results"]
    assert {r["dataset"]["name"] for r in index} == set(TASKS)
    assert {m["type"]: m["value"] for m in index[0]["metrics"]}["acc"] == acc


def test_task_errors_are_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    base = ["eval", str(tiny_dir), "--seq-len", str(SEQ), "--max-tokens", str(SEQ), "-q"]
    assert "is not a directory of lm-eval task YAML" in _cli_error(
        [*base, "--tasks", TASKS[0], "--task-dir", str(tmp_path / "none")], capsys
    )
    assert "holds no *.yaml" in _cli_error([*base, "--tasks", TASKS[0], "--task-dir", str(tmp_path)], capsys)
    assert "limit must be an integer >= 1" in _cli_error([*base, "--tasks", TASKS[0], "--limit", "0"], capsys)
    assert "pass tasks=[...] (--tasks) too" in _cli_error([*base, "--limit", "3"], capsys)
    assert "tasks must name lm-eval tasks" in _cli_error([*base, "--tasks", " , "], capsys)
    err = _cli_error([*base, "--card"], capsys)
    assert "no README.md and no report.json" in err
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # blocks the import, as for an absent package
    with pytest.raises(MissingExtraError, match=r'needs lm_eval, which is not installed: pip install "moecompress\[eval\]"'):
        evaluate(tiny_dir, seq_len=SEQ, max_tokens=SEQ, tasks=TASKS)


@pytest.mark.slow
def test_unknown_task_names_are_one_line(tmp_path):
    (tmp_path / "t.yaml").write_text("task: other\n")  # indexes lm-eval's own tasks too: a minute
    with pytest.raises(MoecompressError, match=r"unknown lm-eval task.*no_such_task_xyz.*--task-dir") as err:
        mlm.run_tasks(None, None, ["no_such_task_xyz"], task_dir=tmp_path)
    assert "\n" not in str(err.value)


@pytest.mark.shared
def test_shared_reference_model_on_the_bundled_tasks():
    ref = SHARED / "data" / "models" / "ref-qwen3moe"
    if not (ref / "tokenizer.json").is_file():
        pytest.skip("../shared reference data is absent")
    r = evaluate(ref, seq_len=256, max_tokens=256, tasks=TASKS[:1], limit=20)  # generation: tiny tests
    nextword = r["tasks"]["moecompress_nextword"]
    assert nextword["samples"] == 20 and nextword["acc"] > 0.25  # better than chance among 4 words
