"""``open_checkpoint``: a checkpoint directory seen through its adapter, read one layer at a time.

``open_checkpoint`` validates everything it can from ``config.json`` and the shard headers (model type,
shard integrity, every MoE tensor's name and shape) before any weight is read, so bad input fails
fast with one line naming the file or key. Streaming a checkpoint into a new one is
:func:`moecompress.engine.layer_loop.rewrite_checkpoint`.

What an output carries over from its input is an allow-list (:func:`is_model_file`: tokenizer,
generation and processor configs, chat templates, license, notice, use policy, README), plus the
names a caller asks for; everything else (a stray ``credentials.json``, a symlink out of the folder)
stays behind and is listed by :meth:`Checkpoint.skipped_files`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from moecompress.adapters import Adapter, adapter_class
from moecompress.adapters.base import Alloc
from moecompress.errors import CheckpointError
from moecompress.io.format import compressed_keys, stock_keys
from moecompress.io.hub import allowed_roots, resolve_checkpoint_dir
from moecompress.io.quantized import QuantizedReader, logical_dtype, quant_format
from moecompress.io.reader import INDEX_NAME, ShardReader, is_confined
from moecompress.io.routing import check_routing, policy_dict, read_routing, routing_tensors, without_routing
from moecompress.io.verify import layer_problem, read_block
from moecompress.ir import ExpertBank, MoELayer

log = logging.getLogger(__name__)

ADAPTERS_KEY = "moecompress_adapters"
"""``config.json`` block naming adapter files stored beside the weights (:mod:`moecompress.runtime.lora_mixer`)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# What transformers' save_pretrained and the tokenizers write beside the weights (besides config.json).
MODEL_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "preprocessor_config.json", "processor_config.json", "README.md",
})  # fmt: skip
MODEL_FILE_PATTERN = re.compile(
    r"[^/\\]+\.(model|tiktoken)|(license|licence|notice|use_policy)([._-][\w.-]*)?", re.IGNORECASE
)


def is_model_file(name: str) -> bool:
    """Whether a file called ``name`` is one a model folder legitimately carries besides its weights and
    ``config.json``: tokenizer files (``*.model``, ``*.tiktoken`` included), chat templates, generation
    and processor configs, ``LICENSE*``, ``NOTICE*``, ``USE_POLICY*`` and ``README.md``."""
    if name.startswith(".") or name.endswith(WEIGHT_SUFFIXES):
        return False
    return name in MODEL_FILES or MODEL_FILE_PATTERN.fullmatch(name) is not None


@dataclass
class Checkpoint:
    """A validated checkpoint directory. Nothing but headers has been read."""

    path: Path
    raw_config: dict
    config: object
    adapter: Adapter
    reader: ShardReader | QuantizedReader
    """the logical view: a quantised input's tensors under their unquantised names, dequantised on
    access (:mod:`moecompress.io.quantized`); for any other input the shard reader itself."""
    _moe_keys: dict[int, list[str]] = field(default_factory=dict, repr=False)

    @property
    def raw(self) -> ShardReader:
        """The byte-level reader of the shards (the on-disk names and encodings)."""
        return getattr(self.reader, "raw", self.reader)

    @property
    def quantization(self) -> str | None:
        """The quant_method the input is read through (``fp8``, ``compressed-tensors``, ``mxfp4``), or ``None``."""
        fmt = getattr(self.reader, "fmt", None)
        return None if fmt is None else fmt.method

    def raw_moe_keys(self, i: int) -> list[str]:
        """On-disk tensor names behind :meth:`moe_keys` (scales, packed codes, ... of a quantised input)."""
        keys = self.moe_keys(i)
        return self.reader.raw_names(keys) if self.quantization else keys

    @property
    def model_type(self) -> str:
        return self.adapter.model_type

    @property
    def moe_layer_indices(self) -> list[int]:
        return self.adapter.moe_layer_indices

    @property
    def layouts(self) -> dict[int, dict]:
        """Descriptions of the layers stored in the moecompress format (``docs/format.md``)."""
        block = self.raw_config.get("moecompress") or {}
        return {int(i): d for i, d in (block.get("layers") or {}).items() if d}

    def read_layer(self, i: int) -> MoELayer:
        """The canonical MoE layer ``i`` (only that layer's tensors are read)."""
        return self.read_layer_with(i, self.reader.get_many)

    def read_experts(self, i: int, start: int, stop: int, alloc: Alloc | None = None) -> ExpertBank:
        """Routed experts ``[start, stop)`` of MoE layer ``i``, dequantised; only their bytes are read
        (per-expert tensors by name, fused ``[E, ...]`` ones by rows). Equal, bit for bit, to
        ``read_layer(i).experts`` restricted to those experts; with ``alloc``, the weights are copied into
        its tensors as they are read (:data:`~moecompress.adapters.base.Alloc`: a cast where its dtype
        differs). Layers in the moecompress format are read whole (:meth:`read_layer`)."""
        if i in self.layouts:
            raise CheckpointError(
                f"{self.path}: layer {i} is stored in the moecompress format, which is read whole, not by "
                "chunks of experts; run it with expert_chunk: off"
            )
        return self.adapter.read_experts(
            i, self.reader.keys, self.reader.get_many, self.reader.get_rows, start, stop, alloc
        )

    def read_layer_shell(self, i: int) -> MoELayer:
        """MoE layer ``i`` with its routed experts on the ``meta`` device (shapes only) and everything else
        (router, score bias, shared expert, routing policy) read: what an expert-chunked run holds
        besides the chunk it works on (:meth:`read_experts`)."""
        if i in self.layouts:
            raise CheckpointError(
                f"{self.path}: layer {i} is stored in the moecompress format, which is read whole, not by "
                "chunks of experts; run it with expert_chunk: off"
            )
        routed = set(self.adapter.expert_keys(i, self.reader.keys))

        def fetch(names) -> dict:
            names = list(names)
            got = self.reader.get_many([n for n in names if n not in routed])
            return {n: got[n] if n in got else self.reader.meta(n) for n in names}

        return self.read_layer_with(i, fetch)

    @property
    def protected(self) -> dict[int, frozenset[int]]:
        """Protected (super) experts recorded by an earlier run, per layer."""
        block = self.raw_config.get("moecompress") or {}
        return {int(i): frozenset(int(e) for e in ids) for i, ids in (block.get("protected") or {}).items()}

    @property
    def routing(self) -> dict[int, dict]:
        """Runtime routing policies recorded by an earlier run, per layer (``docs/routing.md``)."""
        try:
            return {i: policy_dict(p) for i, p in read_routing(self.raw_config.get("moecompress")).items()}
        except ValueError as err:
            raise CheckpointError(f"{self.path / 'config.json'}: {err}") from None

    def read_layer_with(self, i: int, fetch) -> MoELayer:
        """MoE layer ``i`` with tensors from ``fetch(names) -> {name: tensor}`` (e.g. meta tensors)."""
        desc = self.layouts.get(i)
        if desc is not None:
            from moecompress.io.format import read_compressed_layer

            layer = read_compressed_layer(self.adapter, i, desc, fetch)
        else:
            layer = self.adapter.read_layer(i, self.reader.keys, fetch)
        changes: dict = {}
        if self.protected.get(i):
            changes["protected"] = self.protected[i]
        policy = self.routing.get(i)
        if policy:
            names = list(routing_tensors(self.adapter, i, policy))
            changes["routing"] = policy
            changes["routing_similarity"] = fetch(names)[names[0]] if names else None
        return layer.replace(**changes) if changes else layer

    def moe_keys(self, i: int) -> list[str]:
        """On-disk tensor names owned by the MoE block of layer ``i``."""
        return list(self._moe_keys.get(i, []))

    def key_groups(self, *, raw: bool = False) -> list[tuple[int | None, list[str]]]:
        """Tensor names grouped by decoder layer (``None``: outside the decoder layers), in layer order;
        logical names, or the on-disk ones when ``raw``."""
        pat = re.compile(rf"^{re.escape(self.adapter.layers_prefix)}\.(\d+)\.")
        groups: dict[int | None, list[str]] = {None: []}
        for key in (self.raw if raw else self.reader).keys:
            m = pat.match(key)
            groups.setdefault(int(m.group(1)) if m else None, []).append(key)
        order = [None, *sorted(k for k in groups if k is not None)]
        return [(k, groups[k]) for k in order if groups[k]]

    def adapter_files(self) -> list[str]:
        """Relative paths of the adapter files that ``config.json``'s ``moecompress_adapters`` block names
        (a ``lora_heal`` output's routed attention LoRA): steps that rewrite MoE layers leave the attention
        projections they wrap untouched, so an output carries them. A named file that is missing or links
        outside the directory is a :class:`CheckpointError`."""
        block = self.raw_config.get(ADAPTERS_KEY)
        name = block.get("file") if isinstance(block, dict) else None
        if name is None:
            return []
        p = self.path / str(name)
        if ".." in Path(str(name)).parts or not p.is_file() or not is_confined(p, allowed_roots(self.path)):
            raise CheckpointError(
                f"{self.path / 'config.json'}: {ADAPTERS_KEY} names {name!r}, which is not a file inside the checkpoint "
                "directory; restore it from the run that wrote the checkpoint"
            )
        return [str(name)]

    def non_weight_files(self, extra: Iterable[str] = ()) -> list[Path]:
        """The files to copy next to rewritten weights: every :func:`is_model_file` of the directory,
        plus the file names in ``extra`` (sorted by name). Never weights, the index or ``config.json``
        (callers write their own); never a symlink whose target leaves the directory.

        A name in ``extra`` that is not a file of the directory, has a path separator, or is a weight,
        index or ``config.json`` file is a :class:`CheckpointError`."""
        asked = self._extra(extra)
        return [self.path / n for n in self._entries() if n in asked or self._copies(n)]

    def skipped_files(self, extra: Iterable[str] = ()) -> list[str]:
        """Names of what the directory holds that is neither read (shards, index, ``config.json``) nor
        copied by :meth:`non_weight_files` with the same ``extra``; folders end in ``/``."""
        asked = self._extra(extra)
        read = {INDEX_NAME, "config.json", *self.reader.shards}
        out = []
        for name in self._entries():
            p = self.path / name
            if name in read or name in asked or self._copies(name):
                continue
            out.append(f"{name}/" if p.is_dir() and not p.is_symlink() else name)
        return out

    def _entries(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir())

    def _copies(self, name: str) -> bool:
        p = self.path / name
        return is_model_file(name) and is_confined(p, allowed_roots(self.path)) and p.is_file()

    def _extra(self, extra: Iterable[str]) -> set[str]:
        """The names in ``extra``, each checked (a one-line :class:`CheckpointError` for a bad one)."""
        asked = set()
        for name in [extra] if isinstance(extra, str) else extra:
            why = self._extra_problem(name)
            if why is not None:
                raise CheckpointError(
                    f"extra file {name!r} {why} ({self.path}); name plain files of the checkpoint "
                    "directory, e.g. extra: [training_args.json]"
                )
            asked.add(name)
        return asked

    def _extra_problem(self, name: object) -> str | None:
        if not isinstance(name, str) or "/" in name or "\\" in name or "\0" in name:
            return "is not a plain file name (it has a path separator)"
        if name in (INDEX_NAME, "config.json") or name.endswith(WEIGHT_SUFFIXES):
            return "is a weight, index or config.json file, which a run writes itself"
        p = self.path / name
        if name in ("", ".", "..") or not p.is_file():
            return "is not a file of the checkpoint directory"
        if not is_confined(p, allowed_roots(self.path)):
            return "links outside the checkpoint directory"
        return None


def open_checkpoint(
    path_or_id: str | Path, *, revision: str | None = None, validate: bool = True
) -> Checkpoint:
    """Open a local checkpoint directory or a Hub repo id (downloaded with ``huggingface_hub``).

    ``validate=False`` skips the per-layer name/shape checks (``moecompress inspect`` runs them
    itself, collecting every problem instead of stopping at the first)."""
    path = resolve_checkpoint_dir(path_or_id, revision=revision)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path} has no config.json; pass a Hugging Face checkpoint directory")
    if not is_confined(cfg_path, allowed_roots(path)):
        raise CheckpointError(
            f"{cfg_path} links outside the checkpoint directory; copy the file into the directory instead"
        )
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object")
    cls = adapter_class(raw.get("model_type"))
    qc = raw.get("quantization_config")
    layouts, problems = read_block(raw.get("moecompress"), quant_method=qc.get("quant_method") if isinstance(qc, dict) else None)
    if layouts is None:  # unreadable; other problems (loading through transformers) are the loaders'
        raise problems[0].error(cfg_path)
    fmt = quant_format(raw, str(cfg_path))  # an unread quant_method is refused before any shard is opened
    config = _load_config(path)
    reader: ShardReader | QuantizedReader = ShardReader(path)
    if fmt is not None:
        reader = QuantizedReader(reader, fmt, logical_dtype(raw))
    adapter = cls(config)
    try:
        routing = read_routing(raw.get("moecompress"))
    except ValueError as err:
        raise CheckpointError(f"{cfg_path}: {err}") from None
    moe_keys = {}
    if validate:
        why = check_routing(adapter, routing, reader)
        if why is not None:
            raise CheckpointError(f"{path}: {why}; restore the output or re-run the recipe that wrote it")
        for i in adapter.moe_layer_indices:
            own = routing_tensors(adapter, i, routing.get(i))
            moe_keys[i] = [*check_moe_layer(adapter, i, layouts.get(i), reader), *own]
    return Checkpoint(
        path=path, raw_config=raw, config=config, adapter=adapter, reader=reader, _moe_keys=moe_keys
    )


def check_moe_layer(adapter, i: int, desc: dict | None, reader: ShardReader) -> list[str]:
    """Validate MoE layer ``i`` from headers (stock names, or the moecompress format when described)."""
    if desc is None:
        return adapter.check_layer(i, without_routing(adapter, i, reader.keys), reader.shape)
    problem = layer_problem(adapter, i, desc, reader)
    if problem is not None:
        raise problem.error(f"{adapter.model_type} (moecompress format)")
    return [*stock_keys(adapter, i, desc), *compressed_keys(adapter, i, desc)]


def provenance_block(
    block: dict | None, protected: dict[str, list[int]], routing: dict[str, dict] | None = None
) -> dict | None:
    """The input's provenance block (without layouts), with the protection and routing policies that
    were written."""
    if block is None and not protected and not routing:
        return None
    out = {k: v for k, v in (block or {}).items() if k not in ("layers", "protected", "routing")}
    if protected:
        out["protected"] = protected
    if routing:
        out["routing"] = routing
    return out


def _load_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except (ValueError, KeyError, TypeError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path / 'config.json'}: transformers cannot parse it ({first})") from None
