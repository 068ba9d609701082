"""Expert-sharded calibration (``calibration.parallel: auto`` under ``torchrun``): each rank reads and runs only
its chunks of a layer's experts, and rank 0 ends with one process's statistics, bit for bit. The two ranks
run as two threads over queues (``queue_ranks.QueueRanks``); ``tests/test_distributed.py`` runs real gloo
ranks end to end."""

from __future__ import annotations

import threading

import pytest
import torch
from queue_ranks import QueueRanks
from tiny import save_tiny

import moecompress as mc
from moecompress.calibration import expert_sharded
from moecompress.calibration.catalogue import ALWAYS
from moecompress.calibration.skeleton import Skeleton
from moecompress.calibration.stats import SPILLED
from moecompress.calibration.sweep import Batches, run_calibration
from moecompress.errors import RecipeError
from moecompress.reference import add_term, expert_partials, expert_terms, physical_ids, route_logits

FORWARD = {"act_sq_mean", "expert_in_cov", "expert_in_sq_mean", "down_in_cov", "input_cov", "reap_saliency",
           "expert_out_norm_mean", "io_sample", "down_out_absmax", "router_sample", "shared_down_out_absmax",
           "moe_inputs"} | ALWAYS  # fmt: skip


def _ids(n: int = 10, seq: int = 12) -> torch.Tensor:
    return torch.randint(3, 128, (n, seq), generator=torch.Generator().manual_seed(0))


def _calibrate(path, needs, *, ranks=None, chunks=None, spilled=None, shard=True) -> tuple[dict, dict]:
    """``(forward statistics by layer, backward statistics by layer)`` of one rank (``ranks``) or one process."""
    fwd, bwd = {}, {}
    save = None if spilled is None else (lambda i, a, s: spilled.setdefault(i, []).append((a, s)))
    ckpt = mc.open_checkpoint(path)
    run_calibration(Skeleton(ckpt, torch.float32), Batches.make(_ids(), holdout=2, batch_size=2), needs,
                    save_forward=fwd.__setitem__, save_backward=bwd.__setitem__, save_experts=save, progress=False,
                    expert_chunks=chunks or {}, ranks=ranks, shard_experts=shard)  # fmt: skip
    return fwd, bwd


def _two_ranks(path, needs, **kw) -> tuple:
    """Rank 0's and rank 1's ``(forward, backward, spilled)``, two threads."""
    wire, out = {}, {}

    def rank(r: int):
        spilled = {} if kw.get("spilled") is not None else None
        fwd, bwd = _calibrate(path, needs, ranks=QueueRanks(r, 2, wire=wire), **{**kw, "spilled": spilled})
        return fwd, bwd, spilled

    t = threading.Thread(target=lambda: out.update(one=rank(1)))
    t.start()
    zero = rank(0)
    t.join(120)
    assert not t.is_alive()
    return zero, out["one"]


@pytest.fixture(autouse=True)
def _one_thread():
    """Bits need one intra-op thread in the reference and in both ranks alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for i in want:
        assert got[i].keys() == want[i].keys(), i
        diff = [k for k in want[i] if not torch.equal(got[i][k], want[i][k])]
        assert not diff, (i, diff)


@pytest.mark.parametrize(
    ("model_type", "chunk"),
    [("qwen3_moe", None), ("qwen3_moe", 3), ("deepseek_v3", None), ("gpt_oss", 3), ("mixtral", 1)],
)
def test_rank_0_has_the_statistics_of_one_process_bit_for_bit(tmp_path, model_type, chunk):
    """Every forward statistic (per-expert sums, counts and maxima from the owner of each chunk; the router's,
    the samples and the held-back inputs from every rank), and through the layer outputs every later layer's:
    shared experts (deepseek_v3), biases and clamped activations (gpt_oss), chunks of 1 and 3 experts (more
    chunks than ranks: several rounds, an odd one out) and one chunk per rank."""
    save_tiny(model_type, tmp_path / "m", num_hidden_layers=2)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    needs = FORWARD if model_type == "deepseek_v3" else FORWARD - {"shared_down_out_absmax"}
    chunks = {} if chunk is None else dict.fromkeys(ckpt.moe_layer_indices, chunk)
    want, _ = _calibrate(tmp_path / "m", needs)
    (zero, _, _), (one, _, _) = _two_ranks(tmp_path / "m", needs, chunks=chunks)
    _equal(zero, want)
    assert {"expert_in_cov", "reap_saliency", "down_out_absmax", "io_sample_x", "holdout_x"} <= want[1].keys()
    assert one == {i: {} for i in want}, "only rank 0 keeps the layer's statistics"


def test_spilled_covariances_reach_rank_0_in_expert_order(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    needs = {"expert_in_cov", "down_in_cov", "act_sq_mean"} | ALWAYS
    whole, _ = _calibrate(tmp_path / "m", needs)
    chunks = dict.fromkeys(ckpt.moe_layer_indices, 3)
    (zero, _, spilled), (_, _, other) = _two_ranks(tmp_path / "m", needs, chunks=chunks, spilled=True)
    e = ckpt.adapter.num_experts
    for i in ckpt.moe_layer_indices:
        assert [a for a, _ in spilled[i]] == list(range(e)) and not other
        for name in SPILLED:
            assert torch.equal(torch.cat([s[name] for _, s in spilled[i]]), whole[i][name]), (i, name)
        assert all(torch.equal(zero[i][k], v) for k, v in whole[i].items() if k not in SPILLED)


def test_a_layer_the_run_does_not_chunk_writes_its_covariances_expert_by_expert_under_ranks(tmp_path):
    """No ``expert_chunk``: one process keeps the covariances in the layer's statistics; under ranks rank 0
    writes them expert by expert as each round ends (never holding the layer's), rank 1 writes nothing; the
    rows are one process's bits. Without a writer for them they stay in the layer's statistics."""
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    needs = {"expert_in_cov", "down_in_cov", "act_sq_mean"} | ALWAYS
    want, _ = _calibrate(tmp_path / "m", needs)
    (zero, _, spilled), (_, _, other) = _two_ranks(tmp_path / "m", needs, spilled=True)
    e = mc.open_checkpoint(tmp_path / "m").adapter.num_experts
    assert other == {} and spilled.keys() == want.keys()
    for i in want:
        assert [a for a, _ in spilled[i]] == list(range(e))
        for name in SPILLED:
            assert name not in zero[i]
            assert torch.equal(torch.cat([s[name] for _, s in spilled[i]]), want[i][name]), (i, name)
        assert all(torch.equal(zero[i][k], v) for k, v in want[i].items() if k not in SPILLED)
    (zero, _, _), _ = _two_ranks(tmp_path / "m", needs)
    _equal(zero, want)


def test_a_gram_of_every_expert_is_sharded_and_parallel_batches_stays_data_parallel(tmp_path):
    """``expert_out_gram`` (merge budgets) needs every expert's outputs on the Ward tokens: each rank samples its
    own chunks' experts on them (every rank has the tokens) and hands the rows to rank 0, which makes the Gram
    as one process does: one process's bits, no layer read whole. ``parallel: batches``: data-parallel, every
    rank has the statistics."""
    from moecompress.io import checkpoint as cp

    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    needs = {"down_in_cov_pooled", "expert_out_gram"} | ALWAYS
    want, _ = _calibrate(tmp_path / "m", needs)
    assert float(want[1]["expert_out_gram"].abs().sum()) > 0
    for chunks in ({}, {1: 3}):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cp.Checkpoint, "read_layer", lambda self, i, *a, **k: pytest.fail(f"layer {i} read whole"))
            (zero, _, _), (one, _, _) = _two_ranks(tmp_path / "m", needs, chunks=chunks)
        _equal(zero, want)
        assert one == {i: {} for i in want}, "only rank 0 keeps the layer's statistics"
    want, _ = _calibrate(tmp_path / "m", FORWARD)
    (zero, _, _), (one, _, _) = _two_ranks(tmp_path / "m", FORWARD, shard=False)
    _equal(zero, want)
    _equal(one, want)


POOLED = {"down_in_cov_pooled", "down_in_cov", "act_sq_mean"} | ALWAYS


@pytest.fixture
def block_rows(monkeypatch):
    """The float64 block rows of every pooled sum finished (``stats.pooled_total``), by thread, in order: the
    float32 means hide most differences of order in float64 sums."""
    from moecompress.calibration import stats

    seen: dict[str, list[torch.Tensor]] = {}
    real = stats.pooled_total

    def spy(rows):
        seen.setdefault(threading.current_thread().name, []).append(rows.clone())
        return real(rows)

    monkeypatch.setattr(stats, "pooled_total", spy)
    return seen


def _same_rows(seen: dict, one: str) -> None:
    """The pooled rows finished in thread ``one`` (a process, then a rank 0) are one process's bits; no other
    thread finished any."""
    main = threading.main_thread().name
    want, got = seen.pop(one), seen.pop(main)
    assert not seen, "only rank 0 finishes the layer's statistics"
    assert len(want) == len(got) > 0
    for w, g in zip(want, got, strict=True):
        assert w.dtype == torch.float64 and torch.equal(g, w)


@pytest.mark.parametrize(("model_type", "chunk"), [("qwen3_moe", None), ("qwen3_moe", 4), ("qwen3_moe", 6),
                                                   ("deepseek_v3", None), ("deepseek_v3", 2)])  # fmt: skip
def test_a_covariance_pooled_over_experts_is_sharded_by_blocks_with_one_process_bits(tmp_path, model_type, chunk,
                                                                                      block_rows):  # fmt: skip
    """``down_in_cov_pooled`` (every routed expert's terms in one sum) is summed by the layer's 8 fixed blocks
    of experts: with 16 experts (blocks of 2), chunks of 4 (the default on 2 ranks), 2 and 6 (unions of
    blocks, an odd chunk out) give rank 0 one process's statistics bit for bit, each block's row from the rank
    that ran it; rank 1 keeps nothing; no rank reads a layer whole."""
    from moecompress.io import checkpoint as cp

    save_tiny(model_type, tmp_path / "m", num_hidden_layers=2, **{_EXPERTS[model_type]: 16})
    ckpt = mc.open_checkpoint(tmp_path / "m")
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(want=_calibrate(tmp_path / "m", POOLED)[0]), name="one")
    t.start()
    t.join()
    want = out["want"]
    assert float(want[1]["down_in_cov_pooled"].abs().sum()) > 0
    chunks = {} if chunk is None else dict.fromkeys(ckpt.moe_layer_indices, chunk)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cp.Checkpoint, "read_layer", lambda self, i, *a, **k: pytest.fail(f"layer {i} read whole"))
        (zero, _, _), (one, _, _) = _two_ranks(tmp_path / "m", POOLED, chunks=chunks)
    _equal(zero, want)
    assert one == {i: {} for i in want}, "only rank 0 keeps the layer's statistics"
    _same_rows(block_rows, "one")


def test_chunks_that_split_a_block_refuse_the_pooled_covariance_under_ranks_in_one_line(tmp_path):
    """Chunks of 3 of 16 experts cut the blocks of 2: the blocks' sums would take another order, so a layer
    chunked so is refused under ranks (one line naming the fix); one process runs it (its bits differ from the
    whole layer's in the last places only)."""
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2, num_experts=16)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    chunks = dict.fromkeys(ckpt.moe_layer_indices, 3)
    with pytest.raises(RecipeError, match=r"make expert_chunk a multiple of ceil\(experts / 8\)") as err:
        _calibrate(tmp_path / "m", POOLED, ranks=QueueRanks(0, 2), chunks=chunks)
    assert "\n" not in str(err.value)
    whole, _ = _calibrate(tmp_path / "m", POOLED)
    cut, _ = _calibrate(tmp_path / "m", POOLED, chunks=chunks)
    for i in ckpt.moe_layer_indices:
        a, b = cut[i]["down_in_cov_pooled"].double(), whole[i]["down_in_cov_pooled"].double()
        assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max())  # float32 means of float64 sums


_EXPERTS = {"qwen3_moe": "num_experts", "deepseek_v3": "n_routed_experts"}


@pytest.mark.parametrize(
    ("model_type", "chunk"), [("qwen3_moe", None), ("qwen3_moe", 3), ("deepseek_v3", None), ("gpt_oss", 1)]
)
def test_the_streamed_backward_sharded_by_experts_has_one_process_bits(tmp_path, model_type, chunk):
    """A gradient statistic: the forward and the streamed backward are both sharded by experts (each rank
    reads only its chunks in the backward too); rank 0's gradient statistics, hence the gradient every layer
    passed down, are one process's bits (shared expert: deepseek_v3; biases, clamped act: gpt_oss)."""
    save_tiny(model_type, tmp_path / "m", num_hidden_layers=2)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    chunks = {} if chunk is None else dict.fromkeys(ckpt.moe_layer_indices, chunk)
    needs = {"act_sq_mean", "grad_sq_mean", "out_grad_cov"} | ALWAYS
    want = _calibrate(tmp_path / "m", needs)
    (fwd, bwd, _), (_, other, _) = _two_ranks(tmp_path / "m", needs, chunks=chunks)
    _equal(fwd, want[0])
    _equal(bwd, want[1])
    assert float(want[1][ckpt.moe_layer_indices[0]]["grad_sq_mean"].sum()) > 0
    assert other == {i: {} for i in want[1]}, "only rank 0 keeps the layer's statistics"


def test_a_rank_reads_only_its_chunks_in_the_backward(tmp_path, monkeypatch):
    """Rank 1 of 2 reads chunks ``k % 2 == 1`` of each MoE layer, once in the forward and once in the backward."""
    from moecompress.io import checkpoint as cp

    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    e = ckpt.adapter.num_experts
    reads: dict[str, list] = {}
    real = cp.Checkpoint.read_experts

    def spy(self, i, a, b, alloc=None):
        reads.setdefault(threading.current_thread().name, []).append((i, a, b))
        return real(self, i, a, b, alloc)

    monkeypatch.setattr(cp.Checkpoint, "read_experts", spy)
    monkeypatch.setattr(cp.Checkpoint, "read_layer", lambda *a: pytest.fail("a layer read whole"))
    _two_ranks(tmp_path / "m", {"grad_sq_mean"} | ALWAYS, chunks=dict.fromkeys(ckpt.moe_layer_indices, 3))
    mine = [(i, a, min(a + 3, e)) for i in ckpt.moe_layer_indices for a in range(3, e, 6)]
    one = [r for name, rs in reads.items() if name != threading.main_thread().name for r in rs]
    assert sorted(one) == sorted(mine + mine)


def test_statistics_the_chunks_cannot_give_keep_the_backward_data_parallel_with_the_same_bits(tmp_path):
    """``expert_out_gram_fisher`` (autograd's whole-block backward) and ``calibration.parallel: batches``: the
    backward is data-parallel, layers held whole, batch by batch, with one process's bits (``down_in_grad_cov_pooled``
    beside it: its partials of each batch go with that batch's round); with ``expert_chunk`` it is refused in one
    line."""
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    fisher = {"grad_sq_mean", "down_in_grad_cov_pooled", "expert_out_gram_fisher"} | ALWAYS
    for needs, shard in ((fisher, True), ({"grad_sq_mean", "down_in_grad_cov_pooled"} | ALWAYS, False)):
        want = _calibrate(tmp_path / "m", needs)
        (_, zero, _), (_, one, _) = _two_ranks(tmp_path / "m", needs, shard=shard)
        _equal(zero, want[1])
        _equal(one, want[1])
    chunks = {i: 3 for i in mc.open_checkpoint(tmp_path / "m").moe_layer_indices}
    with pytest.raises(RecipeError, match=r"streamed backward needs a statistic") as err:
        _calibrate(tmp_path / "m", fisher, ranks=QueueRanks(0, 2), chunks=chunks)
    assert "\n" not in str(err.value)
    with pytest.raises(RecipeError, match=r"calibration\.parallel is batches"):
        _calibrate(tmp_path / "m", FORWARD, ranks=QueueRanks(0, 2), chunks=chunks, shard=False)


@pytest.mark.parametrize(("model_type", "chunk"), [("qwen3_moe", None), ("qwen3_moe", 6), ("deepseek_v3", 2)])
def test_a_gradient_covariance_pooled_over_experts_is_sharded_by_blocks_with_one_process_bits(tmp_path, model_type,
                                                                                              chunk, block_rows):  # fmt: skip
    """``down_in_grad_cov_pooled`` in the streamed backward sharded by experts: 16 experts (blocks of 2), chunks
    that are unions of blocks; rank 0's gradient statistics are one process's bits, rank 1 keeps none, and no
    layer is read whole. Chunks of 3 cut the blocks: refused under ranks in one line naming the fix."""
    from moecompress.io import checkpoint as cp

    save_tiny(model_type, tmp_path / "m", num_hidden_layers=2, **{_EXPERTS[model_type]: 16})
    ckpt = mc.open_checkpoint(tmp_path / "m")
    needs = {"grad_sq_mean", "down_in_grad_cov_pooled", "out_grad_cov"} | ALWAYS
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(want=_calibrate(tmp_path / "m", needs)), name="one")
    t.start()
    t.join()
    want = out["want"]
    assert float(want[1][ckpt.moe_layer_indices[0]]["down_in_grad_cov_pooled"].abs().sum()) > 0
    chunks = {} if chunk is None else dict.fromkeys(ckpt.moe_layer_indices, chunk)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cp.Checkpoint, "read_layer", lambda self, i, *a, **k: pytest.fail(f"layer {i} read whole"))
        (fwd, bwd, _), (_, other, _) = _two_ranks(tmp_path / "m", needs, chunks=chunks)
    _equal(fwd, want[0])
    _equal(bwd, want[1])
    assert other == {i: {} for i in want[1]}, "only rank 0 keeps the layer's statistics"
    _same_rows(block_rows, "one")
    with pytest.raises(RecipeError, match=r"make expert_chunk a multiple of ceil\(experts / 8\)") as err:
        _calibrate(tmp_path / "m", needs, ranks=QueueRanks(0, 2), chunks=dict.fromkeys(ckpt.moe_layer_indices, 3))
    assert "\n" not in str(err.value)


def test_terms_added_in_expert_order_are_the_partials_bit_for_bit(tmp_path):
    """The oracle of the exchange: :func:`expert_terms` of a bank read in two chunks, added one by one with
    :func:`add_term`, equal :func:`expert_partials` on the whole bank (gpt_oss: down biases, clamped act)."""
    save_tiny("gpt_oss", tmp_path / "m", num_hidden_layers=1)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    layer = ckpt.read_layer(0)
    e = layer.experts.num_experts
    x = torch.randn(9, layer.hidden_size, generator=torch.Generator().manual_seed(3))
    _, ids, w = route_logits(layer, x)
    phys = physical_ids(ids, layer.router.num_experts, layer.expert_map)
    ref = torch.zeros(x.shape)
    expert_partials(layer.experts, x, phys, w, ref, {"out": ref})
    assert ref.abs().sum() > 0
    for cut in (1, e // 2, e - 1):
        out = torch.zeros(x.shape)
        acc = {"out": out}
        for first, stop in ((0, cut), (cut, e)):
            for t in expert_terms(ckpt.read_experts(0, first, stop), x, phys, w, None, first):
                add_term(t, out, acc)
        assert torch.equal(out, ref), cut


def test_shardable_rules(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    assert expert_sharded.shardable({"expert_in_cov"}, None, ckpt, 0, 3)
    assert expert_sharded.shardable({"down_in_cov_pooled"}, None, ckpt, 0, 3)  # 8 experts: blocks of 1
    assert expert_sharded.shardable({"expert_out_gram"}, None, ckpt, 0, 2)
    assert not expert_sharded.shardable({"route_attrib"}, None, ckpt, 0, 2)
    assert not expert_sharded.shardable({"expert_in_cov"}, lambda *a: None, ckpt, 0, 2)
    save_tiny("qwen3_moe", tmp_path / "w", num_hidden_layers=1, num_experts=20)  # blocks of 3, the last of 2
    wide = mc.open_checkpoint(tmp_path / "w")
    assert [expert_sharded.shardable({"down_in_cov_pooled"}, None, wide, 0, n) for n in (2, 3, 6, 7, 20)] == [
        False, True, True, False, True]  # fmt: skip
    assert [expert_sharded.default_size(wide, n, {"down_in_cov_pooled"}) for n in (1, 2, 3, 4)] == [9, 3, 3, 3]
    assert [expert_sharded.default_size(wide, n) for n in (1, 2, 3, 4)] == [10, 5, 4, 3]


def test_batch_groups_keep_each_gather_within_its_budget():
    """Consecutive batches share a gather while their terms (``tokens · row / world`` bytes) fit the budget; a
    batch larger than it goes alone; every rank gets the same groups from the same shapes."""
    groups = expert_sharded.batch_groups
    assert groups([10, 10, 10, 50, 5], 4, 2, budget=40) == [[0, 1], [2], [3], [4]]
    assert groups([10, 10, 10], 4, 2, budget=0) == [[0], [1], [2]]
    assert groups([10, 10, 10], 4, 2, budget=10**9) == [[0, 1, 2]]
    assert groups([], 4, 2) == []


def test_terms_gathered_by_groups_of_batches_keep_one_process_bits(tmp_path, monkeypatch):
    """A gather per batch (budget 0) or one per round of chunks (the default: this model's batches fit in it):
    rank 0's forward and gradient statistics are one process's bits either way, and the default gathers
    fewer times (the ranks wait for each other once per group, not per batch)."""
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    needs = {"act_sq_mean", "expert_in_cov", "grad_sq_mean", "out_grad_cov"} | ALWAYS
    want = _calibrate(tmp_path / "m", needs)
    counts, gather, default = {}, QueueRanks.all_gather_bytes, expert_sharded.GATHER_BYTES
    for b in (0, None):
        monkeypatch.setattr(expert_sharded, "GATHER_BYTES", default if b is None else b)
        calls: list[int] = []

        def counted(self, blob, calls=calls):
            calls.append(1)
            return gather(self, blob)

        monkeypatch.setattr(QueueRanks, "all_gather_bytes", counted)
        (fwd, bwd, _), _ = _two_ranks(tmp_path / "m", needs)
        _equal(fwd, want[0])
        _equal(bwd, want[1])
        counts[b] = len(calls)
    assert counts[None] < counts[0]
