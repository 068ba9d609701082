"""``moecompress inspect``: what a checkpoint holds, and whether it will load and serve.

Per MoE layer: layouts, parameters and bytes, router experts and physical experts, live widths. Checks
that would otherwise surface as crashes in transformers or a serving engine, each reported with the
layer and the fix instead of stopping at the first:

- every expert tensor present with the shape ``config.json`` implies (stock names), or with the names,
  shapes and dtypes its description declares (our format): the checker the loaders run,
  :mod:`moecompress.io.verify`, here in the mode that collects every problem;
- top-k no larger than the experts a layer keeps (and reachable through group-limited routing);
- consistent widths (gate/up/down agree, live widths within the allocated width) and, with
  ``align``, widths divisible by it (kernels, tensor parallelism);
- stock loadability: stock names everywhere and no ``quantization_config`` -> plain transformers;
  otherwise the moecompress quantizer (``import moecompress``). ``load=True`` proves it by loading the
  model and running a 4-token forward;
- vLLM-servability (``vllm``: GPU, and ``cpu`` for vLLM's CPU build) from the rules of
  :mod:`moecompress.io.servability` (``docs/format.md``, "Serving with vLLM"), not from a load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from moecompress.errors import MoecompressError
from moecompress.io.checkpoint import open_checkpoint
from moecompress.io.hub import resolve_checkpoint_dir
from moecompress.io.routing import check_routing, read_routing
from moecompress.io.servability import vllm_servable
from moecompress.io.verify import LOST, read_block, verify_layers


def _light_fetch(reader, names) -> dict[str, torch.Tensor]:
    """Small and integer tensors (widths, expert maps, biases) for real, big weights as meta tensors."""
    out, real = {}, []
    for n in names:
        numel = 1
        for d in reader.shape(n):
            numel *= d
        if reader.dtype(n).startswith(("I", "U")) or numel <= 65536:
            real.append(n)
        else:
            out[n] = reader.meta(n)
    out.update(reader.get_many(real))
    return out


def _problem(layer: int | None, problem: str, fix: str) -> dict[str, Any]:
    return {"layer": layer, "problem": problem, "fix": fix}


def _layer_facts(layer, align: int | None, problems: list) -> dict[str, Any]:
    bank = layer.experts
    widths = [bank.width_of(e) for e in range(bank.num_experts)]
    facts = {
        "layer": layer.index,
        "layouts": {n: getattr(bank, n).kind for n in ("gate", "up", "down")},
        "router_experts": layer.router.num_experts,
        "physical_experts": bank.num_experts,
        "top_k": layer.router.top_k,
        "width_min": min(widths),
        "width_max": max(widths),
        "params": layer.num_params(),
        "bytes": layer.nbytes(),
        "protected": sorted(layer.protected),
        "routing": {k: dict(v) for k, v in (layer.routing or {}).items()},
    }
    if bank.widths is not None and (int(bank.widths.max()) > bank.width or int(bank.widths.min()) < 0):
        problems.append(
            _problem(layer.index, f"live widths outside [0, {bank.width}]", "re-run the pruning step")
        )
    if align and any(w % align for w in widths):
        bad = sorted({w for w in widths if w % align})[:5]
        problems.append(
            _problem(
                layer.index,
                f"expert widths {bad} are not multiples of {align}",
                f"prune with align: {align} (or pad the widths)",
            )
        )
    return facts


def inspect_checkpoint(path: str | Path, *, align: int | None = None, load: bool = False) -> dict[str, Any]:
    """Inspect ``path``; never raises for problems *inside* the checkpoint (they are reported)."""
    directory = resolve_checkpoint_dir(path)
    raw = _raw_config(directory)
    qc = raw.get("quantization_config") if raw is not None else None
    quant_method = qc.get("quant_method") if isinstance(qc, dict) else None
    descs, block_problems = read_block(raw.get("moecompress") if raw else None, quant_method=quant_method)
    if descs is None:  # the block itself cannot be read: nothing below it can
        return _unreadable(directory, raw, block_problems)
    ckpt = open_checkpoint(directory, validate=False)
    adapter, reader = ckpt.adapter, ckpt.reader
    routing_problem = check_routing(adapter, read_routing(raw.get("moecompress")), reader)
    routing = [] if routing_problem is None else [_problem(None, routing_problem, LOST)]
    problems = routing + [p.as_dict() for p in block_problems + verify_layers(adapter, descs, reader)]
    layers: list[dict[str, Any]] = []
    for i in adapter.moe_layer_indices:
        if any(p["layer"] == i for p in problems):
            continue
        try:
            layer = ckpt.read_layer_with(i, lambda names: _light_fetch(reader, names))
        except MoecompressError as err:
            msg = str(err)
            if "top_k" in msg:
                fix = "keep at least num_experts_per_tok experts per layer (or lower num_experts_per_tok)"
            else:
                fix = "see the message"
            problems.append(_problem(i, msg, fix))
            continue
        layers.append(_layer_facts(layer, align, problems))
    problems.sort(key=lambda p: -1 if p["layer"] is None else p["layer"])
    stock_ok = not problems and not ckpt.layouts and quant_method is None
    why = "stock names and shapes in every MoE layer" if stock_ok else (
        "layers in the moecompress format: " + ", ".join(map(str, sorted(ckpt.layouts))) if ckpt.layouts
        else f"quantization_config {quant_method!r}" if quant_method else "see problems")  # fmt: skip
    report: dict[str, Any] = {
        "path": str(ckpt.path),
        "model_type": ckpt.model_type,
        "moe_layers": adapter.moe_layer_indices,
        "layers": layers,
        "params": sum(x["params"] for x in layers),
        "bytes": sum(x["bytes"] for x in layers),
        "problems": problems,
        "stock_transformers": {"loads": stock_ok, "why": why},
        "moecompress_quantizer": {
            "loads": not problems,
            "why": "all layers readable" if not problems else "see problems",
        },
        "vllm": _vllm(raw, descs, problems, quant_method),
    }
    if load and not problems:
        report["load_check"] = _load_check(ckpt.path)
    report["ok"] = not problems and report.get("load_check", {}).get("ok", True)
    return report


def _raw_config(directory: Path) -> dict | None:
    """``config.json`` as JSON, or ``None`` where :func:`open_checkpoint` will say what is wrong with it."""
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _unreadable(directory: Path, raw: dict | None, problems: list) -> dict[str, Any]:
    """The report of a checkpoint whose ``moecompress`` block cannot be read: its problems only."""
    return {
        "path": str(directory),
        "model_type": (raw or {}).get("model_type"),
        "moe_layers": [],
        "layers": [],
        "params": 0,
        "bytes": 0,
        "problems": [p.as_dict() for p in problems],
        "stock_transformers": {"loads": False, "why": "see problems"},
        "moecompress_quantizer": {"loads": False, "why": "see problems"},
        "vllm": {"serves": False, "why": "see problems", "cpu": False, "cpu_why": "see problems"},
        "ok": False,
    }


def _vllm(raw: dict | None, descs: dict, problems: list, quant_method: Any) -> dict[str, Any]:
    """vLLM-servability from the rules of :mod:`moecompress.io.servability` (GPU, and vLLM's CPU build).
    A checkpoint with problems does not serve (a compressed-tensors export is judged by its config only:
    its packed expert tensors are not moecompress's to verify)."""
    if problems and quant_method != "compressed-tensors":
        return {"serves": False, "why": "see problems", "cpu": False, "cpu_why": "see problems"}
    gpu, gpu_why = vllm_servable(raw, descs, platform="gpu")
    cpu, cpu_why = vllm_servable(raw, descs, platform="cpu")
    return {"serves": gpu, "why": gpu_why, "cpu": cpu, "cpu_why": cpu_why}


def _load_check(path: Path) -> dict[str, Any]:
    from moecompress.runtime.loading import load as load_model

    try:
        model = load_model(path)
        with torch.no_grad():
            logits = model(torch.tensor([[1, 2, 3, 4]]) % model.config.vocab_size).logits
        finite = bool(torch.isfinite(logits).all())
        return {"ok": finite, "why": "forward ran" + ("" if finite else " but produced non-finite logits")}
    except Exception as err:  # reported, not raised: this is a diagnosis tool
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return {"ok": False, "why": f"{type(err).__name__}: {first}"}


def format_report(report: dict[str, Any]) -> str:
    """A human-readable summary of :func:`inspect_checkpoint`."""
    lines = [f"{report['path']}  ({report['model_type']}, MoE layers {report['moe_layers']})", ""]
    lines.append(
        f"{'layer':>5} {'layouts':<22} {'experts':>9} {'top-k':>5} {'width':>11} {'params':>12} {'bytes':>12}"
    )
    for x in report["layers"]:
        lay = "/".join(sorted(set(x["layouts"].values())))
        experts = f"{x['router_experts']}/{x['physical_experts']}"
        width = (
            f"{x['width_min']}..{x['width_max']}" if x["width_min"] != x["width_max"] else str(x["width_max"])
        )
        lines.append(
            f"{x['layer']:>5} {lay:<22} {experts:>9} {x['top_k']:>5} {width:>11} {x['params']:>12,} {x['bytes']:>12,}"
        )
    for x in report["layers"]:
        for kind, knobs in x.get("routing", {}).items():
            shown = ", ".join(f"{k}={v}" for k, v in knobs.items())
            lines.append(f"{x['layer']:>5} routing policy {kind}: {shown}")
    st = report["stock_transformers"]
    lines += [
        "",
        f"plain transformers: {'yes' if st['loads'] else 'no'} ({st['why']})",
        f"moecompress quantizer: {'yes' if report['moecompress_quantizer']['loads'] else 'no'}",
    ]
    if "vllm" in report:
        v = report["vllm"]
        lines.append(
            f"vLLM: {'yes' if v['serves'] else 'no'} ({v['why']}); CPU build: {'yes' if v['cpu'] else 'no'}"
            + ("" if v["cpu"] == v["serves"] and v["cpu_why"] == v["why"] else f" ({v['cpu_why']})")
        )
    if "load_check" in report:
        lines.append(
            f"load check: {'ok' if report['load_check']['ok'] else 'FAILED'} ({report['load_check']['why']})"
        )
    for p in report["problems"]:
        at = "" if p["layer"] is None else f" layer {p['layer']}"
        lines.append(f"PROBLEM{at}: {p['problem']} -> fix: {p['fix']}")
    lines.append("OK" if report["ok"] else f"{len(report['problems'])} problem(s)")
    return "\n".join(lines)
