"""Calibration sources: forms, held-out split, determinism, fingerprints and every error, offline."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moecompress.calibration import sources, tokenizing
from moecompress.calibration.builtin_text import builtin_texts
from moecompress.calibration.sources import CalibrationError, load_token_ids, source_fingerprint
from moecompress.errors import MissingExtraError, MoecompressError

SHARED = Path(__file__).resolve().parents[2] / "shared"
MARK = "QUOKKAZEBRA"


def _save_tokenizer(model_dir: Path, vocab_size: int, special: list[str] | None = None) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet, special_tokens=special or [], show_progress=False
    )
    tok.train_from_iterator([text for _, text in builtin_texts()], trainer=trainer)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": tok.get_vocab_size()}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("model")
    _save_tokenizer(d, 300)
    return d


@pytest.fixture(scope="module")
def decode(model_dir):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return lambda ids: tok.decode(ids.tolist())


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A 50,000-character file whose marker words sit only in its last 2% (the eval split)."""
    filler = "\n\n".join(text for _, text in builtin_texts())[:49_000]
    tail = (f" {MARK}" * 100)[:1000]
    path = tmp_path / "corpus.txt"
    path.write_text(filler + tail)
    assert len(path.read_text()) == 50_000
    return path


def load(source, model_dir, **kw):
    args = {"samples": 4, "seq_len": 32, "seed": 0} | kw
    return load_token_ids(source, model_dir=model_dir, **args)


def fingerprint(source, model_dir, **kw):
    args = {"samples": 4, "seq_len": 32, "seed": 0} | kw
    return source_fingerprint(source, model_dir=model_dir, **args)


def test_builtin_shape_dtype_and_determinism(model_dir):
    ids = load("builtin", model_dir, samples=8, seq_len=64, seed=3)
    assert ids.shape == (8, 64) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < 300
    assert torch.equal(ids, load("builtin", model_dir, samples=8, seq_len=64, seed=3))
    assert not torch.equal(ids, load("builtin", model_dir, samples=8, seq_len=64, seed=4))
    assert not torch.equal(ids, load("builtin", model_dir, samples=8, seq_len=64, seed=3, split="eval"))


def test_calibration_and_eval_come_from_disjoint_text(corpus, model_dir, decode):
    source = f"file:{corpus}"
    n_tokens = len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(corpus.read_text()[:49_000]))
    cal = load(source, model_dir, samples=n_tokens // 16, seq_len=16)  # disjoint windows: all of it
    assert all("QUOKKA" not in decode(row) for row in cal)
    ev = load(source, model_dir, samples=16, seq_len=40, split="eval")
    assert all(MARK in decode(row) for row in ev)


def test_file_path_dir_and_comma_list_forms(tmp_path, model_dir):
    texts = [text for _, text in builtin_texts()][:12]
    data = tmp_path / "data"
    data.mkdir()
    (data / "b.txt").write_text("\n".join(texts[: len(texts) // 2]))
    (data / "a.txt").write_text("\n".join(texts[len(texts) // 2 :]))
    (data / "notes.md").write_text("ignored: not a .txt file")
    a, b = data / "a.txt", data / "b.txt"
    assert torch.equal(load(f"file:{a}", model_dir), load(str(a), model_dir))
    by_dir = load(str(data), model_dir, samples=16)
    assert torch.equal(by_dir, load(f"file:{data}", model_dir, samples=16))
    assert torch.equal(by_dir, load(f"file:{a}, {b}", model_dir, samples=16))  # sorted: a then b
    assert not torch.equal(by_dir, load(f"file:{b},{a}", model_dir, samples=16))
    assert fingerprint(str(data), model_dir) == fingerprint(f"file:{a},{b}", model_dir)


def test_tokenizer_config_loads_with_auto_tokenizer_and_eos_joins_files(tmp_path):
    _save_tokenizer(tmp_path, 300, special=["<eos>"])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = tokenizing._load_tokenizer(tmp_path)
    eos = tok.convert_tokens_to_ids("<eos>")
    assert tok.eos_token_id == eos
    ids = tokenizing._tokenise(tok, ["hello world " * 20, "", "goodbye moon " * 20])
    assert int((ids == eos).sum()) == 1  # one separator between the two non-empty texts
    (tmp_path / "a.txt").write_text("hello world " * 200)
    assert load(f"file:{tmp_path / 'a.txt'}", tmp_path).shape == (4, 32)


def test_random_source_needs_no_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50}))
    ids = load("random", tmp_path, samples=3, seq_len=1000, seed=1)
    assert ids.shape == (3, 1000) and ids.dtype == torch.int64
    assert int(ids.min()) == 0 and int(ids.max()) == 49
    assert torch.equal(ids, load("random", tmp_path, samples=3, seq_len=1000, seed=1))
    assert not torch.equal(ids, load("random", tmp_path, samples=3, seq_len=1000, seed=2))
    assert not torch.equal(ids, load("random", tmp_path, samples=3, seq_len=1000, seed=1, split="eval"))


def test_windows_are_disjoint_when_text_suffices_and_overlap_is_logged(caplog):
    ids = torch.arange(1003)
    out = sources._windows(ids, 100, 10, seed=0, what="t")
    assert out.shape == (100, 10) and out.unique().numel() == 1000
    assert torch.equal(out[:, 1:] - out[:, :-1], torch.ones(100, 9, dtype=torch.int64))
    with caplog.at_level(logging.INFO, logger=sources.__name__):
        out = sources._windows(torch.arange(50), 10, 10, seed=0, what="t")
    assert out.shape == (10, 10) and "windows overlap" in caplog.text


def _bad_dirs(tmp_path: Path, model_dir: Path) -> dict[str, Path]:
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "short.txt").write_text("just a few words")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00 not utf-8 \x80")
    (tmp_path / "noconfig").mkdir()
    return {"empty": empty, "model": model_dir, "notok": tmp_path / "noconfig", "tmp": tmp_path}


@pytest.mark.parametrize(
    ("source", "where", "kw", "match"),
    [
        ("builtin", "model", {"samples": 0}, "samples must be an integer >= 1, got 0"),
        ("builtin", "model", {"seq_len": 1}, "seq_len must be an integer >= 2, got 1"),
        ("builtin", "model", {"seed": -1}, "seed must be an integer"),
        ("builtin", "model", {"split": "test"}, "split must be one of calibration, eval; got 'test'"),
        ("webtext", "model", {}, "'webtext' is neither a known form.*use builtin, random, file:PATH"),
        ("", "model", {}, "source must be a non-empty string"),
        ("file:{tmp}/missing.txt", "model", {}, "missing.txt does not exist"),
        ("file:{tmp}/short.txt,", "model", {}, r"expected file:PATH\[,PATH...\]"),
        ("file:{empty}", "model", {}, "empty contains no \\*.txt files"),
        ("file:{tmp}/binary.txt", "model", {}, "binary.txt is not UTF-8 text"),  # fingerprint: bytes only
        (
            "file:{tmp}/short.txt",
            "model",
            {},
            r"has only \d+ tokens, fewer than seq_len \+ 1 = 33; lower seq_len",
        ),
        ("builtin", "notok", {}, "no tokenizer files .* in .*noconfig; .*use source: random"),
        ("random", "notok", {}, "source: random needs .*config.json with vocab_size"),
        ("builtin", "tmp", {"split": "eval", "seq_len": 100_000}, "lower seq_len or add text"),
        ("hf:", "model", {}, r"expected hf:text\|json\|csv\|parquet:PATH.* or hf:NAME\[:CONFIG\]\[@SPLIT\]"),
    ],
)
def test_errors_are_one_line_and_name_the_problem(tmp_path, model_dir, source, where, kw, match):
    dirs = _bad_dirs(tmp_path, model_dir)
    if where == "tmp":
        shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    source = source.format(**{k: str(v) for k, v in dirs.items()})
    for fn in (load, fingerprint):
        if fn is fingerprint and ("lower seq_len" in match or "UTF-8" in match):
            continue  # only loading decodes and tokenises
        with pytest.raises(CalibrationError, match=match) as err:
            fn(source, dirs[where], **kw)
        assert "\n" not in str(err.value) and isinstance(err.value, MoecompressError)


def test_model_dir_must_exist(tmp_path):
    with pytest.raises(CalibrationError, match=r"model_dir .*nowhere is not a directory"):
        load("builtin", tmp_path / "nowhere")


def test_hf_source_without_datasets_package(model_dir, corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # blocks the import, as for an absent package
    for source in ("hf:wikitext", f"hf:text:{corpus}"):
        with pytest.raises(
            MissingExtraError, match=r'needs datasets, .*pip install "moecompress\[data\]"'
        ) as e:
            load(source, model_dir)
        assert "\n" not in str(e.value) and source.split(":")[1] in str(e.value)
    assert fingerprint(f"hf:text:{corpus}", model_dir)  # local files: hashed, the library is not needed


# --- the real `datasets` library on local files -------------------------------------------------------


def test_hf_text_equals_file_for_files_dirs_and_lists(corpus, model_dir, tmp_path):
    other = tmp_path / "sub" / "b.txt"
    other.parent.mkdir()
    other.write_text("\r\n".join(t for _, t in builtin_texts()[:15]) + "\n\n")  # CRLF, trailing blanks
    shutil.copy(corpus, other.parent / "a.txt")
    for split in ("calibration", "eval"):
        for src in (str(corpus), f"{other.parent}", f"{other},{corpus}"):
            kw = {"samples": 8, "seq_len": 40, "split": split}
            hf, plain = load(f"hf:text:{src}", model_dir, **kw), load(f"file:{src}", model_dir, **kw)
            assert hf.shape == (8, 40) and torch.equal(hf, plain), (split, src)
    assert not torch.equal(load(f"hf:text:{other}", model_dir), load(f"hf:text:{corpus}", model_dir))
    fp = fingerprint(f"hf:text:{corpus}", model_dir)
    assert fp == fingerprint(f"hf:text:{corpus}", model_dir) != fingerprint(f"file:{corpus}", model_dir)
    assert fp != fingerprint(f"hf:text:{corpus}", model_dir, seed=1)
    text = corpus.read_text()
    corpus.write_text(text[:100] + text[100:].replace("a", "e", 1))  # same size, one byte differs
    assert fingerprint(f"hf:text:{corpus}", model_dir) != fp


def _rows() -> list[str]:
    return [t for _, t in builtin_texts()[:40] if t.strip()]


def test_hf_json_csv_parquet_and_disk_equal_the_joined_rows(model_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _rows()
    joined = tmp_path / "joined.txt"
    joined.write_text("\n".join(rows))
    expect = load(f"file:{joined}", model_dir, samples=6)
    data = datasets.Dataset.from_dict({"text": rows, "n": list(range(len(rows)))})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": r, "n": 0}) + "\n" for r in rows))
    data.to_csv(str(tmp_path / "rows.csv"), index=False)
    data.to_parquet(str(tmp_path / "rows.parquet"))
    data.rename_column("text", "body").save_to_disk(str(tmp_path / "disk"))
    half = len(rows) // 2
    datasets.DatasetDict({"train": data.select(range(half)), "validation": data}).save_to_disk(
        str(tmp_path / "dict")
    )
    (tmp_path / "pq").mkdir()
    data.select(range(half)).to_parquet(str(tmp_path / "pq" / "0.parquet"))
    data.select(range(half, len(rows))).to_parquet(str(tmp_path / "pq" / "1.parquet"))
    for src in ("json:{t}/rows.jsonl", "csv:{t}/rows.csv", "parquet:{t}/rows.parquet", "parquet:{t}/pq",
                "disk:{t}/disk#body", "disk:{t}/dict@validation"):  # fmt: skip
        source = "hf:" + src.format(t=tmp_path)
        assert torch.equal(load(source, model_dir, samples=6), expect), source
    assert not torch.equal(load(f"hf:disk:{tmp_path}/dict", model_dir, samples=6), expect)  # train: half
    fps = {fingerprint(f"hf:disk:{tmp_path}/dict@{s}", model_dir) for s in ("train", "validation")}
    fps |= {fingerprint(f"hf:parquet:{tmp_path}/rows.parquet", model_dir)}
    assert len(fps) == 3
    before = fingerprint(f"hf:disk:{tmp_path}/disk#body", model_dir)
    data.select(range(3)).rename_column("text", "body").save_to_disk(str(tmp_path / "disk"))
    assert fingerprint(f"hf:disk:{tmp_path}/disk#body", model_dir) != before


def test_hf_bad_input_is_one_line(model_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"content": _rows()}).to_parquet(str(tmp_path / "c.parquet"))
    datasets.Dataset.from_dict({"text": [1, 2, 3]}).to_parquet(str(tmp_path / "ints.parquet"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json at all\n')
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": _rows()})}).save_to_disk(
        str(tmp_path / "dict")
    )
    t = str(tmp_path)
    cases = [
        (f"hf:json:{t}/missing.jsonl", "missing.jsonl does not exist"),
        (f"hf:parquet:{t}/c.parquet", r"has no 'text' column \(columns: \['content'\]\); name the column"),
        (f"hf:parquet:{t}/c.parquet#body", r"no 'body' column"),
        (f"hf:parquet:{t}/ints.parquet", "column 'text' is not a string column"),
        (
            f"hf:json:{t}/bad.jsonl",
            r"could not load Hugging Face dataset hf:json:.*bad.jsonl \(.*check the files",
        ),
        (f"hf:xml:{t}/c.parquet", "is neither a local form .* nor a Hub dataset id"),
        (f"hf:{t}/c.parquet", "is neither a local form"),
        (f"hf:text:{t}/a.txt#col", "takes no #COLUMN"),
        ("hf:json:", "hf:json: needs a path"),
        (f"hf:disk:{t}/c.parquet", "is not a directory written by save_to_disk"),
        (f"hf:disk:{t}/dict", r"has no split 'train' \(splits: validation\); add @SPLIT"),
        (f"hf:disk:{t}/dict@", "empty @SPLIT"),
        (f"hf:json:{t}/none", r"contains no \*.json or \*.jsonl files"),
        ("hf:wiki@", "empty NAME or @SPLIT"),
    ]
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "none").mkdir()
    for source, match in cases:
        with pytest.raises(CalibrationError, match=match) as err:
            load(source, model_dir)
        assert "\n" not in str(err.value), source


def test_hf_hub_form_is_parsed_without_network():
    spec = sources._parse("hf:org/wiki:raw@test#body")
    assert (spec.kind, spec.hf_form, spec.hf, spec.column) == (
        "hf",
        "hub",
        ("org/wiki", "raw", "test"),
        "body",
    )
    assert sources._parse("hf:wikitext").hf == ("wikitext", None, "train")
    assert sources._parse("hf:wikitext").column == "text"


def test_fingerprint_is_stable_and_sensitive(corpus, model_dir, tmp_path, monkeypatch):
    source = f"file:{corpus}"
    base = fingerprint(source, model_dir)
    assert len(base) == 16 and int(base, 16) >= 0
    assert base == fingerprint(source, model_dir)
    assert base == fingerprint(str(corpus), model_dir)
    for kw in ({"seed": 1}, {"seq_len": 33}, {"samples": 5}, {"split": "eval"}):
        assert fingerprint(source, model_dir, **kw) != base, kw
    assert fingerprint("builtin", model_dir) != base

    other = tmp_path / "other_model"
    other.mkdir()
    _save_tokenizer(other, 280)
    assert fingerprint(source, other) != base

    text = corpus.read_text()
    corpus.write_text(text[:100] + text[100:].replace("a", "e", 1))  # same size, one byte differs
    assert fingerprint(source, model_dir) != base

    def no_tokenising(*a, **k):
        raise AssertionError("the fingerprint must not tokenise")

    monkeypatch.setattr(sources, "_load_tokenizer", no_tokenising)
    monkeypatch.setattr(sources, "_tokenise", no_tokenising)
    fingerprint(source, model_dir)
    fingerprint("builtin", model_dir)


def test_random_fingerprint_follows_vocab_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50}))
    first = fingerprint("random", tmp_path)
    assert first == fingerprint("random", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 51}))
    assert fingerprint("random", tmp_path) != first


@pytest.mark.shared
def test_shared_python_docs_with_reference_tokenizer():
    corpus = SHARED / "data" / "corpus" / "python_docs.txt"
    ref = SHARED / "data" / "models" / "ref-qwen3moe"
    if not (corpus.is_file() and (ref / "tokenizer.json").is_file()):
        pytest.skip("../shared reference data is absent")
    vocab = json.loads((ref / "config.json").read_text())["vocab_size"]
    # The eval split (last 2%, ~220 kB) keeps this fast; the 98% split costs 4-10 s of tokenising here.
    ids = load_token_ids(f"file:{corpus}", model_dir=ref, samples=16, seq_len=256, seed=0, split="eval")
    assert ids.shape == (16, 256) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < vocab
    text = Tokenizer.from_file(str(ref / "tokenizer.json")).decode(ids[0].tolist())
    assert text[10:-10] in corpus.read_text()  # real text from the corpus, not id soup


@pytest.mark.shared
def test_shared_corpus_through_datasets_equals_file():
    corpus = SHARED / "data" / "corpus" / "lee_news.txt"
    ref = SHARED / "data" / "models" / "ref-qwen3moe"
    if not (corpus.is_file() and (ref / "tokenizer.json").is_file()):
        pytest.skip("../shared reference data is absent")
    pytest.importorskip("datasets")
    kw = {"model_dir": ref, "samples": 16, "seq_len": 256, "seed": 0}
    hf = load_token_ids(f"hf:text:{corpus}", **kw)
    assert torch.equal(hf, load_token_ids(f"file:{corpus}", **kw))
    assert torch.equal(
        load_token_ids(f"hf:text:{corpus}", split="eval", **kw),
        load_token_ids(f"file:{corpus}", split="eval", **kw),
    )


def test_hf_text_calibration_statistics_equal_file(corpus, model_dir, tmp_path):
    """The whole calibration (the engine's statistics cache entries) is the same through `datasets`."""
    pytest.importorskip("datasets")
    from safetensors.torch import load_file

    from moecompress.engine.executor import calibrate
    from moecompress.testing import save_tiny

    ckpt = tmp_path / "tiny"
    save_tiny("qwen3_moe", ckpt, vocab_size=300)
    shutil.copy(model_dir / "tokenizer.json", ckpt / "tokenizer.json")
    entries = []
    for source in (f"file:{corpus}", f"hf:text:{corpus}"):
        recipe = {
            "model": str(ckpt), "output": str(tmp_path / "out"), "steps": [{"heapr": {"ratio": 0.25}}],
            "calibration": {"source": source, "samples": 8, "seq_len": 32, "cache_dir": str(tmp_path / "cache")},
        }  # fmt: skip
        entries.append(calibrate(recipe, progress=False))
    assert entries[0] != entries[1]  # two cache keys (the sources differ) ...
    files = sorted(p.name for p in entries[0].glob("*.safetensors"))
    assert files and files == sorted(p.name for p in entries[1].glob("*.safetensors"))
    for name in files:  # ... holding identical statistics
        a, b = load_file(entries[0] / name), load_file(entries[1] / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


# --- large splits: sampled by windows, never tokenised whole ------------------------------------------


def _numbered_text(lines: int) -> str:
    """Lines that each carry their number twice (so any window can be located) and non-ASCII words."""
    filler = " ".join(t for _, t in builtin_texts()).split()
    return "".join(f"L{i:05d} {' '.join(filler[3 * i : 3 * i + 3])} é中文 M{i:05d}\n" for i in range(lines))


def _tokenised(monkeypatch) -> list[int]:
    """Record the characters handed to the tokenizer; the whole-text path must not run."""
    seen: list[int] = []
    encode = sources._encode

    def counting(tokenizer, texts):
        seen.extend(len(t) for t in texts)
        return encode(tokenizer, texts)

    def whole(*a, **k):
        raise AssertionError("a large split must not be tokenised whole")

    monkeypatch.setattr(sources, "_encode", counting)
    monkeypatch.setattr(sources, "_tokenise", whole)
    return seen


def test_a_large_file_is_sampled_by_disjoint_windows_of_real_text(tmp_path, model_dir, decode, monkeypatch):
    text = _numbered_text(3000)
    path = tmp_path / "big.txt"
    path.write_text(text)
    samples, seq_len = 8, 32
    seen = _tokenised(monkeypatch)
    ids = load(f"file:{path}", model_dir, samples=samples, seq_len=seq_len, seed=0)
    assert ids.shape == (samples, seq_len) and ids.dtype == torch.int64
    assert sum(seen) <= 2 * samples * seq_len * sources._READ_BYTES_PER_TOKEN < len(text) // 20
    assert torch.equal(ids, load(f"file:{path}", model_dir, samples=samples, seq_len=seq_len, seed=0))
    assert not torch.equal(ids, load(f"file:{path}", model_dir, samples=samples, seq_len=seq_len, seed=1))
    cal_bytes = len(sources._split_text(text, "calibration").encode())
    spans = []
    for row in ids:
        window = decode(row)
        assert window[0].isspace() or text.startswith(window), window  # starts at a word, not inside one
        core = window.rstrip("\ufffd")  # the last token may end inside a character; the first never does
        assert "\ufffd" not in core and core in text
        start = len(text[: text.index(core)].encode())  # unique: every few bytes carry a line number
        spans.append((start, start + len(core.encode())))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "windows overlap"
    assert [s * samples // cal_bytes for s, _ in spans] == list(range(samples)), "one window per range"
    ev = load(f"file:{path}", model_dir, samples=4, seq_len=16, split="eval")
    tail = sources._split_text(text, "eval")
    assert all(decode(row).rstrip("\ufffd") in tail for row in ev)


@pytest.mark.parametrize("with_datasets", [False, True])
def test_sampled_windows_are_the_same_for_crlf_files_lists_and_datasets(
    tmp_path, model_dir, monkeypatch, with_datasets
):
    text = _numbered_text(1500)
    (tmp_path / "lf").mkdir()
    (tmp_path / "crlf").mkdir()
    for i, part in enumerate((text[: len(text) // 3], text[len(text) // 3 :])):
        (tmp_path / "lf" / f"{i}.txt").write_text(part)
        (tmp_path / "crlf" / f"{i}.txt").write_bytes(part.replace("\n", "\r\n").encode())
    _tokenised(monkeypatch)
    kw = {"samples": 6, "seq_len": 24, "seed": 3}
    lf = load(f"file:{tmp_path / 'lf'}", model_dir, **kw)
    assert torch.equal(lf, load(f"file:{tmp_path / 'crlf'}", model_dir, **kw))  # read as text mode does
    assert torch.equal(
        lf, load(f"file:{tmp_path / 'lf' / '0.txt'},{tmp_path / 'lf' / '1.txt'}", model_dir, **kw)
    )
    if with_datasets:
        pytest.importorskip("datasets")
        assert torch.equal(lf, load(f"hf:text:{tmp_path / 'crlf'}", model_dir, **kw))


def test_small_splits_are_tokenised_whole_as_before(tmp_path, model_dir):
    text = _numbered_text(60)  # ~3 kB, less than 16 bytes per requested token
    path = tmp_path / "small.txt"
    path.write_text(text)
    tok = tokenizing._load_tokenizer(model_dir)
    for split, samples in (("calibration", 8), ("eval", 2)):
        got = load(f"file:{path}", model_dir, samples=samples, seq_len=24, seed=5, split=split)
        ids = tokenizing._tokenise(tok, [sources._split_text(text, split)])
        assert torch.equal(got, sources._windows(ids, samples, 24, 5, what="t")), split


def test_ranges_too_short_for_a_window_fall_back_to_the_whole_text(tmp_path, model_dir, caplog):
    d = tmp_path / "many"
    d.mkdir()
    words = " ".join(t for _, t in builtin_texts()).split()
    for i in range(200):  # 200 files of ~6 words: no file holds a 48-token window
        (d / f"{i:03d}.txt").write_text(" ".join(words[6 * i : 6 * i + 6]))
    tok = tokenizing._load_tokenizer(model_dir)
    with caplog.at_level(logging.INFO, logger=sources.__name__):
        got = load(f"file:{d}", model_dir, samples=2, seq_len=48, seed=0)
    assert "tokenising it whole" in caplog.text
    texts = [sources._split_text(p.read_text(), "calibration") for p in sorted(d.glob("*.txt"))]
    assert torch.equal(got, sources._windows(tokenizing._tokenise(tok, texts), 2, 48, 0, what="t"))


def test_a_large_file_is_checked_for_utf8_beyond_the_windows(tmp_path, model_dir):
    path = tmp_path / "late.txt"
    path.write_bytes(_numbered_text(3000).encode() + b"\xff tail\n")
    with pytest.raises(CalibrationError, match=r"late.txt is not UTF-8 text \(invalid start byte\)") as err:
        load(f"file:{path}", model_dir)
    assert "\n" not in str(err.value)
