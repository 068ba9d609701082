"""codequant and the codebook layout: oracles (lossless codebooks, exact rotation), k-means, rotation
learning, fine-tuning, end to end through the quantizer, chaining after heapr, and errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from tiny import reference_logits, save_tiny

import moecompress as mc
from moecompress.engine.spec import LayerStats
from moecompress.errors import PassError
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts import LAYOUTS
from moecompress.layouts.codebook import Codebook
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.methods.codebooks import rotate_bank
from moecompress.methods.kmeans import kmeans_1d, nearest
from moecompress.methods.rotation import hadamard, learn_rotation, quant_error
from moecompress.passes.codequant import SPEC, CodequantConfig, codequant
from moecompress.reference import moe_forward

CAL = {"source": "random", "samples": 8, "seq_len": 32, "batch_size": 4}
E, W, H = 4, 16, 32
IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("cq") / "m"
    save_tiny("qwen3_moe", path)
    return path


def _layer(seed=0, weights=None, protected=frozenset()) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    w = weights or [torch.randn(E, W, H, generator=g), torch.randn(E, W, H, generator=g),
                    torch.randn(E, H, W, generator=g) * 0.2]  # fmt: skip
    spec = RouterSpec(num_experts=E, top_k=2, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(
        0, spec, torch.randn(E, H, generator=g), ExpertBank(*(Dense(t) for t in w)), protected=protected
    )


def _inputs(n=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    x[:, 3] *= 20  # an outlier channel, as MoE block inputs have
    return x


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_kmeans_is_lossless_with_as_many_centroids_as_values_and_nearest_is_exact():
    g = torch.Generator().manual_seed(0)
    for k in (4, 8, 16):
        vals = torch.randn(20, k, generator=g)
        w = vals.gather(1, torch.randint(0, k, (20, 64), generator=g))
        c, a = kmeans_1d(w, k)
        assert torch.equal(c.gather(1, a), w)
    v, c = torch.randn(30, 50, generator=g), torch.randn(30, 7, generator=g)
    brute = (v[:, :, None] - c[:, None, :]).abs().argmin(-1)
    assert torch.equal(c.gather(1, nearest(v, c)), c.gather(1, brute))
    x = torch.randn(10, 40, generator=g)
    assert torch.equal(kmeans_1d(x, 4, seed=3)[0], kmeans_1d(x, 4, seed=3)[0])  # seeded: reproducible


def test_kmeans_ends_at_a_lloyd_fixed_point_with_ascending_centroids():
    """Whatever the iteration does (sorts skipped when the means of sorted runs are sorted already, empty
    clusters), the result is a Lloyd fixed point: every value coded to its nearest centroid, every centroid
    with members the mean of its members, centroids ascending; rows with fewer distinct values than k
    (empty clusters) included."""
    g = torch.Generator().manual_seed(5)
    few = torch.randn(6, 3, generator=g).gather(1, torch.randint(0, 3, (6, 96), generator=g))  # 3 values, k 8
    for w in (torch.randn(40, 96, generator=g), few, torch.randn(40, 96, generator=g) ** 3):
        c, a = kmeans_1d(w, 8)
        assert bool((c[:, 1:] >= c[:, :-1]).all())
        assert torch.equal(c.gather(1, a.long()), c.gather(1, nearest(w, c)))
        sums = torch.zeros(c.shape, dtype=torch.float64).scatter_add_(1, a.long(), w.double())
        counts = torch.zeros(c.shape, dtype=torch.float64).scatter_add_(1, a.long(), torch.ones_like(w.double()))
        held = counts > 0
        mean = (sums / counts.clamp_min(1)).float()
        tol = 4 * torch.finfo(torch.float32).eps * float(w.abs().max())
        assert float((mean - c)[held].abs().max()) <= tol


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codequant_is_lossless_when_rows_hold_at_most_2_to_the_bits_values(bits):
    """Weights on a per-row grid of 2^bits fp16-exact values: the codebooks (and the packed file) are exact."""
    g = torch.Generator().manual_seed(bits)
    k = 1 << bits

    def grid(*shape):  # each row draws from its own k values m/64, exactly representable in fp16
        vals = torch.randint(-128, 128, (*shape[:-1], k), generator=g).float() / 64
        return vals.gather(-1, torch.randint(0, k, shape, generator=g))

    layer = _layer(weights=[grid(E, W, H), grid(E, W, H), grid(E, H, W)])
    stats = LayerStats(0, {"io_sample_x": _inputs()})
    new, info = codequant(layer, stats, CodequantConfig(bits=bits, rotation="none", finetune_steps=0))
    for name in ("gate", "up", "down"):
        lay = getattr(new.experts, name)
        assert isinstance(lay, Codebook) and lay.bits == bits
        assert torch.equal(lay.dense(), getattr(layer.experts, name).dense()), name
        back = LAYOUTS["codebook"].from_tensors(lay.tensors(), lay.meta())
        assert torch.equal(back.dense(), lay.dense())
    x = _inputs(64, 9)
    assert torch.equal(moe_forward(new, x), moe_forward(layer, x))
    assert info["val_error_final"] == 0


def test_rotation_leaves_the_full_precision_block_unchanged_and_protected_experts_bit_identical():
    layer = _layer(3, protected=frozenset({2}))
    x = _inputs(128, 4)
    want = moe_forward(layer, x)
    r_learned, _ = learn_rotation(x, steps=20, init=hadamard(H))
    for r in (hadamard(H, 1), hadamard(H, 7), r_learned):
        assert float((r @ r.T - torch.eye(H, dtype=r.dtype)).abs().max()) < 1e-12
        bank = rotate_bank(layer.experts, r, frozenset({2}))
        assert _rel(moe_forward(layer.replace(experts=bank), x), want) <= 1e-5
        assert torch.equal(bank.gate.expert(2), layer.experts.gate.expert(2))
        assert not torch.equal(bank.gate.expert(0), layer.experts.gate.expert(0))
    h = hadamard(96, 0)  # 96 = 32·3: Hadamard ⊗ a random orthogonal 3×3
    assert float((h @ h.T - torch.eye(96, dtype=h.dtype)).abs().max()) < 1e-12


def test_learned_rotation_beats_hadamard_beats_nothing_on_outlier_inputs():
    x = _inputs(512, 2)
    r0 = hadamard(H, 0)
    r, losses = learn_rotation(x, steps=150, lr=2e-3, init=r0)
    none, had, learned = quant_error(x, 4), quant_error(x @ r0.float(), 4), quant_error(x.double() @ r, 4)
    assert learned < had < none, (none, had, learned)
    assert losses[-1] < losses[0]


def test_finetuning_lowers_the_block_error_and_the_reports_say_so():
    layer = _layer(5)
    stats = LayerStats(0, {"io_sample_x": _inputs(256, 6)})
    base = codequant(layer, stats, CodequantConfig(bits=2, rotation="none", finetune_steps=0))[1]
    tuned = codequant(layer, stats, CodequantConfig(bits=2, rotation="none", finetune_steps=30))[1]
    assert base["val_error_final"] == base["val_error_kmeans"] == tuned["val_error_kmeans"]
    assert tuned["val_error_final"] < 0.95 * tuned["val_error_kmeans"], tuned
    assert tuned["best_step"] > 0 and tuned["router_kl"] == 0.0  # full-precision router, same inputs


def test_patience_stops_early_and_keeps_what_a_run_of_that_many_steps_keeps():
    layer, stats = _layer(5), LayerStats(0, {"io_sample_x": _inputs(256, 6)})
    base = {"bits": 2, "rotation": "none", "finetune_steps": 40}
    early, info = codequant(layer, stats, CodequantConfig(**base, finetune_patience=2))
    assert info["steps_run"] < 40 and info["steps_run"] - info["best_step"] == 2, info
    short, info_s = codequant(
        layer, stats, CodequantConfig(**{**base, "finetune_steps": info["steps_run"]}, finetune_patience=None)
    )
    assert info_s["steps_run"] == info["steps_run"]
    for k in ("val_error_kmeans", "val_error_final", "best_step", "fit_loss_last"):
        assert info[k] == info_s[k], k
    for name in ("gate", "up", "down"):
        ta, tb = getattr(early.experts, name).tensors(), getattr(short.experts, name).tensors()
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
    every = codequant(layer, stats, CodequantConfig(**base, finetune_patience=None))[1]
    assert every["steps_run"] == 40  # no patience: every step


def test_auto_rotation_is_learned_only_where_activations_are_quantised():
    layer = _layer(5)
    stats = LayerStats(0, {"io_sample_x": _inputs(128, 6)})
    plain, info = codequant(layer, stats, CodequantConfig(bits=4, finetune_steps=0))
    assert plain.experts.rotation is None and info["rotation"] == "none" and "act_error_learned" not in info
    a4, info = codequant(
        layer, stats, CodequantConfig(bits=4, finetune_steps=0, eval_act_bits=4, rotation_steps=3)
    )
    assert a4.experts.rotation is not None and info["rotation"] == "learned" and "act_error_learned" in info
    meta = SPEC.emits(layer, CodequantConfig(bits=4))  # the dry run's shapes agree
    assert meta.experts.rotation is None


def test_activation_quantisation_is_stored_and_changes_only_the_rotated_inputs():
    layer = _layer(6, protected=frozenset({1}))
    stats = LayerStats(0, {"io_sample_x": _inputs(256, 7)})
    new, _ = codequant(
        layer, stats, CodequantConfig(bits=4, rotation="hadamard", eval_act_bits=4, finetune_steps=0)
    )
    assert new.experts.act_bits == 4 and new.experts.unrotated == frozenset({1})
    x = _inputs(64, 8)
    without = new.replace(experts=dataclasses.replace(new.experts, act_bits=None))
    assert not torch.equal(moe_forward(new, x), moe_forward(without, x))
    for name in ("gate", "up", "down"):  # the protected expert is stored exactly, unrotated
        assert torch.equal(getattr(new.experts, name).expert(1), getattr(layer.experts, name).expert(1))


def test_end_to_end_packed_bytes_quantizer_load_and_reference(tiny_qwen, tmp_path):
    out = tmp_path / "out"
    mc.apply({"model": str(tiny_qwen), "output": str(out), "calibration": CAL,
              "steps": [{"protect_super_experts": {}}, {"codequant": {"bits": 3, "eval_act_bits": 4,
                                                                       "finetune_steps": 5}}]},
             progress=False)  # fmt: skip
    rep = json.loads((out / "steps" / "02-codequant" / "report.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    desc = cfg["moecompress"]["layers"]["0"]
    assert desc["experts"]["gate"]["kind"] == "codebook" and desc["act_bits"] == 4 and desc["rotation"]
    gate = desc["experts"]["gate"]
    e, i, h = gate["shape"]
    quantised = gate["tensor_shapes"]["codes"][0]
    assert gate["tensor_shapes"]["codes"] == [quantised, i, h * 3 // 8]  # 3 bits per weight, packed
    assert (
        gate["tensor_shapes"]["centroids"] == [quantised, i, 1, 8]
        and gate["dtypes"]["centroids"] == "float16"
    )
    layer = mc.open_checkpoint(out).read_layer(0)
    n_exact = e - quantised
    want = quantised * (2 * i * h + h * i) * 3 / 8  # codes
    want += quantised * (2 * i + h) * 8 * 2  # fp16 centroids, one codebook per row
    want += n_exact * 3 * i * h * 4 + e * 8 * 3 + h * h * 4  # exact fp32 experts, int64 members, rotation
    assert layer.experts.nbytes() == want
    assert rep["layers"][0]["info"]["bytes_after"] == want
    with torch.no_grad():
        got = mc.load(out)(IDS).logits
    torch.testing.assert_close(got, reference_logits(tiny_qwen, out, IDS), rtol=1e-5, atol=1e-5)


def test_protect_heapr_uniform_codequant_chain_loads_and_generates(tiny_qwen, tmp_path):
    out = tmp_path / "chain"
    mc.apply({"model": str(tiny_qwen), "output": str(out), "calibration": CAL,
              "steps": [{"protect_super_experts": {}}, {"heapr": {"ratio": 0.25, "layout": "uniform"}},
                        {"codequant": {"bits": 4, "finetune_steps": 3, "rotation_steps": 10}}]},
             progress=False)  # fmt: skip
    model = mc.load(out)
    gen = model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=5, do_sample=False)
    assert gen.shape == (1, 8)
    layer = mc.open_checkpoint(out).read_layer(0)
    assert layer.experts.width == 24 and isinstance(layer.experts.down, Codebook)  # 32 -> 24 neurons


def test_errors_name_the_field_and_the_fix(tiny_qwen, tmp_path):
    rec = {"model": str(tiny_qwen), "output": str(tmp_path / "o"), "calibration": CAL}
    with pytest.raises(PassError, match="group=24 does not divide"):
        mc.apply({**rec, "steps": [{"codequant": {"group": 24}}]}, dry_run=True)
    pruned = tmp_path / "p"
    mc.apply({**rec, "output": str(pruned), "steps": [{"neuron_prune": {"ratio": 0.25, "method": "magnitude"}}]},
             progress=False)  # fmt: skip
    with pytest.raises(
        PassError, match=r"different widths .*heapr layout: uniform"
    ):  # widths: known at run time
        mc.apply(
            {**rec, "model": str(pruned), "steps": [{"codequant": {"rotation_steps": 2}}]}, progress=False
        )
    svd = tmp_path / "svd"
    mc.apply({**rec, "output": str(svd), "steps": [{"svd_experts": {}}]}, progress=False)
    with pytest.raises(PassError, match=r"codequant needs dense \(or uniformly pruned\) experts.*lowrank"):
        mc.apply({**rec, "model": str(svd), "steps": [{"codequant": {}}]}, dry_run=True)
    with pytest.raises(Exception, match="fuse"):
        CodequantConfig(fuse="model")
    assert not (tmp_path / "o").exists()


def test_uniformly_pruned_bank_with_a_full_width_protected_expert_stores_only_live_neurons():
    """heapr uniform + protection gives a ragged bank (protected expert full width, the others one live
    width): codebooks cover only the live neurons, the protected expert stays exact, lossless on a grid."""
    g = torch.Generator().manual_seed(11)

    def grid(*shape):
        vals = torch.randint(-64, 64, (*shape[:-1], 16), generator=g).float() / 32
        return vals.gather(-1, torch.randint(0, 16, shape, generator=g))

    dense = [grid(E, W, H), grid(E, W, H), grid(E, H, W)]
    live = 12
    keep = [torch.arange(W if e == 1 else live) for e in range(E)]
    lays = [Ragged.from_dense(dense[0], keep, "out"), Ragged.from_dense(dense[1], keep, "out"),
            Ragged.from_dense(dense[2], keep, "in")]  # fmt: skip
    layer = _layer(weights=None, protected=frozenset({1}))
    layer = layer.replace(experts=ExpertBank(*lays))
    stats = LayerStats(0, {"io_sample_x": _inputs()})
    new, _ = codequant(layer, stats, CodequantConfig(bits=4, rotation="none", finetune_steps=0))
    x = _inputs(64, 3)
    assert torch.equal(moe_forward(new, x), moe_forward(layer, x))
    gate, down = new.experts.gate, new.experts.down
    assert gate.codes.shape[:2] == (E - 1, live) and down.in_features == live and gate.shape == (E, W, H)
    assert gate.meta()["stored"] == [live, H] and down.meta()["stored"] == [H, live]
    for lay in (gate, down):
        back = LAYOUTS["codebook"].from_tensors(lay.tensors(), lay.meta())
        assert torch.equal(back.dense(), lay.dense())
    assert torch.equal(gate.expert(1), layer.experts.gate.expert(1))
    assert new.experts.widths.tolist() == [live, W, live, live]
    rotated, _ = codequant(layer, stats, CodequantConfig(bits=4, rotation="hadamard", finetune_steps=0))
    assert _rel(moe_forward(rotated, x), moe_forward(layer, x)) < 0.1  # rotated weights are off the grid
    assert (
        not rotated.experts.gate.expert(0)[live:].any() and not rotated.experts.down.expert(0)[:, live:].any()
    )


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen2_moe"])
def test_shared_experts_are_quantised_stored_in_the_format_and_load(model_type, tmp_path):
    """The shared expert gets codebooks (unrotated); the checkpoint stores it under the shared module's
    path, and transformers loads it through the quantizer with the reference logits."""
    src, out = tmp_path / "m", tmp_path / "out"
    save_tiny(model_type, src)
    mc.apply({"model": str(src), "output": str(out), "calibration": CAL,
              "steps": [{"codequant": {"bits": 4, "finetune_steps": 3, "rotation": "learned", "rotation_steps": 5}}]},
             progress=False)  # fmt: skip
    ckpt = mc.open_checkpoint(out)
    i = ckpt.moe_layer_indices[0]
    layer = ckpt.read_layer(i)
    assert isinstance(layer.shared.gate, Codebook) and layer.shared.rotation is None
    assert isinstance(layer.experts.gate, Codebook) and layer.experts.rotation is not None
    desc = json.loads((out / "config.json").read_text())["moecompress"]["layers"][str(i)]
    assert desc["shared"]["experts"]["down"]["kind"] == "codebook"
    assert any(k.startswith(ckpt.adapter.shared_key(i) + ".gate.codes") for k in ckpt.reader.keys)
    with torch.no_grad():
        got = mc.load(out)(IDS).logits
    torch.testing.assert_close(got, reference_logits(src, out, IDS), rtol=1e-5, atol=1e-5)
    kept = tmp_path / "kept"
    mc.apply({"model": str(src), "output": str(kept), "calibration": CAL,
              "steps": [{"codequant": {"bits": 4, "finetune_steps": 0, "rotation": "none", "shared": False}}]},
             progress=False)  # fmt: skip
    assert isinstance(mc.open_checkpoint(kept).read_layer(i).shared.gate, Dense)


def test_batched_kmeans_sorted_assignment_is_nearest_and_results_do_not_depend_on_the_chunking():
    from moecompress.methods.kmeans import SortedRows

    g = torch.Generator().manual_seed(7)
    v = torch.randn(37, 50, generator=g)
    v[:5] = v[:5].round()  # ties: repeated values and values on a midpoint
    c = torch.randn(37, 6, generator=g)
    c[:5] = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0, 0.0])  # midpoints at ±0.5, ±1.5; a duplicate centroid
    v[:5, :4] = torch.tensor([0.5, -0.5, 1.5, -1.5])
    for chunk in (50, 7 * 50, 1 << 20):
        assert torch.equal(SortedRows(v, chunk_values=chunk).assign(c), nearest(v, c))
    rows = SortedRows(v)
    rows.assign(c)
    for step in range(4):  # incremental reassignment: only values between old and new cuts move
        c = c + (0.05 if step == 2 else 0.005) * torch.randn(c.shape, generator=g)  # step 2 reorders some
        assert torch.equal(rows.update(c), nearest(v, c)), step
    # a cut that moves past its neighbour's old position (ranges overlap, the order unchanged)
    grid = torch.linspace(-1, 3, 50).repeat(2, 1)
    far = SortedRows(grid, code_dtype=torch.uint8)
    far.assign(torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]))
    moved = torch.tensor([[1.2, 2.0, 2.2], [0.0, 1.01, 2.0]])
    assert torch.equal(far.update(moved), nearest(grid, moved).to(torch.uint8))
    whole = kmeans_1d(v, 4, seed=1)
    kept = kmeans_1d(v, 4, seed=1, keep_sorted=True)  # the Lloyd sort, reused: same results, same rows
    assert torch.equal(kept[0], whole[0]) and torch.equal(kept[1], whole[1])
    assert torch.equal(kept[2].assign(c), nearest(v, c))
    for chunk in (50, 3 * 50):  # one row at a time, three rows at a time
        part = kmeans_1d(v, 4, seed=1, chunk_values=chunk)
        assert torch.equal(part[0], whole[0]) and torch.equal(part[1], whole[1])
    cents, codes = whole
    assert torch.equal(codes, nearest(v.double(), cents.double()))  # a fixed point of the assignment
    for r in range(len(v)):  # every centroid is the mean of its values (Lloyd's fixed point)
        for k in codes[r].unique():
            assert torch.allclose(cents[r, k], v[r][codes[r] == k].double().mean().float(), atol=1e-6)


def test_learned_rotation_equals_the_torch_parametrisation_it_replaced():
    """``learn_rotation`` forms only ``x Wᵀ`` of the Cayley-parametrised ``W`` (no ``H × H`` solve with
    ``H`` right-hand sides): with no step it returns the reference's rotation bit for bit, its first loss
    is the reference's exactly, 10 Adam steps follow the same trajectory to float32 rounding, and 40 steps
    reach an equally good rotation. Longer trajectories are not compared entry by entry: the fake
    quantiser's rounding flips on float32 noise and Adam amplifies it, so 40 steps differ by 2e-3 with
    ATen's AVX2/AVX-512 kernels and by 2.3e-2 with ATEN_CPU_CAPABILITY=default (10 steps: 5e-7, 2.3e-4)."""
    from moecompress.methods.rotation import learn_rotation_reference

    g = torch.Generator().manual_seed(3)
    h = 32
    x = torch.randn(400, h, generator=g) * torch.rand(h, generator=g) * 3
    x[:, 5] *= 25  # an outlier channel, as rotations are for
    r0 = hadamard(h, 7)
    r_new, _ = learn_rotation(x, steps=0, init=r0)
    r_ref, _ = learn_rotation_reference(x, steps=0, init=r0)
    assert torch.equal(r_new, r_ref)
    r_new, l_new = learn_rotation(x, steps=10, lr=2e-3, init=r0, seed=1)
    r_ref, l_ref = learn_rotation_reference(x, steps=10, lr=2e-3, init=r0, seed=1)
    assert l_new[0] == l_ref[0]
    assert max(abs(a - b) / b for a, b in zip(l_new, l_ref)) < 5e-4
    assert float((r_new - r_ref).abs().max()) < 2e-3
    r_new, l_new = learn_rotation(x, steps=40, lr=2e-3, init=r0, seed=1)
    r_ref, l_ref = learn_rotation_reference(x, steps=40, lr=2e-3, init=r0, seed=1)
    assert l_new[-1] < 0.9 * l_new[0]  # it learns
    assert torch.allclose(r_new.T @ r_new, torch.eye(h, dtype=torch.float64), atol=1e-12)
    assert abs(quant_error(x.double() @ r_new, 4) - quant_error(x.double() @ r_ref, 4)) < 5e-3 * quant_error(
        x.double() @ r_ref, 4
    )


def test_dry_run_counts_the_fine_tuning_workspace(tiny_qwen, tmp_path):
    """The step estimate holds 12 bytes per quantised weight (float32 weights, uint8 codes twice, sorted
    rows) plus one expert's decode and gradient, and the rotated gate/up, not just the input and output."""
    from moecompress.passes.codequant import WORKSPACE_BYTES_PER_WEIGHT

    rec = {"model": str(tiny_qwen), "output": str(tmp_path / "o"), "steps": [{"codequant": {"bits": 4}}],
           "calibration": {"source": "random", "samples": 4, "seq_len": 8, "cache_dir": str(tmp_path / "c")}}  # fmt: skip
    dry = mc.apply(rec, dry_run=True, progress=False).report["dry_run"]
    est = next(iter(dry["step_memory"].values()))
    from moecompress.engine.dry_run import meta_layer
    from moecompress.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(tiny_qwen)
    bank = meta_layer(ckpt, ckpt.moe_layer_indices[0]).experts
    weights = sum(math.prod(getattr(bank, n).shape) for n in ("gate", "up", "down"))
    assert est["workspace_bytes"] >= WORKSPACE_BYTES_PER_WEIGHT * weights
    assert est["bytes"] >= est["input_bytes"] + est["workspace_bytes"]
