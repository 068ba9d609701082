"""namex / merge_experts on a layer held by chunks of experts: the groups decided from per-expert summaries
gathered chunk by chunk are the whole layer's, and merging group by group (each group's members read expert
by expert) gives the whole layer's merged experts, bit for bit, and its held-back error to rounding."""

from __future__ import annotations

import pytest
import torch
from test_namex import make_layer, make_stats

from moecompress.engine import chunks
from moecompress.engine.pair_sweep import pair_order
from moecompress.ir import ExpertBank
from moecompress.layouts.dense import Dense
from moecompress.passes import merge_experts as me
from moecompress.passes import namex as nx
from moecompress.passes.merge_units import (
    fit_groups,
    gather_pair,
    gather_summaries,
    merge_units,
    run_unit,
    weight_pairs,
)

PROJ = ("gate", "up", "down")
CONFIGS = [
    ("frequency", {"ratio": 0.5}),  # output_tokens, ward
    ("average", {"ratio": 0.25, "similarity": "output", "linkage": "average"}),
    ("frequency", {"target_experts": 3, "similarity": "router", "router": "collapse"}),
    ("frequency", {"target_experts": "auto"}),
    ("namex", {"ratio": 0.5, "refine_steps": 0}),
    ("namex", {"ratio": 0.5, "refine_steps": 0, "router": "collapse", "align": False}),
    ("namex", {"ratio": 0.5}),  # refined: the choice on the whole layer's held-back error, an unwritten pass first
    ("namex", {"ratio": 0.25, "router": "collapse", "phase": 0.0}),
    ("frequency", {"ratio": 0.25, "similarity": "weight", "metric": "euclidean", "linkage": "average"}),
    ("namex", {"ratio": 0.5, "similarity": "weight", "refine_steps": 0}),  # ward on the weight Gram's points
]


def _pass(name: str, kw: dict):
    if name == "namex":
        return nx.namex, nx.merge_groups, nx.NamexConfig(**kw)
    return me.merge_experts, me.merge_groups, me.MergeExpertsConfig(method=name, **kw)


def _cat(banks: list[ExpertBank]) -> ExpertBank:
    return ExpertBank(*(Dense(torch.cat([getattr(b, p).dense() for b in banks])) for p in PROJ))


def _shell(layer):
    bank = layer.experts
    return layer.replace(experts=ExpertBank(*(Dense(getattr(bank, p).dense().to("meta")) for p in PROJ)))


@pytest.mark.parametrize(("name", "kw"), CONFIGS)
@pytest.mark.parametrize("size", [3, 5])
def test_groups_and_merged_experts_by_chunks_are_the_whole_layers(name, kw, size):
    layer = make_layer(seed=7, copies=(1, 6))
    stats = make_stats(layer, n=96)
    whole_fn, merge_groups, cfg = _pass(name, kw)
    whole, info = whole_fn(layer, stats, cfg)
    acc, bounds = None, list(chunks.bounds(8, size))
    sub = lambda k: chunks.sub_layer(layer, chunks.meta_bank(layer.experts, *bounds[k]), bounds[k][0])  # noqa: E731
    for i, j in pair_order(len(bounds)):  # the first sweep: each chunk's summaries, every pair's Gram block
        a = sub(i)
        if i == j:
            acc = gather_summaries(a, stats, cfg, acc)
        if weight_pairs(cfg):
            acc = gather_pair(a, a if i == j else sub(j), cfg, (bounds[i][0], bounds[j][0]), 8, acc)
    dec = fit_groups(acc, _shell(layer), stats, cfg)
    if name == "namex" and cfg.refine_steps:
        dec.variants = nx.refine_variants
    assert dec.plan.groups == info["groups"] and dec.plan.bases == info["bases"]
    assert dec.shell.experts.num_experts == whole.experts.num_experts
    if whole.expert_map is not None:
        assert torch.equal(dec.shell.expert_map, whole.expert_map)
    assert torch.equal(dec.shell.router_weight, whole.router_weight)
    banks, infos, units = [], [], dec.units(size)
    assert all(len(dec.members(lo, hi)) <= size or hi - lo == 1 for lo, hi in units)
    def read(lo, hi):
        return _cat([chunks.meta_bank(layer.experts, e, e + 1) for e in dec.members(lo, hi)])

    if dec.sweeps == 2:
        dec.choose([run_unit(dec, lo, hi, read(lo, hi), merge_groups, cfg)[1] for lo, hi in units])
        assert dec.choice == ("complex" if info["refined"] else "unrefined")
    for lo, hi in units:  # the second sweep: each unit's members read expert by expert
        bank = _cat([chunks.meta_bank(layer.experts, e, e + 1) for e in dec.members(lo, hi)])
        new, part = run_unit(dec, lo, hi, bank, merge_groups, cfg)
        banks.append(new)
        infos.append(part)
    got = _cat(banks)
    for p in PROJ:
        assert torch.equal(getattr(got, p).dense(), getattr(whole.experts, p).dense()), p
    out = merge_units(infos, units, dec)
    assert out["rel_error_held"] == info["rel_error_held"]  # the units' terms added as one forward adds them
    for k in ("groups", "bases", "num_experts_after", "bytes_after", "neurons_moved", "weights", "merged_groups",
              "refined", "refine_fit_loss"):
        assert out.get(k) == info.get(k), k
    for k in ("rel_error_unrefined", "rel_error_refined", "rel_error_refined_real"):
        assert (k in out) == (k in info), k
        if k in info:
            assert out[k] == info[k], k


def test_the_written_pass_refines_the_chosen_run_alone():
    """Once the whole layer's choice is made, a unit refines with the chosen momentum only: the same bits as
    that run among every candidate (the unwritten pass), and no other run."""
    layer = make_layer(seed=7, copies=(1, 6))
    stats = make_stats(layer, n=96)
    _, merge_groups, cfg = _pass("namex", {"ratio": 0.5})
    acc = gather_summaries(layer, stats, cfg, None)
    dec = fit_groups(acc, _shell(layer), stats, cfg)
    dec.variants = nx.refine_variants
    lo, hi = dec.units(8)[0]
    bank = _cat([chunks.meta_bank(layer.experts, e, e + 1) for e in dec.members(lo, hi)])
    unit = dec.plan.unit(lo, hi, bank)
    merged, _ = merge_groups(unit, cfg, lo)
    every, _ = nx.refine_variants(unit, merged, cfg, lo)
    assert set(every) == {"complex", "real"} and every["complex"]
    for name in every:
        alone, _ = nx.refine_variants(unit, merged, cfg, lo, only=name)
        assert list(alone) == [name] and alone[name].keys() == every[name].keys()
        for g in every[name]:
            assert all(torch.equal(alone[name][g][k], every[name][g][k]) for k in every[name][g])
    dec.choice = "complex"
    new, _ = run_unit(dec, lo, hi, bank, merge_groups, cfg)
    want = unit.bank_of(every["complex"])
    assert all(torch.equal(getattr(new, p).dense(), getattr(want, p).dense()) for p in PROJ)


# -- through the engine: expert_chunk: N -------------------------------------------------------------------
CAL = {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 4}
PROTECT = {"protect_super_experts": {"manual": [{"layer": 1, "experts": [2, 6]}]}}


def _run(model, out, steps, chunk, cache):
    import moecompress as mc

    rec = {"model": str(model), "output": str(out), "steps": steps, "expert_chunk": chunk,
           "calibration": {**CAL, "cache_dir": str(cache)}}  # fmt: skip
    return mc.apply(rec, progress=False)


def _files(out):
    import json

    cfg = json.loads((out / "config.json").read_text())
    cfg.get("moecompress", {}).pop("recipe_hash", None)
    return {p.name: p.read_bytes() for p in out.glob("*.safetensors")}, cfg


def _rows(out, name):
    import json

    (f,) = [f for f in out.glob("steps/*/report.json") if name in f.parent.name]
    return json.loads(f.read_text())["layers"]


def _floats_apart(got, want, path: str) -> list[str]:
    """Where two reports' infos differ (a path each): everything equal but floats, equal to float32's
    round-off (the whole layer and its chunks sum the statistics in other orders, which on some CPUs moves the
    last bits of the fits made from them)."""
    if isinstance(want, float) and isinstance(got, float):
        return [] if got == pytest.approx(want, rel=1e-5, abs=1e-7) else [f"{path}: {got} != {want}"]
    if isinstance(want, dict) and isinstance(got, dict) and got.keys() == want.keys():
        return [d for k in want for d in _floats_apart(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, list) and isinstance(got, list) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in _floats_apart(g, w, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


@pytest.mark.parametrize(
    ("model_type", "name", "cfg"),
    [
        ("qwen3_moe", "merge_experts", {"ratio": 0.5}),
        ("qwen3_moe", "merge_experts", {"ratio": 0.25, "router": "collapse", "similarity": "router"}),
        ("qwen3_moe", "merge_experts", {"target_experts": "auto", "method": "average"}),
        ("qwen3_moe", "namex", {"ratio": 0.5, "refine_steps": 0}),
        ("qwen3_moe", "namex", {"ratio": 0.5}),
        ("deepseek_v3", "namex", {"ratio": 0.25, "refine_steps": 0}),
        # a budget over layers: expert_out_gram(_fisher) gathered chunk by chunk (calibration/chunked.py)
        ("qwen3_moe", "merge_experts", {"target_experts": {"ratio": 0.5, "scale": "relative"}}),
        ("deepseek_v3", "namex", {"target_experts": {"ratio": 0.4}, "refine_steps": 0}),
        ("qwen3_moe", "merge_experts", {"ratio": 0.5, "similarity": "weight"}),  # the Gram from pairs of chunks
        ("deepseek_v3", "namex", {"ratio": 0.25, "similarity": "weight", "refine_steps": 0}),
    ],
)
def test_merging_by_chunks_writes_the_whole_layers_checkpoint(tmp_path, model_type, name, cfg):
    from tiny import save_tiny

    extra = {"num_experts_per_tok": 2} if model_type == "deepseek_v3" else {}
    save_tiny(model_type, tmp_path / "m", num_hidden_layers=3 if "target_experts" in cfg else 2, **extra)
    steps = [PROTECT, {name: cfg}]
    _run(tmp_path / "m", tmp_path / "whole", steps, "off", tmp_path / "c")
    _run(tmp_path / "m", tmp_path / "chunk", steps, 3, tmp_path / "c2")  # calibrated again, by chunks
    (wt, wc), (ct, cc) = _files(tmp_path / "whole"), _files(tmp_path / "chunk")
    assert wc == cc and wt.keys() == ct.keys()
    for k in wt:
        assert wt[k] == ct[k], k
    for ra, rb in zip(_rows(tmp_path / "whole", "protect"), _rows(tmp_path / "chunk", "protect"), strict=True):
        assert rb["rel_error"] == pytest.approx(ra["rel_error"], abs=1e-6)  # the step before: every state summed
    for ra, rb in zip(_rows(tmp_path / "whole", name), _rows(tmp_path / "chunk", name), strict=True):
        for k in ("layer", "params_before", "params_after", "bytes_before", "bytes_after", "changed"):
            assert ra[k] == rb[k], k
        assert rb["rel_error"] == pytest.approx(ra["rel_error"], rel=1e-4)
        ia, ib = ra["info"], dict(rb["info"])
        big = ib.pop("largest_unit", None)  # by chunks only: a unit needing more than the dry run planned
        assert big is None or (big["chunk"] == 3 and big["extra_bytes"] > 0), big
        assert ia.keys() == ib.keys()
        for k, v in ia.items():
            if k.startswith("rel_error"):
                assert ib[k] == pytest.approx(v, rel=1e-5, abs=1e-7)
            else:
                assert _floats_apart(ib[k], v, k) == [], k


def test_a_group_larger_than_the_chunk_is_warned_and_refused_when_it_cannot_fit(tmp_path, monkeypatch):
    """Ward groups are not size-limited: a unit holds a larger group alone. The report says so with the bytes
    beyond the dry run's units; a unit that alone exceeds the memory limit is refused before it is read."""
    import json

    from tiny import save_tiny

    from moecompress.engine import layer_run
    from moecompress.errors import MoecompressError

    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    steps = [{"merge_experts": {"ratio": 0.75}}]  # 8 experts -> 2 groups: one has at least 4 members
    res = _run(tmp_path / "m", tmp_path / "o", steps, 2, tmp_path / "c")
    (f,) = (tmp_path / "o").glob("steps/*/report.json")
    rep = json.loads(f.read_text())
    bigs = [r["info"]["largest_unit"] for r in rep["layers"]]
    assert all(b["members"] >= 4 and b["chunk"] == 2 and b["extra_bytes"] > 0 for b in bigs), bigs
    assert any("needed more than the dry run's units of 2" in w for w in rep["warnings"]), rep["warnings"]
    assert res is not None
    monkeypatch.setattr(layer_run, "units_memory_limit", lambda recipe: 1)  # nothing fits at run time
    with pytest.raises(MoecompressError, match=r"step 1 \(merge_experts\), layer \d+: a unit of \d+ experts .*over the memory limit"):
        _run(tmp_path / "m", tmp_path / "o2", steps, 2, tmp_path / "c")
    assert not (tmp_path / "o2").exists()


def test_group_workspace_counts_what_merging_a_unit_holds():
    """While a unit's group of ``c`` members merges: its members, one alignment and the unit's groups merged
    before it (one float32 copy each); the plan assumes the layer's mean group size."""
    from moecompress.passes.expert_merging import ALIGN
    from moecompress.passes.merge_units import group_workspace

    layer = make_layer(seed=7, copies=(1, 6))
    cfg = me.MergeExpertsConfig(ratio=0.5, similarity="router")  # no summaries: experts only
    one = group_workspace(layer, cfg, 1, groups=[2]) // (2 + ALIGN)  # float32 bytes of one expert
    assert group_workspace(layer, cfg, 6, groups=[6]) == one * (6 + ALIGN)
    assert group_workspace(layer, cfg, 6, groups=[2, 2, 2]) == one * (2 + 2 + ALIGN)
    assert group_workspace(layer, cfg, 6, groups=[1, 1, 4]) == one * (4 + ALIGN)
    assert group_workspace(layer, cfg, 6, groups=[1] * 6) == 0
    assert group_workspace(layer, cfg, 6, sets=3, in_flight=5, groups=[2, 2, 2]) == one * (3 * 3 + 5)
    # the plan: 8 experts at ratio 0.5, mean merged group 2: (6 + 2) / 2 + ALIGN
    assert group_workspace(layer, cfg, 6) == one * (4 + ALIGN)
    # merge_experts folds the members in one at a time: the base and the sum, whatever the group's size
    assert group_workspace(layer, cfg, 6, groups=[6], cap=2) == one * (2 + ALIGN)
    assert group_workspace(layer, cfg, 6, groups=[2, 4], cap=2) == one * (1 + 2 + ALIGN)
    assert group_workspace(layer, cfg, 6, groups=[6], cap=4) == one * (4 + ALIGN)  # namex: HOLD_MEMBERS
