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

import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from moecompress.errors import CheckpointError
from moecompress.hub.card_sections import (
    QUANTIZERS,
    STEP_KINDS,
    _calibration_section,
    _cell,
    _evaluation_section,
    _experts_section,
    _int,
    _loading_section,
    _model_index,
    _n_experts,
    _read_json,
    _routing_section,
    _serving_section,
    _sizes_section,
    _steps_section,
)

# Step name -> kind. The kind becomes a tag; unknown steps (analyze, identity, protection masks, ...)
# change no weights structurally and are ignored. Extend this table when a pass is added.
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


def public_path(path: str | None) -> str | None:
    """A path as it may appear in a report or card that leaves this machine: a Hub cache snapshot as
    its repo id, an absolute local path as ``…/<last component>``, anything relative as given."""
    if path is None:
        return None
    text = str(path)
    m = _HF_CACHE.search(text.replace("\\", "/"))
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    if text.startswith(("/", "~")) or (len(text) > 2 and text[1] == ":"):
        return f"…/{Path(text).name}"
    return text


def public_recipe(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """``recipe`` (as :meth:`~moecompress.engine.recipe.Recipe.to_dict` gives it) with its local paths
    made public (:func:`public_path`): model, output, the cache directory and ``file:`` sources."""
    out = dict(recipe)
    for key in ("model", "output"):
        if isinstance(out.get(key), str):
            out[key] = public_path(out[key])
    cal = dict(out.get("calibration") or {})
    if isinstance(cal.get("cache_dir"), str):
        cal["cache_dir"] = public_path(cal["cache_dir"])
    src = cal.get("source")
    if isinstance(src, str) and src.startswith("file:"):
        cal["source"] = "file:" + ",".join(str(public_path(x)) for x in src[5:].split(","))
    if cal:
        out["calibration"] = cal
    return out


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
    (with ``against=`` the base: perplexity of both, KL, top-1 agreement, tokens/s; with ``tasks=``
    the lm-eval metrics, as table columns and as the front matter's ``model-index``) or
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
    index = _model_index(evaluation, name)
    if index:  # lm-eval task results, in the Hub's model-index form
        meta["model-index"] = index
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
        cls = f"({_cell(cfg['architectures'][0])})"
        arch = [f"{arch[0]} {cls}"] if arch else [cls]
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
    body += _routing_section(out_dir)
    body += _loading_section(out_dir, name, loadability, repo_id)
    body += _serving_section(out_dir, loadability)
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

    The base card (for its license) is the one the run recorded in ``report.json`` (``base_card``), else
    read only from places that need no network: the recipe's model directory when it exists, or the
    local Hugging Face cache of its repo id.
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
        "base_card": run.get("base_card")
        if isinstance(run.get("base_card"), str)
        else _local_base_card(str(run.get("model") or (run.get("recipe") or {}).get("model") or "")),
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
