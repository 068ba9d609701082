"""Run README.md's commands the way a user types them, from the root of a fresh copy of the clone.

CI runs it after the test suite (`.ci/run`, lane 1). The repository's tracked files are copied, symlinks
kept, into a temporary folder; that folder is the working directory of every command, exactly as when a
user pastes the commands into a shell at the clone root (so a top-level folder that shadowed an
installed package, as `kernels/` once shadowed PyPI's `kernels`, fails here). Every fenced `bash` block
after the install section runs line by line (continuation lines joined) in one `bash -e`, every fenced
`python` block as `python -c BLOCK`. The install block (the environment is already installed) and the
test-command block (CI runs it itself) are not run. The runnable commands of `docs/` run too
(`DOC_COMMANDS`); commands there that need a GPU, a Hub token or name a placeholder file are listed
in `DOC_NOT_RUN` with the reason. Exits non-zero, printing the failing command and its output::

    python scripts/check_readme.py            # README and docs
    python scripts/check_readme.py --list     # print what would run
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"(<!-- test-command -->\s*)?```(bash|python)\n(.*?)\n```", re.S)

# docs/ commands that run on a CPU as written (file, command)
DOC_COMMANDS = [
    ("docs/kernels.md", "python benchmarks/gpu_moe.py --dry-run"),
]
# docs/ commands that cannot run here as written, and why (checked to exist, so the list stays true)
DOC_NOT_RUN = {
    "OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m moecompress.cli apply recipe.yaml": "recipe.yaml is the user's",
    "torchrun --nproc_per_node 4 -m moecompress.cli apply recipe.yaml": "four GPUs",
    "torchrun --nnodes 2 --nproc_per_node 8": "two hosts",
    "moecompress export --format compressed-tensors out/rtn4 out/rtn4-ct": "out/rtn4 is the user's rtn output",
    "moecompress push out/qwen3-pruned --repo-id me/qwen3-pruned": "a Hub token",
    "python -m pytest tests/test_kernels_*.py": "the default test suite runs these",
    "python benchmarks/gpu_compile_check.py": "a CUDA GPU",
    "python benchmarks/gpu_moe.py --out results/": "a CUDA GPU",
}


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block after the install section, but the test command."""
    start = text.index("## Quickstart")
    return [(lang, body) for marker, lang, body in FENCE.findall(text[start:]) if not marker]


def bash_commands(body: str) -> list[str]:
    """One string per command: comments dropped, backslash continuations joined."""
    out, cur = [], ""
    for line in body.splitlines():
        code = re.sub(r"\s+#.*$", "", line).rstrip()
        if not code or code.lstrip().startswith("#"):
            continue
        cur = f"{cur} {code.strip()}" if cur else code.strip()
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
            continue
        out.append(cur)
        cur = ""
    return out


def doc_commands() -> list[str]:
    """Every bash command in docs/; raises when one is neither run nor listed as not run."""
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        rel = path.relative_to(ROOT).as_posix()
        for _, lang, body in FENCE.findall(path.read_text()):
            if lang == "bash":
                found += [(rel, c) for c in bash_commands(body)]
    return found


def _copy_clone(dst: Path) -> None:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        src, out = ROOT / rel, dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), out)
        elif src.is_file():
            shutil.copy2(src, out)


def _run(cmd: list[str], cwd: Path, label: str) -> str | None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    print(f"[{time.perf_counter() - t0:6.1f} s] {'ok  ' if r.returncode == 0 else 'FAIL'} {label}", flush=True)
    if r.returncode != 0:
        return f"{label}\nexit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return None


def plan() -> list[tuple[str, list[str]]]:
    """``(label, argv)`` of everything to run, in order."""
    steps = []
    for lang, body in readme_blocks((ROOT / "README.md").read_text()):
        if lang == "bash":
            for c in bash_commands(body):
                steps.append((f"README: {c}", ["bash", "-e", "-c", c]))
        else:
            steps.append((f"README python block ({len(body.splitlines())} lines)", [sys.executable, "-c", body]))
    listed = {c for _, c in DOC_COMMANDS}
    for path, c in doc_commands():
        if c in listed:
            steps.append((f"{path}: {c}", ["bash", "-e", "-c", c]))
        elif not any(c.startswith(k) for k in DOC_NOT_RUN):
            raise SystemExit(f"{path}: `{c}` is neither run nor listed in DOC_NOT_RUN of {Path(__file__).name}")
    for key in DOC_NOT_RUN:
        if not any(c.startswith(key) for _, c in doc_commands()):
            raise SystemExit(f"DOC_NOT_RUN names `{key}`, which no file in docs/ holds any more")
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the commands and exit")
    args = ap.parse_args(argv)
    steps = plan()
    if args.list:
        for label, _ in steps:
            print(label)
        return 0
    with tempfile.TemporaryDirectory(prefix="moecompress-clone-") as tmp:
        clone = Path(tmp)
        _copy_clone(clone)
        for label, cmd in steps:
            err = _run(cmd, clone, label)
            if err:
                print(err, file=sys.stderr)
                return 1
    print(f"all {len(steps)} README/docs commands ran from the clone root")
    return 0


if __name__ == "__main__":
    sys.exit(main())
