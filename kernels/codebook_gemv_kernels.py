"""The Triton kernels of K3's decode GEMV (:mod:`moecompress.kernels.codebook_gemv`): ``gate_up`` and ``down``
with their ``@triton.jit`` helpers (code-word unpacking, per-tile tables, decode and row products).

Built on first use by :func:`_kernels` (Triton is imported lazily, inside it); the layout, configs and launch
wrappers are in :mod:`moecompress.kernels.codebook_gemv`.
"""

from __future__ import annotations

_KERNELS: dict[str, object] = {}


def _kernels() -> dict[str, object]:
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    globals()["tl"] = tl  # helpers whose bodies name ``tl`` only in annotations resolve it here (real compiler)

    @triton.jit
    def _unpack(base, offs_n, n_ok, k0, n_words, sn, BITS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """Codes ``[BN, BK]`` (int32) of inputs ``k0 .. k0+BK`` from ``BK·BITS/32`` words per row."""
        CPW: tl.constexpr = 32 // BITS
        # k0 is a multiple of BK (the hint that makes these 16-byte vector loads on sm_90; rows are padded
        # to 16 bytes, and the JIT sees their word stride divisible by 16 at real shapes)
        widx = tl.multiple_of(k0 // CPW, BK // CPW) + tl.arange(0, BK // CPW)
        ptr = base + offs_n[:, None].to(tl.int64) * sn + widx[None, :]
        words = tl.load(ptr, mask=n_ok[:, None] & (widx < n_words)[None, :], other=0)
        q = (words[:, :, None] >> (tl.arange(0, CPW) * BITS)[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(q, [BN, BK])

    @triton.jit
    def _codes(w_ptr, h_ptr, e, offs_n, n_ok, k0, n_words, sn, se, h_words, hsn, hse,
               BITS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        if BITS == 3:
            q = _unpack(w_ptr + e * se, offs_n, n_ok, k0, n_words, sn, 2, BN, BK)
            q = q | (_unpack(h_ptr + e * hse, offs_n, n_ok, k0, h_words, hsn, 1, BN, BK) << 2)
        else:
            q = _unpack(w_ptr + e * se, offs_n, n_ok, k0, n_words, sn, BITS, BN, BK)
        return q

    @triton.jit
    def _params(tab_ptr, zero_ptr, e, offs_n, n_ok, g0, n_rows, G, FMT: tl.constexpr, BITS: tl.constexpr,
                HAS_ZERO: tl.constexpr, GPT: tl.constexpr):  # fmt: skip
        """Groups ``g0 .. g0+GPT`` of rows ``offs_n``, loaded once: codebook centroids ``[BN, GPT, 2^bits]``
        (and a dummy), or rtn scales and zero points ``[BN, GPT]``."""
        gi = g0 + tl.arange(0, GPT)
        gidx = (e * n_rows + offs_n[:, None].to(tl.int64)) * G + gi[None, :]
        gmask = n_ok[:, None] & (gi < G)[None, :]
        if FMT == 0:
            c = tl.arange(0, 1 << BITS)
            tab = tl.load(tab_ptr + gidx[:, :, None] * (1 << BITS) + c[None, None, :], mask=gmask[:, :, None],
                          other=0.0).to(tl.float32)  # fmt: skip
            z = tl.zeros_like(gidx).to(tl.int32)
        else:
            tab = tl.load(tab_ptr + gidx, mask=gmask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(zero_ptr + gidx, mask=gmask, other=0).to(tl.int32)
            else:
                z = tl.zeros_like(gidx).to(tl.int32) + (1 << (BITS - 1))
        return tab, z

    @triton.jit
    def _decode(q, tab, FMT: tl.constexpr, GPT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """The tile, decoded once for the ``BM`` slots: codebook weights ``[BN, BK]`` fp32 (centroids
        picked from the registers' table); rtn codes ``[BN, GPT, BK/GPT]`` as fp32 (scale and zero point
        applied per group after the products, :func:`_row_dot`)."""
        q3 = tl.reshape(q, [BN, GPT, BK // GPT])
        if FMT == 0:
            w = tl.reshape(tl.gather(tab, q3, 2), [BN, BK])
        else:
            w = q3.to(tl.float32)
        return w

    @triton.jit
    def _row_dot(w, tab, z, xm, FMT: tl.constexpr, GPT: tl.constexpr, BK: tl.constexpr):
        """``Σ_k W[n, k] · x[k]`` over the tile, ``[BN]`` fp32. rtn: ``Σ_g s_g·(Σ_k q·x − z_g·Σ_k x)`` —
        scales and zero points meet ``[BN, GPT]`` partial sums, never the per-weight tile (on sm_90 a
        per-weight broadcast of them compiles into one L1 load per weight)."""
        if FMT == 0:
            p = tl.sum(w * xm[None, :], axis=1)
        else:
            x3 = tl.reshape(xm, [GPT, BK // GPT])
            pq = tl.sum(w * x3[None, :, :], axis=2)
            p = tl.sum(tab * (pq - z.to(tl.float32) * tl.sum(x3, axis=1)[None, :]), axis=1)
        return p

    globals().update(_unpack=_unpack, _codes=_codes, _params=_params, _decode=_decode, _row_dot=_row_dot)  # jit callees resolve here

    @triton.jit
    def gemv_gate_up(
        x_ptr, gu_ptr, sorted_ptr, eids_ptr, total_ptr, wid_ptr,
        wg_ptr, hg_ptr, tg_ptr, zg_ptr, wu_ptr, hu_ptr, tu_ptr, zu_ptr, bg_ptr, bu_ptr,
        numel, top_k, K, k_split, stride_x, n_inter, split_stride, n_words, sn, se, h_words, hsn, hse,
        n_rows, G, gs, bias_stride,
        FMT: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
        GPT: tl.constexpr, ONE_GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        if pid_m * BM >= tl.load(total_ptr):
            return
        e = tl.load(eids_ptr + pid_m).to(tl.int64)
        wid = tl.load(wid_ptr + e)
        if pid_n * BN >= wid:
            return
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < wid
        rows = tl.arange(0, BM)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        tab_g, z_g = _params(tg_ptr, zg_ptr, e, offs_n, n_ok, 0, n_rows, G, FMT, BITS, HAS_ZERO, GPT)
        tab_u, z_u = _params(tu_ptr, zu_ptr, e, offs_n, n_ok, 0, n_rows, G, FMT, BITS, HAS_ZERO, GPT)
        for k0 in range(k_lo, k_hi, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < k_hi
            if not ONE_GROUP:
                tab_g, z_g = _params(tg_ptr, zg_ptr, e, offs_n, n_ok, k0 // gs, n_rows, G, FMT, BITS, HAS_ZERO, GPT)
                tab_u, z_u = _params(tu_ptr, zu_ptr, e, offs_n, n_ok, k0 // gs, n_rows, G, FMT, BITS, HAS_ZERO, GPT)
            qg = _codes(wg_ptr, hg_ptr, e, offs_n, n_ok, k0, n_words, sn, se, h_words, hsn, hse, BITS, BN, BK)
            wg = _decode(qg, tab_g, FMT, GPT, BN, BK)
            qu = _codes(wu_ptr, hu_ptr, e, offs_n, n_ok, k0, n_words, sn, se, h_words, hsn, hse, BITS, BN, BK)
            wu = _decode(qu, tab_u, FMT, GPT, BN, BK)
            for m in tl.static_range(BM):
                slot = tl.load(sorted_ptr + pid_m * BM + m)
                tok = (slot // top_k).to(tl.int64)
                xm = tl.load(x_ptr + tok * stride_x + offs_k, mask=k_ok & (slot < numel), other=0.0).to(tl.float32)
                pg = _row_dot(wg, tab_g, z_g, xm, FMT, GPT, BK)
                pu = _row_dot(wu, tab_u, z_u, xm, FMT, GPT, BK)
                acc_g += tl.where(rows[:, None] == m, pg[None, :], 0.0)
                acc_u += tl.where(rows[:, None] == m, pu[None, :], 0.0)
        if HAS_BIAS:  # added once, by split 0
            b_ok = n_ok & (pid_k == 0)
            acc_g += tl.load(bg_ptr + e * bias_stride + offs_n, mask=b_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bu_ptr + e * bias_stride + offs_n, mask=b_ok, other=0.0).to(tl.float32)[None, :]
        slots = tl.load(sorted_ptr + pid_m * BM + rows)
        ok = (slots < numel)[:, None] & n_ok[None, :]
        base = gu_ptr + pid_k * split_stride + slots[:, None].to(tl.int64) * n_inter + offs_n[None, :]
        tl.store(base, acc_g, mask=ok)
        tl.store(base + numel * n_inter, acc_u, mask=ok)

    @triton.jit
    def gemv_down(
        gu_ptr, y_ptr, sorted_ptr, eids_ptr, total_ptr, wid_ptr, rw_ptr,
        wd_ptr, hd_ptr, td_ptr, zd_ptr, bd_ptr,
        numel, N, n_inter, k_split, split_in, stride_ys, n_words, sn, se, h_words, hsn, hse, G, gs,
        alpha, limit,
        FMT: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
        S_IN: tl.constexpr, GPT: tl.constexpr, ONE_GROUP: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        if pid_m * BM >= tl.load(total_ptr):
            return
        e = tl.load(eids_ptr + pid_m).to(tl.int64)
        wid = tl.load(wid_ptr + e)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        rows = tl.arange(0, BM)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, wid)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        tab, z = _params(td_ptr, zd_ptr, e, offs_n, n_ok, 0, N, G, FMT, BITS, HAS_ZERO, GPT)
        for k0 in range(k_lo, k_hi, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < k_hi
            if not ONE_GROUP:
                tab, z = _params(td_ptr, zd_ptr, e, offs_n, n_ok, k0 // gs, N, G, FMT, BITS, HAS_ZERO, GPT)
            q = _codes(wd_ptr, hd_ptr, e, offs_n, n_ok, k0, n_words, sn, se, h_words, hsn, hse, BITS, BN, BK)
            w = _decode(q, tab, FMT, GPT, BN, BK)
            for m in tl.static_range(BM):
                slot = tl.load(sorted_ptr + pid_m * BM + m)
                a_ok = k_ok & (slot < numel)
                gp = gu_ptr + slot.to(tl.int64) * n_inter + offs_k
                g = tl.zeros([BK], dtype=tl.float32)
                u = tl.zeros([BK], dtype=tl.float32)
                for s in tl.static_range(S_IN):  # the gate/up split-K partials, in a fixed order
                    g += tl.load(gp + s * split_in, mask=a_ok, other=0.0)
                    u += tl.load(gp + s * split_in + numel * n_inter, mask=a_ok, other=0.0)
                if ACT == 1:  # GPT-OSS: (clamp(u) + 1) · g · sigmoid(alpha · g), g = min(g, limit)
                    g = tl.minimum(g, limit)
                    u = tl.minimum(tl.maximum(u, -limit), limit)
                    a = (u + 1.0) * (g * tl.sigmoid(g * alpha))
                else:
                    a = g * tl.sigmoid(g) * u
                a = tl.where(a_ok, a, 0.0)
                part = _row_dot(w, tab, z, a, FMT, GPT, BK)
                acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
        if HAS_BIAS:  # added once, by split 0
            acc += tl.load(bd_ptr + e * N + offs_n, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)[None, :]
        slots = tl.load(sorted_ptr + pid_m * BM + rows)
        r_ok = slots < numel
        srow = slots.to(tl.int64)
        acc = acc * tl.load(rw_ptr + srow, mask=r_ok, other=0.0)[:, None]
        yp = y_ptr + pid_k * stride_ys + srow[:, None] * N + offs_n[None, :]
        tl.store(yp, acc, mask=r_ok[:, None] & n_ok[None, :])

    _KERNELS.update(gate_up=gemv_gate_up, down=gemv_down)
    return _KERNELS
