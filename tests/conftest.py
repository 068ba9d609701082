from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Triton kernels run in its CPU interpreter when no CUDA device is present; the variable must be set
# before triton is first imported (KERNELS.md §5-§6).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernel tests run: ``cuda`` when available, else ``cpu`` (Triton's interpreter, above)."""
    from kernel_device import DEV

    return DEV


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not (SHARED / "data" / "models").is_dir():
        pytest.skip("../shared reference data is absent")
    return SHARED


@pytest.fixture
def small_tmpfs(tmp_path):
    """``small_tmpfs(size_bytes, read_only=False)`` -> a directory on its own small tmpfs (a real full
    disk or read-only file system); skips where mounting is not permitted."""
    import subprocess

    mounts = []

    def make(size: int, read_only: bool = False) -> Path:
        path = tmp_path / f"disk{len(mounts)}"
        path.mkdir()
        opts = f"size={size}" + (",ro" if read_only else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
        mounts.append(path)
        return path

    yield make
    for path in mounts:  # lazily where a file is still open there (else pytest's tmp cleanup warns for ever)
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
