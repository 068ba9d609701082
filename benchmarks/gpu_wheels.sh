#!/usr/bin/env bash
# Build wheels/ for benchmarks/gpu_issue33.sh, here (with network), before a GPU session.
#
#   bash benchmarks/gpu_wheels.sh            # -> wheels/ at the repository root (git-excluded locally)
#
# The device machine has torch 2.11, triton 3.6, transformers 5.17, numpy, scipy, pytest, pyyaml, tqdm,
# safetensors and hypothesis (the kernel tests do not use it), but neither pydantic nor tensorly, and no
# network. This folder carries:
#   moecompress-<version>-py3-none-any.whl     this checkout (pip wheel --no-deps .)
#   pydantic, annotated_types, typing_inspection, typing_extensions   pure Python
#   pydantic_core                              compiled: one wheel per CPython 3.10-3.13 (manylinux x86_64)
#   tensorly                                   pure Python (the tucker/tdmoe kernel tests; needs numpy, scipy)
#   pyyaml (compiled, per CPython), tqdm, safetensors (abi3), sortedcontainers, attrs:
#                                              already on the machine; carried in case its image changes
#                                              (pip keeps an installed version that satisfies moecompress)
# Versions are the ones of this venv (a combination the test suite passed with). About 20 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-wheels}
PY=${PYTHON:-python}
rm -rf "$W" && mkdir -p "$W"
grep -qxF "/$W/" .git/info/exclude 2>/dev/null || echo "/$W/" >>.git/info/exclude

ver() { "$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }
pin() { for p in "$@"; do echo "$p==$(ver "$p")"; done; }

"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$W" .

PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$W" \
    $(pin pydantic annotated_types typing_inspection typing_extensions tensorly tqdm sortedcontainers attrs)
for v in 3.10 3.11 3.12 3.13; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$v" "${PLAT[@]}" \
        -d "$W" $(pin pydantic_core pyyaml safetensors)
done
ls -1 "$W"
du -sh "$W"
