"""Step and run reports: ``report.json``, ``report.md`` and PNG plots.

Every recipe step writes ``report.{json,md}`` plus plots into its own directory; the run writes a
``report.{json,md}`` that links them. Reports are always written. matplotlib is optional (extra
``plots``): without it the plots are skipped and the report says so in ``notes``; a plot that cannot be
drawn (bad spec, odd data) is skipped with a note too, because a report must never fail a long run.

Values go through :func:`json_safe` first, so tensors, enums, paths, dataclasses and non-finite floats
(``"inf"``, ``"-inf"``, ``"nan"``) never produce invalid JSON (dumped with ``allow_nan=False``). Each
file is written to a temporary sibling and moved into place with ``os.replace``. matplotlib is used
through its object API on the Agg canvas: no pyplot, no global backend switch.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch
import yaml

from moecompress.methods.metrics import chunks
from moecompress.report.plots import num, write_atomic, write_plots

log = logging.getLogger(__name__)

MAX_LIST_ELEMENTS = 65_536  # tensors/arrays up to this size (1-D/2-D) become lists, larger ones summaries
_SIZE_KEYS = ("params_before", "params_after", "bytes_before", "bytes_after")
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


# ------------------------------------------------------------------------------------------- json_safe
def _tensor_safe(t: torch.Tensor) -> object:
    t = t.detach()
    if t.is_meta:
        return {"shape": list(t.shape), "dtype": str(t.dtype), "device": "meta"}
    if t.dim() == 0:
        return json_safe(t.item())
    if t.dim() <= 2 and t.numel() <= MAX_LIST_ELEMENTS:
        return json_safe(t.tolist())
    n = t.numel()
    out: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype), "numel": n}
    if n and not t.is_complex() and t.dtype != torch.bool:
        lo, hi, s1, s2 = math.inf, -math.inf, 0.0, 0.0
        for (c,) in chunks(t):
            lo, hi = min(lo, float(c.min())), max(hi, float(c.max()))
            s1, s2 = s1 + float(c.sum()), s2 + float(c.square().sum())
        out.update(min=lo, max=hi, mean=s1 / n, std=math.sqrt(max(s2 / n - (s1 / n) ** 2, 0.0)))
    return json_safe(out)


def json_safe(obj: object) -> object:
    """Recursively turn ``obj`` into plain JSON values (dict keys become strings).

    Tensors/arrays: 0-d -> number, 1-d/2-d up to ``MAX_LIST_ELEMENTS`` -> lists, larger ones -> a summary
    ``{"shape", "dtype", "numel", "min", "max", "mean", "std"}`` (population std; meta tensors: shape,
    dtype and ``"device": "meta"``); numpy scalars -> numbers; paths ->
    strings; enums -> ``.value``; sets -> sorted lists; dataclasses and pydantic models -> dicts;
    ``inf``/``-inf``/``nan`` -> ``"inf"``/``"-inf"``/``"nan"``; anything else -> ``str(obj)``.
    """
    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, enum.Enum):
        return json_safe(obj.value)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else ("nan" if math.isnan(obj) else str(obj))
    if isinstance(obj, torch.Tensor):
        return _tensor_safe(obj)
    if isinstance(obj, np.ndarray):
        try:  # numeric arrays follow the tensor rules
            return _tensor_safe(torch.from_numpy(np.ascontiguousarray(obj)))
        except (TypeError, ValueError):  # strings, objects, dtypes torch lacks
            return json_safe(obj.tolist())
    if isinstance(obj, np.generic):
        return json_safe(obj.item())
    if isinstance(obj, PurePath):
        return str(obj)
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            key = json_safe(k)
            out[key if isinstance(key, str) else json.dumps(key)] = json_safe(v)
        return out
    if isinstance(obj, (set, frozenset)):
        return sorted((json_safe(v) for v in obj), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: json_safe(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if callable(getattr(obj, "model_dump", None)):  # pydantic models (resolved recipes)
        return json_safe(obj.model_dump())
    return str(obj)


# ------------------------------------------------------------------------------------------- writing
def _json_bytes(safe: object) -> bytes:
    return (json.dumps(safe, indent=2, allow_nan=False, ensure_ascii=False) + "\n").encode()


def _yaml_block(safe: object) -> list[str]:
    text = yaml.safe_dump(safe, sort_keys=False, allow_unicode=True, default_flow_style=False)
    return ["```yaml", text.rstrip("\n"), "```", ""]


# ---------------------------------------------------------------------------------------- formatting
def _fmt(x: object, spec: str) -> str:
    v = num(x)
    if v is None:
        return "—"
    if math.isnan(v):
        return "nan"
    return ("∞" if v > 0 else "-∞") if math.isinf(v) else format(v, spec)


def _fmt_bytes(x: object) -> str:
    v = num(x)
    if v is None or not math.isfinite(v):
        return _fmt(x, ".0f")
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024:
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.2f} {unit}"
        v /= 1024
    return f"{v:.2f} TiB"


def _delta_pct(before: object, after: object) -> float | None:
    b, a = num(before), num(after)
    return None if b is None or a is None or b == 0 else (a - b) / b * 100.0


def _cell(x: object) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(r) + " |" for r in [header, ["---:"] * len(header), *rows]] + [""]


def _bullets(title: str, items: list[object]) -> list[str]:
    return [f"## {title}", "", *[f"- {_cell(i)}" for i in items], ""] if items else []


def _sum(rows: list[dict], key: str) -> float | int | None:
    vals = [v for v in (num(r.get(key)) for r in rows) if v is not None]
    total = sum(vals) if vals else None
    return int(total) if total is not None and key != "seconds" and math.isfinite(total) else total


def _totals(values: list[object]) -> dict[str, Any]:
    """``{params,bytes}_{before,after}``, ``seconds`` and ``{params,bytes}_reduction_pct``."""
    out = dict(zip((*_SIZE_KEYS, "seconds"), values))
    for k in ("params", "bytes"):
        delta = _delta_pct(out[f"{k}_before"], out[f"{k}_after"])
        out[f"{k}_reduction_pct"] = None if delta is None else -delta
    return out


# ------------------------------------------------------------------------------------------- plots
def _size_cells(r: dict, bytes_delta: bool) -> list[str]:
    """``params before → after``, ``Δ%``, ``bytes before → after`` (and the bytes ``Δ%``)."""
    pb, pa, bb, ba = (r.get(k) for k in _SIZE_KEYS)
    dp, db = (_delta_pct(pb, pa), _delta_pct(bb, ba))
    params = f"{_fmt(pb, ',.0f')} → {_fmt(pa, ',.0f')}"
    cells = [params, _fmt(dp, "+.1f") + "%" * (dp is not None), f"{_fmt_bytes(bb)} → {_fmt_bytes(ba)}"]
    return [*cells, _fmt(db, "+.1f") + "%" * (db is not None)] if bytes_delta else cells


def _reduction_line(totals: dict[str, Any]) -> list[str]:
    red = [_fmt(totals[f"{k}_reduction_pct"], ".1f") for k in ("params", "bytes")]
    return [f"Overall reduction: params {red[0]}%, bytes {red[1]}%.", ""]


def _layer_table(rows: list[dict], totals: dict[str, Any]) -> list[str]:
    if not rows:
        return ["_No MoE layers in this step._", ""]
    header = ["layer", "params before → after", "Δ%", "bytes before → after", "rel. error", "SQNR dB"]
    errors = [[_fmt(r.get("rel_error"), ".3e"), _fmt(r.get("sqnr_db"), ".2f")] for r in rows]
    body = [
        [_cell(r.get("layer", "—")), *_size_cells(r, False), *err, _fmt(r.get("seconds"), ".2f")]
        for r, err in zip(rows, errors)
    ]
    body.append(["**total**", *_size_cells(totals, False), "", "", _fmt(totals["seconds"], ".2f")])
    return _table([*header, "seconds"], body) + _reduction_line(totals)


def _write_pair(directory: Path, out: dict, md: list[str]) -> list[Path]:
    written = [write_atomic(directory / "report.json", _json_bytes(out))]
    return [*written, write_atomic(directory / "report.md", "\n".join(md).encode())]


def write_step_report(directory: Path, report: dict) -> list[Path]:
    """Writes directory/report.json, directory/report.md and PNG plots into directory; returns written paths.

    The JSON holds the report as given (through :func:`json_safe`) with ``plots`` replaced by the PNG file
    names written, the given plot specs kept under ``plot_specs``, plus ``totals`` and ``notes``. Returns
    ``[report.json, report.md, *pngs]``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    safe = json_safe(report)
    rows = [r for r in safe.get("layers") or [] if isinstance(r, dict)]
    totals = _totals([_sum(rows, k) for k in (*_SIZE_KEYS, "seconds")])
    notes: list[str] = []
    extra = report.get("plots") or []
    changed = not rows or any(r.get("changed", True) for r in rows)
    if not changed:
        notes.append("standard plots skipped: the step left every layer unchanged")
    pngs = write_plots(directory, rows, list(extra), notes, standard=changed)
    out = {
        **safe,
        "plots": [p.name for p, _ in pngs],
        "plot_specs": safe.get("plots") or [],
        "totals": totals,
    }
    out["notes"] = notes

    step, name = safe.get("step"), safe.get("name", "")
    md = [f"# Step {step}: {name}" if step is not None else f"# Step: {name}", ""]
    time = f"Time: {_fmt(safe.get('seconds'), '.2f')} s"
    md += [f"{time} · peak RSS: {_fmt(safe.get('peak_rss_mb'), ',.1f')} MB", ""]
    md += ["## Config", "", *_yaml_block(safe.get("config") or {})]
    md += ["## Layers", "", *_layer_table(rows, totals)]
    md += ["## Summary", "", *_yaml_block(safe["summary"])] if safe.get("summary") else []
    md += _bullets("Warnings", safe.get("warnings") or []) + _bullets("Notes", notes)
    md += ["## Plots", "", *[f"![{_cell(t)}]({p.name})\n" for p, t in pngs]] if pngs else []
    return _write_pair(directory, out, md) + [p for p, _ in pngs]


def _pick(steps: list[dict], key: str, last: bool = False) -> object:
    vals = [s.get(key) for s in steps if num(s.get(key)) is not None]
    return (vals[-1] if last else vals[0]) if vals else None


def _step_table(steps: list[dict], totals: dict[str, Any]) -> list[str]:
    if not steps:
        return ["_No steps._", ""]
    body = []
    for s in steps:
        name, link = _cell(s.get("name", "")), s.get("report")
        name = f"[{name}]({link})" if isinstance(link, str) and link else name
        body.append([_cell(s.get("step", "—")), name, *_size_cells(s, True), _fmt(s.get("seconds"), ".2f")])
    body.append(["**run**", "", *_size_cells(totals, True), _fmt(totals["seconds"], ".2f")])
    header = ["step", "name", "params before → after", "Δ%", "bytes before → after", "Δ%", "seconds"]
    return _table(header, body) + _reduction_line(totals)


def write_run_report(directory: Path, run: dict) -> list[Path]:
    """Writes directory/report.json and directory/report.md for the whole run (ties step reports together).

    ``totals`` (added to the JSON) go from the first step's ``*_before`` to the last step's ``*_after``;
    their ``seconds`` is the sum over steps. Returns ``[report.json, report.md]``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    safe = json_safe(run)
    steps = [s for s in safe.get("steps") or [] if isinstance(s, dict)]
    totals = _totals(
        [*(_pick(steps, k, last=k.endswith("after")) for k in _SIZE_KEYS), _sum(steps, "seconds")]
    )
    md = ["# moecompress run report", ""]
    md += [f"- model: `{safe.get('model', '')}`", f"- output: `{safe.get('output', '')}`"]
    md += [f"- moecompress: {safe.get('moecompress_version', '')}"]
    md += [f"- total time: {_fmt(safe.get('total_seconds'), '.2f')} s"]
    md += [f"- peak RSS: {_fmt(safe.get('peak_rss_mb'), ',.1f')} MB", ""]
    md += ["## Steps", "", *_step_table(steps, totals)]
    md += ["## Calibration", "", *_yaml_block(safe["calibration"])] if safe.get("calibration") else []
    md += _bullets("Warnings", safe.get("warnings") or [])
    skipped = [f"`{n}`" for n in safe.get("input_files_skipped") or []]
    md += _bullets("Input files not copied (list them in `copy_extra` to copy them)", skipped)
    md += ["## Recipe", "", *_yaml_block(safe.get("recipe") or {})]
    return _write_pair(directory, {**safe, "totals": totals}, md)
