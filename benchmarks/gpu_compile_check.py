#!/usr/bin/env python
"""Compile the K1/K2/K5 kernels, K3's decode GEMV and the vLLM-algorithm baseline for an H200 (sm_90) without a GPU.

Triton's wheel ships ``ptxas``, so ``triton.compile`` with ``GPUTarget("cuda", 90, 32)`` runs the whole
GPU pipeline on a CPU-only machine. For every launch configuration of ``grouped_gemm.CONFIGS`` (and
vLLM's tuned H200 configs) this reports the static shared memory the compiler allocated, whether the
tile loads became pipelined 16-byte ``cp.async`` copies, and the MMA flavour (``mma.sync``/``wgmma``);
it fails when shared memory exceeds 227 KiB or when a weight-streaming loop is not pipelined — what the
interpreter cannot show. Pointer and stride arguments get the 16-byte divisibility the JIT gives aligned
torch tensors.

    python benchmarks/gpu_compile_check.py        # ≈ 1 min on one CPU core
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # real compilation
ROOT = Path(__file__).resolve().parents[1]
if "moecompress" not in sys.modules:
    for name, path in (("moecompress", ROOT / "moecompress"), ("moecompress.kernels", ROOT / "kernels")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod
sys.path.insert(0, str(ROOT / "benchmarks"))

SMEM_LIMIT = 227 * 1024


def compile_one(fn, types_: dict, consts: dict, div16=(), warps=4, stages=3) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: ("constexpr" if n in consts else types_[n]) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (types_[n].startswith("*") or n in div16)}  # fmt: skip
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)  # fmt: skip
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = k.asm["ptx"]
    return dict(smem=k.metadata.shared, cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"),
                v4=ptx.count("ld.global.v4") + ptx.count("ld.global.nc.v4"))  # fmt: skip


def main() -> int:
    from gpu_moe_baselines import VLLM_H200
    from gpu_moe_baselines import _kernels as vllm_kernels

    from moecompress.kernels import codebook_gemv, codebook_gemv_kernels, combine, grouped_gemm, moe_align

    failures, n = [], 0

    def report(name, res, need_pipeline):
        nonlocal n
        n += 1
        ok = res["smem"] <= SMEM_LIMIT and (res["cp_async"] > 0 or not need_pipeline)
        print(f"{'ok  ' if ok else 'FAIL'} {name:58s} smem {res['smem']:6d} B  cp.async {res['cp_async']:3d}  "
              f"wgmma {res['wgmma']:2d}  mma.sync {res['mma']:2d}", flush=True)  # fmt: skip
        if not ok:
            failures.append(name)

    gate_up, down = grouped_gemm._kernels()
    t1 = dict(x_ptr="*bf16", raw_ptr="*i32", g_ptr="*bf16", u_ptr="*bf16", g_off_ptr="*i64", u_off_ptr="*i64",
              width_ptr="*i32", gb_ptr="*bf16", ub_ptr="*bf16", h_ptr="*bf16", sorted_ptr="*i32", eids_ptr="*i32",
              total_ptr="*i32", numel="i32", H="i32", I_full="i32", stride_h="i32", x_plane="i32", alpha="fp32",
              limit="fp32")  # fmt: skip
    t2 = dict(h_ptr="*bf16", d_ptr="*bf16", d_off_ptr="*i64", width_ptr="*i32", db_ptr="*bf16", w_ptr="*fp32",
              y_ptr="*fp32", sorted_ptr="*i32", eids_ptr="*i32", total_ptr="*i32", numel="i32", N="i32",
              stride_h="i32", stride_dk="i32", stride_dn="i32")  # fmt: skip
    for _, cfg in grouped_gemm.CONFIGS:
        c1 = dict(TOP_K=8, BM=cfg.bm, BN=cfg.bn1, BK=cfg.bk1, EVEN_K=True, HAS_GB=False, HAS_UB=False,
                  HAS_RAW=False, ACT=0, UPCAST=False, PREC="tf32", ALIGN=True)  # fmt: skip
        res = compile_one(gate_up, t1, c1, ("H", "I_full", "stride_h", "x_plane"), cfg.warps, cfg.stages)
        report(f"K2 gate_up BM{cfg.bm} BN{cfg.bn1} BK{cfg.bk1} w{cfg.warps} s{cfg.stages}", res, True)
        for layout, strides in (("dense", dict(stride_dk=1)), ("ragged", dict(stride_dn=1))):
            c2 = dict(BM=cfg.bm, BN=cfg.bn2, BK=cfg.bk2, SPLIT_K=cfg.split_k or 2, HAS_DB=False, UPCAST=False,
                      PREC="tf32", ALIGN=True, EVEN_W=True, **strides)  # fmt: skip
            t2y = {**t2, "y_ptr": "*fp32" if c2["SPLIT_K"] > 1 else "*bf16"}  # as grouped_moe allocates y
            res = compile_one(down, t2y, c2, ("N", "stride_h", "stride_dk", "stride_dn"), cfg.warps, cfg.stages)
            report(f"K2 down {layout} BM{cfg.bm} BN{cfg.bn2} BK{cfg.bk2} split{c2['SPLIT_K']}", res, True)
    # the feature flags (GPT-OSS biases and clamp, unrotated plane, K tail, ragged widths) in fp32 and fp16
    c1 = dict(TOP_K=4, BM=16, BN=32, BK=64, EVEN_K=False, HAS_GB=True, HAS_UB=True, HAS_RAW=True, ACT=1,
              UPCAST=False, PREC="ieee", ALIGN=False)  # fmt: skip
    t1f = {k: v.replace("bf16", "fp32") for k, v in t1.items()}
    report("K2 gate_up fp32 ieee, biases, clamp, raw, K tail", compile_one(gate_up, t1f, c1), False)
    c2 = dict(BM=16, BN=64, BK=32, SPLIT_K=3, HAS_DB=True, UPCAST=False, PREC="tf32", ALIGN=False, EVEN_W=False)
    t2h = {k: v.replace("bf16", "fp16") for k, v in t2.items()}
    report("K2 down fp16, bias, unaligned, split3", compile_one(down, t2h, c2), False)
    c2 = dict(BM=16, BN=64, BK=128, SPLIT_K=2, HAS_DB=False, UPCAST=False, PREC="tf32", ALIGN=True, EVEN_W=False,
              stride_dn=1)  # fmt: skip
    res = compile_one(down, t2, c2, ("N", "stride_h", "stride_dk"))
    report("K2 down ragged layout, arbitrary widths (k-masked)", res, True)
    single, count, scan, scatter = moe_align._kernels()
    ta = dict(ids_ptr="*i64", map_ptr="*i64", sorted_ptr="*i32", expert_ids_ptr="*i32", total_ptr="*i32",
              numel="i32", n_logical="i32", num_experts="i32", bound="i32", n_blocks="i32")  # fmt: skip
    for e_p2, bm in ((128, 16), (8, 64)):
        ca = dict(BLOCK_M=bm, E_P2=e_p2, CHUNK=max(16, min(1024, 8192 // e_p2)),
                  BLK_CHUNK=max(16, min(256, 8192 // e_p2)), HAS_MAP=e_p2 == 8)  # fmt: skip
        report(f"K1 align single E{e_p2} BM{bm}", compile_one(single, ta, ca, warps=8), False)
    tc = dict(ids_ptr="*i64", map_ptr="*i64", counts_ptr="*i32", numel="i32", n_logical="i32", num_experts="i32")
    report("K1 align count E128", compile_one(count, tc, dict(E_P2=128, CHUNK=128, HAS_MAP=True)), False)
    ts = dict(counts_ptr="*i32", base_ptr="*i32", sorted_ptr="*i32", expert_ids_ptr="*i32", total_ptr="*i32",
              numel="i32", bound="i32", n_blocks="i32", n_chunks="i32")  # fmt: skip
    report("K1 align scan E128", compile_one(scan, ts, dict(BLOCK_M=128, E_P2=128, CB=64, BLK_CHUNK=64), warps=8),
           False)  # fmt: skip
    tsc = dict(ids_ptr="*i64", map_ptr="*i64", base_ptr="*i32", sorted_ptr="*i32", numel="i32", n_logical="i32",
               num_experts="i32")  # fmt: skip
    report("K1 align scatter E128", compile_one(scatter, tsc, dict(E_P2=128, CHUNK=128, HAS_MAP=False)), False)
    tk = dict(y_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64", map_ptr="*i64", out_ptr="*fp32", N="i32",
              n_logical="i32", num_experts="i32", split_stride="i32")  # fmt: skip
    for ck in (dict(TOP_K=8, SPLIT=2, BN=256, MUL_W=False, CHECK_IDS=True, HAS_MAP=False),
               dict(TOP_K=2, SPLIT=1, BN=256, MUL_W=True, CHECK_IDS=True, HAS_MAP=True)):
        report(f"K5 combine k{ck['TOP_K']} split{ck['SPLIT']} weights {ck['MUL_W']}",
               compile_one(combine._kernel(), tk, ck, ("N",)), False)  # fmt: skip
    # K3 decode (issue 39): every bucket for codebook 4-bit per-row centroids, and each other format once;
    # the code words must be read with 16-byte vector loads (``ld.global.v4``)
    gv = codebook_gemv_kernels._kernels()
    div = ("K", "stride_x", "n_inter", "sn", "se", "hsn", "hse", "n_words", "h_words", "k_split", "N", "split_in",
           "stride_ys", "split_stride")  # fmt: skip
    formats = [("codebook4 row", 0, 4, False, 1, True)] * len(codebook_gemv.DECODE_CONFIGS)
    formats += [("rtn4 g128 zeros", 1, 4, True, 1, False), ("rtn8 sym row", 1, 8, False, 1, True),
                ("codebook2 row", 0, 2, False, 1, True), ("codebook3 g32 biases clamp", 0, 3, False, 4, False)]
    for j, (name, fmt, bits, zero, gpt, one) in enumerate(formats):
        cfg = codebook_gemv.DECODE_CONFIGS[min(j, len(codebook_gemv.DECODE_CONFIGS) - 1)][1]
        tab = "*bf16" if fmt == 0 else "*fp16"
        for which, bn, bk in (("gate_up", cfg.bn, codebook_gemv.depth(cfg.bk, bits)),
                              ("down", cfg.bn_down, codebook_gemv.depth(cfg.bk_down, bits))):
            fn = gv[which]
            tg = {n: ("*i32" if n.endswith("_ptr") else "i32") for n in fn.arg_names}
            tg.update({n: "*bf16" for n in ("x_ptr", "bg_ptr", "bu_ptr", "bd_ptr")})
            tg.update({n: tab for n in ("tg_ptr", "tu_ptr", "td_ptr")})
            tg.update({n: "*u8" if zero else "*i32" for n in ("zg_ptr", "zu_ptr", "zd_ptr")})
            tg.update(gu_ptr="*fp32", y_ptr="*fp32", rw_ptr="*fp32", alpha="fp32", limit="fp32")
            cg = dict(FMT=fmt, BITS=bits, HAS_ZERO=zero, HAS_BIAS="biases" in name, GPT=gpt, ONE_GROUP=one, BM=cfg.bm, BN=bn,
                      BK=bk)  # fmt: skip
            if which == "down":
                cg.update(ACT=int("clamp" in name), S_IN=2)
            res = compile_one(fn, {k: v for k, v in tg.items() if k in fn.arg_names}, cg,
                              tuple(d for d in div if d in fn.arg_names), cfg.warps, cfg.stages)  # fmt: skip
            tag = f"K3 gemv {which} {name} BM{cfg.bm} BN{bn} BK{bk}"
            report(tag, res, False)
            if res["v4"] == 0:
                print(f"FAIL {tag}: code words not read with 16-byte loads", flush=True)
                failures.append(tag)
    fused, _ = vllm_kernels()
    tv = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", w_ptr="*fp32", sorted_ptr="*i32", eids_ptr="*i32",
              total_ptr="*i32", N="i32", K="i32", EM="i32", num_valid="i32", stride_am="i32", stride_be="i32",
              stride_bn="i32", stride_bk="i32", stride_cm="i32")  # fmt: skip
    for b, c in VLLM_H200.items():
        cv = dict(BM=c["bm"], BN=c["bn"], BK=c["bk"], GROUP_M=c["group"], TOP_K=8, MUL_W=False, UPCAST=False,
                  stride_bk=1)  # fmt: skip
        res = compile_one(fused, tv, cv, ("N", "K", "stride_am", "stride_be", "stride_bn", "stride_cm"),
                          c["warps"], c["stages"])  # fmt: skip
        report(f"vllm fused_moe B={b} BM{c['bm']} BN{c['bn']} BK{c['bk']} s{c['stages']}", res, True)
    print(f"{n} kernels compiled for sm_90, {len(failures)} failed: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
