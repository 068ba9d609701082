"""Model card (``README.md``) of a compressed checkpoint: Hub metadata header plus what was done.

The YAML header follows ``shared/guide/ECOSYSTEM.md`` §6: ``base_model``, ``base_model_relation``,
``library_name``, ``pipeline_tag``, ``license`` (inherited from the base card) and ``tags``. The body
is built from the run report (``report.json``): the steps with parameters and bytes before → after,
calibration, experts kept per layer (when the report has ``experts_kept``), sizes, evaluation (when
given), loadability, the resolved recipe and a loading snippet.

``base_model_relation``: the Hub accepts ``adapter``, ``merge``, ``quantized`` and ``finetune``. We
write ``quantized`` when a step quantises weights (:data:`QUANTIZERS`) and ``finetune`` otherwise
(pruning, expert merging, decomposition, identity/analysis-only runs): ``finetune`` is what the Hub
itself assumes for a derived safetensors checkpoint, ``merge`` would claim a merge of several models
and ``adapter`` a PEFT adapter, neither of which this is. The card says so in its body. When the
recipe's model was a local directory there is no Hub id to point at: ``base_model`` and
``base_model_relation`` are both left out, and the body says so.

Nothing here reads environment variables or handles tokens; a card is built only from the run
report, configs and the base card.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from moecompress.errors import CheckpointError

# Step name -> kind. The kind becomes a tag; unknown steps (analyze, identity, protection masks, ...)
# change no weights structurally and are ignored. Extend this table when a pass is added.
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
LOADABILITY = ("stock", "moecompress")
# quant_method values stock transformers loads without moecompress (used only to infer loadability).
STOCK_QUANT_METHODS = frozenset(
    {"compressed-tensors", "fp8", "fbgemm_fp8", "gptq", "awq", "bitsandbytes", "mxfp4", "torchao", "hqq"}
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HF_CACHE = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/")
_FRONT_MATTER = re.compile(r"\A\ufeff?---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.S)


# ------------------------------------------------------------------------------------------- helpers
def base_repo_id(model: str) -> str | None:
    """The Hub repo id of a recipe's ``model``, or None when it names a local directory.

    A Hub cache snapshot path (``.../models--org--name/snapshots/<rev>``) gives back ``org/name``.
    Like :func:`moecompress.io.hub.resolve_checkpoint_dir`, an existing local path wins over a Hub id.
    """
    text = str(model).strip()
    m = _HF_CACHE.search(text.replace("\\", "/"))
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    if text.startswith((".", "/", "~")) or not _HUB_ID.match(text) or Path(text).exists():
        return None
    return text


def front_matter(card: str) -> dict[str, Any]:
    """The YAML header of a model card as a dict (empty when there is none or it does not parse)."""
    m = _FRONT_MATTER.match(card)
    if not m:
        return {}
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _license(base_card: str | None) -> dict[str, Any]:
    meta = front_matter(base_card) if base_card else {}
    lic = meta.get("license")
    if not (isinstance(lic, str) or (isinstance(lic, list) and all(isinstance(x, str) for x in lic))):
        return {}
    out: dict[str, Any] = {"license": lic}
    if lic == "other":  # custom licenses are described by these two keys on the Hub
        out.update({k: meta[k] for k in ("license_name", "license_link") if isinstance(meta.get(k), str)})
    return out


def _step_names(run: Mapping[str, Any]) -> list[str]:
    steps = run.get("steps")
    if isinstance(steps, list) and steps and all(isinstance(s, Mapping) for s in steps):
        return [str(s.get("name", "?")) for s in steps]
    recipe_steps = (run.get("recipe") or {}).get("steps") or []
    return [str(next(iter(s))) for s in recipe_steps if isinstance(s, Mapping) and s]


def _kinds(names: list[str]) -> list[str]:
    return list(dict.fromkeys(STEP_KINDS[n] for n in names if n in STEP_KINDS))


def relation(run: Mapping[str, Any]) -> str:
    """``quantized`` when any step is a quantiser, else ``finetune`` (see the module docstring)."""
    return "quantized" if any(n in QUANTIZERS for n in _step_names(run)) else "finetune"


def infer_loadability(config: Mapping[str, Any] | None) -> str:
    """``stock`` or ``moecompress`` from a written ``config.json``.

    ``config["moecompress"]["loadability"]`` wins when present; otherwise a ``quantization_config``
    whose ``quant_method`` stock transformers does not know means ``moecompress``.
    """
    config = config or {}
    meta = config.get("moecompress")
    if isinstance(meta, Mapping) and meta.get("loadability") in LOADABILITY:
        return str(meta["loadability"])
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, Mapping) else None
    return "moecompress" if method and method not in STOCK_QUANT_METHODS else "stock"


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
    rows.append({"model": "this model", **{k: ev.get(k) for k in _METRICS}})
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
    return rows, info


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
            "(it registers moecompress's weight formats with transformers). Not servable by vLLM: vLLM "
            "has no kernels for these layouts.",
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
def model_card(
    out_dir: Path,
    *,
    run: dict,
    base_config: dict | None = None,
    base_card: str | None = None,
    evaluation: dict | None = None,
    loadability: str = "stock",
    repo_id: str | None = None,
    name: str | None = None,
) -> str:
    """The ``README.md`` text for the checkpoint in ``out_dir``.

    ``run`` is the run report (``report.json``); ``base_config`` the base model's ``config.json``
    (architecture line, experts per layer); ``base_card`` the base repo's ``README.md`` text (its
    ``license`` is inherited); ``evaluation`` the dict :func:`moecompress.evaluate` returns
    (with ``against=`` the base: perplexity of both, KL, top-1 agreement, tokens/s) or
    ``{"rows": [{"model": "base", "perplexity": ...}, {"model": ..., "kl": ...}], <scalar info>...}``;
    ``loadability``
    is ``"stock"`` or ``"moecompress"``; ``repo_id`` (optional) is used in the loading snippet; ``name``
    (default ``out_dir.name``) is the title, e.g. the final output's name when ``out_dir`` is still
    the run's staging directory.
    """
    if loadability not in LOADABILITY:
        raise ValueError(f"loadability must be one of {LOADABILITY}, got {loadability!r}")
    out_dir = Path(out_dir)
    name = name or out_dir.name or "compressed model"
    recipe = run.get("recipe") or {}
    model = str(run.get("model") or recipe.get("model") or "")
    base = base_repo_id(model) if model else None
    names = _step_names(run)
    kinds = _kinds(names)
    rel = relation(run) if base else None

    meta: dict[str, Any] = {}
    if base:
        meta.update(base_model=base, base_model_relation=rel)
    meta.update(library_name="transformers", pipeline_tag="text-generation", **_license(base_card))
    tags = ["moe", "moecompress", *kinds]
    try:
        qc = _read_json(out_dir / "config.json").get("quantization_config")
    except CheckpointError:  # no or unreadable config: no format tag
        qc = None
    if isinstance(qc, Mapping) and isinstance(qc.get("quant_method"), str):
        tags.append(qc["quant_method"])
    meta["tags"] = list(dict.fromkeys(tags))
    header = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, default_flow_style=False)

    version = run.get("moecompress_version", "?")
    if base:
        origin = f"[{base}](https://huggingface.co/{base})"
    else:
        origin = f"a local checkpoint directory (`{_cell(Path(model).name) or '?'}`)"
    body = [f"# {name}", ""]
    body.append(
        f"A Mixture-of-Experts checkpoint produced from {origin} by moecompress {_cell(version)} "
        f"with the steps {', '.join(f'`{n}`' for n in names) or '(none)'}."
    )
    cfg = base_config or {}
    arch = [f"`{_cell(cfg['model_type'])}`"] if isinstance(cfg.get("model_type"), str) else []
    if isinstance(cfg.get("architectures"), list) and cfg["architectures"]:
        name = f"({_cell(cfg['architectures'][0])})"
        arch = [f"{arch[0]} {name}"] if arch else [name]
    if _int(cfg.get("num_hidden_layers")):
        arch.append(f"{cfg['num_hidden_layers']} layers")
    if _n_experts(cfg):
        arch.append(f"{_n_experts(cfg)} routed experts per MoE layer")
    if _int(cfg.get("num_experts_per_tok")):
        arch.append(f"top-{cfg['num_experts_per_tok']} routing")
    if arch:
        body += ["", "Base architecture: " + ", ".join(arch) + "."]
    body.append("")
    body += _steps_section(run, rel, kinds)
    body += _calibration_section(run)
    body += _experts_section(run, base_config)
    body += _sizes_section(run, out_dir)
    body += _evaluation_section(evaluation)
    body += _loading_section(out_dir, name, loadability, repo_id)
    warnings = [w for w in run.get("warnings") or [] if isinstance(w, str)]
    if warnings:
        body += ["## Warnings from the run", ""]
        body += [f"- {_cell(w)}" for w in warnings[:20]]
        if len(warnings) > 20:
            body.append(f"- … and {len(warnings) - 20} more (see `report.json`)")
        body.append("")
    if recipe:
        recipe_yaml = yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True, default_flow_style=False)
        body += ["## Recipe", "", "The resolved recipe (also in `recipe.yaml`):", "", "```yaml"]
        body += [recipe_yaml.rstrip("\n"), "```", ""]
    body.append("Per-layer details: `report.json`, `report.md` and `steps/` in this repository.")
    return "---\n" + header + "---\n\n" + "\n".join(body) + "\n"


def write_model_card(out_dir: Path, **kwargs: Any) -> Path:
    """Write :func:`model_card` to ``out_dir/README.md`` atomically (temporary sibling + rename)."""
    out_dir = Path(out_dir)
    text = model_card(out_dir, **kwargs)
    dst = out_dir / "README.md"
    tmp = out_dir / f".README.md.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "x", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def card_inputs(folder: Path, *, repo_id: str | None = None) -> dict[str, Any]:
    """:func:`model_card` keyword arguments for a finished run directory (``report.json``, ``config.json``).

    The base card (for its license) is read only from places that need no network: the recipe's
    model directory when it exists, or the local Hugging Face cache of its repo id.
    """
    folder = Path(folder)
    report = folder / "report.json"
    if not report.is_file():
        raise CheckpointError(
            f"{folder} has no README.md and no report.json to build a model card from; "
            "write a README.md or push a directory produced by `moecompress apply`"
        )
    run = _read_json(report)
    config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else None
    return {
        "run": run,
        "base_config": config,
        "base_card": _local_base_card(str(run.get("model") or (run.get("recipe") or {}).get("model") or "")),
        "loadability": infer_loadability(config),
        "repo_id": repo_id,
    }


def _local_base_card(model: str) -> str | None:
    if not model:
        return None
    candidates: list[Path] = [Path(model).expanduser() / "README.md"]
    repo = base_repo_id(model)
    if repo:
        try:  # the local cache only: no network
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(repo, "README.md")
            if isinstance(hit, str):
                candidates.append(Path(hit))
        except Exception:  # a broken cache must not stop a push
            pass
    for path in candidates:
        try:
            if path.is_file():
                return path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
    return None
