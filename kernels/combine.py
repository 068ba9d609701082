"""K5 ``moe_combine``: deterministic top-k (and split-K) gather-sum.

``out[t, :] = Σ_{s < S} Σ_{j < k} ok[t, j] · c[t, j] · y[s, t·k + j, :]`` in fp32, where ``y [S, T·k, N]``
holds per-slot (optionally per split-K part) results in slot order, ``c`` the optional router weights
(``None`` when the producing epilogue already multiplied them in) and ``ok`` masks dropped slots (an id
outside ``[0, n_logical)`` or mapped to ``−1`` by ``expert_map``), whose rows of ``y`` are never read —
they may hold anything. A fixed summation order and no atomics make the result bit-reproducible
(SonicMoE's combine is a gather-sum of this kind, arXiv 2512.14080). Reads ``S·T·k·N``, writes ``T·N``:
at copy bandwidth by design.
"""

from __future__ import annotations

import torch

from moecompress.kernels._launch import check_config


def combine_ref(
    y: torch.Tensor,
    top_k: int,
    weights: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    num_experts: int | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`moe_combine`: ``(y.view(S, T, k, N) · c · ok).sum((0, 2))``."""
    y = y.reshape(-1, *y.shape[-2:]) if y.dim() == 3 else y.unsqueeze(0)
    s, n_slots, n = y.shape
    t = n_slots // top_k
    v = y.float().view(s, t, top_k, n)
    if weights is not None:
        v = v * weights.float().view(1, t, top_k, 1)
    if ids is not None:
        from moecompress.kernels.moe_align import _physical

        ok = (_physical(ids, num_experts, expert_map) >= 0).view(1, t, top_k, 1)
        v = torch.where(ok, v, torch.zeros((), dtype=v.dtype, device=v.device))
    return v.sum((0, 2))


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["split_stride"])
    def moe_combine_kernel(
        y_ptr, w_ptr, ids_ptr, map_ptr, out_ptr,
        N, n_logical, num_experts, split_stride,
        TOP_K: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr,
        MUL_W: tl.constexpr, CHECK_IDS: tl.constexpr, HAS_MAP: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BN + tl.arange(0, BN)
        m = offs < N
        acc = tl.zeros([BN], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            slot = t * TOP_K + j
            ok = m
            if CHECK_IDS:
                e = tl.load(ids_ptr + slot)
                good = (e >= 0) & (e < n_logical)
                if HAS_MAP:
                    e = tl.load(map_ptr + tl.where(good, e, 0))
                good = good & (e >= 0) & (e < num_experts)
                ok = m & good
            part = tl.zeros([BN], dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                part += tl.load(y_ptr + s * split_stride + slot * N + offs, mask=ok, other=0.0).to(tl.float32)
            if MUL_W:
                part = part * tl.load(w_ptr + slot).to(tl.float32)
            acc += part
        tl.store(out_ptr + t * N + offs, acc, mask=m)

    return moe_combine_kernel


_KERNEL = None


def moe_combine(
    y: torch.Tensor,
    top_k: int,
    weights: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    num_experts: int | None = None,
    expert_map: torch.Tensor | None = None,
    block_n: int = 256,
) -> torch.Tensor:
    """``[T, N]`` fp32 weighted top-k sum of ``y`` ``[T·k, N]`` or ``[S, T·k, N]`` (see module docstring).
    ``ids [T, k]`` with ``num_experts`` (physical) and ``expert_map`` mask dropped slots."""
    global _KERNEL
    check_config("moe_combine", pow2={"block_n": block_n})
    if ids is not None and num_experts is None:
        raise ValueError("moe_combine: ids given without num_experts; pass the number of physical experts")
    y3 = y if y.dim() == 3 else y.unsqueeze(0)
    y3 = y3.contiguous()
    s, n_slots, n = y3.shape
    t = n_slots // top_k
    out = torch.empty(t, n, dtype=torch.float32, device=y.device)
    if t == 0 or n == 0:
        return out.zero_()
    if _KERNEL is None:
        _KERNEL = _kernel()
    flat_ids = y3 if ids is None else ids.reshape(-1).contiguous()
    emap = flat_ids if expert_map is None else expert_map.to(y.device, torch.int64).contiguous()
    w = y3 if weights is None else weights.reshape(-1).contiguous()
    n_logical = (num_experts or 0) if expert_map is None else expert_map.numel()
    _KERNEL[(t, -(-n // block_n))](
        y3, w, flat_ids, emap, out,
        n, n_logical, num_experts or 0, n_slots * n,
        TOP_K=top_k, SPLIT=s, BN=block_n,
        MUL_W=weights is not None, CHECK_IDS=ids is not None, HAS_MAP=expert_map is not None,
        num_warps=4,
    )
    return out
