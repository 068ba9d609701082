"""Loading moecompress-format checkpoints through transformers' public quantizer hooks.

``import moecompress`` registers ``quant_method: "moecompress"`` with
``transformers.quantizers.register_quantization_config`` / ``register_quantizer``. When
``AutoModelForCausalLM.from_pretrained`` meets such a checkpoint, it builds the stock model on the
meta device and calls :meth:`MoecompressQuantizer._process_model_before_weight_loading`, which swaps
each described layer's experts module *instance* for a :class:`CompressedExperts` (and a compressed
shared expert's for a :class:`CompressedShared`) whose parameters and buffers are exactly the stored
tensors (``docs/format.md``), and gives a block with a stored routing policy its
:class:`~moecompress.runtime.routing.RoutingPolicy` (``docs/routing.md``); transformers then loads
them by name. The router, attention and dense
shared experts stay transformers' own modules. No class is patched.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from moecompress.errors import CheckpointError
from moecompress.io.format import FORMAT_VERSION, PROJ, decode_bank
from moecompress.io.verify import module_tensors, verify_checkpoint
from moecompress.reference import expert_forward, experts_forward
from moecompress.runtime.routing import attach_stored

METHOD = "moecompress"
_QUANTISED = ("codebook", "rtn")  # the layouts ``dequantize=`` decodes to ``dense_dtype``


class CompressedExperts(nn.Module):
    """Routed experts stored in a moecompress layout; called like transformers' experts modules:
    ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.

    Its parameters (floating tensors) and buffers (integer ones) are exactly the tensors
    :func:`moecompress.io.verify.module_tensors` declares for ``desc``: the names, shapes and dtypes
    the checker compared with the shard headers before any weight was loaded. Calls that need
    gradients run the differentiable reference maths, all others the fast path (:meth:`differentiable`,
    ``docs/serving.md``)."""

    def __init__(self, desc: dict[str, Any], hidden_size: int, field: str = "moecompress.layers") -> None:
        super().__init__()
        self.desc = desc
        for name in PROJ:
            self.add_module(name, nn.Module())
        for local, d in module_tensors(desc, hidden_size, field).items():
            owner, _, key = local.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            t = torch.empty(d.shape, dtype=d.dtype or torch.float32, device="meta")
            if t.dtype.is_floating_point:
                module.register_parameter(key, nn.Parameter(t))  # trainable, as transformers' own weights
            else:
                module.register_buffer(key, t)

    dense_dtype: torch.dtype | None = None
    """Set by ``moecompress.load(..., dequantize=)``: quantised experts decoded once into this dtype."""

    def bank(self):
        """The stored tensors decoded into ``(ExpertBank, expert_map)`` (every call decodes anew)."""
        tensors = {f"x.{k}": v for k, v in self.state_dict(keep_vars=True).items()}
        return decode_bank(self.desc, tensors, "x")

    def prepare(self, device: torch.device | str | None = None, *, static: bool | None = None):
        """Prepare the bank for serving on ``device`` (default: where the stored tensors are), once: the
        eager forward (:func:`prepare_serving`: Triton on CUDA, else the lean path) and, when ``static``
        (default: on CUDA where no kernel serves the layouts), the static-shape forward
        (:mod:`moecompress.runtime.static`) that ``torch.compile`` traces. ``moecompress.load`` calls it;
        call it again (:func:`moecompress.runtime.loading.prepare`) after changing stored tensors on CUDA
        or under ``torch.compile`` (eager CPU calls notice in-place edits). Returns ``self``."""
        device = torch.device(device) if device is not None else next(iter(self._stored())).device
        bank, emap = self.bank()
        self._prepared = prepare_serving(bank, emap, self.dense_dtype)
        if static is None:
            static = getattr(self, "_want_static", None)
        if static is None:
            from moecompress.runtime.lean import LeanBank

            static = device.type == "cuda" and isinstance(self._prepared, LeanBank)
        self._want_static = static
        from moecompress.runtime.static import prepare_static

        self._static = prepare_static(bank, emap, self.dense_dtype) if static else None
        # eager CPU calls re-prepare after an in-place edit (a cheap host-side key, never on CUDA or compiled)
        self._prepared_key = self._stored_key() if device.type == "cpu" else None
        self._handle = _register(self)
        return self

    def _stored(self):
        """Every stored tensor (the module tree never changes)."""
        return [t for m in self.modules() for t in (*m._parameters.values(), *m._buffers.values())]

    def _stored_key(self):
        return (self.dense_dtype, *((t.data_ptr(), t._version) for t in self._stored()))

    def _apply(self, fn, recurse: bool = True):  # .to() / .cuda() / .half(): prepare again on the next call
        self.__dict__.pop("_prepared", None)
        self.__dict__.pop("_static", None)
        return super()._apply(fn, recurse)

    def prepared(self, device: torch.device):
        """The prepared eager forward, prepared now when it is not (or is stale on an eager CPU call)."""
        cached = self.__dict__.get("_prepared")
        stale = cached is None or (
            device.type == "cpu" and self.__dict__.get("_prepared_key") != self._stored_key()
        )
        if stale:
            self.prepare(device)
        return self._prepared

    def serve(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The fast (non-differentiable) forward, fp32 or ``x.dtype`` ``[T, H]``. Compiled: the static
        forward when prepared, else the eager one behind the opaque op ``torch.ops.moecompress.experts``
        (a pure call: no preparation, no host-side key); eager: :meth:`prepared` (on CUDA with a static
        forward, that one at decode sizes, ``T·k ≤ E``)."""
        if not torch.compiler.is_compiling():
            fwd, static = self.prepared(x.device), self._static
            if static is not None and x.device.type == "cuda" and ids.numel() <= static.num_experts:
                return static(x, ids, weights)  # CUDA decode without a kernel: no host sync, graph-capturable
            return fwd(x, ids, weights)
        if self.__dict__.get("_prepared") is None:
            raise RuntimeError(
                "CompressedExperts is not prepared: call moecompress.runtime.loading.prepare(model) "
                "(moecompress.load does) before torch.compile"
            )
        if self._static is not None:
            return self._static(x, ids, weights)
        return torch.ops.moecompress.experts(x, ids, weights, self._handle)

    def differentiable(self, *inputs: torch.Tensor) -> bool:
        """Whether a call must be differentiable: grad mode is on (not ``no_grad``/``inference_mode``) and
        an input or a stored tensor requires grad. Such calls run the reference maths on the bank decoded
        from the stored tensors themselves (:meth:`autograd_bank`); all others the prepared fast path."""
        if not torch.is_grad_enabled():
            return False
        return any(t.requires_grad for t in inputs) or any(p.requires_grad for p in self.parameters())

    def autograd_bank(self):
        """:meth:`bank` for a differentiable call: layouts built on the parameters themselves (gradients
        reach centroids, scales, factors, biases, dense weights), quantised ones decoding to ``dense_dtype``
        when set, as the fast path does."""
        bank, emap = self.bank()
        if self.dense_dtype is not None:
            lays = {p: getattr(bank, p) for p in PROJ}
            bank = dataclasses.replace(
                bank, **{p: lay.cast(self.dense_dtype) for p, lay in lays.items() if lay.kind in _QUANTISED}
            )
        return bank, emap

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.differentiable(hidden_states, top_k_weights):
            bank, emap = self.autograd_bank()
            out = experts_forward(bank, hidden_states, top_k_index, top_k_weights, emap)
        else:
            out = self.serve(hidden_states, top_k_index, top_k_weights)
        return out.to(hidden_states.dtype)


class CompressedShared(CompressedExperts):
    """A shared expert stored in a moecompress layout; called like transformers' shared-expert MLPs:
    ``shared(hidden_states [..., H]) -> [..., H]`` (any gate, e.g. Qwen2-MoE's, stays outside)."""

    def forward(self, hidden_states: torch.Tensor):  # type: ignore[override]
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.differentiable(x):
            y = expert_forward(self.autograd_bank()[0], 0, x)
        else:
            ids = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device)
            ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
            y = self.serve(x, ids, ones)
        return y.reshape(hidden_states.shape).to(hidden_states.dtype)


def prepare_serving(bank, expert_map, dense_dtype=None):
    """The fastest forward for ``bank`` on its device: a Triton kernel on CUDA when one serves its layouts
    (:func:`moecompress.kernels.dispatch.prepare_triton`, needs ``triton``), else the lean PyTorch path."""
    from moecompress.runtime.lean import prepare

    if _on_cuda(bank) and dense_dtype is None:
        try:
            from moecompress.kernels.dispatch import prepare_triton
        except ImportError:  # triton not installed: the lean path serves CUDA too
            prepare_triton = None
        fast = None if prepare_triton is None else prepare_triton(bank, expert_map)
        if fast is not None:
            return fast.forward
    return prepare(bank, expert_map, dense_dtype=dense_dtype)


_SERVED: dict[int, weakref.ref] = {}
"""Handle -> prepared :class:`CompressedExperts`, for the opaque op (a compiled graph holds the int)."""


def _register(module: CompressedExperts) -> int:
    handle = getattr(module, "_handle", None)
    if handle is None:
        handle = len(_SERVED)
        _SERVED[handle] = weakref.ref(module)
    return handle


@torch.library.custom_op("moecompress::experts", mutates_args=())
def _experts_op(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, handle: int) -> torch.Tensor:
    """The prepared eager forward of the :class:`CompressedExperts` registered as ``handle``, opaque to
    ``torch.compile`` (it may loop over experts and sync with the host inside: on CPU, or around Triton
    kernels on CUDA)."""
    module = _SERVED[handle]()
    if module is None or module.__dict__.get("_prepared") is None:
        raise RuntimeError(f"moecompress::experts: module {handle} is gone or was moved; prepare it again")
    return module._prepared(x, ids, weights).float()


@_experts_op.register_fake
def _experts_fake(x, ids, weights, handle):
    return x.new_empty(x.shape, dtype=torch.float32)


def _on_cuda(bank) -> bool:
    t = next(iter(bank.gate.tensors().values()))
    return t.device.type == "cuda"


class MoecompressConfig(QuantizationConfigMixin):
    """``quantization_config`` of moecompress-format checkpoints (layouts live in ``config.moecompress``)."""

    def __init__(self, format: int = FORMAT_VERSION, **kwargs: Any) -> None:
        self.quant_method = METHOD
        if not isinstance(format, int) or isinstance(format, bool):
            raise CheckpointError(
                f"config.json: quantization_config.format is {format!r}, not an integer; "
                "the config.json of this output was edited or damaged: restore it or re-run the recipe"
            )
        self.format = format
        if self.format > FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint format {self.format} is newer than this moecompress understands ({FORMAT_VERSION}); "
                "upgrade moecompress"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": METHOD, "format": self.format}


class MoecompressQuantizer(HfQuantizer):
    """Swaps experts modules for :class:`CompressedExperts` before transformers loads the weights."""

    requires_calibration = False

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs: Any):
        """Verify the checkpoint (``config.json`` against the shard headers, :mod:`moecompress.io.verify`),
        then swap the described layers' modules. ``checkpoint_files`` (the shard paths transformers
        resolved, local or in the Hub cache) locate the headers; without them (a ``state_dict`` was
        passed) only the descriptions are checked."""
        from moecompress.adapters import adapter_class

        config = model.config
        adapter = adapter_class(config.model_type)(config)
        block = getattr(config, "moecompress", None)
        reader, where = _headers(checkpoint_files, getattr(config, "_name_or_path", "") or "config.json")
        problems = verify_checkpoint(adapter, block, reader, quant_method=METHOD)
        if problems:
            raise problems[0].error(where)
        hidden = adapter.hidden_size
        for i, desc in ((block or {}).get("layers") or {}).items():
            if not desc:
                continue
            moe = getattr(model.model.layers[int(i)], adapter.module_attr)
            moe.experts = CompressedExperts(desc, hidden, f"moecompress.layers.{i}")
            if "shared" in desc:
                shared = CompressedShared(desc["shared"], hidden, f"moecompress.layers.{i}.shared")
                setattr(moe, adapter.shared_name, shared)
        attach_stored(model, adapter, block)  # routing policies, on the experts modules now in place
        return model

    def _process_model_after_weight_loading(self, model, **kwargs: Any):
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs: Any) -> bool:
        return False

    @property
    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return True  # grad-mode calls are differentiable (CompressedExperts.differentiable)


def _headers(checkpoint_files, name: str):
    """A :class:`ShardReader` over the directory of ``checkpoint_files`` (``None`` without files), and
    the path to name in messages."""
    from pathlib import Path

    from moecompress.io.reader import ShardReader

    files = [Path(f) for f in checkpoint_files or [] if str(f).endswith(".safetensors")]
    if not files:
        return None, name
    return ShardReader(files[0].parent), files[0].parent


def register() -> None:
    """Register the config and quantizer with transformers (idempotent)."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(MoecompressConfig)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(MoecompressQuantizer)
