"""Adapter contract and the shared implementation for per-expert checkpoints.

An adapter owns every quirk of one ``model_type``: which decoder layers carry an MoE block, the exact
on-disk tensor names and shapes, and the routing semantics. It converts between those tensors and the
canonical :class:`~moecompress.ir.MoELayer`; nothing else in moecompress knows a tensor name.

Two on-disk forms are read:

- **hub** (the Hub's original names): ``<block>.experts.<e>.<gate|up|down>.weight``, written by
  ``save_pretrained`` by default and by every released checkpoint;
- **fused** (transformers 5 in-memory names, ``save_pretrained(save_original_format=False)``):
  ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and ``mlp.experts.down_proj``
  ``[E, H, I]``.

Writing uses the hub form unless ``fused=True`` is asked for.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch

from moecompress.errors import AdapterError, LayoutError
from moecompress.ir import ExpertBank, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense

Fetch = Callable[[Iterable[str]], dict[str, torch.Tensor]]
Rows = Callable[[str, int, int], torch.Tensor]
"""``rows(name, start, stop)``: rows ``start:stop`` of the first dimension of tensor ``name`` (only those
bytes are read: experts of a fused ``[E, ...]`` tensor)."""
Alloc = Callable[[str, tuple[int, ...]], torch.Tensor]
"""``alloc(projection, shape)``: the tensor (any dtype and device) a bank's ``"gate"``, ``"up"`` or ``"down"``
weights are copied into as they are read (a cast where the dtypes differ), instead of fresh memory in the
read dtype (:meth:`Adapter.read_experts`; calibration's chunk buffer)."""


def filled(alloc: Alloc | None, proj: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a view of what was read) as a projection's weights: a contiguous copy, or copied into
    ``alloc``'s tensor (cast to its dtype, moved to its device)."""
    return t.contiguous() if alloc is None else alloc(proj, tuple(t.shape)).copy_(t)


class Adapter(ABC):
    """Base class: configuration queries shared by every architecture."""

    model_type: ClassVar[str]
    layers_prefix: ClassVar[str] = "model.layers"
    count_key: ClassVar[str]
    """config attribute holding the routed expert count (the spelling this model type writes)."""
    width_key: ClassVar[str]
    """config attribute holding the routed expert width."""
    stock_width_change: ClassVar[bool] = True
    """whether a narrower routed-expert width can be written as a stock checkpoint by changing
    ``width_key`` alone (false where other modules' sizes derive from it)."""
    module_attr: ClassVar[str] = "mlp"
    """attribute of transformers' decoder layer that holds the MoE block (in memory)."""
    router_module: ClassVar[str] = "gate"
    """attribute of that block holding transformers' router (in memory)."""
    module_returns_tuple: ClassVar[bool] = False
    """whether that block returns ``(hidden_states, router_scores)`` instead of a tensor."""

    def __init__(self, config) -> None:
        self.config = config
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise AdapterError(f"{self.model_type}: hidden_act={act!r} is not supported (only silu experts)")

    # -- configuration ---------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_experts(self) -> int:
        return int(getattr(self.config, self.count_key))

    @property
    def expert_width(self) -> int:
        return int(getattr(self.config, self.width_key))

    def is_moe_layer(self, i: int) -> bool:
        return 0 <= i < self.num_layers

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @abstractmethod
    def router_spec(self, num_experts: int | None = None) -> RouterSpec:
        """Routing semantics; ``num_experts`` overrides the config's count (layers with fewer experts)."""

    def layer_prefix(self, i: int) -> str:
        return f"{self.layers_prefix}.{i}."

    # -- tensors (implemented by subclasses) -----------------------------------------------------
    @abstractmethod
    def expected_tensors(self, i: int, keys: Iterable[str]) -> tuple[str, dict[str, tuple[int, ...]]]:
        """``(block_prefix, {key: shape})``: what MoE layer ``i`` must hold in the form found in ``keys``."""

    @abstractmethod
    def build_layer(self, i: int, get: Fetch, fmt: str) -> MoELayer:
        """Canonical layer ``i`` from tensors fetched with ``get`` (on-disk form ``fmt``)."""

    @abstractmethod
    def build_experts(
        self, i: int, get: Fetch, rows: Rows, fmt: str, start: int, stop: int, alloc: Alloc | None = None
    ) -> ExpertBank:
        """Routed experts ``[start, stop)`` of layer ``i`` as a bank of ``stop - start`` experts: per-expert
        tensors through ``get``, fused ``[E, ...]`` ones through ``rows`` (only those experts' bytes); with
        ``alloc``, the gate, up and down weights are copied into its tensors (:data:`Alloc`)."""

    @abstractmethod
    def layer_tensors(self, layer: MoELayer, *, fused: bool = False) -> dict[str, torch.Tensor]:
        """On-disk tensors of a canonical layer (hub names unless ``fused``)."""

    @abstractmethod
    def router_tensors(self, layer: MoELayer, *, shared: bool = True) -> dict[str, torch.Tensor]:
        """The stock-named tensors of everything but the routed experts (router, biases, and the shared
        expert unless ``shared=False``: a compressed shared expert is written in the moecompress format)."""

    @abstractmethod
    def router_keys(self, i: int, fmt: str = "hub", *, shared: bool = True) -> list[str]:
        """Names of the tensors :meth:`router_tensors` writes for layer ``i``."""

    @abstractmethod
    def router_part(self, i: int, t: dict[str, torch.Tensor], fmt: str = "hub", *, shared: bool = True) -> dict:
        """``MoELayer`` fields other than the routed experts, from the tensors named by :meth:`router_keys`
        (``shared=False``: the shared expert is not among them and is left ``None``)."""

    def shared_key(self, i: int) -> str | None:
        """Key prefix of the shared expert *module* (memory path) of layer ``i``, where a compressed shared
        expert is stored; ``None`` for architectures without one."""
        return None

    def config_spellings(self, key: str) -> list[str]:
        """Every config.json spelling of attribute ``key`` (transformers' ``attribute_map`` aliases)."""
        amap = getattr(type(self.config), "attribute_map", {}) or {}
        real = amap.get(key, key)
        return [real, *sorted(alias for alias, target in amap.items() if target == real)]

    def experts_key(self, i: int) -> str:
        """Key prefix of the routed experts *module* in transformers' model (memory path): compressed
        layouts are stored under it, so transformers' own key renamings never touch them."""
        return f"{self.layer_prefix(i)}{self.module_attr}.experts"

    # -- driving ---------------------------------------------------------------------------------
    def check_layer(
        self, i: int, keys: Iterable[str], shape_of: Callable[[str], tuple[int, ...]]
    ) -> list[str]:
        """Validate names and shapes of MoE layer ``i`` from headers only; returns the keys it owns."""
        keys = list(keys)
        prefix, expected = self.expected_tensors(i, keys)
        present = set(keys)
        for key, shape in expected.items():
            if key not in present:
                raise AdapterError(
                    f"{self.model_type} layer {i}: missing tensor {key!r} (expected shape {list(shape)})"
                )
            got = tuple(shape_of(key))
            if got != tuple(shape):
                raise AdapterError(
                    f"{self.model_type} layer {i}: tensor {key!r} has shape {list(got)}, expected {list(shape)} "
                    "from config.json"
                )
        extra = sorted(k for k in keys if k.startswith(prefix) and k not in expected)
        if extra:
            hint = (
                " (quantised tensors, but config.json has no quantization_config that moecompress reads: "
                "fp8 with weight_block_size, compressed-tensors or mxfp4; restore the release's "
                "quantization_config, or use a dequantized checkpoint)"
                if any(s in extra[0] for s in ("scale", "blocks", "qweight", "zeros", "packed"))
                else ""
            )
            raise AdapterError(
                f"{self.model_type} layer {i}: tensor {extra[0]!r} is not understood by the adapter{hint}"
            )
        return list(expected)

    def read_layer(self, i: int, keys: Iterable[str], fetch: Fetch) -> MoELayer:
        """Read MoE layer ``i``. ``build_layer`` fetches in groups (one projection at a time) so the
        transient peak stays near one layer; every fetched tensor's shape is checked."""
        if not self.is_moe_layer(i):
            raise AdapterError(
                f"{self.model_type}: layer {i} is not an MoE layer; MoE layers are {self.moe_layer_indices}"
            )
        keys = list(keys)
        _, expected = self.expected_tensors(i, keys)

        def get(names: Iterable[str]) -> dict[str, torch.Tensor]:
            got = fetch(list(names))
            for key, t in got.items():
                if tuple(t.shape) != tuple(expected[key]):
                    raise AdapterError(
                        f"{self.model_type} layer {i}: {key!r} shape {list(t.shape)} != {list(expected[key])}"
                    )
            return got

        return self.build_layer(i, get, self.detect_format(i, keys))

    def read_experts(
        self, i: int, keys: Iterable[str], fetch: Fetch, rows: Rows, start: int, stop: int, alloc: Alloc | None = None
    ) -> ExpertBank:
        """Routed experts ``[start, stop)`` of MoE layer ``i`` (what an expert-chunked run holds at once);
        equal to ``read_layer(...).experts`` restricted to those experts, bit for bit (cast to ``alloc``'s
        tensors' dtype where given: :data:`Alloc`)."""
        keys = list(keys)
        if not 0 <= start < stop <= self.num_experts:
            raise AdapterError(
                f"{self.model_type} layer {i}: expert range [{start}, {stop}) is outside 0..{self.num_experts}"
            )
        _, expected = self.expected_tensors(i, keys)

        def check(key: str, t: torch.Tensor, want: tuple[int, ...]) -> torch.Tensor:
            if tuple(t.shape) != tuple(want):
                raise AdapterError(f"{self.model_type} layer {i}: {key!r} shape {list(t.shape)} != {list(want)}")
            return t

        def get(names: Iterable[str]) -> dict[str, torch.Tensor]:
            return {k: check(k, t, expected[k]) for k, t in fetch(list(names)).items()}

        def part(name: str, a: int, b: int) -> torch.Tensor:
            return check(name, rows(name, a, b), (b - a, *expected[name][1:]))

        return self.build_experts(i, get, part, self.detect_format(i, keys), start, stop, alloc)

    def expert_keys(self, i: int, keys: Iterable[str]) -> list[str]:
        """The on-disk names of layer ``i``'s routed experts (its MoE tensors less the router and shared
        parts): what an expert-chunked run reads in pieces."""
        keys = list(keys)
        fmt = self.detect_format(i, keys)
        _, expected = self.expected_tensors(i, keys)
        other = set(self.router_keys(i, fmt))
        return [k for k in expected if k not in other]

    def detect_format(self, i: int, keys: Iterable[str]) -> str:
        return "hub"

    def expert_of(self, key: str) -> int | None:
        """The routed expert an on-disk per-expert tensor name belongs to (``...experts.<e>.<proj>...``),
        ``None`` for a name of no single expert (a fused ``[E, ...]`` tensor, the router)."""
        m = _EXPERT_KEY.search(key)
        return None if m is None else int(m.group(1))

    def renumber_key(self, key: str, expert: int) -> str:
        """A per-expert tensor name (:meth:`expert_of`) for expert id ``expert`` (experts removed or
        written chunk by chunk)."""
        return _EXPERT_KEY.sub(f".experts.{expert}.", key, count=1)


_EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


def dense3(layout, what: str):
    """The ``[E, out, in]`` tensor of a Dense layout, or a LayoutError naming what cannot be written."""
    if not isinstance(layout, Dense):
        raise LayoutError(
            f"{what} uses the {layout.kind!r} layout, which has no stock on-disk form; "
            "write it with the moecompress format instead"
        )
    return layout.weight


def require_stock(layer: MoELayer, model_type: str) -> None:
    """Raise unless ``layer`` can be written with the architecture's own tensor names."""
    if layer.expert_map is not None:
        raise LayoutError(f"{model_type} layer {layer.index}: an expert_map (merged experts) is not stock")
    for name, bank in (("experts", layer.experts), ("shared", layer.shared)):
        if bank is not None and bank.widths is not None and bool((bank.widths != bank.width).any()):
            raise LayoutError(f"{model_type} layer {layer.index}: ragged {name} widths are not stock")


STACK_READ = 8
"""Per-expert tensors read at once while a projection's ``[E, ...]`` stack is filled: the stack and at most this
many experts' tensors are held (``torch.stack`` of them all held the projection twice)."""


class PerExpertAdapter(Adapter):
    """Architectures whose Hub checkpoints store one tensor per expert and projection."""

    disk_block: ClassVar[str] = "mlp"
    fused_block: ClassVar[str] = "mlp"
    proj: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    disk_router: ClassVar[str] = "gate"
    fused_router: ClassVar[str] = "gate"
    shared_name: ClassVar[str | None] = None
    shared_gate_name: ClassVar[str | None] = None
    has_score_bias: ClassVar[bool] = False

    @property
    def shared_width(self) -> int:
        """Width of the shared expert; adapters that set ``shared_name`` override it."""
        raise TypeError(f"{type(self).__name__} sets shared_name but does not define shared_width")

    def detect_format(self, i: int, keys: Iterable[str]) -> str:
        fused_key = f"{self.layer_prefix(i)}{self.fused_block}.experts.gate_up_proj"
        return "fused" if fused_key in set(keys) else "hub"

    def _names(self, i: int, fmt: str) -> tuple[str, str]:
        block = self.fused_block if fmt == "fused" else self.disk_block
        router = self.fused_router if fmt == "fused" else self.disk_router
        return f"{self.layer_prefix(i)}{block}", router

    def _expected(self, i: int, fmt: str) -> tuple[str, dict[str, tuple[int, ...]]]:
        e, n, h = self.num_experts, self.expert_width, self.hidden_size
        p, router = self._names(i, fmt)
        out: dict[str, tuple[int, ...]] = {f"{p}.{router}.weight": (e, h)}
        if self.has_score_bias:
            out[f"{p}.{router}.e_score_correction_bias"] = (e,)
        g, u, d = self.proj
        if fmt == "fused":
            out[f"{p}.experts.gate_up_proj"] = (e, 2 * n, h)
            out[f"{p}.experts.down_proj"] = (e, h, n)
        else:
            for x in range(e):
                out[f"{p}.experts.{x}.{g}.weight"] = (n, h)
                out[f"{p}.experts.{x}.{u}.weight"] = (n, h)
                out[f"{p}.experts.{x}.{d}.weight"] = (h, n)
        if self.shared_name:
            s = self.shared_width
            out[f"{p}.{self.shared_name}.gate_proj.weight"] = (s, h)
            out[f"{p}.{self.shared_name}.up_proj.weight"] = (s, h)
            out[f"{p}.{self.shared_name}.down_proj.weight"] = (h, s)
        if self.shared_gate_name:
            out[f"{p}.{self.shared_gate_name}.weight"] = (1, h)
        return p + ".", out

    def expected_tensors(self, i: int, keys: Iterable[str]) -> tuple[str, dict[str, tuple[int, ...]]]:
        return self._expected(i, self.detect_format(i, keys))

    def build_layer(self, i: int, get: Fetch, fmt: str) -> MoELayer:
        bank = self.build_experts(i, get, lambda name, a, b: get([name])[name][a:b], fmt, 0, self.num_experts)
        t = get(self.router_keys(i, fmt))
        return MoELayer(index=i, experts=bank, **self.router_part(i, t, fmt))

    def build_experts(
        self, i: int, get: Fetch, rows: Rows, fmt: str, start: int, stop: int, alloc: Alloc | None = None
    ) -> ExpertBank:
        p, _ = self._names(i, fmt)
        g, u, d = self.proj
        n = self.expert_width
        if fmt == "fused":
            gu = rows(f"{p}.experts.gate_up_proj", start, stop)
            gate, up = filled(alloc, "gate", gu[:, :n]), filled(alloc, "up", gu[:, n:])
            del gu
            down = rows(f"{p}.experts.down_proj", start, stop)
            down = down if alloc is None else filled(alloc, "down", down)
        else:

            def stack(name: str, proj: str) -> torch.Tensor:  # a projection, STACK_READ experts at a time, into its stack
                names = [f"{p}.experts.{x}.{name}.weight" for x in range(start, stop)]
                out = None
                for a in range(0, len(names), STACK_READ):
                    got = get(names[a : a + STACK_READ])
                    for k, key in enumerate(names[a : a + STACK_READ], a):
                        t = got.pop(key)
                        if out is None:
                            shape = (len(names), *t.shape)
                            out = t.new_empty(shape) if alloc is None else alloc(proj, shape)
                        out[k] = t  # (a cast where alloc's dtype differs)
                        del t
                return out

            gate, up, down = stack(g, "gate"), stack(u, "up"), stack(d, "down")
        return ExpertBank(Dense(gate), Dense(up), Dense(down))

    def shared_key(self, i: int) -> str | None:
        return f"{self.layer_prefix(i)}{self.module_attr}.{self.shared_name}" if self.shared_name else None

    def router_keys(self, i: int, fmt: str = "hub", *, shared: bool = True) -> list[str]:
        p, router = self._names(i, fmt)
        keys = [f"{p}.{router}.weight"]
        if self.has_score_bias:
            keys.append(f"{p}.{router}.e_score_correction_bias")
        if self.shared_name and shared:
            keys += [f"{p}.{self.shared_name}.{q}.weight" for q in ("gate_proj", "up_proj", "down_proj")]
        if self.shared_gate_name:
            keys.append(f"{p}.{self.shared_gate_name}.weight")
        return keys

    def router_part(self, i: int, t: dict[str, torch.Tensor], fmt: str = "hub", *, shared: bool = True) -> dict:
        p, router = self._names(i, fmt)
        weight = t.pop(f"{p}.{router}.weight")
        bank = None
        if self.shared_name and shared:
            s = f"{p}.{self.shared_name}"
            bank = ExpertBank(
                *(Dense(t.pop(f"{s}.{q}.weight")[None]) for q in ("gate_proj", "up_proj", "down_proj"))
            )
        return {
            "router": self.router_spec(num_experts=weight.shape[0]),
            "router_weight": weight,
            "score_bias": t.pop(f"{p}.{router}.e_score_correction_bias") if self.has_score_bias else None,
            "shared": bank,
            "shared_gate": t.pop(f"{p}.{self.shared_gate_name}.weight") if self.shared_gate_name else None,
        }

    def router_tensors(
        self, layer: MoELayer, *, fused: bool = False, shared: bool = True
    ) -> dict[str, torch.Tensor]:
        p, router = self._names(layer.index, "fused" if fused else "hub")
        out: dict[str, torch.Tensor] = {f"{p}.{router}.weight": layer.router_weight}
        if self.has_score_bias:
            if layer.score_bias is None:
                raise LayoutError(f"{self.model_type} layer {layer.index}: score_bias is required")
            out[f"{p}.{router}.e_score_correction_bias"] = layer.score_bias
        if self.shared_name and shared:
            if layer.shared is None:
                raise LayoutError(f"{self.model_type} layer {layer.index}: the shared expert is required")
            s = f"{p}.{self.shared_name}"
            for q, lay in zip(
                ("gate_proj", "up_proj", "down_proj"), (layer.shared.gate, layer.shared.up, layer.shared.down)
            ):
                out[f"{s}.{q}.weight"] = dense3(lay, f"layer {layer.index} shared {q}")[0].clone()
        if self.shared_gate_name:
            out[f"{p}.{self.shared_gate_name}.weight"] = layer.shared_gate
        return out

    def layer_tensors(self, layer: MoELayer, *, fused: bool = False) -> dict[str, torch.Tensor]:
        require_stock(layer, self.model_type)
        p, _ = self._names(layer.index, "fused" if fused else "hub")
        g, u, d = self.proj
        bank = layer.experts
        gate = dense3(bank.gate, f"layer {layer.index} gate")
        up = dense3(bank.up, f"layer {layer.index} up")
        down = dense3(bank.down, f"layer {layer.index} down")
        out = self.router_tensors(layer, fused=fused)
        if fused:
            out[f"{p}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
            out[f"{p}.experts.down_proj"] = down
        else:
            for x in range(bank.num_experts):
                out[f"{p}.experts.{x}.{g}.weight"] = gate[x].clone()
                out[f"{p}.experts.{x}.{u}.weight"] = up[x].clone()
                out[f"{p}.experts.{x}.{d}.weight"] = down[x].clone()
        return out
