"""GPTQ (Frantar, Ashkboos, Hoefler, Alistarh 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", arXiv 2210.17323): one linear layer ``W`` ``[out, in]`` quantised
column by column, each column's rounding error spread over the columns not yet quantised, so that the
layer-output error ``‖(W − Ŵ) X‖²`` on the calibration inputs ``X`` (``H = X Xᵀ / n``) is small::

    H ← H + λ·mean(diag H)·I                       (λ = damp, the paper's percdamp)
    U = chol(H⁻¹)ᵀ (upper)                         (Cholesky of the inverse Hessian)
    for column j (in order; act_order: by decreasing H_jj):
        ŵ_j = Q(w_j),  e_j = (w_j − ŵ_j) / U_jj,   w_k ← w_k − e_j U_jk   for every k > j

with the lazy batch updates of the paper: inside a ``block`` of columns the update touches only the
block; the rest of ``W`` receives ``E_block U_block,rest`` in one matrix product when the block ends.

``Q`` is the grid of :mod:`moecompress.methods.scalar_quant` (the ``rtn`` layout): per output row and
group of ``group_size`` *consecutive* input channels a float16 scale and a uint8 zero point
(asymmetric: range widened to hold 0; symmetric: ``z = 2^(b−1)``). Without ``act_order`` a group's
scale and zero point are computed when the group starts, from the columns as updated so far (the
paper). The block is rounded down to a multiple of the group size so a group never straddles two
blocks (the reference code reads a stale copy of a group that starts mid-block; we do not). With
``act_order`` columns are processed by decreasing ``H_jj`` and the permutation is undone afterwards;
since the layout's groups are consecutive original channels, the groups' scales are then computed
from the original ``W`` before any column is quantised ("static groups", GPTQModel's
``static_groups``, llm-compressor's ``actorder: weight``). ``static_groups=True`` without
``act_order`` does the same in natural order (what llm-compressor does for every group strategy).

Input channels that saw no calibration input (``H_jj = 0``) get ``H_jj = 1`` and are rounded like
any other (the paper zeroes them; a channel the calibration missed may still carry input later). A
zero ``H`` therefore gives exactly round-to-nearest, as does any diagonal ``H`` (no coupling between
columns): that is the oracle. Arithmetic: ``H⁻¹`` and its Cholesky factor in float64, rounded to
float32, the column loop in float32. The paper's code and llm-compressor factorise in float32 (5.7 CPU s
at DeepSeek-V3's 7168 channels against 9.5 s for their three factorisations in float64), but float32 LAPACK results change with the
thread count, and so would the codes: a layer sharded over ``torchrun`` ranks (one thread each) would not
write one process's bytes. Rounded from float64 they agree (``tests/test_distributed.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moecompress.errors import MethodError
from moecompress.layouts.bitpack import BITS
from moecompress.methods.scalar_quant import _FP16_MAX, group_width
from moecompress.methods.whitening import tri_matmul


def _group_params(
    w: torch.Tensor, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float16 scale, its float32 divisor (``s`` or 1 where ``s = 0``) and the float32 zero point of
    the rows of ``w`` ``[out, g]`` (one group): the formulas of :func:`scalar_quant.quantize`."""
    qmax = (1 << bits) - 1
    if symmetric:
        raw = w.abs().amax(-1) / ((1 << (bits - 1)) - 1)
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        raw = (hi - lo) / qmax
    if raw.numel() and (not bool(torch.isfinite(raw).all()) or float(raw.max()) > _FP16_MAX):
        raise MethodError(
            "GPTQ: weights are too large (or not finite) for float16 group scales; check the checkpoint for "
            "inf/NaN or raise damp if the Hessian is ill-conditioned"
        )
    scales = raw.to(torch.float16)
    s = scales.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    if symmetric:
        z = torch.full_like(s, float(1 << (bits - 1)))
    else:
        z = torch.clamp(torch.round(-lo / safe), 0, qmax)
    return scales, safe, z


LEAF = 512
"""Order below which :func:`lower_inverse_` hands the block to LAPACK's triangular solve."""


def lower_inverse_(c: torch.Tensor, leaf: int = LEAF) -> torch.Tensor:
    """``C⁻¹`` of a lower-triangular ``C`` written over it (a column-major view: LAPACK's layout, so the
    blocks need no copy), by halves, ``[[A, 0], [B, D]]⁻¹ = [[A⁻¹, 0], [−(D⁻¹B)A⁻¹, D⁻¹]]``: ``n³/6``
    multiply-adds, LAPACK ``trtri``'s count (torch exposes no ``trtri``; a triangular solve against the
    identity costs ``n³/2``). Fresh memory: two ``(n/2)²`` products at the top level, less below."""
    n = c.shape[0]
    if n <= leaf:
        c.copy_(torch.linalg.solve_triangular(c, torch.eye(n, dtype=c.dtype, device=c.device), upper=False))
        return c
    m = n // 2
    a, b, d = c[:m, :m], c[m:, :m], c[m:, m:]
    lower_inverse_(a, leaf)
    b.copy_(torch.linalg.solve_triangular(d, b, upper=False) @ a).neg_()
    lower_inverse_(d, leaf)
    return c


@dataclass(frozen=True)
class Root:
    """What the factorisation leaves for :func:`output_errors`: the Cholesky factor ``C`` (lower, float32)
    of ``J (H_p + diag(shift)) J`` (``J`` the order reversal, ``H_p`` the Hessian in the factor's column
    order ``perm``, ``shift`` the diagonal the damping and the dead channels added, float64), so that
    ``tr(D H Dᵀ) = ‖(D_p J) C‖² − Σ_j shift_j ‖D_p[:, j]‖²`` with ``D_p = D[:, perm]``: a product with a
    triangular factor, about half a full one's work."""

    c: torch.Tensor
    shift: torch.Tensor
    perm: torch.Tensor | None = None

    def trace(self, d: torch.Tensor) -> float:
        """``tr(D H Dᵀ)`` for ``d`` ``[rows, in]`` (float32 products, float64 sums)."""
        dp = d if self.perm is None else d[:, self.perm]
        z = tri_matmul(self.c, dp.flip(1), "lower", left=False)
        return float(z.square().sum(dtype=torch.float64)) - float((dp.double().square() * self.shift).sum())


def inverse_hessian_factor(
    h: torch.Tensor, damp: float, dtype: torch.dtype = torch.float32, root: bool = False
) -> torch.Tensor | tuple[torch.Tensor, Root]:
    """``U = chol((H + damp·mean(diag H)·I)⁻¹)ᵀ`` (upper triangular, row-major, in ``dtype``; computed in
    float64), dead channels (``H_jj = 0``) given ``H_jj = 1``; raises :class:`MethodError` when ``H`` is not
    positive definite.

    Without forming ``H⁻¹``: with ``J`` the order reversal and ``J H J = C Cᵀ`` (Cholesky), ``R = J C J`` is
    upper triangular with ``H = R Rᵀ``, so ``H⁻¹ = R⁻ᵀ R⁻¹`` and ``U = R⁻¹ = J C⁻¹ J`` (upper, positive
    diagonal: the Cholesky factor). One Cholesky and one triangular inverse, ``n³/3`` multiply-adds against
    the ``2n³/3`` of Cholesky, inverse, Cholesky (6.2 against 9.5 CPU s at 7168 channels), both in float64
    and in place in one column-major buffer (``J H J`` is symmetric: the row-major copy is its column-major
    self), so that a 7168-channel factor touches 1.2 GB of fresh memory, not 2.9 GB (the kernel's page
    faults were 1.3–1.9 s of system time per factor). ``root``: also the :class:`Root` for
    :func:`output_errors` (a float32 copy of ``C``)."""
    n = h.shape[0]
    c = torch.empty(n, n, dtype=torch.float64, device=h.device)
    c.copy_(h.flip(0, 1))
    c = c.mT  # the same values (symmetric), column-major
    diag = torch.diagonal(c)
    before = diag.clone() if root else None
    dead = diag <= 0
    if bool(dead.any()):
        c[dead, :] = 0
        c[:, dead] = 0
        diag[dead] = 1
    diag += damp * float(diag.mean())
    shift = None if before is None else (diag - before).flip(0)  # the diagonal added, in the factor's order
    info = torch.zeros((), dtype=torch.int32, device=h.device)
    torch.linalg.cholesky_ex(c, out=(c, info))
    if int(info) != 0:
        raise MethodError(
            f"GPTQ: the Hessian (input covariance, {n} channels) is not positive definite after "
            f"damp={damp}; raise damp (e.g. 0.1) or calibrate on more tokens"
        )
    kept = None if shift is None else Root(c.float(), shift)
    lower_inverse_(c)
    u = torch.empty(n, n, dtype=dtype, device=h.device)
    u.copy_(c)  # C⁻¹ (lower), row-major
    u = u.flip(0, 1)  # J C⁻¹ J
    return u if kept is None else (u, kept)


def hessian_factor(h: torch.Tensor, damp: float, act_order: bool, root: bool = False) -> tuple:
    """``(perm, U)`` of :func:`gptq_quantize` for Hessian ``h``: the column order (``act_order``: by
    decreasing ``H_jj``; else ``None``) and the float32 copy of :func:`inverse_hessian_factor` of ``h`` in
    that order; with ``root``, ``(perm, U, Root)`` (:func:`output_errors` reads the :class:`Root`).
    Projections that read the same input (gate and up) share it: at DeepSeek-V3 shapes (7168 channels) it
    is 5 CPU s of float64 Cholesky work."""
    perm = torch.argsort(torch.diagonal(h).double(), descending=True, stable=True) if act_order else None
    hp = h if perm is None else h[perm][:, perm]
    if not root:
        return perm, inverse_hessian_factor(hp, damp)
    u, kept = inverse_hessian_factor(hp, damp, root=True)  # type: ignore[misc]
    return perm, u, replace(kept, perm=perm)


def gptq_quantize(
    w: torch.Tensor,
    h: torch.Tensor,
    bits: int,
    group_size: int = -1,
    symmetric: bool = False,
    act_order: bool = False,
    damp: float = 0.01,
    block: int = 128,
    static_groups: bool | None = None,
    factor: tuple[torch.Tensor | None, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ of ``w`` ``[out, in]`` with Hessian ``h`` ``[in, in]`` (``E[x xᵀ]``; any positive multiple
    gives the same result): uint8 codes ``[out, in]`` (unpacked, original column order), float16 scales
    ``[out, G]`` and uint8 zero points ``[out, G]`` (``None`` if ``symmetric``), exactly the
    representation of :func:`moecompress.methods.scalar_quant.quantize` (decode with its ``dequantize``).
    ``static_groups`` (default: ``act_order``) computes every group's scale from the original ``w``.
    ``factor``: :func:`hessian_factor` of ``h`` with the same ``damp`` and ``act_order``, when already
    computed (the same bits as computing it here)."""
    if bits not in BITS:
        raise MethodError(f"GPTQ: bits={bits} is not supported; use one of {BITS}")
    if w.dim() != 2 or h.shape != (w.shape[1], w.shape[1]):
        raise MethodError(
            f"GPTQ needs W [out, in] and H [in, in]; got W {tuple(w.shape)} and H {tuple(h.shape)}"
        )
    if not 0 <= damp < 10 or block < 1:
        raise MethodError(f"GPTQ: damp={damp} must be in [0, 10) and block={block} at least 1")
    if not bool(torch.isfinite(h.sum(dtype=torch.float64))):  # inf/NaN propagate; float64 cannot overflow here
        raise MethodError("GPTQ: the Hessian holds inf/NaN; the calibration inputs are not finite")
    static = act_order if static_groups is None else static_groups
    if act_order and not static:
        raise MethodError(
            "GPTQ: act_order needs static groups (scales from the original weights): the rtn layout's groups "
            "are consecutive input channels"
        )
    out, inn = w.shape
    gs = group_width(inn, group_size)
    qmax = (1 << bits) - 1
    wf = w.detach().float()  # read only: the column loop works on its transposed copy
    n_groups = inn // gs
    scales = torch.zeros(out, n_groups, dtype=torch.float16, device=w.device)
    zeros = torch.zeros(out, n_groups, dtype=torch.float32, device=w.device)
    safes = torch.ones(out, n_groups, dtype=torch.float32, device=w.device)
    if static:
        for g in range(n_groups):
            scales[:, g], safes[:, g], zeros[:, g] = _group_params(
                wf[:, g * gs : (g + 1) * gs], bits, symmetric
            )
    perm, u = (factor if factor is not None else hessian_factor(h, damp, act_order))[:2]
    if perm is not None:
        wf = wf[:, perm]
    group_of = (perm if perm is not None else torch.arange(inn, device=w.device)) // gs
    blk = max(block // gs, 1) * gs if not static and gs < inn else block  # groups inside one block
    wt = wf.T.clone(memory_format=torch.contiguous_format)  # [in, out], a copy: column j of W is row wt[j]
    codes = torch.zeros(inn, out, dtype=torch.uint8, device=w.device)  # q holds whole numbers 0..qmax
    scale_t, safe_t, zero_t = scales.float().T.contiguous(), safes.T.contiguous(), zeros.T.contiguous()
    groups = group_of.tolist()
    dinv = (1.0 / torch.diagonal(u)).tolist()
    for i1 in range(0, inn, blk):
        i2 = min(i1 + blk, inn)
        w1 = wt[i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = groups[col]
            if not static and col % gs == 0:  # the group as updated so far (it may run past the block)
                cur = torch.cat([w1[i : i + gs], wt[i2 : col + gs]]).T
                sc, sf, zz = _group_params(cur, bits, symmetric)
                scales[:, g] = sc
                scale_t[g], safe_t[g], zero_t[g] = sc.float(), sf, zz
            wc, z = w1[i], zero_t[g]
            q = torch.clamp(torch.round(wc / safe_t[g]) + z, 0, qmax)
            codes[col] = q
            e = (wc - (q - z) * scale_t[g]) * dinv[col]
            w1[i + 1 :].addr_(u1[i, i + 1 :], e, alpha=-1)
            err1[i] = e
        wt[i2:].addmm_(u[i1:i2, i2:].T, err1, alpha=-1)
    codes = codes.T
    zeros = zero_t.T.contiguous()
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return codes.contiguous(), scales, None if symmetric else zeros.to(torch.uint8)


ERROR_ROWS = 512
"""Output rows :func:`output_errors` reads at most (evenly spaced): its products cost ``rows·in²`` each."""


def error_rows(out: int, rows: int | None = ERROR_ROWS) -> torch.Tensor | None:
    """The output rows :func:`output_errors` reads of ``out``: every ``⌈out / rows⌉``-th from row 0, or
    ``None`` (all of them) when ``out ≤ rows`` or ``rows`` is ``None``."""
    if rows is None or out <= rows:
        return None
    return torch.arange(0, out, -(-out // rows))


def output_errors(
    w: torch.Tensor, w_hats: list[torch.Tensor], h: torch.Tensor, rows: int | None = ERROR_ROWS,
    root: Root | None = None,
) -> list[float]:  # fmt: skip
    """``tr((W − Ŵ) H (W − Ŵ)ᵀ) / tr(W H Wᵀ)`` for every ``Ŵ`` of ``w_hats``: the relative layer-output
    error ``‖(W − Ŵ)X‖² / ‖WX‖²`` for inputs with second moment ``H`` (0 when ``W H Wᵀ`` vanishes),
    estimated on the output rows of :func:`error_rows` (exact when ``W`` has at most ``rows`` rows; the
    sum over every row cost 10.8 CPU s per DeepSeek-V3 expert, the estimate 512/2048 and 512/7168 of it).
    The products are float32 (a report figure: relative error ~1e-6), the traces summed in float64; the
    denominator is shared. With the factorisation's ``root`` (:class:`Root` of ``h``) each trace is a
    product with its triangular factor (:meth:`Root.trace`: 1.0 → 0.6 CPU s per 2048 × 7168 projection),
    equal to the direct one to float32 rounding."""
    idx = error_rows(w.shape[0], rows)
    pick = (lambda t: t) if idx is None else (lambda t: t[idx])
    wf = pick(w).float()
    if root is not None:
        trace = root.trace
    else:
        hf = h.float()

        def trace(d: torch.Tensor) -> float:
            return float(((d @ hf) * d).sum(dtype=torch.float64))

    den = trace(wf)
    return [trace(wf - pick(w_hat).float()) / den if den > 0 else 0.0 for w_hat in w_hats]


def output_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor, rows: int | None = ERROR_ROWS) -> float:
    """:func:`output_errors` of one ``Ŵ``."""
    return output_errors(w, [w_hat], h, rows)[0]
