"""The dry run's verdict is the run's (issue 34): every ordered pair of built-in steps on the tiny
checkpoints either runs to the end and its output loads, or is refused by the dry run in one line; never
a late failure after calibration, never a traceback. The default suite runs the natural chains on two
architectures; the slow lane runs the whole 23 x 23 matrix on those two and the natural chains on the other
six (all 8 architectures x 529 pairs take ~40 min on 2 cores: ``benchmarks/pair_matrix.py`` measures them,
``benchmarks/RESULTS.md``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tiny import MODEL_TYPES, save_tiny

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "pair_matrix.py"
_SPEC = importlib.util.spec_from_file_location("pair_matrix", _PATH)
pm = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(pm)

MUST_RUN = {
    ("expert_prune", "gptq"), ("namex", "gptq"), ("merge_experts", "gptq"), ("heapr_uniform", "gptq"),
    ("heapr", "gptq"), ("heapr_uniform", "svd_experts"), ("expert_prune", "neuron_prune"),
    ("heapr_uniform", "codequant"), ("namex", "rtn"), ("heapr", "expert_prune"),
}  # fmt: skip
"""Issue 34's natural chains: they run (the others of FAST are refused in the dry run, with the fix)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            save_tiny(arch, root / arch)
            made[arch] = root / arch
        return made[arch]

    return get


def _check(models, tmp_path, arch, a, b):
    verdict, detail = pm.classify(models(arch), [pm.STEPS[a], pm.STEPS[b]], tmp_path / "out")
    assert verdict in ("run", "refused"), f"{arch} {a} -> {b}: {verdict}: {detail}"
    return verdict, detail


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize(("a", "b"), pm.FAST, ids=[f"{a}-{b}" for a, b in pm.FAST])
def test_natural_chains_run_or_are_refused_in_the_dry_run(models, tmp_path, arch, a, b):
    verdict, detail = _check(models, tmp_path, arch, a, b)
    stats = "reads statistic" in detail or "decides across layers" in detail
    if verdict == "refused":
        assert detail.startswith("step ") and "\n" not in detail, detail  # one line naming the step
    if (a, b) in MUST_RUN:  # never refused for its statistics (a tiny router may not lose experts: shapes)
        assert not stats, f"{arch} {a} -> {b}: {detail}"
        assert verdict == "run" or (arch == "deepseek_v3" and "expert_prune" in (a, b)), detail
    elif stats:
        assert "put " in detail, detail  # the refusal says what to do


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(set(MODEL_TYPES) - {"qwen3_moe", "deepseek_v3"}))
@pytest.mark.parametrize(("a", "b"), pm.FAST, ids=[f"{a}-{b}" for a, b in pm.FAST])
def test_natural_chains_on_the_other_architectures(models, tmp_path, arch, a, b):
    verdict, detail = _check(models, tmp_path, arch, a, b)
    if (a, b) in MUST_RUN:
        assert verdict == "run", f"{arch} {a} -> {b}: {detail}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("a", sorted(pm.STEPS))
def test_every_pair_of_built_in_steps(models, tmp_path, arch, a):
    bad = []
    for b in pm.STEPS:
        verdict, detail = pm.classify(models(arch), [pm.STEPS[a], pm.STEPS[b]], tmp_path / b)
        if verdict not in ("run", "refused"):
            bad.append(f"{a} -> {b}: {verdict}: {detail.strip().splitlines()[-1] if detail.strip() else ''}")
    assert not bad, f"{arch}: " + "; ".join(bad)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_sampled_triples(models, tmp_path, arch):
    bad = []
    for n, chain in enumerate(pm.triples()):
        verdict, detail = pm.classify(models(arch), [pm.STEPS[x] for x in chain], tmp_path / str(n))
        if verdict not in ("run", "refused"):
            bad.append(f"{chain}: {verdict}: {detail.strip().splitlines()[-1] if detail.strip() else ''}")
    assert not bad, f"{arch}: " + "; ".join(bad)
