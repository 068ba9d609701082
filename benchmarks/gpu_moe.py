#!/usr/bin/env python
"""One-script GPU benchmark of the MoE kernels (KERNELS.md §7): whole MoE layer, routing included.

    python benchmarks/gpu_moe.py [--out DIR] [--budget-s 330]     # H200: <= 6 min, CSV + JSON in DIR
    python benchmarks/gpu_moe.py --dry-run [--out DIR]            # same harness, tiny shapes, CPU interpreter
    python benchmarks/gpu_moe.py --only quantised [--out DIR]     # issue 39's rows only: <= 3 min on an H200

1. Roofs: device-to-device copy of 1 GiB (read + write counted) and a bf16 8192³ matmul (do_bench medians).
2. Shapes (random weights): Qwen3-30B-A3B (E 128, k 8, H 2048, I 768), OLMoE-1B-7B (64, 8, 2048, 1024),
   Mixtral-8x7B (8, 2, 4096, 14336). Variants: bf16 dense; ragged keep f ∈ {0.75, 0.5, 0.25} (arbitrary
   widths); uniform pruned 0.5 (multiples of 16); merged E/2 through a remap; codebook 4/2-bit; rtn 4-bit
   g128; tucker r ∈ {128, 256, 512} (K3/K4 through ``prepare_triton`` when their files exist).
3. Batches: decode B ∈ {1, 2, 4, 8, 16, 32, 64}, prefill T ∈ {512, 2048, 8192}; routing uniform (logits
   ~ N(0, 1)), skewed (Zipf s = 1.2 prior on the logits), adversarial (every token on the same k experts).
4. Methods: ``k2`` (our kernels through ``prepare_triton``), ``vllm`` (our re-implementation of vLLM's
   fused_moe algorithm with its tuned H200 configs, on the uncompressed bf16 shape), ``grouped_mm``
   (sort + ``torch._grouped_mm``), ``eager`` (HF-style loop over hit experts, materialising compressed
   experts: dequantise-then-GEMM).
5. Timing: 10 invocations with different router inputs (no L2 reuse across calls) captured in one CUDA
   graph, ``triton.testing.do_bench`` median over replays / 10; eager methods without graphs.
6. Output per row: µs/layer, bytes moved (distinct experts hit × stored bytes + shared factors +
   activations) -> floor µs at the measured copy bandwidth and **% of floor**, TFLOP/s and % of the
   measured matmul, speed-up vs ``vllm`` and ``eager``, and ``vs_k2_bf16``: the bf16 K2 row of the same
   shape, routing and batch divided by this row's time (> 1: faster than bf16; issue 39's acceptance),
   per-token ms over the model's layers.
7. ``--only quantised``: the bf16 K2 rows and the codebook 4/2-bit and rtn 4-bit g128 rows (K3: the
   decode GEMV up to 8 tokens per expert, the GEMM above) at B ∈ {1, 4, 16, 64} and T = 2048 on the
   Qwen3-30B-A3B shape, then B ∈ {1, 16} (and T = 2048) on OLMoE and Mixtral; budget 150 s of rows.

Work is ordered by priority (acceptance numbers first) and stops starting new rows after ``--budget-s``
seconds; rows not run are listed under ``skipped`` in the JSON. Needs only torch and triton: the package
``moecompress`` is entered without its ``__init__`` (which needs pydantic/transformers).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
import types
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    os.environ.setdefault("OMP_NUM_THREADS", "1")
if "moecompress" not in sys.modules:  # the layouts and kernels only, not the engine's dependencies
    for name, path in (("moecompress", ROOT / "moecompress"), ("moecompress.kernels", ROOT / "kernels")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from gpu_moe_baselines import eager_loop, grouped_mm, vllm_config, vllm_moe  # noqa: E402

SHAPES = {  # name: (E, k, H, I, layers)
    "qwen3-30b-a3b": (128, 8, 2048, 768, 48),
    "olmoe-1b-7b": (64, 8, 2048, 1024, 16),
    "mixtral-8x7b": (8, 2, 4096, 14336, 32),
}
DRY_SHAPES = {"qwen3-tiny": (16, 4, 64, 48, 48), "mixtral-tiny": (4, 2, 64, 80, 32)}
COLUMNS = ["shape", "variant", "method", "routing", "batch", "us", "bytes", "floor_us", "pct_floor", "tflops",
           "pct_matmul", "vs_vllm", "vs_eager", "vs_k2_bf16", "per_token_ms", "err", "note"]
QUANTISED = ("codebook4", "rtn4", "codebook2")


# ---------------------------------------------------------------- banks
def build_bank(variant: str, e: int, h: int, i: int, dtype, dev, gen):
    """``(bank, expert_map)`` of a random bank of ``variant`` at shape ``(E, H, I)``."""
    from moecompress.ir import ExpertBank
    from moecompress.layouts import RTN, Codebook, Dense, Tucker
    from moecompress.layouts.bitpack import packed_size
    from moecompress.layouts.ragged import Ragged

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    def dense(n):
        return ExpertBank(Dense(rnd(n, i, h, scale=h**-0.5)), Dense(rnd(n, i, h, scale=h**-0.5)),
                          Dense(rnd(n, h, i, scale=i**-0.5)))

    if variant == "bf16":
        return dense(e), None
    if variant == "merged0.5":
        return dense(e // 2), torch.arange(e, device=dev) // 2
    if variant.startswith(("ragged", "pruned16")):
        f = float(variant.split("_")[-1] if "_" in variant else variant[6:])
        if variant.startswith("pruned16"):
            widths = torch.full((e,), max(16, round(f * i / 16) * 16))
        else:
            jitter = 0.5 + torch.rand(e, generator=torch.Generator().manual_seed(e))
            widths = (f * i * jitter).round().clamp(1, i).long()
        n = int(widths.sum())
        w = widths.to(dev)
        return ExpertBank(Ragged(rnd(n, h, scale=h**-0.5), w, i, "out"), Ragged(rnd(n, h, scale=h**-0.5), w, i, "out"),
                          Ragged(rnd(n, h, scale=i**-0.5), w, i, "in")), None
    members = torch.arange(e, device=dev)
    if variant.startswith("codebook"):
        bits = int(variant[8:])

        def cb(out, inn):
            codes = torch.randint(0, 256, (e, out, packed_size(inn, bits)), generator=gen, device=dev).to(torch.uint8)
            cents = (torch.randn(e, out, 1, 1 << bits, generator=gen, device=dev) * inn**-0.5).half()
            return Codebook(codes, cents, members, torch.zeros(0, out, inn, dtype=dtype, device=dev), bits, inn,
                            dtype, (out, inn))

        return ExpertBank(cb(i, h), cb(i, h), cb(h, i)), None
    if variant == "rtn4":

        def rtn(out, inn):
            gs = min(128, inn)
            codes = torch.randint(0, 256, (e, out, packed_size(inn, 4)), generator=gen, device=dev).to(torch.uint8)
            scales = (torch.rand(e, out, inn // gs, generator=gen, device=dev) * inn**-0.5 / 4).half()
            zeros = torch.full((e, out, inn // gs), 8, dtype=torch.uint8, device=dev)
            return RTN(codes, scales, zeros, members, torch.zeros(0, out, inn, dtype=dtype, device=dev), 4, inn, dtype)

        return ExpertBank(rtn(i, h), rtn(i, h), rtn(h, i)), None
    if variant.startswith("tucker"):
        r = int(variant[6:])

        def tk(out, inn):
            return Tucker(rnd(out, r, scale=r**-0.5), rnd(inn, r, scale=inn**-0.5), rnd(e, r, r, scale=r**-0.5),
                          members)

        return ExpertBank(tk(i, h), tk(i, h), tk(h, i)), None
    raise ValueError(f"unknown variant {variant}")


def expert_bytes(lay) -> tuple[torch.Tensor, int]:
    """Stored bytes per physical expert ``[E]`` and shared bytes (factors) of one layout."""
    kind, e = lay.kind, lay.shape[0]
    if kind == "dense":
        return torch.full((e,), lay.weight[0].numel() * lay.weight.element_size()), 0
    if kind == "ragged":
        return lay.widths.cpu() * lay.rows.shape[1] * lay.rows.element_size(), 0
    if kind == "tucker":
        size = lay.core.element_size()
        return torch.full((e,), lay.core[0].numel() * size), (lay.u_out.numel() + lay.u_in.numel()) * size
    per = sum(t.numel() * t.element_size() for n, t in lay.tensors().items() if n not in ("members", "exact", "dense"))
    return torch.full((e,), per // max(int((lay.members >= 0).sum()), 1)), 0


# ---------------------------------------------------------------- routing and timing
def route(x, wr, bias, k):
    p = (x.float() @ wr.t() + bias).softmax(-1)
    w, ids = p.topk(k, dim=-1)
    return ids, w / w.sum(-1, keepdim=True)


def router_inputs(routing, t, e, k, h, n, dev, gen, dtype):
    """``n`` pairs ``(x, logit bias)``: different tokens per call so calls do not share L2."""
    out = []
    for c in range(n):
        x = torch.randn(t, h, generator=gen, device=dev).to(dtype)
        bias = torch.zeros(e, device=dev)
        if routing == "skewed":
            bias = -1.2 * torch.log(torch.arange(1, e + 1, device=dev, dtype=torch.float32))
        elif routing == "adversarial":
            bias[(c * k + torch.arange(k, device=dev)) % e] = 100.0
        out.append((x, bias))
    return out


def time_calls(fn, inputs, graph: bool) -> tuple[float, str]:
    """Median µs per call of ``fn(x, bias)`` over ``inputs``."""
    if DRY:  # interpreter: one call (≈ 0.1 s per launch), only the harness is being checked
        t0 = time.perf_counter()
        for a in inputs:
            fn(*a)
        return (time.perf_counter() - t0) / len(inputs) * 1e6, "cpu interpreter"
    import triton.testing

    for a in inputs:  # warm-up: compiles every specialisation outside the capture
        fn(*a)
    torch.cuda.synchronize()
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for a in inputs:
                    fn(*a)
            ms = triton.testing.do_bench(g.replay, warmup=10, rep=40, return_mode="median")
            return ms * 1e3 / len(inputs), "graph"
        except Exception as exc:  # a host sync inside fn: fall back to eager timing
            torch.cuda.synchronize()
            note = f"no graph ({type(exc).__name__})"
    else:
        note = "eager"
    ms = triton.testing.do_bench(lambda: [fn(*a) for a in inputs], warmup=5, rep=30, return_mode="median")
    return ms * 1e3 / len(inputs), note


# ---------------------------------------------------------------- roofs
def roofs(dev) -> dict:
    if DRY:
        a = torch.empty(1 << 22, dtype=torch.uint8)
        b = torch.empty_like(a)
        t0 = time.perf_counter()
        b.copy_(a)
        bw = 2 * a.numel() / (time.perf_counter() - t0)
        m = torch.randn(256, 256)
        t0 = time.perf_counter()
        m @ m
        return {"copy_TBps": bw / 1e12, "matmul_TFLOPs": 2 * 256**3 / (time.perf_counter() - t0) / 1e12}
    import triton.testing

    def copy_bw() -> float:
        a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)
        ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=20, rep=200, return_mode="median")
        return 2 * a.numel() / (ms * 1e-3)

    bw = copy_bw()
    torch.cuda.empty_cache()
    m1 = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    m2 = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: m1 @ m2, warmup=20, rep=200, return_mode="median")
    return {"copy_TBps": bw / 1e12, "matmul_TFLOPs": 2 * 8192**3 / (ms * 1e-3) / 1e12}


# ---------------------------------------------------------------- the plan
def plan(dry: bool, only: str | None = None) -> list[tuple]:
    """``(shape, variant, routing, batch, methods)`` in priority order (``only="quantised"``: issue 39's
    rows, each quantised row after the bf16 K2 row of its batch)."""
    if only == "quantised":
        if dry:
            return [("qwen3-tiny", v, "uniform", b, ("k2",)) for b in (1, 3, 33) for v in ("bf16", *QUANTISED)]
        rows = [("qwen3-30b-a3b", v, "uniform", b, ("k2",)) for b in (1, 4, 16, 64, 2048) for v in ("bf16", *QUANTISED)]
        for s in ("olmoe-1b-7b", "mixtral-8x7b"):
            rows += [(s, v, "uniform", b, ("k2",)) for b in (1, 16, 2048) for v in ("bf16", "codebook4", "rtn4")]
        return rows
    if dry:
        every = ("k2", "vllm", "grouped_mm", "eager")
        rows = [("qwen3-tiny", "bf16", "uniform", b, every) for b in (1, 33)]
        rows += [("mixtral-tiny", "bf16", "uniform", 3, every)]
        rows += [("qwen3-tiny", v, "uniform", 3, ("k2", "eager") if v == "codebook4" else ("k2",)) for v in
                 ("ragged0.5", "pruned16_0.5", "merged0.5", "codebook4", "codebook2", "rtn4", "tucker16")]
        rows += [("qwen3-tiny", "bf16", r, 7, ("k2",)) for r in ("skewed", "adversarial")]
        return rows
    q = "qwen3-30b-a3b"
    core = ("k2", "vllm", "grouped_mm")
    rows = []
    for b in (1, 2, 4):  # acceptance numbers first
        rows += [(q, "bf16", "uniform", b, (*core, "eager")), (q, "ragged0.5", "uniform", b, ("k2",)),
                 (q, "codebook4", "uniform", b, ("k2", "eager"))]
    for b in (8, 16, 32, 64, 512, 2048, 8192):
        rows += [(q, "bf16", "uniform", b, core + (("eager",) if b in (16, 2048) else ())),
                 (q, "ragged0.5", "uniform", b, ("k2",)), (q, "codebook4", "uniform", b, ("k2",))]
    for v in ("ragged0.75", "ragged0.25", "pruned16_0.5", "merged0.5", "codebook2", "rtn4", "tucker128",
              "tucker256", "tucker512"):
        rows += [(q, v, "uniform", b, ("k2", "eager") if b == 1 else ("k2",)) for b in (1, 4, 16, 64, 2048)]
    for r in ("skewed", "adversarial"):
        rows += [(q, "bf16", r, b, ("k2", "vllm")) for b in (1, 16, 2048)]
        rows += [(q, "codebook4", r, b, ("k2",)) for b in (1, 16)]
    for s, bs in (("olmoe-1b-7b", (1, 4, 16, 64, 2048)), ("mixtral-8x7b", (1, 4, 16, 2048, 8192))):
        rows += [(s, "bf16", "uniform", b, core) for b in bs]
        rows += [(s, v, "uniform", b, ("k2",)) for v in ("ragged0.5", "codebook4") for b in bs[:3]]
    return rows


class Bench:
    def __init__(self, args):
        self.dry = args.dry_run
        self.dev = torch.device("cpu" if self.dry else "cuda")
        self.dtype = torch.float32 if self.dry else torch.bfloat16  # bf16 is wrong in the interpreter
        self.shapes = DRY_SHAPES if self.dry else SHAPES
        self.calls = 1 if self.dry else 10
        self.cache: dict = {}
        self.rows: list[dict] = []
        self.skipped: list[str] = []

    def bank(self, shape, variant):
        key = (shape, variant)
        if key not in self.cache:
            if self.cache and next(iter(self.cache))[0] != shape:
                self.cache.clear()  # one shape's banks at a time
                if not self.dry:
                    torch.cuda.empty_cache()
            from moecompress.kernels.dispatch import prepare_triton

            e, _, h, i, _ = self.shapes[shape]
            gen = torch.Generator(device=self.dev).manual_seed(zlib.crc32(repr(key).encode()))
            bank, emap = build_bank(variant, e, h, i, self.dtype, self.dev, gen)
            try:
                prep = prepare_triton(bank, emap)
            except Exception as exc:  # a broken kernel family must not end the whole run
                print(f"  prepare_triton failed for {shape}/{variant}: {type(exc).__name__}: {exc}", flush=True)
                prep = None
            per, shared = zip(*(expert_bytes(lay) for lay in (bank.gate, bank.up, bank.down)))
            extra = {}
            if variant == "bf16":
                w13 = torch.cat([bank.gate.weight, bank.up.weight], 1).contiguous()
                extra = {"w13": w13, "w2": bank.down.weight}
            gr = torch.Generator(device=self.dev).manual_seed(7)
            wr = torch.randn(e if emap is None else emap.numel(), h, generator=gr, device=self.dev) * h**-0.5
            self.cache[key] = dict(bank=bank, emap=emap, prep=prep, per=sum(per), shared=sum(shared), wr=wr, **extra)
        return self.cache[key]

    def method_fn(self, method, c, k, batch):
        bank, emap = c["bank"], c["emap"]
        if method == "k2":
            return None if c["prep"] is None else c["prep"].forward
        if method == "vllm":
            cfg = vllm_config(batch, self.dry)
            return lambda x, ids, w: vllm_moe(x, c["w13"], c["w2"], ids, w, cfg, upcast=self.dry)
        if method == "grouped_mm":
            w13t, w2t = c["w13"].transpose(1, 2), c["w2"].transpose(1, 2)
            return lambda x, ids, w: grouped_mm(x, w13t, w2t, ids, w)
        # eager: the HF loop, materialising each hit expert of a compressed layout (dequantise-then-GEMM)
        from moecompress.reference import experts_forward

        if bank.gate.kind == "dense" and bank.widths is None:
            return lambda x, ids, w: eager_loop(x, bank.gate.weight, bank.up.weight, bank.down.weight,
                                                ids if emap is None else emap[ids], w)
        return lambda x, ids, w: experts_forward(bank, x.to(self.dtype), ids, w, emap)

    def run_row(self, shape, variant, routing, batch, methods, deadline):
        _, k, h, i, layers = self.shapes[shape]
        c = self.bank(shape, variant)
        gen = torch.Generator(device=self.dev).manual_seed(batch)
        inputs = router_inputs(routing, batch, c["wr"].shape[0], k, h, self.calls, self.dev, gen, self.dtype)
        routed = [route(x, c["wr"], b, k) for x, b in inputs]
        phys = [ids if c["emap"] is None else c["emap"][ids] for ids, _ in routed]
        nbytes = sum(float(c["per"][torch.unique(p).cpu()].sum()) for p in phys) / len(phys)
        nbytes += c["shared"] + batch * h * (2 + 4)
        widths = c["bank"].widths
        wcol = torch.full((c["per"].numel(),), i) if widths is None else widths.cpu()
        flops = sum(float(2 * 3 * h * wcol[p.cpu()].sum()) for p in phys) / len(phys)
        ref = None
        for method in methods:
            tag = f"{shape}/{variant}/{method}/{routing}/B={batch}"
            if time.time() > deadline:
                self.skipped.append(f"{tag}: time budget")
                continue
            fn = self.method_fn(method, c, k, batch)
            if fn is None:
                self.skipped.append(f"{tag}: no kernel serves this bank (prepare_triton -> None)")
                continue
            try:
                err = None
                if batch <= 64 or self.dry:  # correctness of this method on the first call
                    ids, w = routed[0]
                    if ref is None:
                        from moecompress.reference import experts_forward

                        ref = experts_forward(c["bank"], inputs[0][0], ids, w, c["emap"]).float()
                    got = fn(inputs[0][0], ids, w).float()
                    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
                wr = c["wr"]
                us, note = time_calls(lambda x, b, fn=fn, wr=wr: fn(x, *route(x, wr, b, k)), inputs,
                                      graph=method != "eager")
            except Exception as exc:  # one failing method must not lose the rest of the run
                self.skipped.append(f"{tag}: {type(exc).__name__}: {str(exc)[:200]}")
                print(f"  FAILED {tag}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            self.rows.append(dict(shape=shape, variant=variant, method=method, routing=routing, batch=batch,
                                  us=us, bytes=nbytes, flops=flops, layers=layers, err=err, note=note))
            print(f"{shape:14s} {variant:12s} {method:10s} {routing:11s} B={batch:<5d} {us:10.1f} us"
                  + ("" if err is None else f"  err {err:.1e}"), flush=True)

    def finish(self, roof) -> list[dict]:
        bw, pk = roof["copy_TBps"] * 1e12, roof["matmul_TFLOPs"] * 1e12
        base = {(r["shape"], r["routing"], r["batch"], r["method"]): r["us"] for r in self.rows if r["variant"] == "bf16"}
        out = []
        for r in self.rows:
            floor = r["bytes"] / bw * 1e6
            tf = r["flops"] / (r["us"] * 1e-6) / 1e12
            vl = base.get((r["shape"], r["routing"], r["batch"], "vllm"))
            k2 = base.get((r["shape"], r["routing"], r["batch"], "k2"))
            eg = next((x["us"] for x in self.rows if x["method"] == "eager" and
                       (x["shape"], x["variant"], x["routing"], x["batch"]) ==
                       (r["shape"], r["variant"], r["routing"], r["batch"])), None)
            out.append(dict(
                shape=r["shape"], variant=r["variant"], method=r["method"], routing=r["routing"], batch=r["batch"],
                us=round(r["us"], 2), bytes=int(r["bytes"]), floor_us=round(floor, 2),
                pct_floor=round(100 * floor / r["us"], 1), tflops=round(tf, 2), pct_matmul=round(100 * tf * 1e12 / pk, 1),
                vs_vllm=None if vl is None else round(vl / r["us"], 2),
                vs_eager=None if eg is None else round(eg / r["us"], 2),
                vs_k2_bf16=None if k2 is None else round(k2 / r["us"], 2),
                per_token_ms=round(r["us"] * r["layers"] / 1e3, 3),
                err=None if r["err"] is None else float(f"{r['err']:.2e}"), note=r["note"]))
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_moe_out"), help="output folder (default $OUT)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 on CPU")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting rows after this (330 GPU, 50 dry; --only quantised: 150 GPU)")
    ap.add_argument("--only", choices=["quantised"], default=None,
                    help="quantised: issue 39's rows (bf16 K2, codebook 4/2-bit, rtn 4-bit), <= 3 min on an H200")
    args = ap.parse_args(argv)
    t0 = time.time()
    budget = args.budget_s or (50.0 if args.dry_run else 150.0 if args.only else 330.0)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on CPU", file=sys.stderr)
        return 2
    torch.set_num_threads(1 if args.dry_run else torch.get_num_threads())
    bench = Bench(args)
    roof = roofs(bench.dev)
    print(f"roofs: copy {roof['copy_TBps']:.3f} TB/s, matmul {roof['matmul_TFLOPs']:.1f} TFLOP/s", flush=True)
    for shape, variant, routing, batch, methods in plan(args.dry_run, args.only):
        bench.run_row(shape, variant, routing, batch, methods, t0 + budget)
    rows = bench.finish(roof)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "gpu_moe.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=COLUMNS)
        wr.writeheader()
        wr.writerows(rows)
    import triton

    meta = dict(device="cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                roofs=roof, seconds=round(time.time() - t0, 1), rows=rows, skipped=bench.skipped)
    (out / "gpu_moe.json").write_text(json.dumps(meta, indent=1))
    print(f"{len(rows)} rows, {len(bench.skipped)} skipped, {time.time() - t0:.0f} s -> {out}", flush=True)
    quant = [r for r in rows if r["variant"] in QUANTISED]
    if quant:  # issue 39's table: speed-up over the bf16 K2 layer of the same batch
        print("shape          variant    B      us     vs_k2_bf16  pct_floor")
        for r in quant:
            print(f"{r['shape']:14s} {r['variant']:10s} {r['batch']:<6d} {r['us']:9.1f}  {r['vs_k2_bf16']}  "
                  f"{r['pct_floor']}", flush=True)  # fmt: skip
    bad = [r for r in rows if r["err"] is not None and not (math.isfinite(r["err"]) and r["err"] <= 2e-2)]
    for r in bad:
        print(f"ERROR too large: {r}", file=sys.stderr)
    return 1 if bad and args.dry_run else 0


if __name__ == "__main__":
    sys.exit(main())
