"""Evaluation on held-out text: perplexity, forward throughput and, against a base model, KL and top-1.

``evaluate(model, against=base)`` runs both models on the same token windows, batch by batch, and
returns a JSON-able dict::

    {"model", "against", "texts", "token_source", "seq_len", "windows", "tokens", "split_tokens",
     "dtype", "device", "loss", "perplexity", "seconds", "tokens_per_second",
     # only with against=:
     "base_loss", "base_perplexity", "base_tokens_per_second", "kl", "top1_agreement",
     # only with tasks= (lm-evaluation-harness, :mod:`moecompress.tools.lm_eval`):
     "tasks", "task_harness", and with against= also "base_tasks"}

Tokens. Texts (files, directories of ``*.txt``, or any text form of
:mod:`moecompress.calibration.sources`: ``builtin``, ``file:PATH``, ``hf:NAME``; default ``builtin``)
are tokenised with the tokenizer files of the model's own directory, exactly as calibration does, and
only their held-out ``eval`` split is used: the last 2% of each text, joined with the EOS token (a
newline without one). That stream is cut into its ``len // seq_len`` contiguous, non-overlapping
windows of ``seq_len`` tokens; ``max_tokens // seq_len`` of them are kept, evenly spaced over the
stream so that every text contributes (all of them when the split is short). There is no random
sampling: the windows depend only on the texts, the tokenizer, ``seq_len`` and ``max_tokens``.
``token_source="random"`` replaces the text by uniform token ids (the ``random`` source's eval
stream, seed 0) for models without tokenizer files; its numbers are for tests, not quality.

Metrics. Every window predicts its tokens 1..seq_len-1 from the preceding ones, so ``tokens`` =
``windows * (seq_len - 1)`` positions are scored. Logits are taken to float32 and ``log_softmax``-ed;
``loss`` is the mean next-token negative log-likelihood over those positions and ``perplexity`` its
exponential (what ``exp(model(ids, labels=ids).loss)`` gives on the same windows). With a base model,
``kl`` is the mean over the same positions of KL(base ‖ model) = Σ_v p_base (log p_base − log p_model)
in nats, and ``top1_agreement`` the fraction of positions whose argmax agrees. ``tokens_per_second`` is
``windows * seq_len`` input tokens divided by the wall-clock time of that model's forward passes only
(tokenising, loading and the metric arithmetic are excluded). Only one batch of logits per model is
held at a time.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from moecompress.calibration import sources, tokenizing
from moecompress.calibration.sources import CalibrationError
from moecompress.errors import MoecompressError

TOKEN_SOURCES = ("text", "random")
_SOURCE_FORMS = ("builtin", "file:", "hf:")


class EvaluationError(MoecompressError):
    """Evaluation arguments are unusable (sizes, vocabularies that differ, models that cannot run)."""


def evaluate(
    model,
    *,
    against=None,
    texts=None,
    max_tokens: int = 8192,
    seq_len: int = 256,
    batch_size: int = 4,
    dtype=None,
    device="cpu",
    progress: bool = False,
    token_source: str = "text",
    tokenizer=None,
    tasks=None,
    task_dir=None,
    limit: int | None = None,
    routing=None,
) -> dict:
    """Evaluate ``model`` (a checkpoint directory, Hub id or loaded transformers model) on held-out text.

    ``against``: the base model (same forms) for ``kl`` / ``top1_agreement`` / ``base_perplexity``.
    ``texts``: paths (or source strings) of the text; default ``["builtin"]``. ``tokenizer``: a
    directory of tokenizer files to use instead of the model's own (needed for a loaded model whose
    ``name_or_path`` is not a local directory). ``dtype`` / ``device`` apply to models loaded here
    (through :func:`moecompress.load`); loaded models are used where they are. See the module docstring
    for the windows and the metrics. ``tasks``: lm-eval task names (bundled, lm-eval's own, or YAML
    configs in ``task_dir``), run on the same loaded model(s) with at most ``limit`` documents each
    (:mod:`moecompress.tools.lm_eval`). ``routing``: the evaluated model's routing policies
    (``"off"``, ``"stored"`` or knobs, :func:`moecompress.set_routing`); the policies in force are reported
    under ``routing``.
    """
    _check_sizes(max_tokens, seq_len, batch_size)
    if tasks is not None:
        from moecompress.tools import lm_eval

        lm_eval.check(tasks, task_dir, limit)
    elif task_dir is not None or limit is not None:
        raise EvaluationError("task_dir and limit apply to lm-eval tasks; pass tasks=[...] (--tasks) too")
    if token_source not in TOKEN_SOURCES:
        raise EvaluationError(f"token_source must be one of {', '.join(TOKEN_SOURCES)}; got {token_source!r}")
    if token_source == "random" and texts is not None:
        raise EvaluationError("token_source='random' takes no texts; drop texts or use token_source='text'")
    texts = ["builtin"] if texts is None else [texts] if isinstance(texts, (str, Path)) else list(texts)
    if not texts:
        raise EvaluationError("texts is empty; pass at least one text file (or leave it out for builtin)")

    model_dir = _model_dir(model)
    base_dir = _model_dir(against) if against is not None else None
    if token_source == "random":
        ids = _random_ids(model, model_dir, max_tokens)
    else:
        ids = held_out_ids(texts, tokenizer if tokenizer is not None else model_dir, what=_name(model))
    windows = _windows(ids, seq_len, max_tokens)

    _check_model(model, model_dir, windows, seq_len)
    if against is not None:
        _check_model(against, base_dir, windows, seq_len)
    net = _load(model, model_dir, dtype, device)
    in_force = _routing(net, routing)
    base = _load(against, base_dir, dtype, device) if against is not None else None
    with _eval_mode(net), _eval_mode(base):
        sums = _run(net, base, windows, batch_size, progress)

    scored = windows.shape[0] * (seq_len - 1)
    fed = windows.numel()
    out = {
        "model": _name(model),
        "against": _name(against) if against is not None else None,
        "texts": [str(t) for t in texts] if token_source == "text" else [],
        "token_source": token_source,
        "seq_len": seq_len,
        "windows": windows.shape[0],
        "tokens": scored,
        "split_tokens": ids.numel(),
        "dtype": str(_param(net).dtype).removeprefix("torch."),
        "device": str(_param(net).device),
        "loss": sums["nll"] / scored,
        "perplexity": _exp(sums["nll"] / scored),
        "seconds": sums["seconds"],
        "tokens_per_second": fed / sums["seconds"] if sums["seconds"] > 0 else None,
    }
    if in_force:
        out["routing"] = in_force
    if base is not None:
        out.update(
            base_loss=sums["base_nll"] / scored,
            base_perplexity=_exp(sums["base_nll"] / scored),
            base_tokens_per_second=fed / sums["base_seconds"] if sums["base_seconds"] > 0 else None,
            kl=sums["kl"] / scored,
            top1_agreement=sums["agree"] / scored,
        )
    if tasks is not None:
        out.update(_tasks(net, base, tokenizer if tokenizer is not None else model_dir, tasks, task_dir, limit))
    return out


def _tasks(net, base, tokenizer_dir, tasks, task_dir, limit) -> dict:
    from moecompress.tools.lm_eval import run_tasks

    held_out_ids([], tokenizer_dir, what=_name(net))  # one line when there are no tokenizer files
    directory = Path(tokenizer_dir).expanduser()
    with _eval_mode(net), _eval_mode(base):  # a tokenizer per model: lm-eval may set its pad token
        out = run_tasks(net, tokenizing._load_tokenizer(directory), tasks, task_dir=task_dir, limit=limit)
        if base is not None:
            again = run_tasks(base, tokenizing._load_tokenizer(directory), tasks, task_dir=task_dir, limit=limit)
            out["base_tasks"] = again["tasks"]
    return out


def held_out_ids(texts: list, tokenizer_dir: str | Path | None, *, what: str = "the model") -> torch.Tensor:
    """The held-out (``eval``) split of ``texts`` as one int64 token stream, tokenised like calibration."""
    if tokenizer_dir is None:
        raise EvaluationError(
            f"{what} is a loaded model whose name_or_path is not a local directory, so its tokenizer "
            "files cannot be found; pass tokenizer=DIR (a directory with tokenizer.json, ...)"
        )
    tokenizer_dir = Path(tokenizer_dir).expanduser()
    try:
        tokenizing._tokenizer_files(tokenizer_dir)
    except CalibrationError:
        raise CalibrationError(
            f"no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...) in {tokenizer_dir}: "
            "evaluation tokenises the held-out text with the model's own tokenizer, so --text cannot help; "
            "copy the model's tokenizer files into that directory"
        ) from None
    held_out = [
        sources._split_text(text, "eval") for t in texts for _, text in sources._texts(_parse_text(t))
    ]
    return tokenizing._tokenise(tokenizing._load_tokenizer(tokenizer_dir), held_out)


# --- arguments, models, tokens ------------------------------------------------------------------------


def _check_sizes(max_tokens, seq_len, batch_size) -> None:
    for field, value, low in (
        ("seq_len", seq_len, 2),
        ("max_tokens", max_tokens, 2),
        ("batch_size", batch_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise EvaluationError(f"evaluation {field} must be an integer >= {low}, got {value!r}")
    if max_tokens < seq_len:
        raise EvaluationError(
            f"max_tokens = {max_tokens} is less than one window of seq_len = {seq_len} tokens; "
            "raise max_tokens or lower seq_len"
        )


def _parse_text(text) -> sources._Source:
    raw = str(text)
    if raw.strip() == "random":
        raise EvaluationError("'random' is not a text; use token_source='random' (API) for random token ids")
    if isinstance(text, Path) or not raw.strip().startswith(_SOURCE_FORMS):
        path = Path(raw).expanduser()
        if not path.exists():
            raise CalibrationError(
                f"evaluation text {raw} does not exist; pass UTF-8 text files or directories of *.txt"
            )
        return sources._Source("files", paths=(path,))
    return sources._parse(raw)


def _model_dir(model) -> Path | None:
    if isinstance(model, torch.nn.Module):
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        return Path(name) if name and Path(name).is_dir() else None
    from moecompress.io.hub import resolve_checkpoint_dir

    directory = resolve_checkpoint_dir(model)
    if not (directory / "config.json").is_file():
        raise EvaluationError(f"{directory} has no config.json; pass a checkpoint directory")
    return directory


def _name(model) -> str:
    if isinstance(model, torch.nn.Module):
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        return name or type(model).__name__
    return str(model)


def _routing(net, routing) -> dict[str, dict]:
    """Apply ``routing`` (``None``: what the model carries) to the evaluated model; the policies in force."""
    from moecompress.runtime.routing import policies, set_routing

    if routing is not None:
        set_routing(net, routing)
    return {str(i): m.policy for i, m in policies(net).items() if m.policy}


def _load(model, directory: Path | None, dtype, device) -> torch.nn.Module:
    if isinstance(model, torch.nn.Module):
        return model
    from moecompress.runtime.loading import load

    return load(directory, dtype=dtype, device=device)


def _random_ids(model, model_dir: Path | None, max_tokens: int) -> torch.Tensor:
    if isinstance(model, torch.nn.Module):
        vocab = int(model.config.vocab_size)
    else:
        vocab = sources._vocab_size(model_dir)
    gen = torch.Generator().manual_seed(sources._split_seed(0, "eval"))
    return torch.randint(0, vocab, (max_tokens,), generator=gen, dtype=torch.int64)


def _windows(ids: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    fit = ids.numel() // seq_len
    if fit < 1:
        raise CalibrationError(
            f"the held-out split has only {ids.numel()} tokens, fewer than one window of seq_len = "
            f"{seq_len}; lower --seq-len or add text"
        )
    n = min(fit, max_tokens // seq_len)
    slots = torch.arange(n) * fit // n  # strictly increasing since fit >= n: disjoint windows
    return ids[(slots * seq_len)[:, None] + torch.arange(seq_len)]


def _param(model: torch.nn.Module) -> torch.Tensor:
    return next(model.parameters())


def _check_model(model, directory: Path | None, windows: torch.Tensor, seq_len: int) -> None:
    """Token ids within the vocabulary and windows within the positions, from config.json before loading."""
    if isinstance(model, torch.nn.Module):
        vocab = model.get_input_embeddings().num_embeddings
        limit = getattr(model.config, "max_position_embeddings", None)
    else:
        try:
            config = json.loads((directory / "config.json").read_text())
        except (OSError, ValueError):
            return  # loading will say what is wrong with it
        config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
        vocab, limit = config.get("vocab_size"), config.get("max_position_embeddings")
    top = int(windows.max())
    if isinstance(vocab, int) and top >= vocab:
        raise EvaluationError(
            f"the tokenizer produced token id {top} but {_name(model)} has a vocabulary of {vocab}; "
            "are these the tokenizer files of another model?"
        )
    if isinstance(limit, int) and seq_len > limit:
        raise EvaluationError(
            f"seq_len = {seq_len} exceeds max_position_embeddings = {limit} of {_name(model)}; lower --seq-len"
        )


class _eval_mode:
    """Put a model in eval mode for the duration and restore its previous mode."""

    def __init__(self, model: torch.nn.Module | None):
        self.model, self.was = model, model is not None and model.training

    def __enter__(self):
        if self.model is not None:
            self.model.eval()

    def __exit__(self, *exc):
        if self.model is not None:
            self.model.train(self.was)


def _forward(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    ids = ids.to(_param(model).device)
    _sync(ids.device)
    start = time.perf_counter()
    logits = model(input_ids=ids, use_cache=False).logits
    _sync(ids.device)
    return logits, time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _run(net, base, windows: torch.Tensor, batch_size: int, progress: bool) -> dict:
    sums = dict(nll=0.0, seconds=0.0, base_nll=0.0, base_seconds=0.0, kl=0.0, agree=0)
    batches = windows.split(batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="eval", unit="batch", file=sys.stderr)
    for ids in batches:
        logits, seconds = _forward(net, ids)
        sums["seconds"] += seconds
        target = ids[:, 1:].to(logits.device)
        logp = logits[:, :-1].float().log_softmax(-1)
        del logits
        sums["nll"] += -logp.gather(-1, target[..., None]).double().sum().item()
        if base is None:
            continue
        base_logits, seconds = _forward(base, ids)
        sums["base_seconds"] += seconds
        if base_logits.shape[-1] != logp.shape[-1]:
            raise EvaluationError(
                f"the model has {logp.shape[-1]} output logits but the base has {base_logits.shape[-1]}; "
                "KL needs the same vocabulary"
            )
        base_logp = base_logits[:, :-1].float().log_softmax(-1).to(logp.device)
        del base_logits
        sums["base_nll"] += -base_logp.gather(-1, target[..., None]).double().sum().item()
        kl = (base_logp.exp() * (base_logp - logp)).sum(-1)  # KL(base || model) per position
        sums["kl"] += kl.double().sum().item()
        sums["agree"] += int((base_logp.argmax(-1) == logp.argmax(-1)).sum())
        del base_logp, logp
    return sums


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
