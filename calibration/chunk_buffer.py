"""What chunks of experts are read into in expert-chunked calibration (:mod:`~moecompress.calibration.chunked`)."""

from __future__ import annotations

import torch


class ChunkBuffer:
    """Per projection one tensor in the compute dtype on the device that every chunk of experts is copied into as
    it is read (the adapter's ``build_experts`` with an :data:`~moecompress.adapters.base.Alloc`), and reused from chunk to chunk and layer to layer (:meth:`~moecompress.calibration.chunked.ChunkedLayer.chunk`).

    A chunk read whole is its stacked copy in the checkpoint's dtype and then its cast: fresh memory for every
    chunk of every layer (a chunk of 32 Qwen3-30B experts: 300 MB of bfloat16 and 600 MB of float32), and
    touching fresh memory cost more than the copies (one thread, AMD EPYC with AVX2, a layer's 4 chunks of 32 in
    float32: 2.98 s stacked and cast, 0.87 s read expert by expert and copied into the reused tensors, 0.65 s
    read once and copied into them as read, ``benchmarks/layer_work.py``). A bank taken from it is valid until the next chunk is read into it.

It grows to the largest bank read into it (a whole layer where a layer is held whole: ``chunked.cast_into``) and
is freed with the calibration's :class:`~moecompress.calibration.skeleton.Skeleton`; what calibration holds at
its peak is not raised (a layer held whole: its read copy beside its cast, as before; a chunk: up to 8 read experts of one
projection beside the chunk's cast instead of the chunk's whole read copy)."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The first ``shape[0]`` rows of projection ``name``'s tensor, grown or replaced where it is too small
        or of another shape, dtype or device."""
        t = self._held.get(name)
        if t is None or t.shape[0] < shape[0] or t.shape[1:] != shape[1:] or t.dtype != dtype or t.device != device:
            self._held.pop(name, None)  # (the old one freed before the new one is made)
            t = self._held[name] = torch.empty(shape, dtype=dtype, device=device)
        return t[: shape[0]]
