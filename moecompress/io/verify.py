"""Verified outputs: ``config.json`` and the shard headers agree, before any weight is read.

One checker for every reader of a checkpoint (``moecompress.load``, the transformers quantizer,
``moecompress eval``, ``moecompress inspect``), so that a damaged output never loads with experts
randomly initialised nor ends in a traceback. It checks that

- the ``moecompress`` block is well formed (objects, layer indices, the fields ``docs/format.md`` lists
  with their types), of a ``format`` this moecompress reads, and described layers have
  ``quantization_config``;
- every MoE layer is **stock** (the adapter's ``check_layer``: its stock tensors, shapes from
  config.json) or **described**; a layer stored in the moecompress format but not described is named;
- a described layer stores exactly what its description declares (:func:`module_tensors`, also what
  the quantizer registers), with the declared shapes and dtypes; its stock-named router and shared
  expert have the shapes config.json implies; each projection's logical ``shape`` is what its layout
  rebuilt on ``meta`` tensors gives (``LAYOUTS[kind].from_tensors``; a refusal is a mismatch), and the
  rebuilt layer (router, experts, expert map, live widths) holds together.

No weight is read: only the 1-D integer index vectors (live widths, members, ranks, the expert map; a
few bytes per expert) are, so that the layouts' own consistency checks run too.
:func:`verify_checkpoint` returns every :class:`Problem` (``inspect`` reports them all); loaders raise
the first with :meth:`Problem.error`: one line naming the layer, the tensor or field, and the fix.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from moecompress.errors import CheckpointError, MoecompressError
from moecompress.io.format import FORMAT_VERSION, PROJ, read_compressed_layer, stock_keys
from moecompress.io.reader import SAFETENSORS_DTYPES
from moecompress.io.routing import check_routing, read_routing, without_routing
from moecompress.ir import Act
from moecompress.layouts import LAYOUTS

DAMAGED = "the config.json of this output was edited or damaged: restore it or re-run the recipe"
LOST = "the shards lost a tensor: re-download the output or re-run the recipe that wrote it"
DTYPES = {str(t).removeprefix("torch."): t for t in SAFETENSORS_DTYPES.values()}
"""dtype names ``config.json`` may use, to torch dtypes."""
_ST_NAME = {code: str(t).removeprefix("torch.") for code, t in SAFETENSORS_DTYPES.items()}
_FORMAT_PARTS = ("gate.", "up.", "down.", "widths", "expert_map", "rotation", "gate_bias", "up_bias", "down_bias")  # fmt: skip


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: the layer (``None``: the whole checkpoint), what, the fix."""

    layer: int | None
    problem: str
    fix: str

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "problem": self.problem, "fix": self.fix}

    def error(self, where: object) -> CheckpointError:
        at = "" if self.layer is None else f"layer {self.layer}: "
        return CheckpointError(f"{where}: {at}{self.problem}; {self.fix}")


@dataclass(frozen=True)
class Declared:
    """A tensor a description declares: its shape, its dtype (``None``: any floating dtype) and the
    ``config.json`` fields that say so."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None
    field: str
    dtype_field: str


class _Bad(CheckpointError):
    """A problem found inside one layer's checks (``problem`` and ``fix`` kept apart for inspect)."""

    def __init__(self, problem: str, fix: str = DAMAGED) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix


# -- the moecompress block -----------------------------------------------------------------------
def read_block(block: Any, *, quant_method: Any) -> tuple[dict[int, Any] | None, list[Problem]]:
    """The layer descriptions of ``config.json["moecompress"]`` (``None`` when the block cannot be read
    at all) and the problems of the block itself. ``quant_method``: ``quantization_config``'s."""
    if block is None:
        return {}, []
    if not isinstance(block, dict):
        return None, [Problem(None, f"config.json's 'moecompress' is {_show(block)}, not an object", DAMAGED)]
    fmt = block.get("format", FORMAT_VERSION)
    if not isinstance(fmt, int) or isinstance(fmt, bool):
        return None, [Problem(None, f"moecompress.format is {_show(fmt)}, not an integer", DAMAGED)]
    if fmt > FORMAT_VERSION:
        why = f"moecompress.format {fmt} is newer than this moecompress understands ({FORMAT_VERSION})"
        return None, [Problem(None, why, "upgrade moecompress")]
    layers, descs = block.get("layers", {}), {}
    layers = {} if layers is None else layers
    if not isinstance(layers, dict):
        return None, [Problem(None, f"moecompress.layers is {_show(layers)}, not an object", DAMAGED)]
    for key, desc in layers.items():
        if not (isinstance(key, str) and key.isdigit()):
            return None, [Problem(None, f"moecompress.layers has key {key!r}, not a layer index", DAMAGED)]
        if desc:  # an empty entry describes nothing: the layer is stock
            descs[int(key)] = desc
    protected = block.get("protected") or {}
    if not isinstance(protected, dict) or not all(
        isinstance(k, str) and k.isdigit() and _is_ints(v) for k, v in protected.items()
    ):
        why = f"moecompress.protected is {_show(protected)}, not an object of layer index -> expert ids"
        return None, [Problem(None, why, DAMAGED)]
    try:
        routing = read_routing(block)
    except ValueError as err:
        return None, [Problem(None, str(err), DAMAGED)]
    problems = []
    if routing and quant_method != "moecompress":
        why = (
            f"moecompress.routing holds policies for layers {sorted(routing)} but quantization_config is not "
            f"{{'quant_method': 'moecompress', 'format': {FORMAT_VERSION}}}, so transformers would load the model "
            "without them"
        )
        problems.append(Problem(None, why, DAMAGED))
    if descs and quant_method != "moecompress":
        why = (
            f"moecompress.layers describes layers {sorted(descs)} but quantization_config is not "
            f"{{'quant_method': 'moecompress', 'format': {FORMAT_VERSION}}}, so transformers would initialise "
            "their experts randomly"
        )
        problems.append(Problem(None, why, DAMAGED))
    return descs, problems


# -- what a description declares -----------------------------------------------------------------
def module_tensors(desc: Any, hidden_size: int, field: str) -> dict[str, Declared]:
    """Every tensor the described bank ``desc`` stores, by its name under the module path
    (``gate.rows``, ``widths``, ...): what the quantizer's modules register. Raises
    :class:`CheckpointError` (one line naming the field) for a malformed description."""
    desc = _obj(desc, field)
    experts = _obj(desc.get("experts"), f"{field}.experts")
    e = _int(desc.get("num_experts"), f"{field}.num_experts", low=1)
    _str(desc.get("act", "swiglu"), f"{field}.act", [a.value for a in Act])
    for key in ("alpha", "limit"):
        if key in desc and (not isinstance(desc[key], (int, float)) or isinstance(desc[key], bool)):
            raise _Bad(f"{field}.{key} is {_show(desc[key])}, not a number")
    if desc.get("act_bits") is not None:
        _int(desc["act_bits"], f"{field}.act_bits", low=2)
    if not _is_ints(desc.get("unrotated", [])):
        raise _Bad(f"{field}.unrotated is {_show(desc.get('unrotated'))}, not a list of expert ids")
    out: dict[str, Declared] = {}
    for name in PROJ:
        out.update(
            _projection(
                _obj(experts.get(name), f"{field}.experts.{name}"), name, e, f"{field}.experts.{name}"
            )
        )
    width = int(experts["gate"]["shape"][1])
    biases = desc.get("biases", [])
    if not isinstance(biases, list) or any(b not in PROJ for b in biases):
        raise _Bad(f"{field}.biases is {_show(biases)}; expected a list of {list(PROJ)}")
    for b in biases:
        n = hidden_size if b == "down" else width
        out[f"{b}_bias"] = Declared((e, n), None, f"{field}.biases", f"{field}.biases")
    for flag in ("widths", "expert_map"):
        if not isinstance(desc.get(flag, False), bool):
            raise _Bad(f"{field}.{flag} is {_show(desc[flag])}, not true or false")
    if desc.get("widths"):
        out["widths"] = Declared((e,), torch.int32, f"{field}.widths", f"{field}.widths")
    if desc.get("rotation"):
        dtype = DTYPES[_str(desc["rotation"], f"{field}.rotation", list(DTYPES))]
        out["rotation"] = Declared(
            (hidden_size, hidden_size), dtype, f"{field}.rotation", f"{field}.rotation"
        )
    if desc.get("expert_map"):
        n = _int(desc.get("num_logical_experts", e), f"{field}.num_logical_experts", low=1)
        out["expert_map"] = Declared((n,), torch.int64, f"{field}.num_logical_experts", f"{field}.expert_map")
    return out


def _projection(meta: dict, name: str, e: int, f: str) -> dict[str, Declared]:
    kind = meta.get("kind")
    if not isinstance(kind, str) or kind not in LAYOUTS:
        raise _Bad(
            f"{f}.kind: unknown layout kind {kind!r} (known: {', '.join(sorted(LAYOUTS))})",
            "upgrade moecompress if a newer version wrote this output; otherwise " + DAMAGED,
        )
    shape = _ints(meta.get("shape"), f"{f}.shape", n=3)
    if shape[0] != e:
        raise _Bad(f"{f}.shape {shape} has {shape[0]} experts but num_experts is {e}")
    if "tensor_shapes" in meta:
        shapes = {
            k: _ints(v, f"{f}.tensor_shapes.{k}")
            for k, v in _obj(meta["tensor_shapes"], f"{f}.tensor_shapes").items()
        }
    elif kind == "dense":
        shapes = {"weight": shape}
    else:
        raise _Bad(f"{f} lacks tensor_shapes (a {kind!r} layout stores several tensors)")
    names = meta.get("tensors", ["weight"])
    if not isinstance(names, list) or not all(isinstance(k, str) for k in names) or set(names) != set(shapes):
        raise _Bad(
            f"{f}.tensors {_show(names)} and {f}.tensor_shapes {sorted(shapes)} name different tensors"
        )
    dtypes = _obj(meta.get("dtypes", {}), f"{f}.dtypes")
    default = meta.get("dtype", "float32")
    out = {}
    for k, s in shapes.items():
        where = f"{f}.dtypes.{k}" if k in dtypes else f"{f}.dtype"
        dtype = DTYPES[_str(dtypes.get(k, default), where, list(DTYPES))]
        out[f"{name}.{k}"] = Declared(tuple(s), dtype, f"{f}.tensor_shapes.{k}", where)
    return out


# -- the checks ----------------------------------------------------------------------------------
def verify_checkpoint(adapter, block: Any, reader, *, quant_method: Any) -> list[Problem]:
    """Every problem of a checkpoint (``adapter`` of its config, ``block`` = ``config.json["moecompress"]``,
    ``reader`` a :class:`~moecompress.io.reader.ShardReader`, or ``None`` to check the block alone)."""
    descs, problems = read_block(block, quant_method=quant_method)
    if descs is None:
        return problems
    why = check_routing(adapter, read_routing(block), reader)
    if why is not None:
        problems.append(Problem(None, why, LOST if "missing" in why else DAMAGED))
    return problems + verify_layers(adapter, descs, reader)


def verify_layers(adapter, descs: dict[int, Any], reader) -> list[Problem]:
    """The problems of every MoE layer (at most one each) and of descriptions of non-MoE layers."""
    moe = adapter.moe_layer_indices
    problems = [
        Problem(i, f"moecompress.layers describes layer {i}, which is not an MoE layer (MoE layers: {moe})", DAMAGED)
        for i in sorted(descs) if i not in moe
    ]  # fmt: skip
    problems += [p for i in moe if (p := layer_problem(adapter, i, descs.get(i), reader)) is not None]
    return sorted(problems, key=lambda p: -1 if p.layer is None else p.layer)


def layer_problem(adapter, i: int, desc: Any, reader) -> Problem | None:
    """The problem of MoE layer ``i`` (described by ``desc``, or stock when ``desc`` is ``None``)."""
    try:
        # the index vectors are read on the CPU, whatever device a caller's context defaults to
        # (transformers builds the model, and calls the quantizer, under a ``meta`` device context)
        with torch.device("cpu"):
            if desc is not None:
                check_described(adapter, i, desc, reader)
            elif reader is not None:
                _check_stock(adapter, i, reader)
    except _Bad as bad:
        return Problem(i, bad.problem, bad.fix)
    return None


def check_described(adapter, i: int, desc: Any, reader) -> None:
    """Raise :class:`CheckpointError` unless described layer ``i`` is stored as ``desc`` says."""
    field, hidden = f"moecompress.layers.{i}", adapter.hidden_size
    banks = [(adapter.experts_key(i), module_tensors(desc, hidden, field), desc["experts"], field)]
    if "shared" in desc:
        if adapter.shared_key(i) is None:
            raise _Bad(f"{field}.shared describes a shared expert, which {adapter.model_type} does not have")
        shared = module_tensors(desc["shared"], hidden, f"{field}.shared")
        banks.append((adapter.shared_key(i), shared, desc["shared"]["experts"], f"{field}.shared"))
    if reader is None:
        return
    stock = stock_keys(adapter, i, desc)
    _, expected = adapter.expected_tensors(i, stock)
    for key in stock:
        if key not in reader:
            raise _Bad(f"tensor {key!r} (stock name) is not in the shards", LOST)
        if key in expected and tuple(reader.shape(key)) != tuple(expected[key]):
            why = f"{key!r} is stored as {list(reader.shape(key))} but config.json implies {list(expected[key])}"
            raise _Bad(why)
    tensors: dict[str, torch.Tensor] = {}
    for prefix, spec, experts, f in banks:
        _compare(reader, prefix, spec, f)
        tensors.update(_fetch(reader, [f"{prefix}.{k}" for k in spec]))
        for name in PROJ:
            _rebuild(experts[name], {k.removeprefix(f"{prefix}.{name}."): v for k, v in tensors.items()
                                     if k.startswith(f"{prefix}.{name}.")}, f"{f}.experts.{name}")  # fmt: skip
        _agree(experts, hidden, f)
    try:
        layer = read_compressed_layer(adapter, i, desc, lambda names: _fetch(reader, names, tensors))
    except (MoecompressError, ValueError, TypeError, KeyError, IndexError, RuntimeError) as err:
        raise _Bad(f"the stored experts do not fit together or with the router ({_first(err)})") from None
    for bank, f in ((layer.experts, field), (layer.shared, f"{field}.shared")):
        w = None if bank is None or bank.widths is None or not bank.widths.numel() else bank.widths
        if w is not None and w.device.type != "meta" and not 0 <= int(w.min()) <= int(w.max()) <= bank.width:
            live = f"[{int(w.min())}, {int(w.max())}]"
            raise _Bad(
                f"{f}.experts.*.shape allocate a width of {bank.width} but the live widths lie in {live}"
            )


def _compare(reader, prefix: str, spec: dict[str, Declared], field: str) -> None:
    for local, d in spec.items():
        name = f"{prefix}.{local}"
        if name not in reader:
            raise _Bad(f"tensor {name!r} that config.json declares ({d.field}) is not in the shards", LOST)
        got = list(reader.shape(name))
        if got != list(d.shape):
            raise _Bad(f"{name!r} is stored as {got} but config.json ({d.field}) declares {list(d.shape)}")
        stored = _ST_NAME.get(reader.dtype(name), reader.dtype(name))
        ok = (
            DTYPES.get(stored, torch.uint8).is_floating_point if d.dtype is None else stored == _name(d.dtype)
        )
        if not ok:
            want = "a floating dtype" if d.dtype is None else _name(d.dtype)
            raise _Bad(f"{name!r} is stored as {stored} but config.json ({d.dtype_field}) declares {want}")
    extra = [k for k in reader.keys if k.startswith(f"{prefix}.") and k[len(prefix) + 1 :] not in spec]
    if extra:
        raise _Bad(
            f"{extra[0]!r} is stored under the module path but config.json ({field}) does not declare it"
        )


def _rebuild(meta: dict, own: dict[str, torch.Tensor], field: str) -> None:
    kind = meta["kind"]
    try:
        lay = LAYOUTS[kind].from_tensors(own, meta)
    except (MoecompressError, ValueError, TypeError, KeyError, IndexError, RuntimeError) as err:
        raise _Bad(f"{field}: the stored tensors do not form a {kind!r} layout ({_first(err)})") from None
    if list(lay.shape) != list(meta["shape"]):
        raise _Bad(
            f"{field}.shape is {list(meta['shape'])} but the stored {kind!r} tensors give {list(lay.shape)}"
        )


def _agree(experts: dict, hidden: int, field: str) -> None:
    """The declared logical shapes form one bank: gate/up ``[E, I, H]``, down ``[E, H, I]``, with ``H``
    config.json's ``hidden_size`` (``E`` and ``I`` by majority, so the odd projection is named)."""
    shapes = {name: list(experts[name]["shape"]) for name in PROJ}
    e = Counter(s[0] for s in shapes.values()).most_common(1)[0][0]
    i = Counter([shapes["gate"][1], shapes["up"][1], shapes["down"][2]]).most_common(1)[0][0]
    want = {"gate": [e, i, hidden], "up": [e, i, hidden], "down": [e, hidden, i]}
    for name in PROJ:
        if shapes[name] != want[name]:
            why = (
                f"{field}.experts.{name}.shape is {shapes[name]} but the other projections and config.json's "
                f"hidden_size {hidden} make it {want[name]}"
            )
            raise _Bad(why)


def _check_stock(adapter, i: int, reader) -> None:
    try:
        adapter.check_layer(i, without_routing(adapter, i, reader.keys), reader.shape)
    except MoecompressError as err:
        prefix = f"{adapter.experts_key(i)}."
        ours = [k for k in reader.keys if k.startswith(prefix) and k[len(prefix) :].startswith(_FORMAT_PARTS)]
        if ours:
            why = (
                f"its experts are stored in the moecompress format ({ours[0]!r}) but config.json's "
                f"moecompress.layers has no entry {str(i)!r}"
            )
            raise _Bad(why) from None
        msg = str(err)
        if "missing tensor" in msg:
            fix = "restore the missing tensor (re-download or re-run the recipe that wrote it)"
        elif "shape" in msg:
            fix = "every expert must have the width config.json states; ragged widths need the moecompress format"
        else:
            fix = "see the message"
        raise _Bad(msg, fix) from None


def _fetch(reader, names, known: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``meta`` tensors, except the 1-D integer index vectors (read for real: a few bytes per expert);
    names in ``known`` are taken from it."""
    known = known or {}
    out, small = {n: known[n] for n in names if n in known}, []
    for n in (n for n in names if n not in known):
        shape, code = reader.shape(n), reader.dtype(n)
        if len(shape) == 1 and code in ("I64", "I32", "I16", "I8", "U8") and shape[0] <= 1 << 20:
            small.append(n)
        else:
            out[n] = reader.meta(n)
    return {**out, **reader.get_many(small)}


# -- small validators ----------------------------------------------------------------------------
def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _is_ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def _obj(value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise _Bad(f"{field} is {_show(value)}, not an object")
    return value


def _int(value: Any, field: str, *, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _Bad(f"{field} is {_show(value)}, not an integer >= {low}")
    return value


def _ints(value: Any, field: str, *, n: int | None = None) -> list[int]:
    if not _is_ints(value) or (n is not None and len(value) != n) or any(x < 0 for x in value):
        size = f"{n} " if n else ""
        raise _Bad(f"{field} is {_show(value)}, not a list of {size}non-negative integers")
    return list(value)


def _str(value: Any, field: str, choices: list[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise _Bad(f"{field} is {_show(value)}; expected one of {', '.join(choices)}")
    return value
