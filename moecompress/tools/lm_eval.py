"""lm-evaluation-harness tasks on an already-loaded model (``evaluate(..., tasks=[...])``, ``--tasks``).

The model object that :func:`moecompress.evaluate` loaded (compressed layouts included) is wrapped in
lm-eval's ``HFLM(pretrained=model, tokenizer=...)``: the harness never receives a path it could
reload, and :func:`run_tasks` refuses to go on unless the wrapper holds exactly that object. Tasks are
lm-eval task names: lm-eval's own (they download their data; online only), the YAML task configs of
``task_dir`` (lm-eval's ``TaskManager(include_path=...)``; offline when their data is local), and the
two tasks bundled here, built from the held-out split (last 2 %) of public-domain / PSF texts of the
project's corpus (``devil``, ``jargon``, ``kjv``, ``python_docs``; 200 documents each, local JSON
lines in ``moecompress/data/lm_eval_tasks``):

- ``moecompress_nextword`` (multiple choice): 24 words of context, the true next word among four
  words of the same text; metrics ``acc`` and ``acc_norm``.
- ``moecompress_continuation`` (generation): the same kind of context, greedy decoding of at most 8
  tokens up to a newline; ``exact_match`` of the first generated word with the true next word.

A tokenizer without an EOS token (the project's small BPE models) gets the newline token as lm-eval's
end-of-text and padding token, as calibration joins texts with a newline when there is no EOS.
"""

from __future__ import annotations

import math
from pathlib import Path

from moecompress.errors import MoecompressError

TASK_DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval_tasks"
_MC = {
    "output_type": "multiple_choice",
    "doc_to_text": "{{context}}",
    "doc_to_choice": "{{choices}}",
    "doc_to_target": "{{label}}",
    "metric_list": [
        {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
    ],
}
_GEN = {
    "output_type": "generate_until",
    "doc_to_text": "{{context}}",
    "doc_to_target": "{{target}}",
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
    "filter_list": [
        {
            "name": "first-word",
            "filter": [{"function": "regex", "regex_pattern": "([A-Za-z]+)"}, {"function": "take_first"}],
        }
    ],
    "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
}
BUNDLED = {"moecompress_nextword": ("nextword.jsonl", _MC), "moecompress_continuation": ("continuation.jsonl", _GEN)}


class TaskEvalError(MoecompressError):
    """lm-eval tasks cannot run: unknown names, a bad task directory, a harness failure."""


def bundled_config(name: str) -> dict:
    """The lm-eval task config (a dict) of a bundled task, its data file given by absolute path."""
    data, body = BUNDLED[name]
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(TASK_DATA / data)}},
        "test_split": "test",
        **body,
        "metadata": {"version": 1.0},
    }


def run_tasks(model, tokenizer, tasks, *, task_dir=None, limit=None, batch_size: int = 4) -> dict:
    """Run lm-eval ``tasks`` on the loaded ``model`` with ``tokenizer`` (a transformers tokenizer).

    Returns ``{"tasks": {task: {metric: value, ..., "samples": n}}, "task_harness": {...}}``: lm-eval's
    metric names without the ``,none`` filter suffix (``metric,FILTER`` otherwise), no stderr.
    """
    names, task_dir = check(tasks, task_dir, limit)
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir) if task_dir else None, include_defaults=False)
    local = set(manager.all_tasks) | set(BUNDLED)
    if any(n not in local for n in names):  # lm-eval's own tasks: index them (slow, once)
        manager = TaskManager(include_path=str(task_dir) if task_dir else None)
        unknown = [n for n in names if n not in set(manager.all_tasks) | set(BUNDLED)]
        if unknown:
            where = f" or in --task-dir {task_dir}" if task_dir else ""
            raise TaskEvalError(
                f"unknown lm-eval task(s) {', '.join(unknown)}: not bundled ({', '.join(BUNDLED)}), "
                f"not an lm-eval task{where}; see `lm_eval ls tasks`"
            )
    lm = wrap(model, tokenizer, batch_size=batch_size)
    specs = [bundled_config(n) if n in BUNDLED and n not in manager.all_tasks else n for n in names]
    try:
        out = lm_eval.simple_evaluate(
            model=lm, tasks=specs, task_manager=manager, limit=limit, log_samples=False,
            bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
        )  # fmt: skip
    except MoecompressError:
        raise
    except Exception as err:  # missing data offline, a broken YAML: one line
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise TaskEvalError(
            f"lm-eval could not run {', '.join(names)} ({type(err).__name__}: {reason}); "
            "offline? use the bundled tasks or local task YAMLs (--task-dir)"
        ) from None
    return _metrics(out, names, limit)


def check(tasks, task_dir=None, limit=None) -> tuple[list[str], Path | None]:
    """Validate the task arguments and that lm-eval is installed, before any model is loaded."""
    from moecompress.extras import require

    names = _task_names(tasks)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise TaskEvalError(f"lm-eval limit must be an integer >= 1 (documents per task), got {limit!r}")
    task_dir = _task_dir(task_dir)
    require("eval", "lm-eval tasks (--tasks)")
    return names, task_dir


def wrap(model, tokenizer, *, batch_size: int = 4):
    """lm-eval's ``HFLM`` around exactly ``model`` (never a path), with an end-of-text for ``tokenizer``."""
    from lm_eval.models.huggingface import HFLM

    newline = tokenizer.encode("\n", add_special_tokens=False)
    eot = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else (newline[-1] if newline else None)
    if eot is None:
        raise TaskEvalError("the tokenizer has no EOS token and cannot encode a newline; lm-eval needs one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = eot  # else lm-eval adds a pad token outside the model's vocabulary

    class _LM(HFLM):
        @property
        def eot_token_id(self) -> int:
            return eot

        @property
        def prefix_token_id(self) -> int:
            pre = super().prefix_token_id
            return eot if pre is None else pre

    lm = _LM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    if lm.model is not model:
        raise TaskEvalError("lm-eval's HFLM does not hold the loaded model; refusing to evaluate another one")
    return lm


def _task_names(tasks) -> list[str]:
    raw = tasks.split(",") if isinstance(tasks, str) else list(tasks or [])
    names = [str(t).strip() for t in raw if str(t).strip()]
    if not names or any("," in n for n in names):
        raise TaskEvalError(f"tasks must name lm-eval tasks (e.g. {', '.join(BUNDLED)}); got {tasks!r}")
    return list(dict.fromkeys(names))


def _task_dir(task_dir) -> Path | None:
    if task_dir is None:
        return None
    path = Path(task_dir).expanduser()
    if not path.is_dir():
        raise TaskEvalError(f"--task-dir {path} is not a directory of lm-eval task YAML files")
    if not any(path.rglob("*.yaml")):
        raise TaskEvalError(f"--task-dir {path} holds no *.yaml task configs")
    return path


def _metrics(out, names: list[str], limit) -> dict:
    import lm_eval

    results = (out or {}).get("results", {})
    samples = (out or {}).get("n-samples", {})
    tasks: dict = {}
    for task, values in results.items():
        row = {}
        for key, value in values.items():
            metric, _, flt = key.partition(",")
            if "stderr" in metric or metric == "sample_len" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                continue
            value = float(value) if isinstance(value, float) else int(value)  # numpy scalars -> Python
            row[metric if flt in ("", "none") else f"{metric},{flt}"] = value
        n = samples.get(task, {})
        if isinstance(n, dict) and isinstance(n.get("effective"), int):
            row["samples"] = n["effective"]
        tasks[task] = row
    missing = [n for n in names if n not in tasks]
    if missing:
        raise TaskEvalError(f"lm-eval returned no results for {', '.join(missing)}")
    version = getattr(lm_eval, "__version__", "?")
    return {"tasks": tasks, "task_harness": {"lm_eval": version, "limit": limit, "seed": 0}}
