"""Tucker decomposition of a stack of expert matrices (TD-MoE's maths): the rank choice for a parameter
budget and the decomposition of the whitened stack with tensorly (HOSVD or HOOI).

tensorly is optional (``pip install "moecompress[decompose]"``) and imported only by :func:`decompose`.
"""

from __future__ import annotations

import numpy as np
import torch

from moecompress.errors import MethodError
from moecompress.extras import require
from moecompress.methods.whitening import Whitener, gram_lower


def tucker_ranks(
    m: int, out: int, inp: int, ratio: float, r1: int | None = None
) -> tuple[int, int, int, int]:
    """``(r1, r2, r3, stored params)`` meeting ``ratio`` (see the module docstring)."""
    full = m * out * inp
    target = (1 - ratio) * full
    r1 = m if r1 is None or r1 >= m else r1
    fold = r1 == m
    best, close = None, None
    for r2 in range(1, out + 1):
        lead = out * r2 + (0 if fold else m * r1)
        per_r3 = (m if fold else r1) * r2 + inp
        r3 = max(1, min(inp, int((target - lead) // per_r3)))
        for r in {r3, min(inp, r3 + 1)}:
            p = lead + per_r3 * r
            err = abs(p - target) / full
            cand = (abs(r2 / out - r / inp), err, r2, r, p)
            if err <= 0.005 and (best is None or cand < best):
                best = cand
            if close is None or (err, cand[0]) < (close[1], close[0]):
                close = cand
    _, err, r2, r3, p = best or close  # type: ignore[misc]
    if err > 0.01:
        raise MethodError(
            f"ratio={ratio} cannot be met within 1% for {m} experts of {out}x{inp} (closest keeps {p / full:.3f}); "
            "choose another ratio"
        )
    return r1, r2, r3, p


TUCKER_WORKSPACE_COPIES = 5
"""float64 copies of the stack that tensorly's HOSVD allocates beyond its input: per mode the unfolding,
LAPACK's copy of it, its right singular vectors and work arrays, and the sign-flipped factors (peak growth
of resident memory over ``tucker`` at ``M × out × in`` = 32→64 × 384 × 1024 and 32→64 × 1024 × 384,
differential: 4.98 and 4.80)."""


def decompose_workspace(m: int, out: int, inp: int, itemsize: int) -> int:
    """Peak bytes of one projection's :func:`decompose` and its error check beyond the layer and the kept
    factors (``tdmoe._factorise``): the stack of ``m`` experts copied in the weights' dtype (``itemsize``
    bytes), whitened in float64, and the HOSVD's :data:`TUCKER_WORKSPACE_COPIES`; afterwards the error
    check holds four float64 stacks (the reconstruction, the whitened target and reconstruction, their
    difference), fewer."""
    stack = m * out * inp
    return stack * itemsize + stack * 8 * max(1 + TUCKER_WORKSPACE_COPIES, 4)


def decompose(w: torch.Tensor, wh: Whitener, r1: int, r2: int, r3: int, method: str):
    """Tucker factors of the whitened stack ``w`` ``[M, out, in]``: ``(G, [U_e, U_out, U_in])`` in
    float64, whitened (un-whiten with ``wh``)."""
    require("decompose", "tdmoe (Tucker decomposition with tensorly)")
    import tensorly as tl
    from tensorly.decomposition import tucker

    t = wh.whiten(w).numpy()
    with tl.backend_context("numpy"):
        core, factors = tucker(t, rank=[r1, r2, r3], init="svd", n_iter_max=50 if method == "hooi" else 0)
    return torch.from_numpy(np.ascontiguousarray(core)), [
        torch.from_numpy(np.ascontiguousarray(f)) for f in factors
    ]


def gram_factor(gram: torch.Tensor, r: int) -> torch.Tensor:
    """The leading ``r`` eigenvectors ``[d, r]`` (largest eigenvalue first) of a mode Gram matrix
    ``Σ_e X_e X_eᵀ`` ``[d, d]`` (only its lower triangle is read; computed in its dtype): the HOSVD factor
    of that mode, the left singular vectors of the mode unfolding, which tensorly's :func:`decompose`
    takes; signed as tensorly signs them (``svd_flip``: each column's entry of largest magnitude positive,
    the first such entry on ties), so that both give the same factor up to rounding where the eigenvalues
    at the cut are apart (the reconstruction depends only on the subspace)."""
    _, q = torch.linalg.eigh(gram)
    u = q[:, -r:].flip(-1) if r > 0 else q[:, :0]
    top = u.abs().argmax(0)
    sign = torch.sign(u[top, torch.arange(u.shape[1])])
    return u * torch.where(sign == 0, torch.ones_like(sign), sign)


# -- by chunks of experts (``tdmoe``'s gather / fit / project) ----------------------------------------------
def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the chunked decomposition's products, Grams and eigendecompositions for weights stored
    in ``dtype``: float32 for weights of 16 bits or fewer (bf16, fp16, fp8: float32's rounding, 6e-8, is
    five decades below bf16's, 3.9e-3, and its products and ``eigh`` take half the time or less), float64
    otherwise (float32 weights: the whole layer's float64 to rounding). The whitening transforms are made
    in float64 either way, and the stored factors are un-whitened in float64."""
    return torch.float32 if dtype.itemsize <= 2 else torch.float64


def add_grams(x: torch.Tensor, g_out: torch.Tensor, g_in: torch.Tensor) -> float:
    """One whitened expert ``x`` ``[out, in]`` added to the lower triangles of the mode Grams ``g_out +=
    x xᵀ``, ``g_in += xᵀ x`` (:func:`~moecompress.methods.whitening.gram_lower`, in the Grams' dtype);
    returns ``‖x‖²`` (summed in float64)."""
    gram_lower(x, g_out)
    gram_lower(x.T, g_in)
    return float(torch.linalg.vector_norm(x, dtype=torch.float64) ** 2)


def gram_factors(g_out: torch.Tensor, g_in: torch.Tensor, r2: int, r3: int, wh: Whitener, dtype: torch.dtype):
    """From the lower triangles of the summed mode Grams, the whitened HOSVD factors ``U_out``, ``U_in``
    (:func:`gram_factor`, in the Grams' dtype) as ``(outer, inner)``: ``outer = (A⁻¹U_out, B⁻ᵀU_in)`` in
    ``dtype`` (the stored factors, un-whitened in float64) and ``inner = (AᵀU_out, B U_in)`` in the Grams'
    dtype, with which an expert's core is ``U_outᵀ (A W B) U_in = innerₒᵀ W innerᵢ`` (:func:`sandwich`)
    without whitening it."""
    u_w = gram_factor(g_out, r2)
    v_w = gram_factor(g_in, r3)
    outer = (wh.unwhiten_out(u_w).to(dtype), wh.unwhiten_in(v_w).to(dtype))
    return outer, (wh.transpose_out(u_w).to(g_out.dtype), wh.right_mul(v_w).to(g_in.dtype))


def sandwich(p: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``pᵀ w q`` (in the dtype of ``p`` and ``q``) in the cheaper order of the two products."""
    (out, inp), r2, r3 = w.shape, p.shape[1], q.shape[1]
    w = w.to(p.dtype)
    if r2 * inp * (out + r3) <= out * r3 * (inp + r2):
        return (p.T @ w) @ q
    return p.T @ (w @ q)
