"""Recipes: YAML (or a dict) -> validated, typed :class:`Recipe`, before any weight is read.

```yaml
model: path/or/hub-id
output: out/dir
calibration: {source: builtin, samples: 128, seq_len: 512, seed: 0}
emit: final                  # or every_step: which steps write a checkpoint (reports always)
steps:                       # ordered; a step name is a pass name; numbered from 1 in messages
  - analyze: {}
  - identity: {}
```

Relative paths are relative to the current directory. ``--set key=value`` overrides use dotted paths
(``calibration.samples=256``, ``emit=every_step``, ``steps.2.ratio=0.3`` for the second step); values
are parsed as YAML scalars. Every error is a :class:`~moecompress.errors.RecipeError` whose one-line
message names the step number, step name and field, the problem and what is allowed.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moecompress.engine import follow
from moecompress.engine.spec import PassConfig, PassSpec
from moecompress.errors import RecipeError
from moecompress.passes import BUILTIN_PASSES, BUILTIN_STAGES


def _path_text(value: str | None) -> str | None:
    """A path field: no operating system takes a NUL character in a path, so refuse it here, by name."""
    if value is not None and "\x00" in value:
        raise ValueError("contains a NUL character (\\x00), which no path can hold; remove it")
    return value


NO_CALIBRATION = "none"
"""``calibration.source: none``: a data-free run (every step must need no statistics)."""


class CalibrationConfig(BaseModel):
    """Calibration data and how statistics are gathered."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(
        "builtin",
        description="builtin | file:PATH[,PATH] | hf:NAME[:CONFIG][@SPLIT] | random | none (no calibration: "
        "only for steps that need no statistics, e.g. rtn, identity, ablate_experts, capacity_drop; no tokens "
        "are read and reconstruction errors are not measured)",
    )
    samples: int = Field(128, ge=1, le=1_000_000)
    seq_len: int = Field(512, ge=2, le=1_000_000)
    seed: int = 0
    batch_size: int = Field(8, ge=1, description="sequences per forward batch")
    holdout: int | None = Field(
        None, ge=1, description="sequences held back for reconstruction errors (default samples // 8, >= 1)"
    )
    propagate: Literal["original", "compressed"] = "original"
    recalibrate: Literal["auto", "off"] = Field(
        "auto",
        description="a step whose statistics cannot follow the layer through earlier steps (gradients or a "
        "trace through the changed model, a cross-layer plan): auto cuts the recipe there and calibrates the "
        "changed model again (one more calibration pass and a staged checkpoint); off refuses it in the dry run",
    )
    sample_tokens: int = Field(512, ge=1, description="size of the bounded sample of MoE inputs/outputs")
    parallel: Literal["auto", "batches"] = Field(
        "auto",
        description="under torchrun: auto splits each MoE layer's experts over the ranks (each reads and runs only "
        "its own, the sums over experts by 8 fixed blocks of them) | "
        "batches: every rank holds whole layers and runs its share of the batches; the same statistics either way",
    )
    offload: Literal["auto", "ram", "disk"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field(
        "auto",
        description="where calibration and the pass maths run: auto (CUDA when present) | cpu | cuda[:N]",
    )
    cache_dir: str | None = None
    memory_limit: int | str | None = Field(
        None, description="refuse a calibration estimated to need more memory (default: what is available)"
    )

    @field_validator("source", "cache_dir")
    @classmethod
    def _cal_paths(cls, value: str | None) -> str | None:
        return _path_text(value)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if re.fullmatch(r"auto|cpu|cuda(:\d+)?", value) is None:
            raise ValueError("must be auto (CUDA when present), cpu, cuda or cuda:N")
        return value

    @field_validator("memory_limit")
    @classmethod
    def _limit(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            from moecompress.io.outputs import parse_size

            parse_size(value)  # raises ValueError with the accepted forms
        return value

    @model_validator(mode="after")
    def _holdout_fits(self) -> CalibrationConfig:
        if self.samples < 2:
            raise ValueError("samples must be at least 2 (one for statistics, one held back)")
        if self.holdout is not None and self.holdout >= self.samples:
            raise ValueError(f"holdout={self.holdout} must be smaller than samples={self.samples}")
        return self

    @property
    def holdout_samples(self) -> int:
        return self.holdout if self.holdout is not None else max(1, self.samples // 8)

    @property
    def data_free(self) -> bool:
        """``source: none``: no calibration tokens, no statistics, no held-back reconstruction errors."""
        return self.source == NO_CALIBRATION


@dataclass(frozen=True)
class Step:
    """A validated recipe step. ``number`` is 1-based, as in every message."""

    number: int
    name: str
    spec: PassSpec
    config: PassConfig
    digits: int = 2
    """Width of the step number in folder names (at least 2; enough for every step of the recipe, so
    folders sort in step order at any count)."""

    @property
    def label(self) -> str:
        return f"step {self.number} ({self.name})"

    @property
    def dirname(self) -> str:
        return f"{self.number:0{self.digits}d}-{self.name}"

    @property
    def needs(self) -> frozenset[str]:
        """Statistics this step needs with its configuration."""
        return self.spec.needs_for(self.config)


class _RecipeModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    output: str = Field(min_length=1)
    calibration: CalibrationConfig = CalibrationConfig()
    emit: Literal["final", "every_step"] = "final"
    max_shard_size: int | str = "5GB"
    copy_extra: list[str] = Field(
        default_factory=list, description="input files to copy besides the tokenizer, configs and license files"
    )
    quantized_input: Literal["auto", "keep", "dequantize"] = Field(
        "auto",
        description="a quantised input's untouched tensors: keep (their encoding, byte for byte), dequantize "
        "(everything in the compute dtype, so that moecompress layouts can be written), auto (keep unless a "
        "written step needs the moecompress format)",
    )
    expert_chunk: int | str = Field(
        "auto",
        description="MoE layers read, calibrated, compressed and written by chunks of this many experts: auto "
        "(whole layers when they fit the memory limit, chunks sized to fit when not), off (whole layers; "
        "refused when they do not fit), or a number of experts",
    )
    steps: list[Any] = Field(min_length=1)

    @field_validator("expert_chunk", mode="before")
    @classmethod
    def _chunk(cls, value: str | int) -> str | int:
        if value in ("auto", "off") or (type(value) is int and value >= 1):
            return value
        raise ValueError("must be auto, off or a number of experts >= 1")

    @field_validator("model", "output", "copy_extra")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        for text in value if isinstance(value, list) else [value]:
            _path_text(text)
        return value

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, value: int | str) -> int | str:
        from moecompress.io.outputs import parse_size

        parse_size(value)  # raises ValueError with the accepted forms
        return value


@dataclass(frozen=True)
class Recipe:
    model: str
    output: str
    calibration: CalibrationConfig
    emit: str
    max_shard_size: int | str
    steps: tuple[Step, ...]
    copy_extra: tuple[str, ...] = ()
    quantized_input: str = "auto"
    expert_chunk: str | int = "auto"

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe (defaults filled in), as YAML would hold it."""
        return {
            "model": self.model,
            "output": self.output,
            "calibration": self.calibration.model_dump(),
            "emit": self.emit,
            "max_shard_size": self.max_shard_size,
            **({"copy_extra": list(self.copy_extra)} if self.copy_extra else {}),
            **({"quantized_input": self.quantized_input} if self.quantized_input != "auto" else {}),
            **({"expert_chunk": self.expert_chunk} if self.expert_chunk != "auto" else {}),
            "steps": [{s.name: s.config.model_dump(mode="json")} for s in self.steps],
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self) -> str:
        """Hash of everything that determines the output bytes (not the output path)."""
        d = self.to_dict()
        d.pop("output")
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @property
    def needs(self) -> frozenset[str]:
        """What calibration collects for the steps: their needs, and what their statistics need to follow
        the layer through earlier steps (:func:`moecompress.engine.follow.extra_needs`)."""
        return frozenset().union(*(s.needs for s in self.steps)) | follow.extra_needs(self.steps, self.recalibrates)

    @property
    def recalibrates(self) -> bool | str:
        """``calibration.recalibrate: auto`` on a calibrated run: the recipe may be cut (``follow.cuts``);
        ``"chunks"`` (true) under ``expert_chunk: N``: cut before every step whose statistics would have to
        follow the layer, which a layer held by chunks of experts cannot do."""
        if self.calibration.recalibrate != "auto" or self.calibration.data_free:
            return False
        return "chunks" if isinstance(self.expert_chunk, int) else True


# -- errors --------------------------------------------------------------------------------------
def _suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _explain(err: ValidationError, where: str, model: type[BaseModel]) -> RecipeError:
    errors = err.errors()
    e = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])  # typos first
    loc = ".".join(str(x) for x in e["loc"]) if e["loc"] else "(top level)"
    allowed = list(model.model_fields)
    if e["type"] == "extra_forbidden":
        field = str(e["loc"][-1])
        owner = CalibrationConfig if e["loc"][0] == "calibration" and model is _RecipeModel else model
        options = list(owner.model_fields)
        if not options:
            return RecipeError(f"{where}: unknown field {loc!r}; this step takes no settings (use {{}})")
        return RecipeError(
            f"{where}: unknown field {loc!r}{_suggest(field, options)}; allowed: {', '.join(options)}"
        )
    if e["type"] == "missing":
        return RecipeError(f"{where}: missing required field {loc!r}; fields: {', '.join(allowed)}")
    got = e.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
    msg = e["msg"].removeprefix("Value error, ")
    return RecipeError(f"{where}: field {loc!r}: {msg}{shown}")


# -- loading -------------------------------------------------------------------------------------
def _read(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return json.loads(json.dumps(dict(source), default=str))  # a deep, plain copy
    path = Path(source)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise RecipeError(f"{path}: not UTF-8 text (byte {err.start}); save the recipe as UTF-8") from None
    except OSError as err:
        raise RecipeError(f"recipe file {path} cannot be read ({err.strerror})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise RecipeError(f"{path}: {problem}{at}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping with model, output and steps")
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected key=value, e.g. calibration.samples=256")
    key, _, raw = item.partition("=")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise RecipeError(f"--set {item!r}: empty key")
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Apply ``key=value`` overrides (or a ``{dotted.key: value}`` mapping) to a raw recipe dict."""
    items = (
        [(str(k).split("."), v) for k, v in overrides.items()]
        if isinstance(overrides, Mapping)
        else [parse_override(o) for o in overrides]
    )
    for parts, value in items:
        key = ".".join(parts)
        if parts[0] == "steps":
            steps = data.get("steps")
            if len(parts) != 3 or not parts[1].isdigit() or not isinstance(steps, list):
                raise RecipeError(f"--set {key}: use steps.N.field=value with N the step number (from 1)")
            n = int(parts[1])
            if not 1 <= n <= len(steps) or not isinstance(steps[n - 1], dict) or len(steps[n - 1]) != 1:
                raise RecipeError(f"--set {key}: the recipe has no step {n} (it has {len(steps)})")
            name = next(iter(steps[n - 1]))
            cfg = steps[n - 1][name] if isinstance(steps[n - 1][name], dict) else {}
            steps[n - 1] = {name: {**cfg, parts[2]: value}}
            continue
        node = data
        for p in parts[:-1]:
            if not isinstance(node.get(p, {}), dict):
                raise RecipeError(f"--set {key}: {p!r} is not a section")
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return data


def pass_table(extra: Iterable[PassSpec] = ()) -> dict[str, PassSpec]:
    """The built-in passes and stages plus ``extra`` ones (plugins, tests); a name may not be taken twice."""
    table = {**BUILTIN_PASSES, **BUILTIN_STAGES}
    for spec in extra:
        if not isinstance(spec, PassSpec):
            raise RecipeError(f"passes=: expected PassSpec objects, got {type(spec).__name__}")
        if spec.name in table:
            raise RecipeError(f"passes=: a pass named {spec.name!r} exists already; choose another name")
        table[spec.name] = spec
    return table


def _parse_step(number: int, item: Any, passes: Mapping[str, PassSpec]) -> Step:
    if isinstance(item, str):
        item = {item: {}}
    if not isinstance(item, dict) or len(item) != 1:
        raise RecipeError(
            f"step {number}: each step is a mapping with exactly one key, the step name, e.g. '- analyze: {{}}'"
        )
    name, cfg = next(iter(item.items()))
    name = str(name)
    if name not in passes:
        raise RecipeError(
            f"step {number}: unknown step {name!r}{_suggest(name, passes)}; available: {', '.join(sorted(passes))}"
        )
    spec = passes[name]
    if cfg is None:
        cfg = {}
    if not isinstance(cfg, dict):
        raise RecipeError(f"step {number} ({name}): the settings must be a mapping, got {type(cfg).__name__}")
    try:
        config = spec.config.model_validate(cfg)
    except ValidationError as err:
        raise _explain(err, f"step {number} ({name})", spec.config) from None
    return Step(number=number, name=name, spec=spec, config=config)


def load_recipe(
    source: str | Path | Mapping[str, Any],
    overrides: Iterable[str] | Mapping[str, Any] = (),
    *,
    passes: Mapping[str, PassSpec] | None = None,
) -> Recipe:
    """Parse and validate a recipe (path to YAML, or a dict) with optional overrides; step names are
    looked up in ``passes`` (see :func:`pass_table`)."""
    passes = pass_table() if passes is None else passes
    data = apply_overrides(_read(source), overrides)
    try:
        raw = _RecipeModel.model_validate(data)
    except ValidationError as err:
        raise _explain(err, "recipe", _RecipeModel) from None
    digits = max(2, len(str(len(raw.steps))))
    steps = tuple(replace(_parse_step(n, item, passes), digits=digits) for n, item in enumerate(raw.steps, start=1))
    return Recipe(
        model=raw.model,
        output=raw.output,
        calibration=raw.calibration,
        emit=raw.emit,
        max_shard_size=raw.max_shard_size,
        steps=steps,
        copy_extra=tuple(raw.copy_extra),
        quantized_input=raw.quantized_input,
        expert_chunk=raw.expert_chunk,
    )
