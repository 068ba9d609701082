"""``svd_experts``: per-expert truncated SVD with data-aware whitening (the low-rank baseline).

Each projection ``W`` ``[out, in]`` (gate, up, down) of every routed expert that is not protected is
replaced by a rank-``r`` product ``u·v`` (:class:`~moecompress.layouts.lowrank.LowRank` layout)::

    W_w = A·W·B,   W_w ≈ U_r S_r V_rᵀ (truncated SVD),   u = A⁻¹ U_r S_r  [out, r],   v = (B⁻ᵀ V_r)ᵀ  [r, in]

With input whitening (``B = L``, ``L Lᵀ = E[x xᵀ]``) the truncation minimises the output error
``E‖(W − u·v)x‖²`` on the calibration data instead of the weight error: SVD-LLM (Wang et al.,
"SVD-LLM: Truncation-aware Singular Value Decomposition for Large Language Model Compression",
ICLR 2025). Output / both sides and the ``inverse`` form are described in :mod:`moecompress.methods.whitening`.
Applied expert by expert, this is the per-expert SVD (MoE-SVD) baseline that TD-MoE's paper compares
against. The covariances are pooled over the experts of a layer (one whitener per projection type).

**Rank.** A rank-``r`` expert stores ``r·(out + in)`` elements instead of ``out·in``; ``ratio`` is the
fraction of the decomposed experts' parameters removed, per projection type. With ``c = (1 − ratio)·
out·in / (out + in)`` and ``M`` decomposed experts, ``ranks: balanced`` (default) spends the total
rank ``R = ⌊c·M⌋``: every expert gets ``⌊c⌋`` and the ``R mod M`` experts whose next whitened singular
value is largest get one more (ranks differ by at most 1; this greedy choice minimises the summed
whitened error). The stored factors are packed, so the achieved fraction is within
``(out + in)/(out·in·M)`` of ``ratio``. ``ranks: uniform`` gives every expert ``⌊c⌋`` (the textbook
baseline; on small matrices it removes noticeably more than ``ratio``, e.g. 0.4375 for 0.4 on
``[32, 64]``). A ratio that leaves rank 0 fails in the dry run.

**By chunks of experts** (``expert_chunk: N`` or ``auto``, a layer larger than memory): the whiteners are
pooled over the layer and passed whole to every chunk, so each expert's factors depend on that expert
alone. With ``ranks: uniform`` the output is byte-identical to the whole layer's. With ``ranks:
balanced`` a chunk whose ``M_k`` decomposed experts follow ``B`` decomposed experts of the layer spends
``⌊c·(B + M_k)⌋ − ⌊c·B⌋`` (:func:`~moecompress.methods.svd.rank_share`; the prelude tells it ``B``) by
the same greedy choice inside the chunk: the chunks' totals add up to the whole layer's ``⌊c·M⌋``, so
the layer removes the same fraction, and an expert's rank may differ by one from the whole-layer
allocation (which of the experts gets the extra ranks is chosen within each chunk). Every layer with a
routed expert is written in the ``lowrank`` layout, also one whose experts are all protected (all stored
dense in it), so that chunks join.

**Under ``torchrun``** a layer not chunked by request is shared out by units of experts with the whole
layer's bytes, ``ranks: balanced`` included, in two phases (``Chunking.phased``): the ranks factorise the
layer's fixed blocks (:mod:`~moecompress.engine.block_sweep`, block ``k`` on rank ``k mod N``), each keeping
its experts' factors at :func:`~moecompress.methods.svd.kept_rank` and sending every expert's next whitened
singular value; every rank then makes the whole layer's greedy choice (:func:`fit_ranks`) and each unit
cuts its experts' factors to their ranks, factorising only the experts another rank gathered (the same
function on the same expert: the same bits). The whitened error is averaged with ``math.fsum`` over the
experts' own errors, so the report is the whole layer's too.

Protected (super) experts keep all three projections dense and bit-identical; shared experts, routers
and biases are untouched. Input must be dense: decompose before neuron pruning, or prune with
``layout: uniform``.

Statistics: ``input_cov`` (gate/up input), ``down_in_cov_pooled`` (down input) for input whitening;
``down_in_grad_cov_pooled`` (gate/up output, TD-MoE's approximation), ``out_grad_cov`` (down output)
for output whitening (streamed backward); none for ``whitening: none``.

Example steps::

    steps:
      - svd_experts: {ratio: 0.4}                       # input (SVD-LLM) whitening
      - svd_experts: {ratio: 0.5, whitening: both}      # needs the backward sweep
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Literal

import torch
from pydantic import Field

from moecompress.engine.spec import Chunking, LayerStats, PassConfig, PassSpec, shifted_ids
from moecompress.errors import PassError
from moecompress.ir import ExpertBank, MoELayer
from moecompress.layouts.dense import Dense
from moecompress.layouts.lowrank import LowRank
from moecompress.layouts.ragged import Ragged
from moecompress.methods.svd import (
    cut,
    factor_experts,
    factorize,
    factorize_workspace,
    greedy_ranks,
    kept_rank,
    rank_share,
    rank_split,
)
from moecompress.methods.whitening import ALL_NEEDS, projection_whiteners, whitener_bytes, whitening_needs
from moecompress.passes.merge_units import Summaries, add_summaries, take_summaries

PROJ = ("gate", "up", "down")


class SvdExpertsConfig(PassConfig):
    ratio: float = Field(
        0.4, gt=0, lt=1, description="fraction of the decomposed experts' parameters removed"
    )
    whitening: Literal["input", "output", "both", "none"] = Field(
        "input", description="which side is whitened before the SVD (input: SVD-LLM)"
    )
    input_form: Literal["chol", "inverse"] = Field("chol", description="input whitener: Cholesky or Σ^-1/2")
    ranks: Literal["balanced", "uniform"] = Field(
        "balanced", description="ranks differing by at most 1 to meet the ratio, or one rank for all"
    )


def check_decomposable(layer: MoELayer, cfg: SvdExpertsConfig) -> None:
    """Dry-run checks on shapes (``meta`` tensors allowed)."""
    bank = layer.experts
    pruned = bank.widths is not None and (
        bank.widths.device.type == "meta" or bool((bank.widths < bank.width).any())
    )
    for name in PROJ:
        lay = getattr(bank, name)
        if isinstance(lay, Ragged) or pruned:
            raise PassError(
                "the experts are neuron-pruned with per-expert widths (layout 'ragged', also the result of "
                "layout: uniform in a layer with protected experts); run svd_experts before the pruning step, "
                "or prune with layout: uniform"
            )
        if not isinstance(lay, Dense):
            raise PassError(
                f"svd_experts needs dense experts, got layout {lay.kind!r} ({name}); decompose once, "
                "from dense weights"
            )
        _, out, inn = lay.shape
        if rank_split(out, inn, 1, cfg.ratio, cfg.ranks)[0] < 1:
            best = 1 - (out + inn) / (out * inn)
            raise PassError(
                f"ratio={cfg.ratio} leaves rank 0 for the {name} projection [{out}, {inn}] (rank 1 already "
                f"costs {out + inn} of {out * inn} parameters); use ratio <= {math.floor(best * 1e4) / 1e4}"
            )


def _emits(layer: MoELayer, cfg: SvdExpertsConfig) -> MoELayer:
    """Shapes only: every projection in the :class:`LowRank` layout at the balanced (or uniform) ranks,
    protected experts dense."""
    bank = layer.experts
    todo = bank.num_experts - len({layer.physical(e) for e in layer.protected})
    lays = []
    for name in PROJ:
        lay = getattr(bank, name)
        e, out, inn = lay.shape
        base, extra = rank_split(out, inn, todo, cfg.ratio, cfg.ranks)
        total = min(base, out, inn) * todo + (extra if base < min(out, inn) else 0)
        lays.append(LowRank.meta_like(e, out, inn, factorised=todo, total_rank=total, dtype=lay.dtype))
    return layer.replace(experts=ExpertBank(*lays, widths=bank.widths, biases=bank.biases, act=bank.act,
                                            alpha=bank.alpha, limit=bank.limit))  # fmt: skip


def _workspace(layer: MoELayer, cfg: SvdExpertsConfig) -> int:
    """Bytes beyond the input and output (the dry run's estimate), the larger of two phases:

    - making the pooled whiteners (:func:`~moecompress.methods.whitening.whitener_bytes`'s peak);
    - factorising the largest projection while the whiteners are held: its decomposed experts copied
      (``w[todo]``), and the larger of :func:`~moecompress.methods.svd.factorize`'s float64 workspace (one
      expert at a time) and a second copy of the projection's kept factors (they are cut to their ranks
      at the end, beside the factors at the largest rank, which the output already counts).

    Measured at 16 experts, H 1024, I 512 (bf16, ratio 0.4): the pass grows by 76.1 MB against 78.5 MB
    declared with its output (``test_step_memory``)."""
    bank = layer.experts
    todo = bank.num_experts - len({layer.physical(e) for e in layer.protected})
    if todo <= 0:
        return 0
    shapes = {n: getattr(bank, n).shape[1:] for n in PROJ}
    held, build = whitener_bytes(cfg.whitening, shapes)
    factorising = 0
    for name, (out, inn) in shapes.items():
        item = getattr(bank, name).dtype.itemsize
        base, extra = rank_split(out, inn, todo, cfg.ratio, cfg.ranks)
        keep = min(base + (1 if extra else 0), out, inn)
        kept = keep * (out + inn) * todo * item
        copy = todo * out * inn * item
        factorising = max(factorising, copy + max(factorize_workspace(out, inn, todo), kept))
    return max(build, held + factorising)


@dataclasses.dataclass(frozen=True)
class Prelude:
    """What a layer held by chunks of experts computes once for every chunk (:func:`prelude`, or
    :func:`fit_ranks` after the first sweep): the pooled whiteners, which physical experts are protected,
    (:meth:`chunk`) the chunk's first expert; after a first sweep, every expert's rank per projection
    (``None``: protected) and the factors this rank made then, by ``(projection, expert)``, each taken out
    by the unit that uses it (:meth:`factors`)."""

    whiteners: dict
    protected: frozenset[int]
    first: int = 0
    ranks: dict[str, list[int | None]] | None = None
    held: dict = field(default_factory=dict)

    def chunk(self, a: int, b: int) -> Prelude:
        return dataclasses.replace(self, first=a)

    def factors(self, name: str, e: int, w: torch.Tensor, keep: int) -> tuple:
        """Expert ``e``'s factors of projection ``name`` at rank ``keep`` (``w``: the expert's weight): those
        made in the first sweep (taken out of :attr:`held`), else made now, by the same function."""
        got = self.held.pop((name, e), None)
        return got if got is not None else factor_experts(w[None], self.whiteners[name].to(w.device), keep)[0]

    def before(self) -> int:
        """Decomposed (not protected) experts of the layer before the chunk."""
        return self.first - sum(1 for e in self.protected if e < self.first)


def _whiteners(stats: LayerStats, cfg: SvdExpertsConfig) -> dict:
    """The layer's pooled whiteners: made once per layer by :func:`prelude` for a layer held by chunks of
    experts, else here (the same function)."""
    if isinstance(stats.prelude, Prelude):
        return stats.prelude.whiteners
    return projection_whiteners(stats, cfg.whitening, cfg.input_form)


def prelude(shell: MoELayer, stats: LayerStats, cfg: SvdExpertsConfig) -> Prelude | None:
    """For a layer held by chunks of experts: the pooled whiteners, once per layer (their Cholesky factors
    of ``hidden × hidden`` covariances cost more than a chunk's SVDs), and the protected experts (each
    chunk's share of the layer's balanced total rank); ``None`` when every expert is protected (the
    chunks then make none)."""
    protected = frozenset(shell.physical(e) for e in shell.protected)
    if shell.experts.num_experts <= len(protected):
        return None
    return Prelude(projection_whiteners(stats, cfg.whitening, cfg.input_form), protected)


@dataclasses.dataclass
class Spectra(Summaries):
    """The first sweep's accumulator on one rank (:func:`gather_spectra`): per expert of the step's input in
    expert order, whether it is decomposed (``todo``) and its next whitened singular value per projection
    (``next.gate`` ..., ``s[⌊c⌋]``; NaN where protected), as :class:`~.merge_units.Summaries` rows; the
    whiteners, made once; the factors this rank made, by ``(projection, expert)``."""

    whiteners: dict | None = None
    held: dict = field(default_factory=dict)


def gather_spectra(sub: MoELayer, stats: LayerStats, cfg: SvdExpertsConfig, acc: Spectra | None) -> Spectra:
    """``Chunking.gather``: every decomposed expert of the chunk factorised at
    :func:`~moecompress.methods.svd.kept_rank` (kept in ``acc.held``) and its next singular value recorded."""
    check_decomposable(sub, cfg)
    acc = acc if acc is not None else Spectra()
    if acc.whiteners is None:
        acc.whiteners = projection_whiteners(stats, cfg.whitening, cfg.input_form)
    bank = sub.experts
    protected = {sub.physical(e) for e in sub.protected}
    todo = [e for e in range(bank.num_experts) if e not in protected]
    acc.part.setdefault("todo", []).append(torch.tensor([e not in protected for e in range(bank.num_experts)]))
    for name in PROJ:
        lay = getattr(bank, name)
        _, out, inn = lay.shape
        base = rank_split(out, inn, 1, cfg.ratio)[0]
        w = lay.dense()
        nxt = torch.full((bank.num_experts,), float("nan"), dtype=torch.float64)
        made = factor_experts(w[todo], acc.whiteners[name].to(w.device), kept_rank(out, inn, base))
        for e, f in zip(todo, made):
            nxt[e] = f[2][min(base, len(f[2]) - 1)].cpu()
            acc.held[(name, stats.first + e)] = f
        acc.part.setdefault(f"next.{name}", []).append(nxt)
    return acc


def take_spectra(acc: Spectra | None) -> dict[str, torch.Tensor]:
    """``Chunking.take``: the block's rows (:func:`~.merge_units.take_summaries`); the factors stay."""
    return take_summaries(acc)


def add_spectra(acc: Spectra | None, part: dict[str, torch.Tensor]) -> Spectra:
    """``Chunking.add``: a block's rows after the blocks before it (concatenated)."""
    return add_summaries(acc if acc is not None else Spectra(), part)  # type: ignore[return-value]


def fit_ranks(acc: Spectra | None, shell: MoELayer, stats: LayerStats, cfg: SvdExpertsConfig) -> Prelude | None:
    """``Chunking.fit``: the whole layer's greedy choice of the extra ranks
    (:func:`~moecompress.methods.svd.greedy_ranks` on the decomposed experts' next singular values, in expert
    order), every rank the same; ``None`` when every expert is protected."""
    protected = frozenset(shell.physical(e) for e in shell.protected)
    if acc is None or shell.experts.num_experts <= len(protected):
        return None
    rows = acc.sums()
    ids = rows["todo"].nonzero().flatten()
    ranks: dict[str, list[int | None]] = {}
    for name in PROJ:
        _, out, inn = getattr(shell.experts, name).shape
        base, extra = rank_split(out, inn, len(ids), cfg.ratio, cfg.ranks)
        got = greedy_ranks(rows[f"next.{name}"][ids], base, extra, kept_rank(out, inn, base)).tolist()
        ranks[name] = [None] * shell.experts.num_experts
        for e, r in zip(ids.tolist(), got):
            ranks[name][e] = r
    whiteners = acc.whiteners if acc.whiteners is not None else projection_whiteners(stats, cfg.whitening,
                                                                                       cfg.input_form)  # fmt: skip
    return Prelude(whiteners, protected, ranks=ranks, held=acc.held)


def _ranks(out: int, inn: int, n: int, stats: LayerStats, cfg: SvdExpertsConfig) -> tuple[int, int]:
    """``(base, extra)`` for the ``n`` decomposed experts at hand: a whole layer's split, or a chunk's share
    of its layer's total (:func:`~moecompress.methods.svd.rank_share`)."""
    pre = stats.prelude
    if cfg.ranks == "balanced" and isinstance(pre, Prelude):
        return rank_share(out, inn, pre.before(), n, cfg.ratio)
    return rank_split(out, inn, n, cfg.ratio, cfg.ranks)


def svd_experts(layer: MoELayer, stats: LayerStats, cfg: SvdExpertsConfig) -> tuple[MoELayer, dict]:
    """Replace each routed expert's projections by a whitened truncated SVD (per-expert low rank)."""
    check_decomposable(layer, cfg)
    bank = layer.experts
    protected = sorted({layer.physical(e) for e in layer.protected})
    todo = [e for e in range(bank.num_experts) if e not in protected]
    info: dict = {"protected": protected, "ranks": {}, "whitened_rel_error": {}}
    # every expert protected (a whole layer, or a chunk of one): the lowrank layout, all dense, so that
    # the chunks of a layer held by chunks join
    pre = stats.prelude
    decided = isinstance(pre, Prelude) and pre.ranks is not None  # by the first sweep, on the whole layer
    whiteners = _whiteners(stats, cfg) if todo and not decided else {}
    lays, dec_before, dec_after = [], 0, 0
    for name in PROJ:
        lay = getattr(bank, name)
        _, out, inn = lay.shape
        w = lay.dense()
        if todo and decided:
            keep = kept_rank(out, inn, rank_split(out, inn, 1, cfg.ratio)[0])
            made = [pre.factors(name, pre.first + e, w[e], keep) for e in todo]
            pairs, err = cut(made, [pre.ranks[name][pre.first + e] for e in todo])  # type: ignore[index]
            del made
        elif todo:
            pairs, err = factorize(
                w[todo], whiteners[name].to(w.device), *_ranks(out, inn, len(todo), stats, cfg)
            )
        else:
            pairs, err = [], None
        new = LowRank.from_factors(dict(zip(todo, pairs)), {e: w[e] for e in protected}, w)
        lays.append(new)
        ranks = dict(zip(todo, (int(p[0].shape[1]) for p in pairs)))
        del pairs  # not alive beside the next projection's factorisation
        info["ranks"][name] = [ranks.get(e) for e in range(bank.num_experts)]
        errs = err.tolist() if err is not None else []
        info["whitened_rel_error"][name] = math.fsum(errs) / len(errs) if errs else 0.0
        info.setdefault(ERRS, {})[name] = errs  # each expert's, for merge_svd (taken out there)
        dec_before += len(todo) * out * inn
        dec_after += sum(ranks.values()) * (out + inn)
    new_bank = ExpertBank(*lays, widths=bank.widths, biases=bank.biases, act=bank.act, alpha=bank.alpha,
                          limit=bank.limit)  # fmt: skip
    info.update(params_before=bank.num_params(), params_after=new_bank.num_params(),
                decomposed_before=dec_before, decomposed_after=dec_after)  # fmt: skip
    if stats.prelude is None:  # a whole layer: its info is the report's
        info.pop(ERRS)
    return layer.replace(experts=new_bank), info


ERRS = "_expert_errors"
"""A chunk's info: each decomposed expert's whitened error per projection, which :func:`merge_svd` averages
as the whole layer does (``math.fsum``: the same float whatever the chunks) and leaves out of the report."""


def merge_svd(infos: list[dict], bnds: list[tuple[int, int]], cfg: SvdExpertsConfig) -> dict:
    """A layer's info from its chunks' (``bnds``: each chunk's ``(a, b)``): ranks concatenated, the
    protected ids in the layer's numbering, counts summed, the whitened errors averaged over the layer's
    decomposed experts (their own errors, :data:`ERRS`: the whole layer's float)."""
    out: dict = {"protected": shifted_ids(infos, bnds, "protected"), "ranks": {}, "whitened_rel_error": {}}
    for name in infos[0]["ranks"]:
        out["ranks"][name] = [r for i in infos for r in i["ranks"][name]]
        errs = [e for i in infos for e in i.get(ERRS, {}).get(name, [])]
        out["whitened_rel_error"][name] = math.fsum(errs) / len(errs) if errs else 0.0
    for key in ("params_before", "params_after", "decomposed_before", "decomposed_after"):
        out[key] = sum(i[key] for i in infos)
    return out


def summarize_svd(infos: dict[int, dict], cfg: SvdExpertsConfig) -> dict:
    """Step summary: achieved vs target fraction, the rank histogram, the whitened errors per layer."""
    layers = sorted(infos)
    before = sum(infos[i]["params_before"] for i in layers)
    after = sum(infos[i]["params_after"] for i in layers)
    dec_b = sum(infos[i]["decomposed_before"] for i in layers)
    dec_a = sum(infos[i]["decomposed_after"] for i in layers)
    hist: dict[str, dict[str, int]] = {}
    for i in layers:
        for name, rs in infos[i]["ranks"].items():
            for r in rs:
                if r is not None:
                    hist.setdefault(name, {})[str(r)] = hist.setdefault(name, {}).get(str(r), 0) + 1
    achieved = 1 - dec_a / dec_b if dec_b else 0.0
    warnings = []
    if dec_b and abs(achieved - cfg.ratio) > 0.01:
        warnings.append(
            f"the decomposed experts lost {achieved:.4f} of their parameters for ratio={cfg.ratio} "
            f"(ranks: {cfg.ranks} on small matrices); ranks: balanced meets the ratio"
        )
    return {
        "summary": {
            "ratio": cfg.ratio,
            "whitening": cfg.whitening,
            "routed_fraction_removed": 1 - after / before if before else 0.0,
            "decomposed_fraction_removed": achieved,
            "routed_params_before": before,
            "routed_params_after": after,
            "rank_histogram": hist,
            "whitened_rel_error": {str(i): infos[i]["whitened_rel_error"] for i in layers},
        },
        "warnings": warnings,
    }


SPEC = PassSpec(
    "svd_experts", SvdExpertsConfig, svd_experts, needs=ALL_NEEDS, emits=_emits, check=check_decomposable,
    needs_fn=lambda cfg: whitening_needs(cfg.whitening), summarize=lambda infos, cfg: summarize_svd(infos, cfg),
    on_device=True, workspace=_workspace, alters=frozenset({"weights"}),
    chunking=Chunking(
        "expert", merge=merge_svd, prelude=prelude, gather=gather_spectra, fit=fit_ranks, take=take_spectra,
        add=add_spectra, phased=lambda cfg, units: units and cfg.ranks == "balanced",
    ),  # pooled whiteners: per expert; balanced ranks on units from the whole layer's spectra
)  # fmt: skip
