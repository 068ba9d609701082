"""The contract every built-in pass keeps, checked over the whole table:

- the input layer is not mutated; a second run is bit-identical; the info is JSON-serialisable;
- unknown configuration keys are rejected with the step's name;
- what ``emits`` says on shapes alone is what the pass produces (so the chained dry run is truthful);
- a pass reads only the statistics it declared.
"""

from __future__ import annotations

import json

import pytest
import torch
from pass_samples import SAMPLES
from tiny import save_tiny

import moecompress as mc
from moecompress.calibration.catalogue import ALWAYS
from moecompress.engine.dry_run import meta_layer
from moecompress.engine.spec import LayerStats
from moecompress.errors import MissingStatError, PassError, RecipeError
from moecompress.extras import missing
from moecompress.ir import ExpertBank, MoELayer
from moecompress.passes import BUILTIN_PASSES
from moecompress.report.write import json_safe
from moecompress.testing import layer_statistics

MODELS = ("qwen3_moe", "deepseek_v3", "gpt_oss")  # plain; shared expert + groups; biases, fused disk form


def test_every_pass_has_a_sample():
    assert set(SAMPLES) == set(BUILTIN_PASSES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    out = {}
    for m in MODELS:
        save_tiny(m, root / m)
        out[m] = mc.open_checkpoint(root / m)
    return out


def _tensors(obj, prefix="") -> dict[str, torch.Tensor]:
    """Every tensor a layer holds, by a path (layouts through their stored tensors)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, MoELayer | ExpertBank):
        for name in obj.__dataclass_fields__:
            out.update(_tensors(getattr(obj, name), f"{prefix}.{name}"))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}.{k}"))
    elif hasattr(obj, "tensors") and hasattr(obj, "kind"):
        out.update({f"{prefix}.{k}": v for k, v in obj.tensors().items()})
    return out


def _structure(layer: MoELayer) -> dict:
    """What the dry run may rely on: layouts, logical and stored shapes (a ragged layout's total of live
    rows is data-dependent), dtypes, widths, expert count and map, rotation, protection count."""

    def bank(b: ExpertBank | None):
        if b is None:
            return None
        projs = {}
        for p in ("gate", "up", "down"):
            lay = getattr(b, p)
            stored = {k: (list(t.shape)[1:] if lay.kind == "ragged" and k == "rows" else list(t.shape), t.dtype)
                      for k, t in lay.tensors().items()}  # fmt: skip
            projs[p] = (lay.kind, lay.shape, lay.dtype, stored)
        return {
            **projs, "widths": b.widths is not None, "biases": {k: list(v.shape) for k, v in b.biases.items()},
            "rotation": None if b.rotation is None else list(b.rotation.shape), "act_bits": b.act_bits,
            "unrotated": len(b.unrotated),
        }  # fmt: skip

    return {
        "router": (layer.router.num_experts, layer.router.top_k, list(layer.router_weight.shape)),
        "biases": [None if t is None else list(t.shape) for t in (layer.router_bias, layer.score_bias)],
        "experts": bank(layer.experts),
        "shared": bank(layer.shared),
        "expert_map": None if layer.expert_map is None else list(layer.expert_map.shape),
        "protected": len(layer.protected),
    }


def _run(spec, cfg, ckpt, layer, protected=frozenset()):
    needs = spec.needs_for(cfg) | ALWAYS
    stats = {i: layer_statistics(ckpt.read_layer(i).replace(protected=protected), needs, seed=i)
             for i in ckpt.moe_layer_indices}  # fmt: skip
    decision = None
    if spec.plan is not None:
        views = {i: LayerStats.view(i, s, spec.needs_for(cfg), protected=protected) for i, s in stats.items()}
        decision = spec.plan(views, cfg).get(layer.index)
    view = LayerStats.view(layer.index, stats[layer.index], spec.needs_for(cfg), plan=decision)
    return spec.fn(layer, view, cfg)


@pytest.mark.parametrize("protect", [(), (1,)], ids=["unprotected", "protected"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_pass_contract(checkpoints, model, name, protect):
    spec = BUILTIN_PASSES[name]
    extras = spec.extras_for(spec.config.model_validate(SAMPLES[name]))
    if any(missing(extra) for extra in extras):
        pytest.skip(f"needs the {extras} extra")
    ckpt = checkpoints[model]
    cfg = spec.config.model_validate(SAMPLES[name])
    i = ckpt.moe_layer_indices[0]
    protected = frozenset(protect)
    layer = ckpt.read_layer(i).replace(protected=protected)
    before = {k: v.clone() for k, v in _tensors(layer).items()}
    cfg0 = cfg if name != "ablate_experts" else spec.config.model_validate({"experts": [{"layer": i, "experts": [2]}]})
    if spec.check is not None:
        try:
            spec.check(layer, cfg0)
        except PassError:  # infeasible on this model (deepseek's tiny groups cannot lose an expert):
            with pytest.raises(PassError):  # the shapes-only check must say so too
                spec.check(meta_layer(ckpt, i).replace(protected=protected), cfg0)
            return
    new, info = _run(spec, cfg0, ckpt, layer, protected)
    again, info2 = _run(spec, cfg0, ckpt, layer, protected)
    # input not mutated
    after = _tensors(layer)
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before), name
    # deterministic
    a, b = _tensors(new), _tensors(again)
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a), name
    assert json.dumps(json_safe(info), sort_keys=True) == json.dumps(json_safe(info2), sort_keys=True)
    # JSON-serialisable as the engine writes it, and plain already (no tensors sneak into reports)
    json.dumps(json_safe(info), allow_nan=False)
    json.dumps(info, default=lambda o: pytest.fail(f"{name}: info holds a {type(o).__name__}"))
    # emits tells the truth on shapes
    shape_only = spec.emitted(meta_layer(ckpt, i).replace(protected=protected), cfg0)
    want, got = _structure(new if not spec.report_only else layer), _structure(shape_only)
    if spec.protects is not None:  # which experts a plan protects is known only from the statistics
        want.pop("protected"), got.pop("protected")
    assert got == want, name


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_unknown_keys_are_rejected_with_the_step_name(name):
    rec = {"model": "m", "output": "o", "steps": [{"identity": {}}, {name: {**SAMPLES[name], "no_such_key": 1}}]}
    with pytest.raises(RecipeError, match=rf"^step 2 \({name}\): unknown field 'no_such_key'"):
        mc.load_recipe(rec)


class _Peek(mc.PassConfig):
    pass


def _peek(layer, stats, cfg):
    """Test-only: reads a statistic it never declares."""
    return layer, {"sum": float(stats["act_sq_mean"].sum())}


def test_a_pass_reading_an_undeclared_statistic_fails_whatever_the_cache_holds(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    peek = mc.PassSpec("peek", _Peek, _peek, needs={"expert_counts"})
    cal = {"source": "random", "samples": 4, "seq_len": 8}
    rec = {"model": str(tmp_path / "m"), "calibration": cal}
    for out in ("cold", "warm"):  # first with a fresh cache, then with one left by a run that needed it
        with pytest.raises(PassError, match=r"step 1 \(peek\), layer 0: step 1 \(peek\) reads statistic "
                           r"'act_sq_mean' that it does not declare; add it to the pass's needs"):  # fmt: skip
            mc.apply({**rec, "output": str(tmp_path / out), "steps": [{"peek": {}}]}, passes=[peek], progress=False)
        mc.apply({**rec, "output": str(tmp_path / f"{out}-heapr"), "steps": [{"heapr": {"scope": "layer"}}]},
                 progress=False)  # fmt: skip


def test_the_view_holds_exactly_the_declared_statistics():
    entry = {"act_sq_mean": torch.ones(2, 3), "io_sample_x": torch.ones(4, 3), "io_sample_y": torch.ones(4, 3),
             "input_cov": torch.eye(3)}  # fmt: skip
    view = LayerStats.view(0, entry, {"io_sample", "shared_down_out_absmax"}, step="step 3 (x)")
    assert sorted(view) == ["io_sample_x", "io_sample_y"]  # the catalogue's companions, nothing else
    assert view.get("shared_down_out_absmax") is None  # declared, not produced (no shared expert)
    with pytest.raises(MissingStatError, match=r"step 3 \(x\) reads statistic 'input_cov' that it does not declare"):
        view["input_cov"]
    with pytest.raises(MissingStatError, match="does not declare"):
        view.get("act_sq_mean")
    with pytest.raises(TypeError):
        view.tensors["input_cov"] = torch.eye(3)  # read-only
