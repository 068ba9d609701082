"""A transformers model skeleton on the ``meta`` device, materialised one decoder layer at a time.

This is how calibration runs transformers' own layer modules without loading the model:

1. build the model from its config on ``meta`` (no memory);
2. load the embeddings, re-create modules whose non-persistent buffers only exist after ``__init__``
   (rotary embeddings), and capture every decoder layer's call arguments with identity "catcher"
   modules swapped in for the layers (the GPTQ trick; masks and position embeddings come from the
   model's own forward, so per-layer masks such as sliding windows are right);
3. per layer: deep-copy the meta layer, swap its MoE block *instance* for :class:`InstrumentedMoE`
   (our reference forward on the canonical :class:`~moecompress.ir.MoELayer`, which equals the
   transformers block and exposes its internals to statistics), load the rest of the layer's tensors
   from the shards with ``assign=True``, run, free.

No transformers class is patched; only module instances of our own skeleton are replaced.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

from moecompress.calibration.chunk_buffer import ChunkBuffer
from moecompress.errors import CheckpointError
from moecompress.io.checkpoint import Checkpoint
from moecompress.ir import MoELayer, cast_layer, layer_to
from moecompress.reference import moe_forward

log = logging.getLogger(__name__)


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN/Inf: its minimum and maximum (``aminmax`` propagates NaN), one pass with
    no temporary, about 10x faster than ``isfinite(t).all()`` on bf16 weights on one CPU thread."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    try:
        lo, hi = torch.aminmax(t)
    except (RuntimeError, NotImplementedError):  # a dtype without aminmax (float8)
        return bool(torch.isfinite(t.float()).all())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_finite(layer: MoELayer, experts: bool = True) -> None:
    """:class:`CheckpointError` naming the layer, projection and expert of the first NaN/Inf weight of
    the MoE block (found before it poisons every later layer's statistics); ``experts=False``: the
    router and the shared expert only (an expert-chunked layer checks each chunk as it is read)."""
    if experts:
        check_bank_finite(layer.index, layer.experts)
    if layer.shared is not None:
        check_bank_finite(layer.index, layer.shared, shared=True)
    for name in ("router_weight", "router_bias", "score_bias", "shared_gate"):
        t = getattr(layer, name)
        if t is not None and not all_finite(t):
            raise CheckpointError(f"layer {layer.index}: the router's {name} holds NaN/Inf; the checkpoint is damaged")


def check_bank_finite(index: int, bank, shared: bool = False, first: int = 0) -> None:
    """The check of :func:`check_finite` on one bank (``first``: the layer's id of its expert 0)."""
    bank_name = "shared expert" if shared else "expert"
    for proj in ("gate", "up", "down"):
        for name, t in getattr(bank, proj).tensors().items():
            if all_finite(t):
                continue
            bad = ~torch.isfinite(t.reshape(t.shape[0], -1)).all(1) if t.dim() == 3 else None
            which = f" {first + int(bad.nonzero()[0])}" if bad is not None and not shared else ""
            raise CheckpointError(
                f"layer {index}: {bank_name}{which} {proj}_proj ({name}) holds NaN/Inf weights; the "
                "checkpoint is damaged: re-download or re-export it"
            )


def to_device(obj, device: torch.device):
    """``obj`` (a tensor, or tuples, lists and dicts of them) with every tensor on ``device``: the
    activations stay on the host and visit the compute device one batch at a time."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def run_batch(mod, x: torch.Tensor, args: tuple, kw: dict, device: torch.device):
    """One batch through a materialised decoder layer on ``device``; the output back on the host (on the
    CPU every move is a no-op)."""
    return to_device(mod(x.to(device), *to_device(args, device), **to_device(kw, device)), torch.device("cpu"))


class InstrumentedMoE(nn.Module):
    """Drop-in MoE block running :func:`moe_forward` on a canonical layer, with an optional observer."""

    def __init__(self, layer: MoELayer, observer=None, returns_tuple: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.observer = observer
        self.returns_tuple = returns_tuple

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        obs = self.observer
        if obs is not None:
            obs.on_input(x)
        out = moe_forward(self.layer, x, obs)
        if obs is not None:
            obs.on_output(out)
        out = out.reshape(shape)
        return (out, None) if self.returns_tuple else out


class _Stop(Exception):
    pass


class _Catcher(nn.Module):
    def __init__(self, index: int, sink: dict, last: bool) -> None:
        super().__init__()
        self.index, self.sink, self.last = index, sink, last

    def forward(self, hidden_states, *args, **kwargs):
        if self.index == 0:
            self.sink["hidden"] = hidden_states
        self.sink[self.index] = (args, kwargs)
        if self.last:
            raise _Stop
        return hidden_states


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


class Skeleton:
    """The meta-device model of a checkpoint, with embeddings and head materialised on demand."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.ckpt = ckpt
        self.dtype = dtype
        self.device = torch.device(device)
        self._head: tuple[nn.Module, nn.Module] | None = None
        self.chunk_buffer = ChunkBuffer()  # what chunks of experts are read into (calibration/chunked.py)
        config = copy.deepcopy(ckpt.config)
        config.use_cache = False
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.model.eval().requires_grad_(False)
        self.layers = self.model.model.layers
        self.meta_layers = list(self.layers)
        self.prefix = ckpt.adapter.layers_prefix
        groups = dict(ckpt.key_groups())
        self._global_keys = groups.get(None, [])
        self._layer_keys = {i: groups.get(i, []) for i in range(len(self.meta_layers))}
        self._load_globals(lambda k: not k.startswith("lm_head") and ".norm." not in f".{k}")
        self._rebuild_buffer_modules()

    # -- globals ---------------------------------------------------------------------------------
    def _load_globals(self, want) -> None:
        keys = [k for k in self._global_keys if want(k)]
        tensors = {
            k: v.to(self.dtype) if v.is_floating_point() else v
            for k, v in self.ckpt.reader.get_many(keys).items()
        }
        result = self.model.load_state_dict(tensors, strict=False, assign=True)
        if result.unexpected_keys:
            raise CheckpointError(
                f"tensors not in the {self.ckpt.model_type} model: {result.unexpected_keys[:3]}"
            )

    def _rebuild_buffer_modules(self) -> None:
        """Re-create modules outside the decoder layers whose buffers are still meta (rotary tables)."""
        done: set[str] = set()
        for name, buf in list(self.model.named_buffers()):
            if not buf.is_meta or name.startswith(("model.layers.", "layers.")):
                continue
            mod_name = name.rpartition(".")[0]
            if mod_name in done:
                continue
            parent, attr = _owner(self.model, mod_name)
            old = getattr(parent, attr)
            try:
                new = type(old)(config=self.model.config)
            except TypeError as err:
                raise CheckpointError(
                    f"cannot materialise {mod_name} ({type(old).__name__}): {err}"
                ) from None
            setattr(parent, attr, new)
            done.add(mod_name)

    def release_embeddings(self) -> None:
        """Free the input embeddings (every batch is captured; at DeepSeek-V3's vocabulary they are 1.8 GB in
        bf16): :meth:`capture` and a tied :meth:`load_head` read them again."""
        emb = self.model.get_input_embeddings()
        if not emb.weight.is_meta:
            emb.weight = nn.Parameter(torch.empty_like(emb.weight, device="meta"), requires_grad=False)

    def _embeddings(self) -> nn.Module:
        emb = self.model.get_input_embeddings()
        if emb.weight.is_meta:
            name = next(n for n, p in self.model.named_parameters(remove_duplicate=False) if p is emb.weight)
            self._load_globals(lambda k: k == name)
        return emb

    def load_head(self) -> None:
        """Materialise the final norm and the LM head (tied to the embeddings if the config says so)."""
        self._load_globals(lambda k: k.startswith("lm_head") or ".norm." in f".{k}")
        head = self.model.get_output_embeddings()
        if head.weight.is_meta:
            if not getattr(self.model.config, "tie_word_embeddings", False):
                raise CheckpointError("the checkpoint has no lm_head.weight and tie_word_embeddings is false")
            head.weight = self._embeddings().weight

    def capture(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
        """Embedding output and every decoder layer's call arguments for one batch."""
        n = len(self.meta_layers)
        self._embeddings()
        sink: dict = {}
        for i in range(n):
            self.layers[i] = _Catcher(i, sink, last=i == n - 1)
        try:
            with torch.no_grad():
                self.model.model(input_ids=input_ids, use_cache=False)
        except _Stop:
            pass
        finally:
            for i, layer in enumerate(self.meta_layers):
                self.layers[i] = layer
        if "hidden" not in sink or len(sink) != n + 1:
            raise CheckpointError("could not capture the decoder layers' inputs (unexpected model forward)")
        return sink["hidden"], [sink[i] for i in range(n)]

    # -- layers ----------------------------------------------------------------------------------
    def layer(self, i: int, moe: MoELayer | None = None, observer=None, block: nn.Module | None = None) -> nn.Module:
        """Decoder layer ``i`` with real weights; its MoE block replaced by ``moe`` if given (or by the
        module ``block``, whose MoE tensors are then not read: the chunked calibration's recorder)."""
        adapter = self.ckpt.adapter
        mod = copy.deepcopy(self.meta_layers[i])
        owned: set[str] = set()
        if moe is not None:
            moe = layer_to(cast_layer(moe, self.dtype), self.device)
            block = InstrumentedMoE(moe, observer, adapter.module_returns_tuple)
        if block is not None:
            setattr(mod, adapter.module_attr, block)
            owned = set(self.ckpt.moe_keys(i))
        keys = [k for k in self._layer_keys[i] if k not in owned]
        start = len(f"{self.prefix}.{i}.")
        tensors = {
            k[start:]: (v.to(self.dtype) if v.is_floating_point() else v)
            for k, v in self.ckpt.reader.get_many(keys).items()
        }
        result = mod.load_state_dict(tensors, strict=False, assign=True)
        leftover = [n for n, t in [*mod.named_parameters(), *mod.named_buffers()] if t.is_meta]
        if result.unexpected_keys or leftover:
            what = result.unexpected_keys[:3] or leftover[:3]
            raise CheckpointError(f"layer {i}: cannot materialise transformers' layer module (keys {what})")
        return mod.to(self.device).eval().requires_grad_(False)

    def lm_loss_and_grad(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, total_tokens: int
    ) -> tuple[float, torch.Tensor]:
        """Sum of next-token NLL over the batch / ``total_tokens`` and its gradient w.r.t. ``hidden``."""
        if self._head is None:  # on the compute device (the host's modules stay where they are)
            norm, head = self.model.model.norm, self.model.lm_head
            if self.device.type != "cpu":
                norm, head = copy.deepcopy(norm).to(self.device), copy.deepcopy(head).to(self.device)
            self._head = (norm, head)
        norm, head = self._head
        h = hidden.detach().to(self.device).requires_grad_(True)
        input_ids = input_ids.to(self.device)
        with torch.enable_grad():
            logits = head(norm(h)).float()
            loss = (
                F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]),
                    input_ids[:, 1:].reshape(-1),
                    reduction="sum",
                )
                / total_tokens
            )
            loss.backward()
        return float(loss.detach()), h.grad
