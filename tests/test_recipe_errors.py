"""Bad recipes: one line naming the step/field, exit status 2, no traceback, nothing written.

1. Parametrised bad recipes through ``moecompress apply`` (``cli_main``): one ``error: ...`` line,
   status 2, the step number and name or the field in the message, and ``tmp_path`` unchanged.
2. A hypothesis property: random mutations of a valid recipe dict either validate (then the dry run
   works or raises a one-line ``MoecompressError``) or raise a one-line ``MoecompressError``; no
   ``TypeError``/``KeyError``/``ValidationError``/... escapes and the dry run writes nothing.
3. ``--set`` overrides resolve (``calibration.samples``, ``steps.N.field``, ``emit=every_step``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
import yaml
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import moecompress as mc
from moecompress.cli import main as cli_main
from moecompress.engine.recipe import load_recipe
from moecompress.errors import MoecompressError
from moecompress.passes import BUILTIN_PASSES
from moecompress.testing import save_tiny

FAST_CALIBRATION = {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 2}


# -- fixtures and helpers --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("recipe-errors-model") / "model"
    save_tiny("qwen3_moe", d)
    return d


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # A mutated `model` such as "a/b" looks like a Hub repo id: never touch the network from tests.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def workdir(tmp_path, tiny_model, monkeypatch) -> Path:
    """``tmp_path`` as the current directory, with a private copy of the tiny model in ``model/``."""
    shutil.copytree(tiny_model, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def base_recipe(model: Path, output: Path) -> dict[str, Any]:
    return {
        "model": str(model),
        "output": str(output),
        "calibration": dict(FAST_CALIBRATION),
        "steps": [{"analyze": {"top": 3}}, {"identity": {}}],
    }


def snapshot(root: Path) -> dict[str, Any]:
    """Every path under ``root`` with its bytes (files) or ``None`` (directories)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


def assert_one_line(msg: str) -> None:
    assert msg.strip(), "empty error message"
    assert "\n" not in msg and "\r" not in msg, f"multi-line error message: {msg!r}"
    assert "Traceback" not in msg, msg


def run_cli(argv: list[str], capsys) -> tuple[int | None, str, str]:
    """``(status, stderr, escaped)``: ``escaped`` describes an exception that escaped ``cli_main``."""
    escaped = ""
    rc = None
    try:
        rc = cli_main(argv)
    except SystemExit as err:  # argparse
        rc = err.code
    except Exception as err:
        escaped = f"{type(err).__name__}: {err}"
    captured = capsys.readouterr()
    return rc, captured.err, escaped


# -- 1. parametrised bad recipes through the CLI ---------------------------------------------------
def _set(path: str, value: Any):
    """A recipe edit: set the dotted ``path`` (``steps.0.analyze`` indexes lists from 0) to ``value``."""

    def edit(d: dict) -> None:
        *parents, last = path.split(".")
        node: Any = d
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def _delete(key: str):
    def edit(d: dict) -> None:
        del d[key]

    return edit


def _rename(old: str, new: str):
    def edit(d: dict) -> None:
        d[new] = d.pop(old)

    return edit


INVALID_YAML = """\
model: {model}
output: {output}
calibration: {{source: random, samples: 4, seq_len: 8}}
steps:
  - analyze: {{top: [3}}
  - identity: {{}}
"""
INVALID_YAML_LINE = 5

# (id, recipe edit or the whole YAML text ({model}/{output} filled in), extra argv, substrings of the error)
CASES: list[tuple[str, Any, list[str], list[str]]] = [
    ("unknown_step", _set("steps.1", {"heapr2": {}}), [], ["step 2", "heapr2", "available", "analyze"]),
    (
        "unknown_step_field",
        _set("steps.0", {"analyze": {"tpo": 3}}),
        [],
        ["step 1", "analyze", "'tpo'", "top", "allowed"],
    ),
    ("wrong_type", _set("steps.0", {"analyze": {"top": "many"}}), [], ["step 1", "analyze", "top", "many"]),
    ("out_of_range_top", _set("steps.0", {"analyze": {"top": 0}}), [], ["step 1", "analyze", "top"]),
    ("float_top", _set("steps.0", {"analyze": {"top": 2.5}}), [], ["step 1", "analyze", "top"]),
    ("nan_top", _set("steps.0", {"analyze": {"top": float("nan")}}), [], ["step 1", "analyze", "top"]),
    ("identity_unknown_field", _set("steps.1", {"identity": {"x": 1}}), [], ["step 2", "identity", "'x'"]),
    ("step_settings_list", _set("steps.0", {"analyze": [3]}), [], ["step 1", "analyze", "mapping"]),
    ("step_two_keys", _set("steps.0", {"analyze": {}, "identity": {}}), [], ["step 1"]),
    ("step_is_list", _set("steps.1", ["identity"]), [], ["step 2"]),
    ("step_is_int", _set("steps.1", 7), [], ["step 2"]),
    ("samples_1", _set("calibration.samples", 1), [], ["samples"]),
    ("holdout_too_big", _set("calibration.holdout", 10), [], ["holdout", "samples"]),
    ("seq_len_1", _set("calibration.seq_len", 1), [], ["seq_len"]),
    ("batch_size_0", _set("calibration.batch_size", 0), [], ["batch_size"]),
    ("sample_tokens_0", _set("calibration.sample_tokens", 0), [], ["sample_tokens"]),
    ("bad_offload", _set("calibration.offload", "cloud"), [], ["offload", "cloud"]),
    ("bad_propagate", _set("calibration.propagate", "later"), [], ["propagate", "later"]),
    ("bad_dtype", _set("calibration.dtype", "int8"), [], ["dtype", "int8"]),
    (
        "calibration_typo",
        _set("calibration.smaples", 4),
        [],
        ["calibration.smaples", "did you mean 'samples'"],
    ),
    ("calibration_not_mapping", _set("calibration", 3), [], ["calibration"]),
    ("bad_emit", _set("emit", "sometimes"), [], ["emit", "sometimes"]),
    ("missing_model_dir", _set("model", "{tmp}/does-not-exist"), [], ["'model'", "does-not-exist"]),
    ("model_is_a_file", _set("model", "{tmp}/recipe.yaml"), [], ["'model'"]),
    ("model_without_config", _set("model", "{tmp}"), [], ["'model'", "config.json"]),
    ("missing_model_key", _delete("model"), [], ["model"]),
    ("missing_steps_key", _delete("steps"), [], ["steps"]),
    ("top_level_typo", _rename("output", "outptu"), [], ["outptu", "did you mean 'output'"]),
    ("empty_steps", _set("steps", []), [], ["steps"]),
    ("steps_not_list", _set("steps", 3), [], ["steps"]),
    ("invalid_yaml", INVALID_YAML, [], [f"line {INVALID_YAML_LINE}"]),
    ("recipe_is_list", "- model\n- output\n", [], ["mapping"]),
    ("recipe_is_scalar", "just a string\n", [], ["mapping"]),
    ("recipe_empty_file", "", [], ["mapping"]),
    ("set_step_out_of_range", None, ["--set", "steps.9.top=3"], ["steps.9", "step 9"]),
    ("set_step_not_number", None, ["--set", "steps.x.top=1"], ["steps.x", "steps.N.field"]),
    ("set_step_no_field", None, ["--set", "steps.1=3"], ["steps.1"]),
    ("set_no_equals", None, ["--set", "nokeyvalue"], ["nokeyvalue", "key=value"]),
    ("set_empty_key", None, ["--set", "=3"], ["empty key"]),
    ("set_not_a_section", None, ["--set", "model.x=3"], ["model"]),
    ("set_samples_abc", None, ["--set", "calibration.samples=abc"], ["calibration.samples", "abc"]),
    ("set_unknown_top_level", None, ["--set", "outptu=x"], ["outptu", "output"]),
    ("unknown_source_prefix", _set("calibration.source", "ftp:x"), [], ["source", "ftp:x"]),
    ("negative_seed", _set("calibration.seed", -1), [], ["seed"]),
    ("max_shard_size_garbage", _set("max_shard_size", "garbage"), [], ["max_shard_size"]),
    ("max_shard_size_zero", _set("max_shard_size", 0), [], ["max_shard_size"]),
    ("cache_dir_is_a_file", _set("calibration.cache_dir", "{tmp}/recipe.yaml"), [], ["cache_dir"]),
    # A newline inside a value or key must not split the message (it is shown with repr()).
    ("model_path_with_newline", _set("model", "{tmp}/no\nsuch"), [], ["'model'"]),
    ("set_key_with_newline", None, ["--set", "steps.1\n.top=3"], ["steps"]),
    # No path can hold a NUL; each path field names itself instead of a ValueError from the OS.
    ("model_path_with_nul", _set("model", "{tmp}/mo\x00del"), [], ["'model'", "NUL"]),
    ("output_path_with_nul", _set("output", "{tmp}/o\x00ut"), [], ["'output'", "NUL"]),
    ("cache_dir_with_nul", _set("calibration.cache_dir", "\x00"), [], ["cache_dir", "NUL"]),
    ("source_file_with_nul", _set("calibration.source", "file:a\x00b"), [], ["source", "NUL"]),
    ("copy_extra_with_nul", _set("copy_extra", ["a\x00b"]), [], ["copy_extra", "NUL"]),
    ("set_cache_dir_nul", None, ["--set", "calibration.cache_dir=a\x00b"], ["cache_dir", "NUL"]),
]


def _fill(value: Any, tmp: Path) -> Any:
    return value.replace("{tmp}", str(tmp)) if isinstance(value, str) else value


def _write_recipe(tmp: Path, edit: Any) -> Path:
    path = tmp / "recipe.yaml"
    model, output = tmp / "model", tmp / "out"
    if isinstance(edit, str):
        path.write_text(edit.format(model=model, output=output))
        return path
    d = base_recipe(model, output)
    if edit is not None:
        edit(d)
    d = json.loads(json.dumps(d), object_hook=lambda o: {k: _fill(v, tmp) for k, v in o.items()})
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


@pytest.mark.parametrize(("edit", "argv", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_recipe_one_line_nothing_written(workdir, capsys, edit, argv, needles):
    recipe = _write_recipe(workdir, edit)
    before = snapshot(workdir)
    assert set(before) >= {"recipe.yaml", "model"}
    rc, err, escaped = run_cli(["apply", str(recipe), "-q", *argv], capsys)
    after = snapshot(workdir)
    written = sorted(set(after) - set(before))
    changed = sorted(k for k in before if k in after and before[k] != after[k])
    assert not escaped, (
        f"an exception escaped cli_main (a traceback for the user): {escaped}; wrote {written}"
    )
    assert rc == 2, (rc, err)
    assert err.startswith("error: "), err
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert_one_line(err.removesuffix("\n"))
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    assert not (workdir / "out").exists()
    assert written == [], f"files written before/after the error: {written}"
    assert changed == [] and set(before) <= set(after)


@pytest.mark.parametrize(
    ("where", "settings"),
    [("top", {"": 1}), ("analyze", {"": 2}), ("identity", {"x": 1}), ("identity", {"": 1})],
    ids=["empty_top_level_key", "empty_analyze_key", "identity_takes_no_fields", "empty_identity_key"],
)
def test_unknown_field_message_names_field_and_alternatives(tiny_model, tmp_path, where, settings):
    d = base_recipe(tiny_model, tmp_path / "out")
    if where == "top":
        d.update(settings)
    else:
        d["steps"] = [{where: settings}]
    with pytest.raises(MoecompressError) as info:
        load_recipe(d)
    msg = str(info.value)
    assert_one_line(msg)
    key = next(iter(settings))
    assert f"unknown field {key!r}" in msg, msg
    assert "(top level)" not in msg, f"the unknown field is {key!r}, not the top level: {msg!r}"
    assert not msg.rstrip().endswith("allowed:"), f"empty list of allowed fields: {msg!r}"
    if where != "top":
        assert f"step 1 ({where})" in msg


def test_output_exists_is_left_untouched(workdir, capsys):
    recipe = _write_recipe(workdir, None)
    out = workdir / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    (out / "sub").mkdir()
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = snapshot(workdir)
    rc, err, escaped = run_cli(["apply", str(recipe), "-q"], capsys)
    assert not escaped
    assert rc == 2
    assert_one_line(err.strip())
    assert "already exists" in err and "--overwrite" in err and str(out) in err
    assert snapshot(workdir) == before


def test_missing_recipe_file(workdir, capsys):
    before = snapshot(workdir)
    rc, err, escaped = run_cli(["apply", str(workdir / "nope.yaml"), "-q"], capsys)
    assert not escaped and rc == 2
    assert_one_line(err.strip())
    assert "nope.yaml" in err
    assert snapshot(workdir) == before


# -- 2. property: random mutations never escape as anything but a one-line MoecompressError --------
TRICKY_TEXT = st.sampled_from(
    [
        "",
        " ",
        "\n",
        "a\nb",
        "random",
        "builtin",
        "ftp:x",
        "hf:",
        "file:",
        "file:nope",
        "auto",
        "disk",
        "float16",
        "compressed",
        "every_step",
        "final",
        "5GB",
        "0",
        "-1",
        "1e3",
        "analyze",
        "identity",
        "heapr2",
        "{}",
        "[",
        ".",
        "~",
        "/",
    ]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-2, max_value=10),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    TRICKY_TEXT,
)
KEYS = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["model", "output", "steps", "top", "samples", "source", "analyze", "identity"]),
)
GARBAGE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=6,
)
OPS = ["delete", "typo", "replace", "insert", "step_name", "nest", *["valid_value"] * 3, "model_path"]
STEP_ITEMS = st.one_of(
    st.builds(lambda top: {"analyze": {"top": top}}, st.integers(1, 10)),
    st.sampled_from([{"analyze": {}}, {"analyze": None}, {"identity": {}}, {"identity": None}, "identity"]),
)


def _valid_values(model: Path) -> dict[tuple[str, ...], st.SearchStrategy]:
    """Values that ``load_recipe`` accepts, so that mutated recipes also reach the dry run."""
    return {
        ("model",): st.sampled_from(
            [
                str(model),
                f"{model}/",
                f"{model}/config.json",
                f"{model}\n",
                str(model.parent),
                str(model) + "-missing",
                "no/such-repo",
                "a\nb",
                ".",
                "~",
                "/dev/null",
            ]
        ),
        ("output",): st.one_of(st.text(min_size=1, max_size=10), st.sampled_from(["out", ".", "/", "a\nb"])),
        ("emit",): st.sampled_from(["final", "every_step"]),
        ("max_shard_size",): st.one_of(st.integers(), st.sampled_from(["5GB", "1KB", "garbage", "0"])),
        ("steps",): st.lists(STEP_ITEMS, min_size=1, max_size=4),
        ("calibration", "source"): TRICKY_TEXT,
        ("calibration", "samples"): st.integers(2, 64),
        ("calibration", "seq_len"): st.integers(2, 64),
        ("calibration", "seed"): st.integers(),
        ("calibration", "batch_size"): st.integers(1, 8),
        ("calibration", "holdout"): st.one_of(st.none(), st.integers(1, 3)),
        ("calibration", "propagate"): st.sampled_from(["original", "compressed"]),
        ("calibration", "sample_tokens"): st.integers(1, 1024),
        ("calibration", "offload"): st.sampled_from(["auto", "ram", "disk"]),
        ("calibration", "dtype"): st.sampled_from(["auto", "float32", "bfloat16", "float16"]),
        ("calibration", "cache_dir"): st.one_of(st.none(), st.text(max_size=10)),
    }


def _typo(data, word: str) -> str:
    kind = data.draw(st.sampled_from(["drop", "double", "swap", "swap_char", "case", "affix"]), label="typo")
    if not word:
        return data.draw(st.text(min_size=1, max_size=5))
    i = data.draw(st.integers(0, len(word) - 1))
    if kind == "drop":
        return word[:i] + word[i + 1 :]
    if kind == "double":
        return word[: i + 1] + word[i:]
    if kind == "swap" and len(word) > 1:
        j = min(i + 1, len(word) - 1)
        i = j - 1
        return word[:i] + word[j] + word[i] + word[j + 1 :]
    if kind == "case":
        return word.upper() if word != word.upper() else word.lower()
    if kind == "affix":
        return data.draw(st.sampled_from(["_", "s", " ", "-"])) + word
    return word[:i] + data.draw(st.characters(codec="utf-8")) + word[i + 1 :]


def _pick_slot(data, root: Any) -> tuple[Any, Any] | None:
    """A (container, key/index) chosen by walking down from the root; top-level keys are favoured."""
    node, slot = root, None
    while isinstance(node, dict | list) and len(node) > 0:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = data.draw(st.sampled_from(keys), label="key")
        slot = (node, key)
        child = node[key]
        if not isinstance(child, dict | list) or not child or not data.draw(st.booleans(), label="descend"):
            break
        node = child
    return slot


def _containers(obj: Any) -> list[Any]:
    found = [obj] if isinstance(obj, dict | list) else []
    children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else []
    for c in children:
        found.extend(_containers(c))
    return found


def _mutate(data, d: dict, model: Path) -> None:
    op = data.draw(st.sampled_from(OPS), label="op")
    if op in ("valid_value", "model_path"):
        choices = _valid_values(model)
        path = ("model",) if op == "model_path" else data.draw(st.sampled_from(list(choices)), label="field")
        node = d
        for p in path[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        # copies: a drawn value may be a shared constant that a later mutation would edit in place,
        # which would make the next example's strategies differ (hypothesis: FlakyStrategyDefinition)
        node[path[-1]] = copy.deepcopy(data.draw(choices[path], label="valid value"))
        return
    if op == "insert":
        where = data.draw(st.sampled_from(_containers(d)), label="into")
        if isinstance(where, dict):
            key = data.draw(st.one_of(KEYS, st.sampled_from(list(d) or ["model"]).map(str)), label="new key")
            if data.draw(st.booleans(), label="typo key") and key:
                key = _typo(data, key)
            where[key] = copy.deepcopy(data.draw(GARBAGE, label="value"))
        else:
            where.insert(data.draw(st.integers(0, len(where))), copy.deepcopy(data.draw(GARBAGE, label="item")))
        return
    if op == "step_name":
        steps = d.get("steps")
        if isinstance(steps, list) and steps:
            i = data.draw(st.integers(0, len(steps) - 1))
            if isinstance(steps[i], dict) and len(steps[i]) == 1:
                (name, cfg), *_ = steps[i].items()
                new = data.draw(
                    st.one_of(
                        st.sampled_from([*BUILTIN_PASSES, "heapr2", "Analyze", ""]),
                        st.text(max_size=10),
                        st.just(_typo(data, str(name))),
                    ),
                    label="step name",
                )
                steps[i] = {new: cfg}
                return
        op = "replace"
    slot = _pick_slot(data, d)
    if slot is None:
        return
    node, key = slot
    if op == "delete":
        del node[key]
    elif op == "typo" and isinstance(node, dict):
        node[_typo(data, str(key))] = node.pop(key)
    elif op == "nest":
        wrap = data.draw(st.sampled_from(["dict", "list", "self"]), label="wrap")
        value = node[key]
        if wrap == "dict":
            node[key] = {data.draw(KEYS, label="wrap key"): value}
        elif wrap == "list":
            node[key] = [value]
        else:
            node[key] = {str(key): value}
    else:  # replace (and a typo on a list index)
        node[key] = copy.deepcopy(data.draw(GARBAGE, label="value"))


# derandomize: CI runs the same 300 examples on every machine. To explore further, set it to False here and
# run `pytest tests/test_recipe_errors.py -k mutated --hypothesis-seed=N` (seeds 1-11 passed on 2026-12-01).
@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(data=st.data())
def test_mutated_recipes_fail_with_one_line(tiny_model, tmp_path, monkeypatch, data):
    monkeypatch.chdir(tmp_path)  # relative paths in mutated recipes land here; nothing may appear
    d = base_recipe(tiny_model, tmp_path / "out")
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        _mutate(data, d, tiny_model)
    note(f"recipe: {d!r}")
    stage = "load_recipe"
    try:
        load_recipe(copy.deepcopy(d))
        stage = "apply(dry_run=True)"
        result = mc.apply(copy.deepcopy(d), dry_run=True, progress=False)
        assert result.dry_run
        event("valid: dry run passed")
    except MoecompressError as err:
        event(f"{stage}: {type(err).__name__}")
        msg = str(err)
        assert msg.strip(), f"{stage}: empty message from {type(err).__name__}"
        assert "\n" not in msg and "\r" not in msg, f"{stage}: multi-line {type(err).__name__}: {msg!r}"
    except Exception as err:
        raise AssertionError(
            f"{stage} let {type(err).__name__} escape (not a MoecompressError): {err}"
        ) from err
    assert os.listdir(tmp_path) == [], f"the dry run wrote {os.listdir(tmp_path)}"


# -- 3. overrides resolve --------------------------------------------------------------------------
def test_overrides_resolve(workdir, capsys):
    recipe = _write_recipe(workdir, None)
    resolved = load_recipe(recipe, ["calibration.samples=6", "steps.1.top=2"]).to_dict()
    assert resolved["calibration"]["samples"] == 6
    assert resolved["calibration"]["seq_len"] == 8
    assert resolved["steps"] == [{"analyze": {"top": 2}}, {"identity": {}}]
    assert load_recipe(recipe).to_dict()["steps"][0] == {"analyze": {"top": 3}}  # the file is unchanged

    argv = [
        "apply",
        str(recipe),
        "-q",
        "--dry-run",
        "--set",
        "calibration.samples=6",
        "--set",
        "steps.1.top=2",
    ]
    assert cli_main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["calibration_tokens"] == 6 * 8
    assert not (workdir / "out").exists()


def test_emit_every_step_via_set(workdir, capsys):
    d = base_recipe(workdir / "model", workdir / "out")
    d["steps"] = [{"identity": {}}, {"analyze": {"top": 2}}, {"identity": {}}]
    recipe = workdir / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(d, sort_keys=False))

    assert load_recipe(recipe).emit == "final"
    assert load_recipe(recipe, ["emit=every_step"]).to_dict()["emit"] == "every_step"
    assert load_recipe(recipe, {"emit": "every_step"}).emit == "every_step"

    assert cli_main(["apply", str(recipe), "-q", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"] == 1
    assert cli_main(["apply", str(recipe), "-q", "--dry-run", "--set", "emit=every_step"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"] == 2

    assert cli_main(["apply", str(recipe), "-q", "--set", "emit=every_step"]) == 0
    out = workdir / "out"
    assert (out / "config.json").is_file() and (out / "recipe.yaml").is_file()
    assert (out / "steps" / "01-identity" / "checkpoint" / "config.json").is_file()
    assert not (out / "steps" / "02-analyze" / "checkpoint").exists()  # report-only step
    assert yaml.safe_load((out / "recipe.yaml").read_text())["emit"] == "every_step"
