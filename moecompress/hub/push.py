"""Upload a compressed checkpoint directory to the Hugging Face Hub (``moecompress push``).

What is uploaded is exactly :func:`upload_files`: the files moecompress writes in an output and nothing
else — the weights (``*.safetensors``) and their index, ``config.json``, the model files a run carries
over from its input (:func:`moecompress.io.checkpoint.is_model_file`: tokenizer, generation config,
license, ...), ``recipe.yaml``, ``report.json``, ``report.md``, the ``README.md`` card, and under
``steps/`` the same names plus the report plots (``*.png``). A symlink whose target leaves the
directory is never uploaded. Everything else is listed by :func:`skipped_files` (and in the summary's
``skipped``); hidden folders (the statistics cache ``.moecompress-cache``, ``.<out>.partial``) and
``__pycache__`` are listed once, not walked. Without a ``README.md`` (or when it is the base
model's card, which a run copies with the other non-weight files) the model card is generated first
(:mod:`moecompress.hub.card`, from ``report.json`` and ``config.json``). ``dry_run=True`` makes no
network call: it copies exactly those files, plus the generated card, into a staging directory
(default ``<dir>.push-preview`` beside it) — the folder that would be uploaded.

The token is an argument (the CLI takes it from ``--token`` or ``HF_TOKEN``); it is handed to
``HfApi`` only, never written or logged, and scrubbed from error messages.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi

from moecompress.errors import MoecompressError, OutputExistsError
from moecompress.hub.card import card_inputs, model_card, write_model_card
from moecompress.io.checkpoint import is_model_file
from moecompress.io.reader import INDEX_NAME, is_confined


class HubError(MoecompressError):
    """A push cannot be done: bad repo id or folder, or the Hub refused or could not be reached."""


_REPO_PART = re.compile(r"^[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?$")
CACHE_DIRS = frozenset({".moecompress-cache", "__pycache__"})
OUTPUT_FILES = frozenset({INDEX_NAME, "config.json", "recipe.yaml", "report.json", "report.md", "README.md"})
_SECRETS = (re.compile(r"hf_[A-Za-z0-9]{6,}"), re.compile(r"(?i)(bearer\s+)\S+"))


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it is ``owner/name`` as the Hub accepts it, else a one-line :class:`HubError`."""
    text = str(repo_id)
    parts = text.split("/")
    ok = (
        len(parts) == 2
        and all(_REPO_PART.match(p) for p in parts)
        and "--" not in text
        and ".." not in text
        and len(parts[1]) <= 96
        and not parts[1].endswith(".git")
    )
    if not ok:
        raise HubError(
            f"repo id {text!r} is not of the form owner/name (letters, digits, '-', '_', '.'; no '--' "
            "or '..'; at most 96 characters in the name), e.g. --repo-id me/qwen3-30b-pruned"
        )
    return text


def _uploaded(rel: str) -> bool:
    """Whether the file at relative POSIX path ``rel`` is one moecompress writes in an output."""
    *dirs, name = rel.split("/")
    if name.startswith(".") or (dirs and dirs[0] != "steps"):
        return False
    if dirs and name.endswith(".png"):  # the step reports' plots
        return True
    return name.endswith(".safetensors") or name in OUTPUT_FILES or is_model_file(name)


def _plan(folder: Path) -> tuple[list[str], list[str]]:
    """(files to upload, what is left out) as sorted relative POSIX paths; folders left out end in ``/``."""
    roots = [folder.resolve()]
    files, skipped = [], []
    for root, dirs, names in os.walk(folder):  # symlinked directories are not followed
        base = Path(root)
        for d in list(dirs):
            if d.startswith(".") or d in CACHE_DIRS or (base / d).is_symlink():
                dirs.remove(d)
                skipped.append((base / d).relative_to(folder).as_posix() + "/")
        for name in names:
            path = base / name
            rel = path.relative_to(folder).as_posix()
            ok = _uploaded(rel) and is_confined(path, roots) and path.is_file()
            (files if ok else skipped).append(rel)
    return sorted(files), sorted(skipped)


def upload_files(folder: Path) -> list[str]:
    """Relative POSIX paths of the files a push uploads from ``folder`` (sorted; see module docstring)."""
    return _plan(Path(folder))[0]


def skipped_files(folder: Path) -> list[str]:
    """Relative POSIX paths of what ``folder`` holds that a push leaves out (folders end in ``/``)."""
    return _plan(Path(folder))[1]


def _literal(path: str) -> str:
    """An fnmatch pattern that matches exactly ``path`` (for ``upload_folder(allow_patterns=...)``)."""
    return re.sub(r"([*?\[])", r"[\1]", path)


def _scrub(text: str, token: str | None) -> str:
    if token:
        text = text.replace(token, "***")
    text = _SECRETS[0].sub("hf_***", text)
    return _SECRETS[1].sub(r"\1***", text)


def _hub_error(err: Exception, repo_id: str, token: str | None) -> HubError:
    lines = str(err).strip().splitlines()
    reason = _scrub(lines[0] if lines else type(err).__name__, token)[:300]
    status = getattr(getattr(err, "response", None), "status_code", None)
    kind = type(err).__name__
    if status == 401 or kind == "LocalTokenNotFoundError":
        hint = "authentication failed: pass --token or set HF_TOKEN to a token with write access"
    elif status == 403:
        hint = f"the token may not write to {repo_id.split('/')[0]!r}: use a token with write access there"
    elif isinstance(err, (OSError, TimeoutError)) or "Connect" in kind or "Timeout" in kind:
        hint = "the Hub could not be reached: check the network (--dry-run works offline)"
    else:
        hint = "check the repo id, the token's permissions and the network"
    return HubError(f"push to {repo_id!r} failed ({kind}: {reason}); {hint}")


def _check_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise HubError(f"{folder} is not a directory; pass the checkpoint directory to push")
    if not (folder / "config.json").is_file():
        raise HubError(f"{folder} has no config.json; pass a checkpoint directory written by moecompress")


def _preview(folder: Path, files: list[str], card: str | None, staging: Path) -> None:
    """Copy ``files`` (and the generated card) into ``staging``, atomically."""
    if staging.exists() or staging.is_symlink():
        raise OutputExistsError(f"preview directory {staging} already exists; remove it or pass another one")
    src, dst = folder.resolve(), staging.resolve()
    if dst == src or src in dst.parents:
        raise HubError(f"preview directory {staging} must not be inside the checkpoint directory {folder}")
    if not staging.parent.is_dir():
        raise HubError(f"cannot create preview directory {staging}: {staging.parent} does not exist")
    tmp = Path(tempfile.mkdtemp(prefix=f".{staging.name}.", suffix=".tmp", dir=staging.parent))
    try:
        for rel in files:
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(folder / rel, target)
        if card is not None:
            (tmp / "README.md").write_text(card, encoding="utf-8")
        os.replace(tmp, staging)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _card_plan(folder: Path, files: list[str], repo_id: str) -> tuple[dict[str, Any] | None, str]:
    """Card inputs when a card must be (re)generated, and ``"generated"/"regenerated"/"existing"``.

    A run copies the base model's non-weight files, its ``README.md`` included: a README identical
    to the base model's card (found locally) is replaced by a generated one, which inherits its license.
    """
    if "README.md" not in files:
        return card_inputs(folder, repo_id=repo_id), "generated"
    if not (folder / "report.json").is_file():
        return None, "existing"
    try:
        inputs = card_inputs(folder, repo_id=repo_id)
        copied = (folder / "README.md").read_text(encoding="utf-8", errors="replace") == inputs["base_card"]
    except (MoecompressError, OSError):  # a damaged report: keep the README as it is
        return None, "existing"
    return (inputs, "regenerated") if copied else (None, "existing")


def push(
    path: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    dry_run: bool = False,
    token: str | None = None,
    staging: str | Path | None = None,
) -> dict[str, Any]:
    """Upload the checkpoint directory ``path`` to the Hub repo ``repo_id`` (created if needed).

    Returns ``{"repo_id", "files", "bytes", "dry_run", "card", "skipped", ...}``: ``skipped`` lists
    what the folder holds that is not uploaded (:func:`skipped_files`); with ``dry_run`` also
    ``"folder"`` (the staging copy, nothing sent); otherwise ``"private"`` and ``"commit_url"``.
    ``card`` is ``"existing"``, ``"generated"`` (there was no README.md) or ``"regenerated"`` (the
    README.md was the base model's card, copied by the run). A real push writes a generated card into
    ``path``; a dry run only into the staging copy.
    """
    repo_id = check_repo_id(repo_id)
    folder = Path(path).expanduser()
    _check_folder(folder)
    files, skipped = _plan(folder)
    inputs, card = _card_plan(folder, files, repo_id)

    if dry_run:
        target = Path(staging) if staging is not None else folder.parent / f"{folder.name}.push-preview"
        text = model_card(folder, **inputs) if inputs is not None else None
        _preview(folder, files, text, target)
        files = upload_files(target)
        size = sum((target / f).stat().st_size for f in files)
        return {
            "repo_id": repo_id,
            "files": files,
            "bytes": size,
            "dry_run": True,
            "card": card,
            "skipped": skipped,
            "folder": str(target),
        }

    if inputs is not None:
        write_model_card(folder, **inputs)
        files = upload_files(folder)
    size = sum((folder / f).stat().st_size for f in files)
    from moecompress._version import __version__

    message = f"Upload {folder.name} with moecompress {__version__}"
    try:
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            allow_patterns=[_literal(f) for f in files],
            commit_message=message,
        )
    except Exception as err:  # auth, network, permissions, quota: one line, never the token
        raise _hub_error(err, repo_id, token) from None
    return {
        "repo_id": repo_id,
        "files": files,
        "bytes": size,
        "dry_run": False,
        "card": card,
        "skipped": skipped,
        "private": private,
        "commit_url": _scrub(str(getattr(info, "commit_url", info)), token),
    }
