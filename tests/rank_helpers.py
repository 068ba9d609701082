"""What the multi-rank tests share (``test_distributed``, ``test_every_pass_on_two_ranks``, ``test_fsdp``): the
calibration of their recipes, the environment ``torchrun`` would give a rank, one thread for the one-process
reference, and the hashes of an output's weights and configs."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from contextlib import contextmanager

import torch

CAL = {"source": "random", "samples": 10, "seq_len": 12, "batch_size": 2, "holdout": 2}
# 5 batches: two ranks get 3 and 2 (an uneven last round), one of them held back


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}  # fmt: skip


def _weight_bytes(p) -> bytes:
    """A file's bytes; a config without its ``recipe_hash`` (the two recipes name different outputs)."""
    data = p.read_bytes()
    if p.name == "config.json":
        text = data.decode()
        cfg = json.loads(text)
        digest = cfg.get("moecompress", {}).pop("recipe_hash", None)
        assert digest is not None and text.count(digest) == 1
        data = text.replace(digest, "").encode()
    return data


def output_hashes(path) -> dict[str, str]:
    """Every weight file and config (reports hold timings; the recipe names its own output)."""
    files = [p for p in sorted(path.rglob("*")) if p.suffix == ".safetensors" or p.name.endswith("config.json")
             or p.name.endswith(".index.json")]  # fmt: skip
    return {str(p.relative_to(path)): hashlib.sha256(_weight_bytes(p)).hexdigest() for p in files}


@contextmanager
def one_thread():
    """The ranks run with ``OMP_NUM_THREADS=1`` (:func:`rank_env`); the one-process reference must too: with two
    intra-op threads a matmul may split its reduction differently, and the bytes differ."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
