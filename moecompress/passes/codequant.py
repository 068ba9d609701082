"""``codequant``: learned rotation + per-row codebook quantisation of the routed experts (CodeQuant).

CodeQuant (arXiv 2604.10496, ICLR 2026), adapted to one MoE layer at a time:

1. **Rotation** (AOS) of the MoE block's input ``x' = x R`` (``R`` orthogonal ``[H, H]``):
   ``rotation: learned`` minimises ``mean ‖x R − Q_b(x R)‖²`` (``Q_b`` per-token asymmetric min-max,
   ``rotation_bits``) on the layer's calibration inputs with the Cayley parametrisation and Adam, from a
   randomised Hadamard start (:mod:`moecompress.methods.rotation`); ``hadamard`` uses that start as is; ``none``
   skips it; ``auto`` (the default) is ``learned`` when activations are quantised (``eval_act_bits``, the
   paper's A4W4 setting, what the rotation is trained for) and ``none`` for weight-only quantisation
   (:func:`rotation_kind`). **``fuse: online``** (the one built): the bank rotates its input once per token (an
   ``H × H`` matmul) and gate/up are stored as ``W R``, so the full-precision function is unchanged. The
   router is *not* rotated: it stays a stock full-precision module reading ``x`` (``W_r x = (W_r R)(x R)ᵀ``,
   so rotating it would change nothing but its module). ``fuse: model`` (QuaRot-style folding of
   RMSNorm weights and one ``R`` into embeddings, attention and lm_head) is not built: it rewrites
   tensors outside the MoE layers, which a per-layer pass cannot express, and it forces one ``R`` on
   every layer where online fusion lets each layer learn its own.
2. **Codebooks** (ACCF): each output row of every routed expert projection (``scope: all``: gate, up and
   down; ``rotated_inputs``: gate and up only, as the released code, down kept dense), split into groups
   of ``group`` inputs (``-1``: the whole row), gets ``2^bits`` centroids by k-means (k-means++ seeded,
   ``kmeans_iters``) — :class:`~moecompress.layouts.codebook.Codebook` layout, codes bit-packed, fp16 centroids.
3. **Output-aware reassignment**: ``k*(i, j) = argmin_k (B_j W_ij − A_j C_ik)²`` with ``A_j = E[x_j²]``,
   ``B_j = E[x_j x̂_j]`` over the expert's routed calibration inputs, ``x̂`` the activation-quantised
   input (``eval_act_bits``). Without activation quantisation ``B = A`` and this is nearest-centroid
   assignment (as in the released code); down inputs are never activation-quantised.
4. **Centroid fine-tuning**: ``finetune_steps`` Adam steps on the centroids (assignment fixed within a
   step, reassigned after it) against ``‖MoE_q(x) − MoE(x)‖² / ‖MoE(x)‖² + kl_weight · KL(P_router ‖
   P_router,q)`` on the first 3/4 of the calibration sample; the centroids with the lowest error on the
   last 1/4 are kept (the k-means result if no step improves). ``MoE`` is this step's input layer, so the
   pass chains after pruning. The router stays full precision and reads the same layer-local input, so
   the KL term is exactly 0 here (reported); it matters only when a step changes the router or its input.
   ``finetune_steps: 0`` is the "k-means only" ablation. ``finetune_patience`` (10) stops after that many
   steps without a lower held-back error (``steps_run`` in the report; the result is that of a run of
   that many steps; ``null``: every step). On whole layers of both reference models it wrote the same
   bytes as all 50 steps, stopping after 14–29 (``benchmarks/RESULTS.md``, 2026-12-05 fifth session).
5. ``eval_act_bits`` (optional) stores an activation fake-quantiser in the output: every forward (and
   the fine-tuning) quantises the rotated gate/up input per token, as in the paper's A4W4 tables.

Protected (super) experts are stored bit-identically (``exact``), read the unrotated input and are never
activation-quantised. The shared expert (DeepSeek, Qwen2-MoE; ``shared: true``) gets per-row codebooks
too and joins the fine-tuning, but reads the unrotated input without activation quantisation (a second
``H × H`` rotation per layer would cost more than it saves; ``shared: false`` keeps it dense). Input
must be dense or uniformly pruned (quantise last; prune with ``layout: uniform`` before).

**By chunks of experts** (``expert_chunk: N`` or ``auto``, a layer larger than memory): the rotation is a
function of the layer's calibration inputs only, so it is computed once per layer (:func:`prelude`, the
same :func:`_rotation` a whole layer runs: the same tensor) and applied to every chunk, with the whole
router's routing of the calibration tokens (a chunk's router holds only its rows). Each expert's k-means++
seeds come from its id in the layer (:func:`~moecompress.methods.codebooks.expert_seed`), so with
``finetune_steps: 0`` the output is byte-identical to the whole layer's. The fine-tuning of a chunk
minimises the error of *its own experts' part* of the block output, relative to that part's norm: the
cross terms between its experts' errors and the other chunks' (not held) are dropped, and each chunk keeps
its own best step (``best_step_per_chunk``, ``val_error_*_per_chunk`` in the report); the router KL is 0
as on a whole layer. ``shared: true`` on a layer with a shared expert is refused in the dry run (a chunk
cannot change the shared expert, which the fine-tuning fits with every routed expert): set ``shared:
false`` to keep it dense. Under ``torchrun`` (``N`` ranks) a fine-tuned layer not chunked by request goes in
``N`` units worked at the same time (``Chunking.team``, ``stats.team``): every step, each unit runs its own
experts, the weighted outputs are gathered and added in expert order, and each unit steps its own centroids
(Adam is elementwise), so the objective is the whole layer's and the bytes are one process's (the whole layer
is a team of one: its target is the experts' outputs added in expert order, the step sizes' mean |weight|
float64 sums per expert). Rank 0 still runs the layer whole when a step before it selects experts (a rank
could be left without one) or the experts do not make ``N`` units.

Statistics: ``io_sample`` (the layer's calibration inputs; raise ``calibration.sample_tokens`` for more
than 512 tokens). Cost per layer: the rotation (``rotation_steps`` Cayley steps, one ``H × H`` LU each), k-means
of every row (``E·(2I + H)`` rows, sorted once: the sort also serves every reassignment), and per
fine-tuning step the quantised experts' forward (no gradient; each expert's input and activations are
kept) together with the validation forward of the same centroids (one decode for both), then each
expert's backward on its own routed tokens given the block's output gradient, written out as autograd
computes it, with no second forward (the routing, the rotated input and the protected experts' output
are computed once; one expert's decoded weights are alive at a time, its gradient a block of rows at a
time, scattered into its centroids; codes are ``uint8``), and an incremental reassignment (only the
weights between a cluster cut's old and new position move)
(:mod:`~moecompress.methods.codebook_finetune`). At DeepSeek-V3's shapes (H 7168, I 2048, 64 routed
tokens per expert) a step costs about 0.4 CPU s per expert and the k-means 6.7 s per expert
(``benchmarks/codequant_step.py``).

Example steps::

    steps:
      - protect_super_experts: {}
      - codequant: {bits: 4}                                  # fine-tuned codebooks (weights only: no rotation)
      - codequant: {bits: 4, eval_act_bits: 4}                # A4W4: learned rotation (auto)
      - codequant: {bits: 3, rotation: hadamard, finetune_steps: 0, eval_act_bits: 4}
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
from pydantic import Field

from moecompress.engine.spec import Chunking, LayerStats, PassConfig, PassSpec
from moecompress.errors import PassError
from moecompress.ir import MoELayer
from moecompress.layouts.base import meta_tensor
from moecompress.layouts.codebook import Codebook
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.methods.codebook_finetune import finetune
from moecompress.methods.codebooks import (
    Routing,
    cluster,
    expert_seed,
    gate_up_scales,
    reassign,
    rotate_bank,
)
from moecompress.methods.kmeans import CHUNK_VALUES
from moecompress.methods.rotation import hadamard, learn_rotation, quant_error
from moecompress.passes.codequant_chunks import Prelude, merge_codequant, refuse_shared
from moecompress.passes.neuron_pruning import one_width_members


class CodequantConfig(PassConfig):
    bits: Literal[2, 3, 4] = Field(4, description="index bits per weight (2^bits centroids per group)")
    group: int = Field(
        -1, description="inputs per codebook (must divide every projection's input); -1: whole row"
    )
    scope: Literal["all", "rotated_inputs"] = Field(
        "all", description="quantise gate, up and down, or only gate/up (the released code's scope)"
    )
    rotation: Literal["auto", "learned", "hadamard", "none"] = Field(
        "auto", description="input rotation; auto: learned with eval_act_bits, none for weights only"
    )
    fuse: Literal["online"] = Field(
        "online", description="how the rotation is applied (only online is built)"
    )
    rotation_bits: int = Field(4, ge=2, le=8, description="per-token activation bits of the rotation loss")
    rotation_steps: int = Field(100, ge=0, description="Adam steps of the learned rotation")
    rotation_lr: float = Field(1e-3, gt=0, description="Adam learning rate of the rotation")
    kmeans_iters: int = Field(300, ge=1, description="Lloyd iterations at most")
    finetune_steps: int = Field(50, ge=0, description="centroid fine-tuning steps (0: k-means only)")
    finetune_patience: int | None = Field(
        10, ge=1, description="stop fine-tuning after this many steps without a lower held-back error (null: never)"
    )
    finetune_lr: float = Field(
        0.01, gt=0, description="Adam step, relative to the projection's mean |weight|"
    )
    kl_weight: float = Field(1.0, ge=0, description="weight λ of the router KL term")
    eval_act_bits: int | None = Field(None, ge=2, le=16, description="fake-quantise gate/up inputs (A4: 4)")
    shared: bool = Field(True, description="also quantise the shared expert (unrotated, weights only)")
    seed: int = Field(42, ge=0, description="seed of k-means++, the Hadamard signs and the rotation batches")


def _projections(cfg: CodequantConfig) -> tuple[str, ...]:
    return ("gate", "up", "down") if cfg.scope == "all" else ("gate", "up")


def _check(layer: MoELayer, cfg: CodequantConfig) -> None:
    bank = layer.experts
    if not all(isinstance(getattr(bank, n), (Dense, Ragged)) for n in ("gate", "up", "down")):
        kinds = sorted({getattr(bank, n).kind for n in ("gate", "up", "down")})
        raise PassError(
            f"codequant needs dense (or uniformly pruned) experts, got layouts {kinds}; quantise last"
        )
    if bank.rotation is not None or bank.act_bits is not None:
        raise PassError("this layer is already rotated/quantised by an earlier codequant step; quantise once")
    if cfg.group != -1:
        inputs = {name: getattr(bank, name).shape[2] for name in _projections(cfg)}
        if cfg.shared and layer.shared is not None:
            inputs["shared down"] = layer.shared.down.shape[2]
        for name, inn in inputs.items():
            if cfg.group <= 0 or inn % cfg.group:
                raise PassError(
                    f"group={cfg.group} does not divide the {inn} inputs of {name}; use a divisor of "
                    f"{', '.join(str(v) for v in sorted(set(inputs.values())))}, or -1 (whole rows)"
                )


def _targets(layer: MoELayer, cfg: CodequantConfig) -> list[tuple[str, str]]:
    """``(bank, projection)`` pairs to quantise: the routed experts' (per ``scope``), and the shared
    expert's gate/up/down when ``shared`` is on."""
    out = [("experts", name) for name in _projections(cfg)]
    if cfg.shared and layer.shared is not None:
        out += [("shared", name) for name in ("gate", "up", "down")]
    return out


def _members(layer: MoELayer, cfg: CodequantConfig) -> tuple[list[int], frozenset[int], int]:
    """Quantised and exact (protected) physical experts, and the quantised experts' live width."""
    ids, protected, live = one_width_members(layer, "codequant", "quantised")
    if cfg.group != -1 and "down" in _projections(cfg) and live % cfg.group:
        raise PassError(
            f"group={cfg.group} does not divide the pruned experts' width {live}; use -1 or a divisor"
        )
    return ids, frozenset(protected), live


def rotation_kind(cfg: CodequantConfig) -> str:
    """The rotation a step uses: ``auto`` is ``learned`` when activations are quantised (``eval_act_bits``),
    the setting the rotation is for (its loss is the activation quantiser's error), and ``none`` for
    weight-only quantisation, where no quantiser reads the rotated input: it measured no better than
    ``none`` on the three reference models (perplexity within noise, ``none`` often best), costs an
    ``H × H`` float32 matrix per layer (0.83 → 1.00 bytes per routed parameter at 4 bits on those small
    models), the ``H × H`` matmul per token in serving, and the rotation's training (benchmarks/RESULTS.md,
    2026-11-29 and 2026-12-02)."""
    if cfg.rotation == "auto":
        return "none" if cfg.eval_act_bits is None else "learned"
    return cfg.rotation


def _rotation(layer: MoELayer, x: torch.Tensor, cfg: CodequantConfig, info: dict) -> torch.Tensor | None:
    kind = rotation_kind(cfg)
    info["rotation"] = kind
    if kind == "none":
        return None
    r = hadamard(layer.hidden_size, cfg.seed + layer.index)
    info["act_error_unrotated"] = quant_error(x, cfg.rotation_bits)
    info["act_error_hadamard"] = quant_error(x.double() @ r, cfg.rotation_bits)
    if kind == "learned" and cfg.rotation_steps:
        r, losses = learn_rotation(
            x, bits=cfg.rotation_bits, steps=cfg.rotation_steps, lr=cfg.rotation_lr, init=r, seed=cfg.seed
        )
        info["act_error_learned"] = quant_error(x.double() @ r, cfg.rotation_bits)
        info["rotation_loss_first_last"] = [losses[0], losses[-1]]
    return r


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fit tokens (the first 3/4) and the validation tokens (the rest; all when there is no rest)."""
    n_fit = max(1, (3 * x.shape[0]) // 4)
    return x[:n_fit], x[n_fit:] if x.shape[0] > n_fit else x


def prelude(shell: MoELayer, stats: LayerStats, cfg: CodequantConfig) -> Prelude:
    """A layer held by chunks of experts: the rotation of its MoE input (a function of the calibration
    inputs only, learned once per layer: the same :func:`_rotation` a whole layer computes) and the
    routing of the calibration tokens by the whole router (a chunk's router holds only its rows)."""
    x_fit, x_val = _split(stats["io_sample_x"].float())
    info: dict = {}
    r = _rotation(shell, x_fit, cfg, info)
    return Prelude(r, info, Routing.of(shell, x_fit), Routing.of(shell, x_val))


def summarize_codequant(infos: dict[int, dict], cfg: CodequantConfig) -> dict:
    """Step summary: bytes and bytes per routed-expert parameter, errors per layer."""
    layers = sorted(infos)
    before = sum(infos[i]["bytes_before"] for i in layers)
    after = sum(infos[i]["bytes_after"] for i in layers)
    params = sum(infos[i]["routed_params"] for i in layers)
    keys = ("act_error_unrotated", "act_error_hadamard", "act_error_learned", "val_error_kmeans", "val_error_final",
            "best_step", "steps_run", "router_kl")  # fmt: skip
    per_layer = {str(i): {k: infos[i][k] for k in keys if k in infos[i]} for i in layers}
    warnings = [
        f"layer {i}: centroid fine-tuning did not improve the held-back error; kept the k-means codebooks"
        for i in layers
        if cfg.finetune_steps and infos[i].get("best_step") == 0 and infos[i].get("quantised_experts")
    ]
    return {
        "summary": {
            "bits": cfg.bits,
            "rotation": rotation_kind(cfg),
            "scope": cfg.scope,
            "routed_bytes_before": before,
            "routed_bytes_after": after,
            "routed_bytes_per_param": after / params if params else 0.0,
            "routed_bits_per_param": 8 * after / params if params else 0.0,
            "routed_fraction_removed": 0.0,
            "shared_bytes_before": sum(infos[i].get("shared_bytes_before", 0) for i in layers),
            "shared_bytes_after": sum(infos[i].get("shared_bytes_after", 0) for i in layers),
            "per_layer": per_layer,
        },
        "warnings": warnings,
    }


def _emits(layer: MoELayer, cfg: CodequantConfig) -> MoELayer:
    """Shapes only: codebooks for the quantised projections (live neurons only), protected experts
    exact, the rotation and activation quantiser on the bank, the shared expert's codebooks."""
    _, protected, live = _members(layer, cfg)
    new: dict[str, dict] = {"experts": {}, "shared": {}}
    for bank_name, name in _targets(layer, cfg):
        src = getattr(layer, bank_name)
        lay = getattr(src, name)
        e, out, inn = lay.shape
        width, exact = (live, len(protected)) if bank_name == "experts" else (src.width, 0)
        stored = (out, width) if name == "down" else (width, inn)
        groups = 1 if cfg.group == -1 else stored[1] // cfg.group
        new[bank_name][name] = Codebook.meta_like(
            e, out, inn, bits=cfg.bits, groups=groups, stored=stored, exact=exact, dtype=lay.dtype
        )
    h = layer.hidden_size
    rotation = None if rotation_kind(cfg) == "none" else meta_tensor(h, h, dtype=torch.float32)
    bank = dataclasses.replace(
        layer.experts, **new["experts"], rotation=rotation, act_bits=cfg.eval_act_bits,
        unrotated=protected if rotation is not None else frozenset(),
    )  # fmt: skip
    shared = layer.shared if not new["shared"] else dataclasses.replace(layer.shared, **new["shared"])
    return layer.replace(experts=bank, shared=shared)


WORKSPACE_BYTES_PER_WEIGHT = 12
"""What :func:`codequant` holds per quantised weight while it fine-tunes (every target projection at
once): the float32 weights (4 bytes), the k-means codes (1, ``uint8``; kept for a run whose best step is
the first), the sorted reassignment rows (float32 values and int16 positions: 6), the working codes (1,
updated in place). The forwards and the backward decode one expert at a time, into buffers reused across
experts and steps (:class:`~moecompress.methods.codebook_finetune.Decoded`): :data:`EXPERT_BYTES_PER_WEIGHT`
per weight of one expert of each part. The rotated gate/up copy (layer dtype) and the k-means chunk
(:data:`~moecompress.methods.kmeans.CHUNK_VALUES` values, about 10 float64 copies) come on top."""

EXPERT_BYTES_PER_WEIGHT = 8
"""The fine-tuning's buffers per weight of one expert of each part (a routed expert's projections, the
shared expert's): its decoded float32 weights and the same from float16-rounded centroids (the
validation forward's): 4 + 4. The int64 index and the weight gradient exist a block of rows at a time."""


def _workspace(layer: MoELayer, cfg: CodequantConfig) -> int:
    """Bytes :func:`codequant` allocates on ``layer`` beyond its input and output (the dry run's estimate):
    :data:`WORKSPACE_BYTES_PER_WEIGHT` per quantised weight, :data:`EXPERT_BYTES_PER_WEIGHT` per weight of
    one expert of each part, and the rotated gate/up (in the layer's dtype)."""
    shapes = [getattr(getattr(layer, b), n).shape for b, n in _targets(layer, cfg)]
    bank = layer.experts
    rotated = 0 if rotation_kind(cfg) == "none" else bank.gate.nbytes() + bank.up.nbytes()
    per_weight = WORKSPACE_BYTES_PER_WEIGHT if cfg.finetune_steps else 5  # k-means only: weights, codes
    one_expert = sum(math.prod(s[1:]) for s in shapes)  # also the validation forward of k-means only
    total = sum(math.prod(s) for s in shapes)
    return per_weight * total + EXPERT_BYTES_PER_WEIGHT * one_expert + rotated + 10 * 8 * CHUNK_VALUES


def codequant(layer: MoELayer, stats: LayerStats, cfg: CodequantConfig) -> tuple[MoELayer, dict]:
    """Rotation + per-row codebook quantisation of the routed experts (CodeQuant)."""
    _check(layer, cfg)
    bank = layer.experts
    x_fit, x_val = _split(stats["io_sample_x"].float())
    ids, protected, live = _members(layer, cfg)
    info: dict = {"protected": sorted(protected), "bits": cfg.bits, "bytes_before": bank.nbytes()}
    pre: Prelude | None = stats.prelude  # a chunk of a layer held by chunks of experts
    if pre is None:
        r, first = _rotation(layer, x_fit, cfg, info), 0
    else:
        why = refuse_shared(layer, cfg)
        if why is not None:
            raise PassError(why)
        r, first = pre.rotation, pre.first
        info.update(pre.info)
    rotated = layer if r is None else layer.replace(experts=rotate_bank(bank, r, protected))
    if cfg.eval_act_bits is not None:
        rotated = rotated.replace(experts=dataclasses.replace(rotated.experts, act_bits=cfg.eval_act_bits))
    routing = None if pre is None else (pre.fit, pre.val)
    gate_up_scale = gate_up_scales(  # B/A, once for gate and up
        rotated, x_fit, ids, cfg.eval_act_bits, None if pre is None else pre.fit
    )
    parts = {}
    for bank_name, name in _targets(layer, cfg):
        src = getattr(rotated, bank_name)
        part = {"proj": name, "ids": ids, "live": live} if bank_name == "experts" else {
            "proj": name, "ids": [0], "live": src.width}  # fmt: skip
        # each expert's k-means++ seeds from its id in the layer: a chunk's codebooks are the whole layer's
        seeds = (
            [expert_seed(cfg.seed, first + e) for e in ids]
            if bank_name == "experts"
            else [expert_seed(cfg.seed, -1)]
        )
        w = getattr(src, name).dense()
        w = w[torch.tensor(part["ids"], dtype=torch.long)].float()
        w = w[:, :, : part["live"]] if name == "down" else w[:, : part["live"]]  # pruned: live part only
        gs = w.shape[2] if cfg.group == -1 else cfg.group
        scale = gate_up_scale if bank_name == "experts" and name != "down" else None
        keep = bool(cfg.finetune_steps) and scale is None  # the k-means sort serves the reassignments
        cents, codes, *rows = cluster(
            w, cfg.bits, gs, iters=cfg.kmeans_iters, seed=cfg.seed, keep_sorted=keep, seeds=seeds
        )
        if scale is not None:
            codes = reassign(w, cents, scale)
        parts[bank_name, name] = {**part, "w": w, "cents": cents, "codes": codes, "scale": scale}
        if rows:
            parts[bank_name, name]["rows"] = rows[0]
    team = stats.team  # the layer's units fine-tuned together, one per rank (the whole layer's objective)
    steps = cfg.finetune_steps if ids or team is not None or any(b == "shared" for b, _ in parts) else 0
    info.update(
        finetune(
            layer,
            rotated,
            parts,
            x_fit,
            x_val,
            steps=steps,
            lr=cfg.finetune_lr,
            kl_weight=cfg.kl_weight,
            routing=routing,
            patience=cfg.finetune_patience,
            team=team,
        )
    )
    if team is not None:
        info["team"] = True  # the errors and steps are the layer's, the same in every unit
    new: dict[str, dict] = {"experts": {}, "shared": {}}
    for (bank_name, name), p in parts.items():
        dense = getattr(getattr(rotated, bank_name), name).dense()
        exact = {e: dense[e] for e in range(dense.shape[0]) if e not in p["ids"]}
        new[bank_name][name] = Codebook.build(
            dict(zip(p["ids"], p["codes"])), dict(zip(p["ids"], p["cents"])), exact, cfg.bits, dense
        )
    out_bank = dataclasses.replace(rotated.experts, **new["experts"])
    shared = rotated.shared if not new["shared"] else dataclasses.replace(rotated.shared, **new["shared"])
    logical = 3 * bank.num_experts * bank.width * bank.hidden_size
    info.update(bytes_after=out_bank.nbytes(), routed_params=logical, quantised_experts=len(ids))
    if pre is not None and r is not None:  # the layer's rotation, counted once by merge_codequant
        info["rotation_bytes"] = out_bank.rotation.nbytes  # type: ignore[union-attr]
        info["bytes_after"] -= info["rotation_bytes"]
    info["bytes_per_param"] = info["bytes_after"] / logical
    if layer.shared is not None:
        info.update(shared_bytes_before=layer.shared.nbytes(), shared_bytes_after=shared.nbytes())  # type: ignore[union-attr]
    return layer.replace(experts=out_bank, shared=shared), info


SPEC = PassSpec(
    "codequant", CodequantConfig, codequant, needs={"io_sample"}, emits=_emits, check=_check,
    summarize=summarize_codequant, workspace=_workspace,
    alters=lambda cfg: {"weights", "shared"} if cfg.shared else {"weights"},
    chunking=Chunking(
        "expert", merge=merge_codequant, refuse_layer=refuse_shared, prelude=prelude,
        exact=lambda cfg: cfg.finetune_steps == 0,  # fine-tuned by chunks: each chunk's own error
        team=lambda cfg: cfg.finetune_steps > 0,  # units fine-tuned together: the whole layer's error
    ),
)  # fmt: skip
