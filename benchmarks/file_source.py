"""Time and peak memory of a ``file:`` calibration source: windows sampled vs the whole text tokenised.

``load_token_ids("file:DIR", samples, seq_len)`` on a large split samples one window per equal byte
range and tokenises only those (``sampled``). ``whole`` is the path every split took before issue 18
(and small splits still take): read every file, tokenise the whole split, draw the windows from the
token stream; it is run here with the module's own helpers (``_texts``, ``_split_text``,
``_tokenise``, ``_windows``), the same code the old ``load_token_ids`` ran.

Each measurement runs in a fresh interpreter (``VmHWM`` of that process, :func:`moecompress.engine.peak.peak_rss_bytes`; the baseline is the
peak after importing torch and transformers and loading the tokenizer, before any text is read). CPU
time is ``time.process_time()`` (the machine is shared, so wall time is printed but not compared).

    python benchmarks/file_source.py                       # ../shared corpus, ref-qwen3moe tokenizer
    python benchmarks/file_source.py --corpus DIR --model DIR --samples 128 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"

WORKER = r"""
import json, sys, time
mode, source, model, samples, seq_len, seed, split = sys.argv[1:8]
samples, seq_len, seed = int(samples), int(seq_len), int(seed)
import torch, transformers  # noqa: F401
from moecompress.calibration import sources, tokenizing
from moecompress.engine.peak import peak_rss_bytes
tok = tokenizing._load_tokenizer(sources.Path(model))
base = peak_rss_bytes()
t0, c0 = time.perf_counter(), time.process_time()
if mode == "sampled":
    ids = sources.load_token_ids(source, model_dir=model, samples=samples, seq_len=seq_len, seed=seed, split=split)
else:  # the whole-text path (before issue 18): every file read and tokenised
    spec = sources._parse(source)
    texts = [sources._split_text(text, split) for _, text in sources._texts(spec)]
    ids = sources._windows(tokenizing._tokenise(tok, texts), samples, seq_len, seed, what=source)
out = {"cpu": time.process_time() - c0, "wall": time.perf_counter() - t0, "base": base,
       "peak": peak_rss_bytes(), "shape": list(ids.shape),
       "min": int(ids.min()), "max": int(ids.max()), "text": tok.decode(ids[0].tolist())[:60]}
print(json.dumps(out))
"""


def run(mode: str, args: argparse.Namespace) -> dict:
    argv = [
        mode,
        f"file:{args.corpus}",
        str(args.model),
        str(args.samples),
        str(args.seq_len),
        str(args.seed),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, *argv, args.split], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=SHARED / "corpus", help="a .txt file or a directory")
    ap.add_argument("--model", type=Path, default=SHARED / "models" / "ref-qwen3moe", help="tokenizer dir")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="calibration", choices=["calibration", "eval"])
    ap.add_argument("--repeat", type=int, default=1, help="runs per mode (the fastest is reported)")
    args = ap.parse_args()
    if not args.corpus.exists() or not (args.model / "tokenizer.json").is_file():
        raise SystemExit(f"needs {args.corpus} and {args.model}/tokenizer.json (../shared data)")
    files = sorted(args.corpus.glob("*.txt")) if args.corpus.is_dir() else [args.corpus]
    mb = sum(p.stat().st_size for p in files) / 2**20
    print(
        f"file:{args.corpus} ({len(files)} files, {mb:.1f} MiB), tokenizer {args.model.name}, "
        f"{args.samples} x {args.seq_len} tokens, {args.split} split; fresh interpreter per run\n"
    )
    print("| mode | CPU s | wall s | peak RSS MiB | peak − baseline MiB | shape | first row starts |")
    print("|---|---:|---:|---:|---:|---|---|")
    for mode in ("whole", "sampled"):
        r = min((run(mode, args) for _ in range(args.repeat)), key=lambda x: x["cpu"])
        print(
            f"| {mode} | {r['cpu']:.2f} | {r['wall']:.2f} | {r['peak'] / 2**20:.0f} | "
            f"{(r['peak'] - r['base']) / 2**20:.0f} | {r['shape']} | {json.dumps(r['text'][:40])} |"
        )


if __name__ == "__main__":
    main()
