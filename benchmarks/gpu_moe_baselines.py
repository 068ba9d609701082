"""Baselines of ``benchmarks/gpu_moe.py`` (KERNELS.md §7 step 6), all on the same router output.

- ``eager``: the HF-style loop over the experts that received tokens, in the weights' dtype (what users
  run; host syncs, so never graph-captured).
- ``grouped_mm``: sort slots by expert, gather rows, ``torch._grouped_mm`` twice with SwiGLU between,
  weighted ``index_add_`` back (PyTorch only, graph-capturable).
- ``vllm``: our re-implementation of vLLM's ``fused_moe`` *algorithm* from its description (KERNELS.md §2;
  no vLLM code): K1 alignment, an expert-blocked GEMM on ``w13 [E, 2I, H]`` into ``[T·k, 2I]``, a separate
  ``silu_and_mul`` kernel, the same GEMM on ``w2 [E, H, I]`` with the routed weight in the epilogue into
  ``[T, k, H]``, then the sum over ``k``; 1-D grid with ``GROUP_SIZE_M`` swizzling; vLLM's small-batch
  grid cut (``EM = min(len, T·k·BM)`` when ``T < BM``); configs from vLLM's tuned
  ``E=128,N=768,device_name=NVIDIA_H200.json`` values quoted in KERNELS.md (nearest batch key).
- ``dequant``: a compressed bank's layouts materialised to dense weights, then ``grouped_mm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# vLLM's tuned H200 entries for E=128, N=768 (KERNELS.md §2), by batch size; missing fields take vLLM's
# defaults (GROUP_SIZE_M 1 for small batches, num_stages 3).
VLLM_H200 = {
    1: dict(bm=16, bn=64, bk=64, group=1, warps=4, stages=5),
    16: dict(bm=16, bn=64, bk=256, group=1, warps=4, stages=2),
    64: dict(bm=16, bn=256, bk=128, group=1, warps=8, stages=3),
    1024: dict(bm=128, bn=256, bk=64, group=16, warps=8, stages=4),
}
VLLM_DRY = dict(bm=16, bn=32, bk=32, group=1, warps=4, stages=2)


def vllm_config(batch: int, dry: bool) -> dict:
    if dry:
        return VLLM_DRY
    key = min(VLLM_H200, key=lambda b: abs(b - batch))
    return VLLM_H200[key]


def eager_loop(x, gate, up, down, ids, w):
    """HF-style: per hit expert ``down(silu(gate x) * up x)`` in the weights' dtype, weighted sum."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    xd = x.to(gate.dtype)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < gate.shape[0]:
            continue
        tok, slot = torch.where(ids == e)
        h = F.silu(xd[tok] @ gate[e].T) * (xd[tok] @ up[e].T)
        out.index_add_(0, tok, (h @ down[e].T).float() * w[tok, slot, None])
    return out


def grouped_mm(x, w13t, w2t, ids, w):
    """Sort + ``torch._grouped_mm``; ``w13t [E, H, 2I]`` and ``w2t [E, I, H]`` (transposed views)."""
    t, k = ids.shape
    e = w13t.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
    xs = x.to(w13t.dtype)[tok]
    gu = torch._grouped_mm(xs, w13t, offs=offs)
    i = gu.shape[1] // 2
    h = F.silu(gu[:, :i]) * gu[:, i:]
    y = torch._grouped_mm(h, w2t, offs=offs).float() * w.reshape(-1)[order, None]
    return torch.zeros(t, w2t.shape[2], dtype=torch.float32, device=x.device).index_add_(0, tok, y)


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_valid"])
    def fused_moe_kernel(
        a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, eids_ptr, total_ptr,
        N, K, EM, num_valid, stride_am, stride_be, stride_bn, stride_bk, stride_cm,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        TOP_K: tl.constexpr, MUL_W: tl.constexpr, UPCAST: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(EM, BM)
        num_pid_n = tl.cdiv(N, BN)
        in_group = GROUP_M * num_pid_n
        first_m = (pid // in_group) * GROUP_M
        size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + ((pid % in_group) % size_m)
        pid_n = (pid % in_group) // size_m
        if pid_m * BM >= tl.load(total_ptr):
            return
        offs_tok = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        tmask = offs_tok < num_valid
        offs_n = pid_n * BN + tl.arange(0, BN)
        e = tl.load(eids_ptr + pid_m).to(tl.int64)
        c_ptrs = c_ptr + offs_tok[:, None] * stride_cm + offs_n[None, :]
        cmask = tmask[:, None] & (offs_n[None, :] < N)
        if e == -1:
            tl.store(c_ptrs, tl.zeros([BM, BN], dtype=c_ptr.dtype.element_ty), mask=cmask)
            return
        offs_bn = offs_n % N
        offs_k = tl.arange(0, BK)
        a_ptrs = a_ptr + (offs_tok[:, None] // TOP_K) * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + e * stride_be + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(a_ptrs, mask=tmask[:, None] & (offs_k[None, :] < K - k0), other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK * stride_bk
        if MUL_W:
            acc = acc * tl.load(w_ptr + offs_tok, mask=tmask, other=0.0)[:, None]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < inter
        g = tl.load(x_ptr + row * 2 * inter + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * inter + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)

    return fused_moe_kernel, silu_and_mul_kernel


_K = None


def vllm_moe(x, w13, w2, ids, w, cfg: dict, upcast: bool = False):
    """vLLM's ``fused_experts`` algorithm: ``w13 [E, 2I, H]``, ``w2 [E, H, I]``; returns fp32 ``[T, H]``."""
    global _K
    if _K is None:
        _K = _kernels()
    fused, silu_mul = _K
    from moecompress.kernels.moe_align import moe_align

    t, k = ids.shape
    e, n2, h = w13.shape
    i = n2 // 2
    bm = cfg["bm"]
    sorted_ids, eids, total = moe_align(ids, e, bm)
    em = sorted_ids.numel()
    if t < bm:
        em = min(em, t * k * bm)
    xd = x.to(w13.dtype).contiguous()
    c1 = torch.empty(t * k, n2, dtype=w13.dtype, device=x.device)

    def launch(a, b, c, n, kdim, stride_am, mul_w, top_k):
        grid = (-(-em // bm) * -(-n // cfg["bn"]),)
        fused[grid](
            a, b, c, w, sorted_ids, eids, total, n, kdim, em, t * k, stride_am, b.stride(0), b.stride(1),
            b.stride(2), c.stride(0), BM=bm, BN=cfg["bn"], BK=cfg["bk"], GROUP_M=cfg["group"], TOP_K=top_k,
            MUL_W=mul_w, UPCAST=upcast, num_warps=cfg["warps"], num_stages=cfg["stages"],
        )

    launch(xd, w13, c1, n2, h, h, False, k)
    act = torch.empty(t * k, i, dtype=w13.dtype, device=x.device)
    silu_mul[(t * k, -(-i // 1024))](c1, act, i, BLOCK=1024)
    c2 = torch.empty(t * k, h, dtype=w13.dtype, device=x.device)
    launch(act, w2, c2, h, i, i, True, 1)
    return c2.view(t, k, h).float().sum(1)
