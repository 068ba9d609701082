"""Sections of the model card (split from :mod:`moecompress.hub.card`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moecompress.errors import CheckpointError
from moecompress.io.servability import VLLM_VERSION, vllm_servable
from moecompress.io.verify import read_block

QUANTIZERS = frozenset({"codequant", "rtn"})
STEP_KINDS: dict[str, str] = {
    "heapr": "pruned",
    "reap": "pruned",
    "prune": "pruned",
    "prune_experts": "pruned",
    "namex": "merged",
    "merge": "merged",
    "merge_experts": "merged",
    "tdmoe": "decomposed",
    "svd": "decomposed",
    "distill": "distilled",
    **dict.fromkeys(QUANTIZERS, "quantized"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _cell(x: object) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _num(n: object) -> str:
    i = _int(n)
    return f"{i:,}" if i is not None else "?"


def _human(n: object) -> str:
    i = _int(n)
    if i is None:
        return "?"
    value = float(i)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{i} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"  # pragma: no cover  (the loop always returns)


def _change(before: object, after: object) -> str:
    b, a = _int(before), _int(after)
    if b is None or a is None or b == 0:
        return ""
    pct = 100.0 * (a - b) / b
    return " (unchanged)" if a == b else f" ({pct:+.1f} %)"


def _fmt(x: object) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return _cell(x)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} cannot be read as JSON ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


# ---------------------------------------------------------------------------------------- sections
def _totals(run: Mapping[str, Any]) -> dict[str, Any]:
    totals = run.get("totals")
    if isinstance(totals, Mapping):
        return dict(totals)
    steps = [s for s in run.get("steps") or [] if isinstance(s, Mapping)]
    if not steps:
        return {}
    return {
        "params_before": steps[0].get("params_before"),
        "params_after": steps[-1].get("params_after"),
        "bytes_before": steps[0].get("bytes_before"),
        "bytes_after": steps[-1].get("bytes_after"),
    }


def _steps_section(run: Mapping[str, Any], rel: str | None, kinds: list[str]) -> list[str]:
    lines = ["## What was done", ""]
    steps = [s for s in run.get("steps") or [] if isinstance(s, Mapping)]
    if steps:
        lines += [
            "Sizes are those of the MoE blocks (routed and shared experts, routers) the steps work on.",
            "",
            "| # | step | kind | parameters before → after | bytes before → after | seconds |",
            "|---|---|---|---|---|---|",
        ]
        for s in steps:
            name = str(s.get("name", "?"))
            pb, pa, bb, ba = (
                s.get(k) for k in ("params_before", "params_after", "bytes_before", "bytes_after")
            )
            lines.append(
                f"| {_cell(s.get('step', '?'))} | `{_cell(name)}` | {STEP_KINDS.get(name, '—')} "
                f"| {_num(pb)} → {_num(pa)}{_change(pb, pa)} | {_human(bb)} → {_human(ba)}{_change(bb, ba)} "
                f"| {_fmt(s.get('seconds', ''))} |"
            )
    else:
        lines.append("The run report lists no steps.")
    lines.append("")
    done = ", ".join(kinds) if kinds else "no structural change (analysis or identity steps only)"
    if rel is None:
        lines.append(
            f"Weights: {done}. The base model was a local directory, not a Hub repo id, so the metadata "
            "has no `base_model` (and therefore no `base_model_relation`); add them by hand if the base "
            "is on the Hub."
        )
    elif rel == "quantized":
        lines.append(f"Weights: {done}. `base_model_relation: quantized` because a step quantises weights.")
    else:
        lines.append(
            f"Weights: {done}. `base_model_relation: finetune` is a choice: the Hub has no relation for "
            "pruned, merged-expert or decomposed models, `finetune` is what it assumes for a derived "
            "safetensors checkpoint, and `merge` (several models merged) or `adapter` would be wrong."
        )
    return [*lines, ""]


def _calibration_section(run: Mapping[str, Any]) -> list[str]:
    cal = (run.get("recipe") or {}).get("calibration")
    if not isinstance(cal, Mapping):
        return []
    if cal.get("source") == "none":  # a data-free run: its sample fields were not used
        return ["## Calibration", "", "- source: `none` (data-free steps only): no calibration tokens were read and "
                "reconstruction errors were not measured", ""]  # fmt: skip
    samples, seq_len = _int(cal.get("samples")), _int(cal.get("seq_len"))
    lines = ["## Calibration", "", f"- source: `{_cell(cal.get('source', '?'))}`"]
    line = f"- samples: {_num(samples)} sequences × {_num(seq_len)} tokens"
    if samples is not None and seq_len is not None:
        line += f" = {samples * seq_len:,} tokens"
    lines.append(line)
    for key in ("seed", "holdout", "propagate"):
        if cal.get(key) is not None:
            lines.append(f"- {key}: `{_cell(cal[key])}`")
    info = run.get("calibration")
    if isinstance(info, Mapping) and info.get("cached"):
        lines.append("- statistics were reused from the statistics cache")
    return [*lines, ""]


def _n_experts(config: Mapping[str, Any] | None) -> int | None:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config and _int(config.get(key)):
            return int(config[key])
    return None


def _experts_section(run: Mapping[str, Any], base_config: Mapping[str, Any] | None) -> list[str]:
    kept = run.get("experts_kept")
    if isinstance(kept, list):
        kept = dict(enumerate(kept))
    if not isinstance(kept, Mapping) or not kept:
        return []
    total = _n_experts(base_config)
    lines = ["## Experts kept per layer", "", "| layer | experts kept |", "|---|---|"]
    for layer, value in kept.items():
        ids = value if isinstance(value, list) else None
        count = len(ids) if ids is not None else _int(value)
        text = _num(count) + (f" of {total}" if total and count is not None else "")
        if ids is not None and len(ids) <= 32:
            text += f" ({', '.join(map(str, ids))})"
        lines.append(f"| {_cell(layer)} | {_cell(text)} |")
    return [*lines, ""]


def _sizes_section(run: Mapping[str, Any], out_dir: Path) -> list[str]:
    t = _totals(run)
    lines = ["## Sizes", ""]
    if t:
        pb, pa, bb, ba = (t.get(k) for k in ("params_before", "params_after", "bytes_before", "bytes_after"))
        lines.append(f"- MoE parameters: {_num(pb)} → {_num(pa)}{_change(pb, pa)}")
        lines.append(f"- MoE bytes: {_human(bb)} → {_human(ba)}{_change(bb, ba)}")
    shards = sorted(out_dir.glob("*.safetensors")) if out_dir.is_dir() else []
    if shards:
        size = sum(p.stat().st_size for p in shards)
        lines.append(f"- checkpoint weights on disk: {_human(size)} in {len(shards)} safetensors file(s)")
    elif not run.get("checkpoint", True):
        lines.append("- no checkpoint was written (report-only run)")
    return [*lines, ""] if len(lines) > 2 else []


_METRICS = {
    "perplexity": "perplexity",
    "kl": "KL(base ‖ model), nats",
    "top1_agreement": "top-1 agreement with base",
    "tokens_per_second": "tokens/s",
}


def _eval_rows(ev: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Table rows and info lines from an evaluation: ``evaluate()``'s dict or ``{"rows": [...]}``."""
    if isinstance(ev.get("rows"), list):
        rows = [dict(r) for r in ev["rows"] if isinstance(r, Mapping)]
        info = [f"{_cell(k)}: {_fmt(v)}" for k, v in ev.items() if k != "rows" and not isinstance(v, Mapping)]
        return rows, info
    rows = []
    if ev.get("base_perplexity") is not None:
        rows.append(
            {
                "model": "base",
                "perplexity": ev["base_perplexity"],
                "tokens_per_second": ev.get("base_tokens_per_second"),
            }
        )
    rows.append({"model": "this model", **{k: ev.get(k) for k in _METRICS}, **_task_cells(ev.get("tasks"))})
    if rows[0]["model"] == "base":
        rows[0].update(_task_cells(ev.get("base_tasks")))
    info = []
    if _int(ev.get("tokens")):
        info.append(
            f"{ev['tokens']:,} scored tokens in {_num(ev.get('windows'))} windows of {_num(ev.get('seq_len'))}"
        )
    texts = [Path(str(t)).name for t in ev.get("texts") or []]
    if ev.get("token_source") == "random":
        info.append("token source: random ids (a smoke test, not a quality measure)")
    elif texts:
        info.append("held-out split (last 2 %) of: " + ", ".join(f"`{_cell(t)}`" for t in texts))
    else:
        info.append("held-out split (last 2 %) of the builtin texts")
    if ev.get("dtype") or ev.get("device"):
        info.append(f"dtype {_cell(ev.get('dtype', '?'))} on {_cell(ev.get('device', '?'))}")
    if isinstance(ev.get("tasks"), Mapping) and ev["tasks"]:
        harness = ev.get("task_harness") if isinstance(ev.get("task_harness"), Mapping) else {}
        done = [
            f"`{_cell(t)}` ({_num(m.get('samples'))} documents)" if isinstance(m, Mapping) else f"`{_cell(t)}`"
            for t, m in ev["tasks"].items()
        ]
        info.append(f"lm-evaluation-harness {_cell(harness.get('lm_eval', '?'))} tasks: " + ", ".join(done))
    return rows, info


def _model_index(evaluation: Mapping[str, Any] | None, name: str) -> list[dict[str, Any]] | None:
    """The Hub's ``model-index`` results (front matter) for the lm-eval tasks of an evaluation."""
    tasks = (evaluation or {}).get("tasks")
    if not isinstance(tasks, Mapping) or not tasks:
        return None
    results = []
    for task, metrics in tasks.items():
        if not isinstance(metrics, Mapping):
            continue
        values = [{"type": k, "value": v, "name": k} for k, v in metrics.items() if k != "samples" and _is_num(v)]
        if values:
            dataset = {"name": str(task), "type": str(task)}
            results.append({"task": {"type": "text-generation"}, "dataset": dataset, "metrics": values})
    return [{"name": name, "results": results}] if results else None


def _task_cells(tasks: Any) -> dict[str, Any]:
    """``{"TASK METRIC": value}`` table cells from ``evaluate(..., tasks=...)``'s ``tasks`` dict."""
    if not isinstance(tasks, Mapping):
        return {}
    cells = {}
    for task, metrics in tasks.items():
        if isinstance(metrics, Mapping):
            cells |= {f"{task} {k}": v for k, v in metrics.items() if k != "samples" and _is_num(v)}
    return cells


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _evaluation_section(evaluation: Mapping[str, Any] | None) -> list[str]:
    if not evaluation:
        return []
    rows, info = _eval_rows(evaluation)
    lines = ["## Evaluation", "", *(f"- {line}" for line in info)]
    if not rows:
        return [*lines, ""]
    keys = [k for k in _METRICS if any(r.get(k) is not None for r in rows)]
    keys += sorted({k for r in rows for k in r if k not in _METRICS and k != "model"})
    base = next((r for r in rows if r.get("model") == "base"), None)
    base_ppl = base.get("perplexity") if base else None
    delta = isinstance(base_ppl, (int, float)) and not isinstance(base_ppl, bool)
    head = ["model", *(_METRICS.get(k, k) for k in keys)] + (["Δ perplexity vs base"] if delta else [])
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [_cell(r.get("model", "?"))]
        cells += [_fmt(r[k]) if r.get(k) is not None else "—" for k in keys]
        if delta:
            ppl = r.get("perplexity")
            ok = isinstance(ppl, (int, float)) and not isinstance(ppl, bool)
            cells.append(f"{ppl - base_ppl:+.4g}" if ok else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _routing_section(out_dir: Path) -> list[str]:
    """The routing policies the checkpoint stores (``docs/routing.md``), grouped by identical knobs."""
    try:
        block = _read_json(out_dir / "config.json").get("moecompress")
    except CheckpointError:
        return []
    routing = block.get("routing") if isinstance(block, Mapping) else None
    if not isinstance(routing, Mapping) or not routing:
        return []
    groups: dict[str, list[int]] = {}
    for layer, policy in sorted(routing.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else -1):
        if not isinstance(policy, Mapping):
            continue
        for kind, knobs in policy.items():
            shown = ", ".join(f"{k}={v}" for k, v in (knobs or {}).items()) if isinstance(knobs, Mapping) else ""
            groups.setdefault(f"`{_cell(kind)}` ({_cell(shown)})", []).append(int(layer))
    lines = ["## Routing policies", "",
             "Applied by the moecompress runtime when the model runs; the weights are not changed by them.", ""]  # fmt: skip
    lines += [f"- {policy}: MoE layers {', '.join(map(str, layers))}" for policy, layers in groups.items()]
    lines += ["", 'Switch them off with `moecompress.load(path, routing="off")` or change their knobs with '
              '`routing={...}` (moecompress docs/routing.md).', ""]  # fmt: skip
    return lines


def _serving_section(out_dir: Path, loadability: str) -> list[str]:
    """vLLM-servability by :func:`moecompress.io.servability.vllm_servable` (GPU and vLLM's CPU build)."""
    try:
        cfg = _read_json(out_dir / "config.json")
    except CheckpointError:
        cfg = None
    if cfg is None:
        if loadability != "moecompress":
            return []
        return ["**vLLM:** not servable: moecompress's own layouts (run it with `moecompress.load`).", ""]
    qc = cfg.get("quantization_config")
    descs, _ = read_block(cfg.get("moecompress"), quant_method=qc.get("quant_method") if isinstance(qc, Mapping) else None)
    gpu, why = vllm_servable(cfg, descs or {}, platform="gpu")
    cpu, cpu_why = vllm_servable(cfg, descs or {}, platform="cpu")
    return [
        f"**vLLM {_cell(VLLM_VERSION)}:** {'serves it' if gpu else 'not servable'} ({_cell(why)}); its CPU build: "
        f"{'yes' if cpu else 'no'} ({'the same' if cpu_why == why else _cell(cpu_why)}). "
        "By moecompress's servability rules (docs/format.md).",
        "",
    ]


def _loading_section(out_dir: Path, name: str, loadability: str, repo_id: str | None) -> list[str]:
    where = json.dumps(repo_id or name)
    comment = "" if repo_id else "  # this directory, or its Hub repo id"
    tok = any((out_dir / f).is_file() for f in TOKENIZER_FILES)
    if loadability == "stock":
        lines = [
            "## Loading",
            "",
            "**Loadability:** loads with plain transformers (moecompress is not needed).",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM" + (", AutoTokenizer" if tok else ""),
            "",
        ]
    else:
        lines = [
            "## Loading",
            "",
            "**Loadability:** needs `pip install moecompress` and `import moecompress` before loading "
            "(it registers moecompress's weight formats with transformers).",
            "",
            "```python",
            "import moecompress  # registers moecompress's formats with transformers",
            "from transformers import AutoModelForCausalLM" + (", AutoTokenizer" if tok else ""),
            "",
        ]
    lines.append(f'model = AutoModelForCausalLM.from_pretrained({where}, dtype="auto"){comment}')
    if tok:
        lines.append(f"tokenizer = AutoTokenizer.from_pretrained({where})")
    return [*lines, "```", ""]


# -------------------------------------------------------------------------------------------- public
