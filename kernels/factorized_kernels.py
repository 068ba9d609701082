"""The Triton kernels of K4 ``moe_lowrank`` (:mod:`moecompress.kernels.factorized`): the ``shrink`` and ``expand``
launches and their ``@triton.jit`` helper (the rank-space accumulation of one projection).

Built on first use by :func:`_kernels` (Triton is imported lazily, inside it); the stages, configs and launches
are in :mod:`moecompress.kernels.factorized`.
"""

from __future__ import annotations

_KERNELS: dict[str, object] = {}


def _kernels() -> dict[str, object]:
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def shrink_kernel(
        a_ptr, c_ptr, sorted_ptr, eids_ptr, total_ptr, p_ptr, off_ptr, rank_ptr, ld_ptr, dim_ptr, acol_ptr, ccol_ptr,
        numel, a_div, n_exp, stride_a, stride_cs, stride_c, k_split,
        SPLIT: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
        BK: tl.constexpr,
    ):  # fmt: skip
        """``C[split, s, col_z + r] = Σ_{k in split} A[s // a_div, acol_z + k] · P_{z,e}[r, k]``."""
        pid_m = tl.program_id(0)
        pid_r = tl.program_id(1)
        z = tl.program_id(2) // SPLIT
        pid_k = tl.program_id(2) % SPLIT
        if pid_m * BM >= tl.load(total_ptr):
            return
        e = tl.load(eids_ptr + pid_m)
        r_e = tl.load(rank_ptr + z * n_exp + e)
        if pid_r * BR >= r_e:
            return
        kdim = tl.load(dim_ptr + z)
        ld = tl.load(ld_ptr + z)
        base = tl.load(off_ptr + z * n_exp + e)
        slot = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
        row_ok = slot < numel
        arow = (slot // a_div).to(tl.int64) * stride_a + tl.load(acol_ptr + z)
        offs_r = pid_r * BR + tl.arange(0, BR)
        r_ok = offs_r < r_e
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, kdim)
        acc = tl.zeros([BM, BR], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < k_hi
            a = tl.load(a_ptr + arow[:, None] + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            p = tl.load(p_ptr + base + offs_r[None, :].to(tl.int64) * ld + offs_k[:, None],
                        mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(a.to(CDT), p.to(CDT), acc, input_precision=PREC)
        cp = c_ptr + pid_k * stride_cs + slot[:, None].to(tl.int64) * stride_c + tl.load(ccol_ptr + z) + offs_r[None, :]
        tl.store(cp, acc, mask=row_ok[:, None] & r_ok[None, :])

    @triton.jit
    def _expand_acc(c_ptr, q_ptr, off_ptr, rank_ptr, ld_ptr, dim_ptr, col_ptr, z, e, n_exp, srow, row_ok, offs_n,
                    stride_cs, stride_c, SPLIT: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):  # fmt: skip
        """``Σ_r C[s, col_z + r] · Q_{z,e}[n, r]`` (C summed over the shrink's splits) ``[BM, BN]`` fp32."""
        r_e = tl.load(rank_ptr + z * n_exp + e)
        ld = tl.load(ld_ptr + z)
        base = tl.load(off_ptr + z * n_exp + e)
        n_ok = offs_n < tl.load(dim_ptr + z)
        crow = srow * stride_c + tl.load(col_ptr + z)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for r0 in range(0, r_e, BR):
            offs_r = r0 + tl.arange(0, BR)
            r_ok = offs_r < r_e
            c = tl.zeros([BM, BR], dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                c += tl.load(c_ptr + s * stride_cs + crow[:, None] + offs_r[None, :],
                             mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
            q = tl.load(q_ptr + base + offs_n[None, :].to(tl.int64) * ld + offs_r[:, None],
                        mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(c.to(CDT), q.to(CDT), acc, input_precision=PREC)
        return acc

    globals()["_expand_acc"] = _expand_acc  # jit callees resolve in the module's globals (triton is lazy here)

    @triton.jit
    def expand_kernel(
        c_ptr, o_ptr, sorted_ptr, eids_ptr, total_ptr, q_ptr, off_ptr, rank_ptr, ld_ptr, dim_ptr, col_ptr,
        rw_ptr, bg_ptr, bu_ptr, numel, n_exp, stride_cs, stride_c, stride_o, bias_stride, alpha, limit,
        SPLIT: tl.constexpr, DUAL: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_W: tl.constexpr,
        CDT: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
    ):  # fmt: skip
        """``O[s, n] = act(gate, up)`` (``DUAL``) or ``w_s · (Q_e · c_s + b_e)``, for the slots of one M-block."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BM >= tl.load(total_ptr):
            return
        e = tl.load(eids_ptr + pid_m)
        slot = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
        row_ok = slot < numel
        srow = slot.to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < tl.load(dim_ptr)
        acc = _expand_acc(c_ptr, q_ptr, off_ptr, rank_ptr, ld_ptr, dim_ptr, col_ptr, 0, e, n_exp, srow, row_ok, offs_n,
                          stride_cs, stride_c, SPLIT, CDT, PREC, BM, BN, BR)  # fmt: skip
        if HAS_BIAS:
            acc += tl.load(bg_ptr + e * bias_stride + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if DUAL:
            up = _expand_acc(c_ptr, q_ptr, off_ptr, rank_ptr, ld_ptr, dim_ptr, col_ptr, 1, e, n_exp, srow, row_ok,
                             offs_n, stride_cs, stride_c, SPLIT, CDT, PREC, BM, BN, BR)  # fmt: skip
            if HAS_BIAS:
                up += tl.load(bu_ptr + e * bias_stride + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if ACT == 1:  # GPT-OSS: (clamp(u) + 1) · g · sigmoid(alpha · g), g = min(g, limit)
                g = tl.minimum(acc, limit)
                u = tl.minimum(tl.maximum(up, -limit), limit)
                acc = (u + 1.0) * (g * tl.sigmoid(g * alpha))
            else:
                acc = acc * tl.sigmoid(acc) * up
        if MUL_W:
            acc = acc * tl.load(rw_ptr + srow, mask=row_ok, other=0.0)[:, None]
        op = o_ptr + srow[:, None] * stride_o + offs_n[None, :]
        tl.store(op, acc.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    _KERNELS.update(shrink=shrink_kernel, expand=expand_kernel)
    return _KERNELS
