"""Resolve a checkpoint argument: a local directory, a bundled model, or a Hugging Face Hub repo id.

``moecompress:NAME`` names a small model shipped inside the package (``moecompress/data/``), so the
quickstart runs on a fresh clone with no network: ``moecompress:quickstart`` is a 2.3M-parameter
Qwen3-MoE (see ``scripts/train_tiny_moe.py``).

From the Hub, only safetensors weights, JSON configs and tokenizer files are downloaded; pickle
weights (``*.bin``, ``*.pt``) and remote code are never fetched. A snapshot's files are symlinks into
the repo's ``blobs/`` folder (``models--org--name/snapshots/<rev>/f -> ../../blobs/<hash>``):
:func:`allowed_roots` says where the files of a checkpoint directory may point.
"""

from __future__ import annotations

import re
from pathlib import Path

from moecompress.errors import CheckpointError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
BUNDLED_PREFIX = "moecompress:"
BUNDLED = {"quickstart": "quickstart-qwen3moe"}  # moecompress:NAME -> folder in moecompress/data/
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja", "*.md"]


def resolve_checkpoint_dir(path_or_id: str | Path, *, revision: str | None = None) -> Path:
    """Return a local directory for ``path_or_id``, downloading a Hub snapshot if needed."""
    if isinstance(path_or_id, str) and path_or_id.startswith(BUNDLED_PREFIX):
        return bundled_model_dir(path_or_id[len(BUNDLED_PREFIX) :])
    path = Path(path_or_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; pass the checkpoint *directory* (with config.json)")
        return path
    text = str(path_or_id)
    if not _REPO_ID.match(text) or text.startswith((".", "/", "~")):
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id=text, revision=revision, allow_patterns=ALLOW_PATTERNS)
    except Exception as err:  # offline, unknown repo, gated repo, auth: all end the same way for the user
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{text!r} is not a local directory and could not be downloaded from the Hugging Face Hub "
            f"({type(err).__name__}: {reason}). Pass a local checkpoint directory, or check the repo id, "
            "your network and HF_TOKEN."
        ) from None
    return Path(local)


def allowed_roots(directory: str | Path) -> list[Path]:
    """The resolved folders that the files of ``directory`` may resolve into: the directory itself, and
    for a Hub cache snapshot (``models--org--name/snapshots/<rev>``) also the repo's ``blobs/`` folder."""
    root = Path(directory).resolve()
    roots = [root]
    repo = root.parent.parent
    if root.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        roots.append((repo / "blobs").resolve())
    return roots


def bundled_model_dir(name: str) -> Path:
    """The directory of the bundled model ``moecompress:NAME`` inside the installed package."""
    if name not in BUNDLED:
        known = ", ".join(BUNDLED_PREFIX + n for n in sorted(BUNDLED))
        raise CheckpointError(
            f"unknown bundled model {BUNDLED_PREFIX}{name}; the bundled models are: {known}"
        )
    path = Path(__file__).resolve().parent.parent / "data" / BUNDLED[name]
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"the bundled model {BUNDLED_PREFIX}{name} is missing from this installation ({path}); "
            "reinstall moecompress with its package data, or pass a checkpoint directory"
        )
    return path
