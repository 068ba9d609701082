"""Every built-in pass (its sample configuration, ``tests/pass_samples.py``), one process against two ranks:
the same output bytes, calibration included.

The two ranks are two threads of this process whose collectives and sends go over queues
(``tests/queue_ranks.py``): the engine's own code on both ranks — calibration sharded by experts or
data-parallel, statistics reduced on rank 0, the layer loop's units worked on either rank — without two
interpreters starting per pass. ``tests/test_distributed.py`` runs real ``gloo`` ranks (``torchrun``, two
nodes, a killed rank) on a few of these passes.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
import yaml
from pass_samples import SAMPLES
from queue_ranks import QueueRanks
from rank_helpers import CAL, one_thread, output_hashes
from tiny import save_tiny

import moecompress as mc
from moecompress.engine import executor
from moecompress.engine.dry_run import dry_run
from moecompress.extras import missing
from moecompress.io.checkpoint import open_checkpoint
from moecompress.passes import BUILTIN_PASSES


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("every-pass")
    save_tiny("qwen3_moe", root / "model", num_hidden_layers=2)
    return root / "model"


def _recipes(tmp_path, model, name: str) -> tuple:
    paths = []
    for tag in ("one", "two"):
        rec = {"model": str(model), "output": str(tmp_path / tag), "emit": "every_step", "steps": [{name: SAMPLES[name]}],
               "calibration": {**CAL, "cache_dir": str(tmp_path / f"cache-{tag}")}}  # fmt: skip
        (tmp_path / f"{tag}.yaml").write_text(yaml.safe_dump(rec))
        paths.append(tmp_path / f"{tag}.yaml")
    return paths


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_builtin_pass_writes_one_process_bytes_on_two_ranks(tmp_path, model, name):
    spec = BUILTIN_PASSES[name]
    extras = spec.extras_for(spec.config.model_validate(SAMPLES[name]))
    if any(missing(extra) for extra in extras):
        pytest.skip(f"needs the {extras} extra")
    one, two = _recipes(tmp_path, model, name)
    with one_thread():
        ref = mc.apply(str(one), progress=False).report
        rec = mc.load_recipe(str(two))
        ckpt = open_checkpoint(rec.model)
        plan, fp, wire, out, errors = dry_run(rec, ckpt), executor._check_calibration_source(rec, ckpt), {}, {}, []

        def rank(r: int) -> dict:
            return executor._compress(rec, ckpt, plan, fp, None, False, QueueRanks(r, 2, wire=wire)).report

        def other() -> None:
            try:
                out.update(rank(1))
            except BaseException as err:  # reported below, with rank 0's outcome
                errors.append(err)

        t = threading.Thread(target=other)
        t.start()
        got = rank(0)
        t.join(120)
    assert not t.is_alive() and not errors, errors
    assert ref["calibration"]["batches"] == got["calibration"]["batches"]
    weights = output_hashes(tmp_path / "one")
    assert output_hashes(tmp_path / "two") == weights and (weights != {}) == (not spec.report_only)
    (rows, errors), (rows1, errors1) = _step_reports(tmp_path / "two"), _step_reports(tmp_path / "one")
    assert rows == rows1
    # the held-back reconstruction error: one process forwards a layer held whole, two ranks add their units'
    # float32 sums, in another order
    assert errors == pytest.approx(errors1, rel=16 * torch.finfo(torch.float32).eps)


ERRORS = ("rel_error", "sqnr_db")


def _step_reports(out) -> tuple[list[dict], list[float]]:
    """Each step report's rows (the pass's info, the sizes), summary and warnings, all but the timings, the
    memory and the reconstruction errors; and those errors."""
    reps = [json.loads(p.read_text()) for p in sorted(out.glob("steps/*/report.json"))]
    assert reps, out
    rows = [{"layers": [{k: v for k, v in row.items() if k not in ("seconds", *ERRORS)} for row in r["layers"]],
             "summary": r["summary"], "warnings": r["warnings"]} for r in reps]  # fmt: skip
    errors = [float(row[k]) for r in reps for row in r["layers"] for k in ERRORS if k in row]
    return rows, errors


def _one_and_two_ranks(tmp_path, model, monkeypatch, steps: list, chunk="off", emit: str = "final") -> tuple:
    """``steps`` in one process (a layer held whole), then on two ranks (``expert_chunk: chunk``) with one
    statistics cache: ``(checkpoint, reads)``, the two ranks' reads of experts as ``(thread, layer, a, b)``."""
    recs = []
    for tag in ("one", "two"):
        rec = {"model": str(model), "output": str(tmp_path / tag), "steps": steps, "emit": emit,
               "expert_chunk": chunk if tag == "two" else "off",
               "calibration": {**CAL, "cache_dir": str(tmp_path / "cache")}}  # fmt: skip
        (tmp_path / f"{tag}.yaml").write_text(yaml.safe_dump(rec))
        recs.append(tmp_path / f"{tag}.yaml")
    with one_thread():
        mc.apply(str(recs[0]), progress=False)
        rec = mc.load_recipe(str(recs[1]))
        ckpt = open_checkpoint(rec.model)
        reads, real = [], ckpt.read_experts
        monkeypatch.setattr(ckpt, "read_experts", lambda i, a, b, alloc=None: reads.append(
            (threading.current_thread().name, i, a, b)) or real(i, a, b, alloc))  # fmt: skip
        plan, fp, wire, errors = dry_run(rec, ckpt), executor._check_calibration_source(rec, ckpt), {}, []

        def other() -> None:
            try:
                executor._compress(rec, ckpt, plan, fp, None, False, QueueRanks(1, 2, wire=wire))
            except BaseException as err:
                errors.append(err)

        t = threading.Thread(target=other, name="rank1")
        t.start()
        executor._compress(rec, ckpt, plan, fp, None, False, QueueRanks(0, 2, wire=wire))
        t.join(120)
    assert not t.is_alive() and not errors, errors
    assert output_hashes(tmp_path / "two") == output_hashes(tmp_path / "one")
    return ckpt, reads


def _reads_by_both(ckpt, reads, times: int = 2) -> None:
    """Every expert read exactly ``times`` in all (once to gather, once in its unit), by both ranks together."""
    e = ckpt.adapter.num_experts
    for i in ckpt.moe_layer_indices:
        mine = [(who, b - a) for who, j, a, b in reads if j == i]
        assert sum(n for _, n in mine) == times * e, (i, mine)
        assert {who for who, _ in mine} == {"rank1", threading.current_thread().name}


def test_tdmoe_gathers_each_block_on_one_rank(tmp_path, model, monkeypatch):
    """``tdmoe`` (shared factors fitted from every expert) on two ranks without ``expert_chunk``: the layer
    goes by units (not whole on rank 0), its first sweep by blocks, each block read by one rank only
    (:mod:`moecompress.engine.block_sweep`), then each unit projected by one rank: every expert is read
    exactly twice in all, by both ranks together, and the bytes are one process's."""
    pytest.importorskip("tensorly")
    _reads_by_both(*_one_and_two_ranks(tmp_path, model, monkeypatch, [{"tdmoe": SAMPLES["tdmoe"]}]))


def test_balanced_svd_goes_by_units_factorising_each_expert_once(tmp_path, model, monkeypatch):
    """``svd_experts`` with ``ranks: balanced`` (its default: the extra ranks go to the layer's experts with the
    largest next singular values) on two ranks without ``expert_chunk``: the layer is shared out by units, not
    run whole on rank 0. The ranks factorise the layer's blocks, exchange the next singular values, every
    rank makes the whole layer's choice, and each unit cuts the factors its rank kept: every expert is read
    twice and factorised once per projection in all, and the bytes and the report (the averaged whitened
    error too) are one process's."""
    from moecompress.methods import svd

    calls, real = [], svd.whitened_svd
    monkeypatch.setattr(svd, "whitened_svd", lambda *a: calls.append(1) or real(*a))
    step = {"svd_experts": {"ratio": 0.4}}
    ckpt, reads = _one_and_two_ranks(tmp_path, model, monkeypatch, [step])
    _reads_by_both(ckpt, reads)
    layers, e = len(ckpt.moe_layer_indices), ckpt.adapter.num_experts
    assert len(calls) == 2 * 3 * layers * e  # one process's factorisations, then the two ranks' (no repeat)
    (rows, _), (rows1, _) = _step_reports(tmp_path / "two"), _step_reports(tmp_path / "one")
    assert rows == rows1
    ranks = rows[0]["layers"][0]["info"]["ranks"]["gate"]
    assert len(set(ranks)) == 2, ranks  # the ratio leaves extra ranks to choose: the choice is tested


@pytest.mark.parametrize("chunk", [3, "off"])
@pytest.mark.parametrize("step", [{"merge_experts": {"ratio": 0.25}},
                                  {"namex": {"ratio": 0.25, "similarity": "output_tokens", "refine_steps": 0}}])
def test_a_merge_gathers_each_block_on_one_rank(tmp_path, model, monkeypatch, step, chunk):
    """A merge on two ranks, by units of groups (``expert_chunk: 3``, and without it: the layer is shared out
    by units, not run whole on rank 0): its gathering sweep goes by blocks (``Chunking.take``), each block
    read by one rank only and the summaries exchanged, then each unit's members read by the unit's rank:
    every expert is read exactly twice in all (by chunks each rank repeated the sweep before: three times),
    by both ranks together, and the bytes and the step reports are one process's (a layer held whole)."""
    ckpt, reads = _one_and_two_ranks(tmp_path, model, monkeypatch, [step], chunk, "every_step")
    (rows, errs), (rows1, errs1) = _step_reports(tmp_path / "two"), _step_reports(tmp_path / "one")
    for r in rows:  # by request only: a unit over the dry run's plan
        for row in r["layers"]:
            row["info"].pop("largest_unit", None)
    assert rows == rows1  # the merge's own held-back errors included: one process's bits
    assert errs == pytest.approx(errs1, rel=16 * torch.finfo(torch.float32).eps)
    _reads_by_both(ckpt, reads)  # by chunks each rank repeated the sweep before: three times


def test_a_merge_grouping_by_router_logits_reads_each_expert_once(tmp_path, model, monkeypatch):
    """``similarity: router`` groups by the router's logits, which the experts do not change: the first sweep
    reads no expert (``Chunking.reads``), so on two ranks every expert is read once, in its unit, and the
    bytes are one process's."""
    step = {"merge_experts": {"ratio": 0.25, "similarity": "router"}}
    _reads_by_both(*_one_and_two_ranks(tmp_path, model, monkeypatch, [step]), times=1)
