"""PNG plots for step reports (:mod:`moecompress.report.write.write` draws them).

matplotlib is optional (extra ``plots``) and used through its object API on the Agg canvas: no pyplot,
no global backend switch. A plot that cannot be drawn is skipped with a note, never raised.
"""

from __future__ import annotations

import io
import logging
import math
import os
import re
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

MATPLOTLIB_MISSING = "plots skipped: matplotlib not installed (pip install moecompress[plots])"
PLOT_KINDS = ("heatmap", "bar", "line")
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_PLOT_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.png")


def write_atomic(path: Path, data: bytes) -> Path:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def num(x: object) -> float | None:
    """A number from a json_safe value (``"inf"`` strings included), else None."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return _NONFINITE.get(x) if isinstance(x, str) else None


def _load_matplotlib() -> tuple[Any, Any] | None:
    try:
        import matplotlib  # noqa: F401  (explicit: a None in sys.modules must count as missing)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


def _series(rows: list[dict], key: str) -> list[float]:
    vals = [num(r.get(key)) for r in rows]
    return [v if v is not None and math.isfinite(v) else math.nan for v in vals]


def _as_array(data: object) -> np.ndarray:
    if isinstance(data, torch.Tensor):
        return data.detach().to("cpu", torch.float64).numpy()
    return np.asarray(data, dtype=np.float64)


def _layer_axis(ax: Any, rows: list[dict]) -> list[int]:
    x = list(range(len(rows)))
    ax.set_xticks(x, [str(r.get("layer", i)) for i, r in enumerate(rows)], rotation=90 if len(x) > 24 else 0)
    ax.set_xlabel("layer")
    if not rows:
        ax.text(0.5, 0.5, "no MoE layers", transform=ax.transAxes, ha="center", va="center")
    return x


def _draw_reconstruction(fig: Any, rows: list[dict]) -> None:
    ax_err, ax_sqnr = fig.subplots(2, 1, sharex=True)
    x = _layer_axis(ax_sqnr, rows)
    err = _series(rows, "rel_error")
    ax_err.plot(x, err, "o-", color="tab:blue")
    if any(v > 0 for v in err):  # nan > 0 is False
        ax_err.set_yscale("log")
    ax_err.set_ylabel("relative error")
    ax_err.set_title("Reconstruction error per layer")
    ax_sqnr.plot(x, _series(rows, "sqnr_db"), "s-", color="tab:orange")
    ax_sqnr.set_ylabel("SQNR (dB)")


def _draw_size(fig: Any, rows: list[dict]) -> None:
    ax = fig.subplots()
    x = _layer_axis(ax, rows)
    for key, shift in (("params_before", -0.2), ("params_after", 0.2)):
        ax.bar([i + shift for i in x], _series(rows, key), 0.4, label=key.split("_")[1])
    ax.set_ylabel("parameters")
    ax.set_title("Parameters per layer")
    if rows:
        ax.legend()


def _draw_extra(fig: Any, spec: Mapping) -> None:
    data, kind = _as_array(spec["data"]), spec["kind"]
    ax = fig.subplots()
    if data.ndim not in {"heatmap": (2,), "bar": (1,), "line": (1, 2)}[kind]:
        raise ValueError(f"{kind} data of shape {list(data.shape)}: heatmap takes 2-D, bar 1-D, line 1-D/2-D")
    if kind == "heatmap":
        fig.colorbar(ax.imshow(data, aspect="auto", interpolation="nearest"), ax=ax)
    elif kind == "bar":
        ax.bar(range(len(data)), data)
    else:  # line: one series per row
        for series in np.atleast_2d(data):
            ax.plot(series, marker=".")
    for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
        axis.get_major_locator().set_params(integer=True)  # indices (experts, layers), not fractions
        if spec.get(f"{name}ticklabels") is not None:  # optional, e.g. the real layer ids
            labels = [str(v) for v in spec[f"{name}ticklabels"]]
            axis.set_ticks(range(len(labels)), labels)
        axis.set_label_text(str(spec.get(f"{name}label", "")))
    ax.set_title(str(spec.get("title", "")))


def _spec_problem(spec: object, taken: set[str]) -> str | None:
    if not isinstance(spec, Mapping):
        return f"plot spec must be a dict, got {type(spec).__name__}"
    file = spec.get("file")
    if not isinstance(file, str) or not _PLOT_FILE.fullmatch(file):
        return f"plot {file!r} skipped: 'file' must be a plain file name ending in .png"
    if file in taken:
        return f"plot {file} skipped: that file is already written by this report"
    if spec.get("kind") not in PLOT_KINDS:
        return f"plot {file} skipped: kind {spec.get('kind')!r} is not one of {', '.join(PLOT_KINDS)}"
    return None if "data" in spec else f"plot {file} skipped: no 'data'"


def write_plots(
    directory: Path, rows: list[dict], extra: list, notes: list[str], *, standard: bool = True
) -> list[tuple[Path, str]]:
    """Standard plots (unless ``standard`` is false), then the extra specs; returns ``(path, title)`` of
    every PNG written."""
    if not standard and not extra:
        return []
    mpl = _load_matplotlib()
    if mpl is None:
        notes.append(MATPLOTLIB_MISSING)
        return []
    figure_cls, canvas_cls = mpl
    jobs: list[tuple[str, str, Callable[[Any], None]]] = [
        ("reconstruction.png", "Reconstruction error per layer", lambda f: _draw_reconstruction(f, rows)),
        ("size.png", "Parameters per layer", lambda f: _draw_size(f, rows)),
    ] if standard else []
    taken = {file for file, _, _ in jobs}
    for spec in extra:
        problem = _spec_problem(spec, taken)
        if problem:
            notes.append(problem)
            continue
        taken.add(spec["file"])
        jobs.append(
            (spec["file"], str(spec.get("title") or spec["file"]), lambda f, s=spec: _draw_extra(f, s))
        )
    written = []
    for file, title, draw in jobs:
        try:
            fig = figure_cls(figsize=(8, 6 if file == "reconstruction.png" else 4.5), layout="constrained")
            canvas_cls(fig)
            draw(fig)
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=100)
            written.append((write_atomic(directory / file, buf.getvalue()), title))
        except Exception as exc:  # a plot must never fail the run
            log.warning("plot %s skipped: %s", file, exc)
            notes.append(f"plot {file} skipped: {type(exc).__name__}: {exc}")
    return written


# ------------------------------------------------------------------------------------------- reports
