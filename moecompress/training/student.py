"""The model a training stage runs: transformers' own modules with every MoE block replaced by
:class:`LayoutMoE`, which holds the layer's *stored* tensors (whatever its layout) as parameters.

``LayoutMoE`` flattens a canonical :class:`~moecompress.ir.MoELayer` into named tensors — the router,
each projection's ``Layout.tensors()`` (ragged rows, Tucker factors and cores, low-rank factors,
codebook centroids, RTN scales and zeros, dense weights), biases, the shared expert — and rebuilds the
layer from them on every forward (``Layout.from_tensors``), so the reference forward
(:func:`moecompress.reference.moe_forward`) differentiates straight into what the layout stores.
Floating-point tensors are float32 master parameters; the forward rounds them to their stored dtype
first, so the model computes with exactly what :meth:`LayoutMoE.layer` writes back. Integer tensors
(codes, widths, members, expert maps) are buffers and never change; a bank's rotation stays fixed.

Protected (super) experts stay bit-identical: every stored element that influences a protected
expert's decoded weight (found by autograd on the decoded weight) is restored after each optimiser
step (:meth:`LayoutMoE.restore_frozen`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moecompress.calibration.skeleton import Skeleton
from moecompress.errors import CheckpointError, PassError
from moecompress.io.checkpoint import Checkpoint
from moecompress.ir import ExpertBank, Gating, MoELayer
from moecompress.methods.token_rounding import token_round
from moecompress.reference import expert_forward, experts_forward, moe_forward, router_logits

PROJ = ("gate", "up", "down")
ROUTER = ("router_weight", "router_bias", "shared_gate")
FIXED = ("score_bias", "expert_map", "routing_similarity")


def _key(name: str) -> str:
    return name.replace(".", "__")  # nn.ParameterDict keys may not hold dots


def flatten(layer: MoELayer) -> dict[str, torch.Tensor]:
    """The layer's stored tensors by a dotted name (``experts.gate.rows``, ``router_weight``, ...)."""
    out: dict[str, torch.Tensor] = {}
    for name in (*ROUTER, *FIXED):
        t = getattr(layer, name)
        if t is not None:
            out[name] = t
    for which in ("experts", "shared"):
        bank = getattr(layer, which)
        if bank is None:
            continue
        for p in PROJ:
            for k, t in getattr(bank, p).tensors().items():
                out[f"{which}.{p}.{k}"] = t
        for k, t in bank.biases.items():
            out[f"{which}.bias.{k}"] = t
        for k in ("widths", "rotation"):
            if getattr(bank, k) is not None:
                out[f"{which}.{k}"] = getattr(bank, k)
    return out


def unflatten(template: MoELayer, tensors: dict[str, torch.Tensor]) -> MoELayer:
    """``template`` with its stored tensors replaced by ``tensors`` (names as :func:`flatten`)."""

    def bank(which: str, b: ExpertBank | None) -> ExpertBank | None:
        if b is None:
            return None
        lays = {}
        for p in PROJ:
            lay = getattr(b, p)
            own = {k: tensors[f"{which}.{p}.{k}"] for k in lay.tensors()}
            lays[p] = type(lay).from_tensors(own, lay.meta())
        biases = {k: tensors[f"{which}.bias.{k}"] for k in b.biases}
        fixed = {k: tensors[f"{which}.{k}"] for k in ("widths", "rotation") if getattr(b, k) is not None}
        return dataclasses.replace(b, **lays, biases=biases, **fixed)

    fields = {n: tensors[n] for n in (*ROUTER, *FIXED) if getattr(template, n) is not None}
    return template.replace(experts=bank("experts", template.experts), shared=bank("shared", template.shared),
                            **fields)  # fmt: skip


def group_of(name: str) -> str:
    """``router`` for routing tensors, ``compressed`` for the experts' stored tensors, ``fixed`` else."""
    if name in ROUTER:
        return "router"
    return "fixed" if name in FIXED or name.endswith((".widths", ".rotation")) else "compressed"


class _Capture:
    """Observer keeping the routing weights and every routed slot's expert output ``[T, k, H]``."""

    def __init__(self) -> None:
        self.weights = self.outputs = None

    def on_input(self, x: torch.Tensor) -> None:
        pass

    def on_output(self, y: torch.Tensor) -> None:
        self.moe_out = y

    def on_route(self, logits, ids, weights) -> None:
        self.weights = weights
        self.outputs = weights.new_zeros(*ids.shape, 0)

    def on_expert(self, e, tok, slot, h, y) -> None:
        if self.outputs.shape[-1] != y.shape[-1]:
            self.outputs = self.weights.new_zeros(*self.weights.shape, y.shape[-1])
        self.outputs = self.outputs.index_put((tok, slot), y.float())

    def on_shared(self, h, y) -> None:
        pass


class LayoutMoE(nn.Module):
    """A drop-in MoE block whose parameters are the stored tensors of a canonical layer."""

    def __init__(self, layer: MoELayer, *, returns_tuple: bool = False) -> None:
        super().__init__()
        self.returns_tuple = returns_tuple
        self.capture: _Capture | None = None
        self.stored_dtype: dict[str, torch.dtype] = {}
        self.params = nn.ParameterDict()
        self.names: list[str] = []
        for name, t in flatten(layer).items():
            self.names.append(name)
            if t.is_floating_point() and group_of(name) != "fixed" and t.numel():
                self.stored_dtype[name] = t.dtype
                self.params[_key(name)] = nn.Parameter(t.detach().float().clone(), requires_grad=False)
            else:
                self.register_buffer(_key(name), t.detach().clone(), persistent=False)
        # the layer's structure, its trained tensors on ``meta`` (their values live in ``params`` alone)
        flat = flatten(layer)
        self.template = unflatten(layer, {n: t.to("meta") if n in self.stored_dtype else t for n, t in flat.items()})
        self.frozen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lora: nn.Module | None = None
        self.exact = False
        """The parameters hold the stored values unchanged (a frozen teacher): read them without the
        round trip through the stored dtype, which would give the same values through a whole-weight copy."""
        self.rounding: tuple[int, str] | None = None
        """``(tile, mode)`` while training with token rounding; exact top-k routing otherwise."""

    def attach_lora(self, rank: int, alpha: float, seed: int) -> list[nn.Parameter]:
        """Per-expert LoRA factors (``trainable: lora``); returns them (merged by :meth:`layer`)."""
        from moecompress.training.lora import ExpertLoRA

        device = next(iter(self.params.values())).device if len(self.params) else torch.device("cpu")
        self.lora = ExpertLoRA(self.template, rank, alpha, seed).to(device)
        return list(self.lora.parameters())

    def tensor(self, name: str) -> torch.Tensor:
        k = _key(name)
        if k in self.params:
            p = self.params[k]
            delta = None if self.lora is None else self.lora.delta(name)
            p = p if delta is None else p + delta
            dt = self.stored_dtype[name]
            return p if dt == torch.float32 or (self.exact and delta is None) else p.to(dt).to(torch.float32)
        t = getattr(self, k)
        return t.float() if t.is_floating_point() else t

    def named_stored(self) -> dict[str, nn.Parameter]:
        """The trainable (floating-point) stored tensors, by dotted name."""
        return {n: self.params[_key(n)] for n in self.stored_dtype}

    def current(self) -> MoELayer:
        """The layer the parameters describe now (float32 compute, autograd-connected)."""
        return unflatten(self.template, {n: self.tensor(n) for n in self.names})

    def layer(self) -> MoELayer:
        """The layer to write: every stored tensor in its original dtype, detached, on the CPU."""
        out = {}
        for n in self.names:
            t = self.tensor(n).detach()
            out[n] = (t.to(self.stored_dtype[n]) if n in self.stored_dtype else getattr(self, _key(n))).cpu()
        return unflatten(self.template, out)

    def freeze_protected(self) -> None:
        """Record which stored elements influence a protected expert (restored after each step)."""
        lay = self.template
        if not lay.protected:
            return
        phys = sorted({lay.physical(e) for e in lay.protected})
        with torch.enable_grad():
            leaves = {n: p.detach().clone().requires_grad_(True) for n, p in self.named_stored().items()}
            vals = {n: leaves.get(n, self.tensor(n)) for n in self.names}
            bank = unflatten(lay, vals).experts
            g = torch.Generator().manual_seed(0)
            total = 0
            for p in PROJ:
                for e in phys:
                    w = getattr(bank, p).expert(e).float()
                    total = total + (w * torch.rand(w.shape, generator=g).to(w.device)).sum()
            for b in bank.biases.values():
                total = total + b[phys].sum()
            grads = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
        for n, gr in zip(leaves, grads):
            if gr is not None and bool((gr != 0).any()):
                self.frozen[n] = (gr != 0, self.named_stored()[n].detach().clone())

    @torch.no_grad()
    def restore_frozen(self) -> None:
        """Under FSDP2 (a sharded parameter) on this rank's rows of the mask and the original only."""
        params = self.named_stored()
        for n, (mask, orig) in self.frozen.items():
            p = params[n]
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(torch.where(local_rows(mask, p), local_rows(orig, p), local))

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).float()
        if self.rounding is not None:
            out = rounded_forward(self.current(), x, *self.rounding)
        else:
            out = moe_forward(self.current(), x, self.capture)
        out = out.to(hidden_states.dtype).reshape(shape)
        return (out, None) if self.returns_tuple else out


def rounded_forward(layer: MoELayer, x: torch.Tensor, tile: int, mode: str) -> torch.Tensor:
    """The MoE block with SonicMoE token rounding (:func:`moecompress.methods.token_rounding.token_round`)
    instead of exact top-k: every (token, expert) pair kept is weighted by its softmax score (divided by
    the token's top-k sum under ``norm_topk``); softmax top-k routers only."""
    spec = layer.router
    if spec.gating is not Gating.SOFTMAX_TOPK or spec.n_group is not None:
        raise PassError(f"token_rounding needs a softmax top-k router without groups, not {spec.gating.value}")
    p = router_logits(layer, x).softmax(dim=-1)
    keep = token_round(p, spec.top_k, tile, mode)
    w = p / p.topk(spec.top_k, dim=-1).values.sum(-1, keepdim=True) if spec.norm_topk else p
    e = p.shape[1]
    ids = torch.where(keep, torch.arange(e, device=x.device).expand_as(keep), torch.full_like(keep, e, dtype=torch.int64))
    out = experts_forward(layer.experts, x, ids, torch.where(keep, w * spec.routed_scale, 0.0), layer.expert_map)
    if layer.shared is not None:
        s = expert_forward(layer.shared, 0, x).float()
        if layer.shared_gate is not None:
            s = s * torch.sigmoid(F.linear(x.float(), layer.shared_gate.float()))
        out = out + s
    return out


def build_model(
    ckpt: Checkpoint, device: str = "cpu", on_layer: Callable[[int, nn.Module], None] | None = None
) -> tuple[nn.Module, dict[int, LayoutMoE]]:
    """Transformers' model of ``ckpt`` in float32 on ``device``, eval mode, nothing trainable yet, its
    MoE blocks :class:`LayoutMoE` modules of the checkpoint's layers (any layout). ``on_layer(i, layer)``:
    called on each decoder layer as soon as it is built (FSDP2's ``fully_shard`` for a frozen teacher, or
    trained tensors put in place of those just read: one layer's read tensors held at a time)."""
    sk = Skeleton(ckpt, torch.float32)
    sk.load_head()
    adapter = ckpt.adapter
    moes: dict[int, LayoutMoE] = {}
    for i in range(len(sk.meta_layers)):
        if i in ckpt.moe_layer_indices:
            layer = ckpt.read_layer(i)
            mod = sk.layer(i, moe=layer)
            moes[i] = LayoutMoE(layer, returns_tuple=adapter.module_returns_tuple)
            setattr(mod, adapter.module_attr, moes[i])
        else:
            mod = sk.layer(i)
        sk.layers[i] = mod
        if on_layer is not None:
            on_layer(i, mod)
    model = sk.model
    model.config.use_cache = False
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{ckpt.path}: cannot materialise {left[:3]} for training")
    return model.to(device).eval().requires_grad_(False), moes


def non_moe_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The transformers parameters outside the MoE blocks, by their state-dict name."""
    return {n: p for n, p in model.named_parameters() if ".params." not in n}


def local_rows(full: torch.Tensor, param) -> torch.Tensor:
    """The rows of ``full`` that ``param``'s local shard holds (FSDP2: dim 0 in ``torch.chunk`` parts)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return full
    mesh = param.device_mesh
    parts = list(torch.chunk(full, mesh.size(), dim=0))
    r = mesh.get_local_rank()
    return parts[r] if r < len(parts) else full[:0]
