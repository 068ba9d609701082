"""CPU seconds per expert of ``svd_experts``' factorisation and ``tdmoe``'s chunked pieces at DeepSeek-V3
shapes (hidden 7168, expert width 2048: gate/up ``[2048, 7168]``, down ``[7168, 2048]``), one thread: the
code as it was at a8b887c (``_legacy_*``, its maths copied) and now, interleaved in one process, best of
``--repeat``. Per expert of a 64-expert layer, svd_experts costs ``svd.per_expert_new_s`` plus
``whiteners.new_per_layer_s / 64``; tdmoe by chunks ``gather.new_s + project.new_s`` plus
``(whiteners.new_per_layer_s + fit_once_per_layer_s) / 64``.

Data: bf16 weights ``N(0, 0.02²)``, random SPD covariances with a spread spectrum
(``D (ZZᵀ/k + 0.1 I) D``, ``D`` log-uniform over two decades, so that eigenvalue clamping is active).
The whiteners of the factorisation pieces are plain Cholesky factors of these (the pieces' cost does not
depend on how the triangle was made); ``whiteners`` times :func:`projection_whiteners` itself.

Pieces (``--pieces``; each run adds its keys to ``--out``):

- ``whiteners``: ``projection_whiteners`` (input side) now, and one more Cholesky of the 7168 covariance
  (before, gate and up each made theirs; and ``svd_experts`` made them once per chunk of experts); ``chol``
  of a 7168 covariance with clamped eigenvalues and of one without (now: no eigendecomposition).
- ``svd``: ``factorize`` of one expert per projection shape (gate == up), ``ratio 0.4``, 64 experts'
  ranks; the reconstruction ``u·v`` compared in float64 (the inputs are bf16 values held in float64).
- ``gather``: ``tdmoe_chunks.gather`` on a chunk of one expert (all three projections).
- ``fit``: ``tdmoe_chunks.fit`` once (ranks of 64 experts), then ``project`` on a chunk of one expert, the cores
  and stored factors compared.
- ``precision``: tdmoe by chunks with float64 work (the old default for every dtype) against float32 (bf16
  weights, ``work_dtype``), the same values: gather, fit, project and the reconstructions compared.

    OMP_NUM_THREADS=1 python benchmarks/decomp_speed.py --pieces svd gather
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moecompress.engine.spec import LayerStats
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.layouts.tucker import Tucker
from moecompress.methods.svd import factorize, rank_split, whitened_svd
from moecompress.methods.tucker import work_dtype
from moecompress.methods.whitening import Whitener, chol, projection_whiteners
from moecompress.passes import tdmoe_chunks as td

HID, WID, M = 7168, 2048, 64
OUT = Path(__file__).parent / "results" / "decomp_speed.json"


def _cov(n: int, g: torch.Generator) -> torch.Tensor:
    z = torch.randn(n, 1024, generator=g, dtype=torch.float64)
    d = torch.logspace(-1, 1, n, dtype=torch.float64)[torch.randperm(n, generator=g)]
    return d[:, None] * (z @ z.T / 1024 + 0.1 * torch.eye(n, dtype=torch.float64)) * d[None, :]


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _best(rows: list[dict]) -> dict:
    return {k: min(r[k] for r in rows) for k in rows[0]}


# -- the code before (verbatim maths) ------------------------------------------------------------------
def _legacy_whiten(wh: Whitener, w):
    w = w.double()
    if wh.left is not None:
        w = wh.left @ w
    return w if wh.right is None else w @ wh.right


def _legacy_unwhiten_in(wh: Whitener, v):
    return v if wh.right is None else torch.linalg.solve(wh.right.T, v.double())


def _legacy_factorize(w, wh, base, extra=0, chunk=16):  # the left (output) side is None here
    keep = min(base + (1 if extra else 0), *w.shape[1:])
    us, vs, ss = [], [], []
    for a in range(0, w.shape[0], chunk):
        u_, s, vh = torch.linalg.svd(_legacy_whiten(wh, w[a : a + chunk]), full_matrices=False)
        us.append((u_[:, :, :keep] * s[:, None, :keep]).to(w.dtype))
        vs.append(_legacy_unwhiten_in(wh, vh[:, :keep].transpose(1, 2)).transpose(1, 2).to(w.dtype))
        ss.append(s)
    return torch.cat(us), torch.cat(vs), torch.cat(ss)


def _legacy_gather(sub: MoELayer, acc: td.Grams) -> None:
    for proj in td.PROJ:
        full, wh = getattr(sub.experts, proj).dense(), acc.whiteners[proj]
        for e in range(sub.experts.num_experts):
            x = _legacy_whiten(wh, full[e])
            acc.g_out[proj].addmm_(x, x.T)
            acc.g_in[proj].addmm_(x.T, x)


def _legacy_project(sub: MoELayer, whiteners, white) -> dict:
    out = {}
    for proj in td.PROJ:
        lay, wh = getattr(sub.experts, proj), whiteners[proj]
        full, dt = lay.dense(), lay.dtype
        u_w, v_w = white[proj]
        xs = [_legacy_whiten(wh, full[e]) for e in range(lay.shape[0])]
        cores = torch.stack([u_w.T @ x @ v_w for x in xs])
        u_out, u_in = u_w, _legacy_unwhiten_in(wh, v_w)  # no output whitening: unwhiten_out is the identity
        new = Tucker(u_out.to(dt), u_in.to(dt), cores.to(dt), torch.arange(lay.shape[0]), None, None)
        err = ref = 0.0
        for e, x in enumerate(xs):
            err += float((_legacy_whiten(wh, new.expert(e).double()) - x).pow(2).sum())
            ref += float(x.pow(2).sum())
        out[proj] = (new, (err / ref) ** 0.5)
    return out


# -- the pieces ----------------------------------------------------------------------------------------
def _layer(weights: dict[str, torch.Tensor]) -> MoELayer:
    n = weights["gate"].shape[0]
    spec = RouterSpec(num_experts=n, top_k=1, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    bank = ExpertBank(*(Dense(weights[p]) for p in td.PROJ))
    return MoELayer(0, spec, torch.zeros(n, HID, dtype=weights["gate"].dtype), bank)


def piece_whiteners(data, reps: int) -> dict:
    stats = LayerStats(0, {"input_cov": data["cov_in"], "down_in_cov_pooled": data["cov_down"]})
    well = data["cov_in"] + 0.01 * float(data["cov_in"].diagonal().mean()) * torch.eye(
        HID, dtype=torch.float64
    )
    rows = []
    for _ in range(reps):
        t_new, _ = _timed(projection_whiteners, stats, "input")
        t_one, _ = _timed(chol, data["cov_in"])  # eigenvalues clamped: clamp_psd's eigh, then Cholesky
        t_well, _ = _timed(chol, well)  # none clamped: Cholesky only (before: as t_one)
        rows.append({"new_per_layer_s": t_new, "old_per_chunk_s": t_new + t_one, "chol_7168_clamped_s": t_one,
                     "chol_7168_unclamped_s": t_well})  # fmt: skip
    return _best(rows)


def piece_svd(data, whs, reps: int) -> dict:
    res = {}
    for proj in ("gate", "down"):
        w = data["w"][proj][:1].double()  # bf16 values, held in float64 (compared before any cast)
        base, extra = rank_split(*w.shape[1:], M, 0.4)
        rows = []
        for _ in range(reps):
            t_old, (u0, v0, s0) = _timed(_legacy_factorize, w, whs[proj], base, extra)
            t_new, (pairs, _) = _timed(factorize, w, whs[proj], base, extra)
            rows.append({"old_s": t_old, "new_s": t_new})
        (u1, v1), r = pairs[0], pairs[0][0].shape[1]
        a, b = u0[0, :, :r] @ v0[0, :r], u1 @ v1
        s1 = whitened_svd(w[0], whs[proj], 1)[2]
        res[proj] = {**_best(rows), "rank": r, "recon_rel_diff": float((a - b).norm() / a.norm()),
                     "kept_s_max_diff_over_s1": float((s0[0, : r + 1] - s1[: r + 1]).abs().max() / s0[0, 0])}  # fmt: skip
    res["per_expert_old_s"] = 2 * res["gate"]["old_s"] + res["down"]["old_s"]
    res["per_expert_new_s"] = 2 * res["gate"]["new_s"] + res["down"]["new_s"]
    return res


def _acc(whs, members: int = 0, dtype: torch.dtype = torch.float64) -> td.Grams:
    acc = td.Grams(dict(whs), {}, {}, members)
    for proj, (o, i) in {"gate": (WID, HID), "up": (WID, HID), "down": (HID, WID)}.items():
        acc.g_out[proj] = torch.zeros(o, o, dtype=dtype)
        acc.g_in[proj] = torch.zeros(i, i, dtype=dtype)
        acc.energy[proj] = []
        acc.work[proj] = whs[proj].to(dtype=dtype)
    return acc


def piece_gather(data, whs, reps: int) -> dict:
    sub, cfg, stats = _layer({p: data["w"][p][:1] for p in td.PROJ}), td.TdmoeConfig(), LayerStats(0)
    rows = []
    for _ in range(reps):
        t_old, _ = _timed(_legacy_gather, sub, _acc(whs))
        t_new, _ = _timed(td.gather, sub, stats, cfg, _acc(whs))
        rows.append({"old_s": t_old, "new_s": t_new})
    return _best(rows)


def piece_fit_project(data, whs, reps: int) -> dict:
    sub, cfg = _layer({p: data["w"][p][:1] for p in td.PROJ}), td.TdmoeConfig()
    acc = td.gather(sub, LayerStats(0), cfg, _acc(whs))
    acc.members = M  # the ranks of a 64-expert layer
    t_fit, pre = _timed(td.fit, acc, sub, LayerStats(0), cfg)
    del acc
    white = {p: (pre.inner[p][0], torch.linalg.solve_triangular(whs[p].right, pre.inner[p][1], upper=False))
             for p in td.PROJ}  # U_out (no output whitening) and U_in = B⁻¹ (B U_in)  # fmt: skip
    rows = []
    for _ in range(reps):
        t_old, old = _timed(_legacy_project, sub, whs, white)
        t_new, (new, info) = _timed(td.project, sub, pre.chunk(0, 1))
        rows.append({"old_s": t_old, "new_s": t_new})
    diffs = {}
    for p in td.PROJ:
        a, b = old[p][0].expert(0).double(), getattr(new.experts, p).expert(0).double()
        diffs[p] = {"recon_rel_diff": float((a - b).norm() / a.norm()), "err_old": old[p][1],
                    "err_new": info[p]["whitened_rel_error"], "ranks": info[p]["ranks"]}  # fmt: skip
    return {"fit_once_per_layer_s": t_fit, "project": {**_best(rows), **diffs}}


def piece_precision(data, whs, reps: int, gathered: int) -> dict:
    """tdmoe by chunks in float64 (the weights' bf16 values held as float32: ``work_dtype`` float64, what
    every dtype used before) against float32 (bf16 weights), the same values, interleaved: ``gather`` of
    ``gathered`` experts (per expert), ``fit`` (once; ranks of 64 experts), ``project`` of one expert; the
    stored factors and the expert's reconstruction compared (relative to bf16's eps)."""
    cfg, out, eps = td.TdmoeConfig(), {}, torch.finfo(torch.bfloat16).eps
    g = torch.Generator().manual_seed(1)
    w = {p: torch.cat([data["w"][p][:1], (0.02 * torch.randn(gathered - 1, *data["w"][p].shape[1:], generator=g))
                       .bfloat16()]) for p in td.PROJ}  # fmt: skip
    subs = {torch.float64: _layer({p: w[p].float() for p in td.PROJ}), torch.float32: _layer(w)}
    assert all(work_dtype(s.experts.gate.dtype) == dt for dt, s in subs.items())
    timing: dict[str, list[dict]] = {"gather": [], "project": []}
    pres, news = {}, {}
    for rep in range(reps):
        row_g, row_p = {}, {}
        for dt, sub in subs.items():
            key = str(dt).removeprefix("torch.")
            t, acc = _timed(td.gather, sub, LayerStats(0), cfg, _acc(whs, 0, dt))
            row_g[key + "_per_expert_s"] = t / gathered
            if rep == 0:
                acc.members = M
                t_fit, pres[dt] = _timed(td.fit, acc, sub, LayerStats(0), cfg)
                out[key + "_fit_once_per_layer_s"] = t_fit
            del acc
            one = _layer({p: getattr(sub.experts, p).dense()[:1] for p in td.PROJ})
            t, news[dt] = _timed(td.project, one, pres[dt].chunk(0, 1))
            row_p[key + "_s"] = t
        timing["gather"].append(row_g)
        timing["project"].append(row_p)
    out["gather"], out["project"] = _best(timing["gather"]), _best(timing["project"])
    (a, ia), (b, ib) = news[torch.float64], news[torch.float32]
    for p in td.PROJ:
        x, y = getattr(a.experts, p).expert(0).double(), getattr(b.experts, p).expert(0).double()
        out[p] = {"recon_rel_diff_over_bf16_eps": float((x - y).norm() / x.norm()) / eps,
                  "whitened_rel_error": [ia[p]["whitened_rel_error"], ib[p]["whitened_rel_error"]],
                  "ranks": ia[p]["ranks"]}  # fmt: skip
    f64, f32 = (out["gather"]["float64_per_expert_s"] + out["project"]["float64_s"],
                out["gather"]["float32_per_expert_s"] + out["project"]["float32_s"])
    out["layer_of_64_experts_s"] = {"float64": M * f64 + out["float64_fit_once_per_layer_s"],
                                    "float32": M * f32 + out["float32_fit_once_per_layer_s"]}  # fmt: skip
    return out


def main() -> None:
    global HID, WID
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pieces", nargs="+", default=["svd", "gather"],
                    choices=["whiteners", "svd", "gather", "fit", "precision"])  # fmt: skip
    ap.add_argument("--gathered", type=int, default=8, help="precision: experts in the Gram sweep")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--shape", type=int, nargs=2, default=[HID, WID], help="hidden, width (smoke runs)")
    args = ap.parse_args()
    HID, WID = args.shape
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = {"w": {p: (0.02 * torch.randn(1, *((WID, HID) if p != "down" else (HID, WID)), generator=g)).bfloat16()
                  for p in td.PROJ}, "cov_in": _cov(HID, g), "cov_down": _cov(WID, g)}  # fmt: skip
    whs = None
    if set(args.pieces) - {"whiteners"}:
        l_in, l_down = torch.linalg.cholesky(data["cov_in"]), torch.linalg.cholesky(data["cov_down"])
        whs = {"gate": Whitener(right=l_in), "up": Whitener(right=l_in), "down": Whitener(right=l_down)}
    res = json.loads(args.out.read_text()) if args.out.exists() else {}
    res["setup"] = {"hidden": HID, "width": WID, "experts_for_ranks": M, "ratio": 0.4, "threads": 1,
                    "repeat": args.repeat, "cpu": _cpu(), "before": "a8b887c"}  # fmt: skip
    for piece in args.pieces:
        print(piece, flush=True)
        if piece == "whiteners":
            res[piece] = piece_whiteners(data, args.repeat)
        elif piece == "svd":
            res[piece] = piece_svd(data, whs, args.repeat)
        elif piece == "gather":
            res[piece] = piece_gather(data, whs, args.repeat)
        elif piece == "precision":
            res[piece] = piece_precision(data, whs, args.repeat, args.gathered)
        else:
            res[piece] = piece_fit_project(data, whs, args.repeat)
        print(json.dumps(res[piece], indent=1), flush=True)
        res.update(_estimate(res))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")


def _estimate(res: dict) -> dict:
    """CPU seconds of one 64-expert layer, now (the module docstring's sums), once every piece is in."""
    if not {"whiteners", "svd", "gather", "fit"} <= res.keys():
        return {}
    wh, fit = res["whiteners"]["new_per_layer_s"], res["fit"]["fit_once_per_layer_s"]
    td_expert = res["gather"]["new_s"] + res["fit"]["project"]["new_s"]
    return {"layer_of_64_experts_s": {"svd_experts": M * res["svd"]["per_expert_new_s"] + wh,
                                      "tdmoe_by_chunks": M * td_expert + wh + fit}}  # fmt: skip


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
