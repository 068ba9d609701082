#!/usr/bin/env python
"""Compile the K1/K2/K5 kernels and the vLLM-algorithm baseline for an H200 (sm_90) without a GPU.

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
                wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"))  # fmt: skip


def main() -> int:
    from gpu_moe_baselines import VLLM_H200
    from gpu_moe_baselines import _kernels as vllm_kernels

    from moecompress.kernels import combine, grouped_gemm, moe_align

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
