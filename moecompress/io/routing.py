"""Routing policies on disk: ``config.json["moecompress"]["routing"]`` and SERE's similarity tensor.

A layer's policy is stored as ``moecompress.routing.<i> = {"capacity_drop": {...}, "sere": {...}}``
(any of them; the knobs of :class:`CapacityPolicy` / :class:`SerePolicy` / :class:`TopKPolicy`), and a SERE policy's
``[E, E]`` float32 expert similarity as the tensor ``model.layers.<i>.<moe block>.routing.similarity``
(the in-memory path of the runtime's policy module, so transformers loads it by name). A checkpoint
with a policy carries ``quantization_config = {"quant_method": "moecompress"}``: the policy is applied
by the moecompress runtime, which ``import moecompress`` registers (``docs/routing.md``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from moecompress.errors import LayoutError

KINDS = ("capacity_drop", "sere", "top_k")
SIMILARITY = "similarity"


class CapacityPolicy(BaseModel):
    """Capacity-aware token drop (and expanded drop) at prefill; never in single-token decode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gamma: float = Field(1.5, gt=0, description="capacity factor: C = ceil(gamma * k * T / E); inf: no cap")
    strategy: Literal["score", "random", "first", "last", "overselect"] = Field(
        "score", description="which overflowing slots an expert keeps"
    )
    expanded: bool = Field(False, description="expanded drop: top-k plus the local experts are candidates")
    local_experts: Literal["all"] | list[int] = Field(
        "all", description="experts local to the device (expanded drop); all on one device"
    )
    renormalize: bool = Field(False, description="rescale a token's kept weights to its original total")
    rounds: int = Field(2, ge=1, le=64, description="overselect: candidates per token = k * rounds")
    seed: int = Field(0, ge=0, description="random strategy: the seed of the drop order")


class SerePolicy(BaseModel):
    """SERE re-routing in decode batches (one token per sequence)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    select_top: int = Field(2, ge=1, description="S: each token's top-S experts are primary")
    threshold: float = Field(0.1, description="rho: re-route to the most similar primary when S[u, v] >= rho")
    similarity: Literal["frobenius", "cosine", "cka"] = Field(
        "cosine", description="how S was computed (the paper's default is frobenius; docs/routing.md says why not ours)"
    )
    simulate_decode: bool = Field(
        False,
        description="apply to multi-token forwards as teacher-forced decode: each position of a batch of "
        "sequences is one decode batch (for measuring; exact, by causality)",
    )

    @field_validator("threshold")
    @classmethod
    def _finite(cls, value: float) -> float:
        if math.isnan(value):
            raise ValueError("threshold is NaN; give a number (similarities lie in [-1, 1])")
        return value


class TopKPolicy(BaseModel):
    """Top-k reduction (the baseline of both papers): each token keeps its ``k`` highest-weighted experts,
    at every forward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    k: int = Field(ge=1, description="experts each token keeps (fewer than the model's top-k)")
    renormalize: bool = Field(True, description="rescale the kept weights to the token's original total")


MODELS: dict[str, type[BaseModel]] = {"capacity_drop": CapacityPolicy, "sere": SerePolicy, "top_k": TopKPolicy}


def parse_policy(value: Any, where: str) -> dict[str, BaseModel]:
    """``{"capacity_drop": CapacityPolicy, "sere": SerePolicy}`` from a stored or given policy; raises
    ``ValueError`` with one line naming ``where`` and the field."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} is {value!r}, not an object such as {{'capacity_drop': {{'gamma': 1.5}}}}")
    out = {}
    for kind, knobs in value.items():
        if kind not in MODELS:
            raise ValueError(f"{where} has policy {kind!r}; known: {', '.join(KINDS)}")
        try:
            out[kind] = MODELS[kind].model_validate(knobs if knobs is not None else {})
        except ValidationError as err:
            e = err.errors()[0]
            loc = ".".join(str(x) for x in e["loc"])
            raise ValueError(f"{where}.{kind}.{loc}: {e['msg']} (got {e.get('input')!r})") from None
    return out


def read_routing(block: Any) -> dict[int, dict[str, BaseModel]]:
    """The policies of ``config.json["moecompress"]`` by layer; ``ValueError`` (one line) when damaged."""
    raw = (block or {}).get("routing") if isinstance(block, dict) else None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"moecompress.routing is {raw!r}, not an object of layer index -> policy")
    out = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ValueError(f"moecompress.routing has key {key!r}, not a layer index")
        out[int(key)] = parse_policy(value, f"moecompress.routing.{key}")
    return out


def stored_policy(layer) -> dict[str, dict]:
    """The JSON form of ``layer.routing`` with every knob checked and defaults filled in (what an output's
    ``config.json`` stores); a malformed policy is a one-line :class:`LayoutError`."""
    try:
        return policy_dict(parse_policy(dict(layer.routing), f"layer {layer.index}: routing"))
    except ValueError as err:
        raise LayoutError(str(err)) from None


def policy_dict(policy: dict[str, BaseModel]) -> dict[str, dict]:
    """The JSON form of a parsed policy (what ``config.json`` stores)."""
    return {k: v.model_dump(mode="json") for k, v in sorted(policy.items())}


def routing_prefix(adapter, i: int) -> str:
    """In-memory (and on-disk) path of layer ``i``'s routing-policy module."""
    return f"{adapter.layer_prefix(i)}{adapter.module_attr}.routing"


def without_routing(adapter, i: int, keys) -> list[str]:
    """``keys`` without layer ``i``'s routing-policy tensors (checked by :func:`check_routing`, not by the
    adapter, which refuses names it does not know)."""
    own = f"{routing_prefix(adapter, i)}."
    return [k for k in keys if not k.startswith(own)]


def routing_tensors(adapter, i: int, policy: dict[str, Any] | None) -> dict[str, tuple[int, ...]]:
    """The tensors a layer's policy stores: ``{name: shape}`` (SERE's similarity, float32)."""
    if not policy or "sere" not in policy:
        return {}
    e = adapter.num_experts
    return {f"{routing_prefix(adapter, i)}.{SIMILARITY}": (e, e)}


def check_routing(adapter, policies: dict[int, dict], reader) -> str | None:
    """The first problem of the stored policies against the shard headers (``None``: none)."""
    for i, policy in sorted(policies.items()):
        if i not in adapter.moe_layer_indices:
            return f"moecompress.routing has a policy for layer {i}, which is not an MoE layer"
        for name, shape in routing_tensors(adapter, i, policy).items():
            if reader is None:
                continue
            if name not in reader.keys:
                return f"layer {i}: its SERE policy's similarity tensor {name!r} is missing"
            got, dtype = tuple(reader.shape(name)), reader.torch_dtype(name)
            if got != shape or dtype != torch.float32:
                return f"layer {i}: {name!r} is {got} {dtype}, the policy needs {shape} float32"
    return None
