"""The Triton kernels of K3 ``moe_codebook_gemm`` (:mod:`moecompress.kernels.codebook_gemm`): ``gate_up`` and
``down`` with their ``@triton.jit`` helpers (the register centroid table and the decoded B tile).

Built on first use by :func:`_kernels` (Triton is imported lazily, inside it); the prepared layout, configs and
launches are in :mod:`moecompress.kernels.codebook_gemm`.
"""

from __future__ import annotations

_KERNELS: dict[str, object] = {}


def _kernels() -> dict[str, object]:
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def _table(tab_ptr, e, offs_n, n_ok, n_rows, G, grp, BITS: tl.constexpr):
        """The centroids of group ``grp`` of rows ``offs_n``, transposed: ``[2^bits, BN]`` fp32 (registers)."""
        c = tl.arange(0, 1 << BITS)
        idx = ((e * n_rows + offs_n[None, :].to(tl.int64)) * G + grp) * (1 << BITS) + c[:, None]
        return tl.load(tab_ptr + idx, mask=n_ok[None, :], other=0.0).to(tl.float32)

    globals()["_table"] = _table

    @triton.jit
    def _tile(codes_ptr, tab_ptr, zero_ptr, e, offs_k, offs_n, mask, code_se, code_sn, n_rows, G, gs, tab,
              FMT: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_EPI: tl.constexpr,
              LUT_REG: tl.constexpr, CDT: tl.constexpr):  # fmt: skip
        """Decoded B tile ``[BK, BN]`` (element ``(k, n)`` = W[e][n, k]) in ``CDT``; ``LUT_REG``: the
        centroids come from the register table ``tab`` (``_table``) by ``tl.gather``, not from L1."""
        bitpos = offs_k * BITS
        ptr = codes_ptr + e * code_se + offs_n[None, :].to(tl.int64) * code_sn + (bitpos // 8)[:, None]
        word = tl.load(ptr, mask=mask, other=0).to(tl.int32)
        if BITS == 3:
            word = word | (tl.load(ptr + 1, mask=mask, other=0).to(tl.int32) << 8)
        q = (word >> (bitpos % 8)[:, None]) & ((1 << BITS) - 1)
        gidx = (e * n_rows + offs_n[None, :].to(tl.int64)) * G + (offs_k // gs)[:, None]
        if FMT == 0 and LUT_REG:
            w = tl.gather(tab, q, 0)
        elif FMT == 0:
            w = tl.load(tab_ptr + gidx * (1 << BITS) + q, mask=mask, other=0.0).to(tl.float32)
        else:
            if HAS_ZERO:
                z = tl.load(zero_ptr + gidx, mask=mask, other=0).to(tl.int32)
            else:
                z = 1 << (BITS - 1)
            w = (q - z).to(tl.float32)
            if not SCALE_EPI:
                w = w * tl.load(tab_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
        return w.to(CDT)

    globals()["_tile"] = _tile  # jit functions resolve callees in the module's globals (triton is lazy here)

    @triton.jit
    def gate_up_kernel(
        x_ptr, h_ptr, sorted_ptr, eids_ptr, total_ptr, wid_ptr,
        cg_ptr, tg_ptr, zg_ptr, cu_ptr, tu_ptr, zu_ptr, bg_ptr, bu_ptr,
        numel, top_k, K, stride_x, stride_h, code_se, code_sn, n_rows, G, gs, bias_stride, alpha, limit,
        FMT: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_EPI: tl.constexpr,
        ACT: tl.constexpr, HAS_BIAS: tl.constexpr, LUT: tl.constexpr, CDT: tl.constexpr,
        PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BM >= tl.load(total_ptr):
            return
        e = tl.load(eids_ptr + pid_m).to(tl.int64)
        wid = tl.load(wid_ptr + e)
        if pid_n * BN >= wid:
            return
        slot = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
        row_ok = slot < numel
        tok = (slot // top_k).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < wid
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        tab_g = tl.zeros([1 << BITS, BN], dtype=tl.float32)
        tab_u = tab_g
        if LUT == 1:  # one group per row: one register table per program
            tab_g = _table(tg_ptr, e, offs_n, n_ok, n_rows, G, 0, BITS)
            tab_u = _table(tu_ptr, e, offs_n, n_ok, n_rows, G, 0, BITS)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < K
            a = tl.load(x_ptr + tok[:, None] * stride_x + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0).to(CDT)  # fmt: skip
            mask = k_ok[:, None] & n_ok[None, :]
            if LUT == 2:  # groups of whole K blocks (gs % BK == 0): one table per K block
                tab_g = _table(tg_ptr, e, offs_n, n_ok, n_rows, G, k0 // gs, BITS)
                tab_u = _table(tu_ptr, e, offs_n, n_ok, n_rows, G, k0 // gs, BITS)
            wg = _tile(cg_ptr, tg_ptr, zg_ptr, e, offs_k, offs_n, mask, code_se, code_sn, n_rows, G, gs, tab_g,
                       FMT, BITS, HAS_ZERO, SCALE_EPI, LUT > 0, CDT)  # fmt: skip
            acc_g = tl.dot(a, wg, acc_g, input_precision=PREC)
            wu = _tile(cu_ptr, tu_ptr, zu_ptr, e, offs_k, offs_n, mask, code_se, code_sn, n_rows, G, gs, tab_u,
                       FMT, BITS, HAS_ZERO, SCALE_EPI, LUT > 0, CDT)  # fmt: skip
            acc_u = tl.dot(a, wu, acc_u, input_precision=PREC)
        if SCALE_EPI:
            sidx = e * n_rows + offs_n
            acc_g = acc_g * tl.load(tg_ptr + sidx, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u = acc_u * tl.load(tu_ptr + sidx, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc_g += tl.load(bg_ptr + e * bias_stride + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bu_ptr + e * bias_stride + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACT == 1:  # GPT-OSS: (clamp(u) + 1) · g · sigmoid(alpha · g), g = min(g, limit)
            g = tl.minimum(acc_g, limit)
            u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            h = (u + 1.0) * (g * tl.sigmoid(g * alpha))
        else:
            h = acc_g * tl.sigmoid(acc_g) * acc_u
        hp = h_ptr + slot[:, None].to(tl.int64) * stride_h + offs_n[None, :]
        tl.store(hp, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit
    def down_kernel(
        h_ptr, y_ptr, sorted_ptr, eids_ptr, total_ptr, wid_ptr, rw_ptr, cd_ptr, td_ptr, zd_ptr, bd_ptr,
        numel, N, stride_h, stride_y, stride_ys, code_se, code_sn, G, gs, k_split,
        FMT: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_EPI: tl.constexpr,
        HAS_BIAS: tl.constexpr, LUT: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        if pid_m * BM >= tl.load(total_ptr):
            return
        e = tl.load(eids_ptr + pid_m).to(tl.int64)
        wid = tl.load(wid_ptr + e)
        slot = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
        row_ok = slot < numel
        srow = slot.to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, wid)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        tab = tl.zeros([1 << BITS, BN], dtype=tl.float32)
        if LUT == 1:
            tab = _table(td_ptr, e, offs_n, n_ok, N, G, 0, BITS)
        for k0 in range(k_lo, k_hi, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < k_hi
            a = tl.load(h_ptr + srow[:, None] * stride_h + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0).to(CDT)  # fmt: skip
            if LUT == 2:
                tab = _table(td_ptr, e, offs_n, n_ok, N, G, k0 // gs, BITS)
            w = _tile(cd_ptr, td_ptr, zd_ptr, e, offs_k, offs_n, k_ok[:, None] & n_ok[None, :], code_se, code_sn,
                      N, G, gs, tab, FMT, BITS, HAS_ZERO, SCALE_EPI, LUT > 0, CDT)  # fmt: skip
            acc = tl.dot(a, w, acc, input_precision=PREC)
        if SCALE_EPI:
            acc = acc * tl.load(td_ptr + e * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:  # added once, by split 0
            acc += tl.load(bd_ptr + e * N + offs_n, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)[None, :]
        acc = acc * tl.load(rw_ptr + srow, mask=row_ok, other=0.0)[:, None]
        yp = y_ptr + pid_k * stride_ys + srow[:, None] * stride_y + offs_n[None, :]
        tl.store(yp, acc, mask=row_ok[:, None] & n_ok[None, :])

    _KERNELS.update(gate_up=gate_up_kernel, down=down_kernel)
    return _KERNELS
