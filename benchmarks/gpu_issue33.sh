#!/usr/bin/env bash
# Issue 33, item 5, on one H200 in a single run (under 8 minutes): the Triton kernel tests on CUDA (the
# full count, not -x) and benchmarks/gpu_device_check.py (calibration.device: cuda against the CPU).
#
# Run it from the device tool, at the repository root:
#     command:  bash benchmarks/gpu_issue33.sh        carry: ["wheels"]        timeout_s: 540
# Outputs in $OUT (7 files): summary.txt (counts and timings, also printed last), env.txt, install.log,
# pytest.log, kernels.xml (junit), device_check.jsonl (one JSON line per check), device_check.err.
#
# Needs wheels/ at the repository root, built here with `bash benchmarks/gpu_wheels.sh` (about 26 MB):
#   moecompress-0.1.0-py3-none-any.whl            this checkout, `pip wheel --no-deps .`
#   pydantic-2.14.4, annotated_types-0.8.0, typing_inspection-0.4.5, typing_extensions-4.16.0 (py3-none-any)
#   pydantic_core-2.50.5 cp310/cp311/cp312/cp313 manylinux x86_64 (the machine's python3 was 3.12.3)
#   tensorly-0.10.0 (py3-none-any; without it the tucker kernel tests skip)
#   pyyaml-6.0.4 (cp310-cp313), safetensors-0.8.0 (abi3), tqdm-4.70.1, sortedcontainers-2.4.0,
#   attrs-26.1.0: on the machine already; used only where its own are missing
# The machine's torch 2.11, triton 3.6, transformers 5.17, numpy, scipy, pytest, hypothesis (and
# pytest-xdist, used for the compiles when present) stay as they are: pip installs from wheels/ only what
# is missing. moecompress needs transformers>=5.13 (pyproject), and the machine's 5.17 satisfies it.
# Everything runs with `python -P`, so the checkout never shadows the installed package.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out-gpu-issue33}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WORKERS=${WORKERS:-8}  # pytest-xdist processes compiling kernels in parallel (0: one process)
DEADLINE=${DEADLINE:-465}  # seconds: everything is cut to end by then
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T0=$SECONDS
log() { echo "[$((SECONDS - T0))s] $*" | tee -a "$OUT/summary.txt"; }
left() { echo $((DEADLINE - (SECONDS - T0))); }

# 1. install what the machine lacks, from wheels/ only, without touching what it has (--no-deps: the
#    resolver never revisits torch's own requirements); the versions pinned are those of wheels/
[ -d wheels ] || { log "no wheels/ folder: build it with benchmarks/gpu_wheels.sh and carry it"; exit 2; }
MUST=()
for w in wheels/{moecompress,pydantic,pydantic_core,annotated_types,typing_inspection,tensorly}-*.whl; do
    b=$(basename "$w"); r=${b#*-}; MUST+=("${b%%-*}==${r%%-*}")
done
mapfile -t MUST < <(printf '%s\n' "${MUST[@]}" | sort -u)
IFMISSING=("typing_extensions>=4.14.1" pyyaml tqdm "safetensors>=0.8" sortedcontainers attrs)
PIP=(timeout 120 "$PY" -m pip install --no-index --no-deps --find-links wheels --no-cache-dir --no-compile)
if "${PIP[@]}" "${MUST[@]}" "${IFMISSING[@]}" >"$OUT/install.log" 2>&1; then
    log "installed ${MUST[*]} into $("$PY" -c 'import sys; print(sys.prefix)')"
else
    log "pip install into the environment failed (install.log); installing to /tmp/site"
    "${PIP[@]}" --target /tmp/site "${MUST[@]}" "typing_extensions>=4.14.1" >>"$OUT/install.log" 2>&1 \
        || { log "install failed (install.log)"; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
    nvidia-smi -L 2>&1
    "$PY" -P -c '
import importlib.metadata as m, sys, torch, triton, transformers, numpy, pydantic, moecompress
from moecompress.kernels import dispatch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "", "| triton", triton.__version__,
      "| transformers", transformers.__version__, "| numpy", numpy.__version__, "| pydantic", pydantic.__version__)
for name in ("tensorly", "hypothesis", "pytest", "pytest-xdist"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "absent")
print("moecompress", moecompress.__version__, "from", moecompress.__file__)
print("kernels from", dispatch.__file__)
'
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
grep -q "from $PWD/moecompress" "$OUT/env.txt" && log "WARNING: moecompress imported from the checkout, not the wheel"

# 2. the kernel tests on CUDA (conftest sets TRITON_INTERPRET only without CUDA); the full count
XDIST=()
if [ "$WORKERS" -gt 0 ] && "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n "$WORKERS"); fi
T=$(($(left) - 150))  # keep 150 s for the device check
[ "$T" -gt 300 ] && T=300
log "kernel tests: ${XDIST[*]:-one process}, timeout ${T}s"
timeout -s INT -k 15 "$T" "$PY" -P -m pytest tests/test_kernels_*.py -q -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} \
    -rfEs --durations=15 --junitxml="$OUT/kernels.xml" >"$OUT/pytest.log" 2>&1
rc=$?
tail -n 40 "$OUT/pytest.log"
log "kernel tests: exit $rc; $(grep -E '(passed|failed|error)' "$OUT/pytest.log" | tail -n 1)"

# 3. calibration.device: cuda against the CPU; checks not started within the budget are printed as skipped;
#    the timing check at half its sizes (at full size its CPU side alone takes minutes)
T=$(($(left) - 5))
[ "$T" -gt 240 ] && T=240
B=$((T - 45))
[ "$B" -lt 10 ] && B=10
log "gpu_device_check: timeout ${T}s, budget ${B}s"
# shellcheck disable=SC2086  # CHECK_ARGS: extra options, e.g. "--device cpu --small" to rehearse on a CPU
timeout -s INT -k 5 "$T" "$PY" -P benchmarks/gpu_device_check.py --budget-s "$B" --timing-scale 2 ${CHECK_ARGS:-} \
    >"$OUT/device_check.jsonl" 2>"$OUT/device_check.err"
rc2=$?
cat "$OUT/device_check.jsonl"
tail -n 5 "$OUT/device_check.err"
log "gpu_device_check: exit $rc2; $(grep '"check": "done"' "$OUT/device_check.jsonl" || echo 'no done line (cut by the timeout?)')"
log "total $((SECONDS - T0))s"
cat "$OUT/summary.txt"
[ "$rc" -eq 0 ] && [ "$rc2" -eq 0 ]
