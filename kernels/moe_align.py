"""K1 ``moe_align``: routing metadata for expert-blocked GEMMs (vLLM's ``moe_align_block_size``).

Given ``ids [T, k]`` (flat slot ``s = t·k + j``), group the slots by expert and pad every expert's run
to a multiple of ``block_m``:

- ``sorted_token_ids`` int32 ``[T·k + E·(block_m − 1)]`` (the static bound, so the call is CUDA-graph
  capturable): expert 0's slots in ascending order, padded with the sentinel ``T·k`` to a multiple of
  ``block_m``, then expert 1's, ...; the tail past the padded total is also ``T·k``;
- ``expert_ids`` int32 ``[len(sorted_token_ids) / block_m]``: the expert of each M-block, ``−1`` past
  the padded total;
- ``num_tokens_post_padded`` int32 ``[1]``: ``Σ_e ⌈cnt_e / block_m⌉·block_m``, kept on the device.

An id outside ``[0, n_logical)`` is a dropped slot; with an ``expert_map [n_logical]`` ids are first
mapped to physical experts (``−1`` or ``>= num_experts`` entries drop the slot too). Slots keep their
original order inside an expert (stable), so kernel and reference agree exactly.

Decode sizes (≤ 8 chunks of slots) use one program (vLLM's CUDA kernel is one thread block too): pass 1
counts per expert with a one-hot ``[C, E]`` reduction per chunk of ``C`` slots; padded offsets are an
exclusive prefix sum; after a barrier, pass 2 gives each slot its stable rank from a cumulative sum of
the one-hot chunk. Larger inputs take three launches: per-chunk counts in parallel, one program that
scans the ``[n_chunks, E]`` counts (layout, block owners, sentinels, each chunk's first position per
expert), and a parallel scatter. Cost ``O(T·k·E / threads)``: ≈ 1–3 µs at decode sizes [est].
"""

from __future__ import annotations

import torch

from moecompress.kernels._launch import check_config, next_pow2


def _physical(ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Flat physical expert per slot, ``-1`` for dropped slots."""
    flat = ids.reshape(-1).to(torch.int64)
    n_logical = num_experts if expert_map is None else expert_map.numel()
    valid = (flat >= 0) & (flat < n_logical)
    if expert_map is not None:
        flat = expert_map.to(flat.device, torch.int64)[flat.clamp(0, n_logical - 1)]
    valid &= (flat >= 0) & (flat < num_experts)
    return torch.where(valid, flat, torch.full_like(flat, -1))


def align_ref(
    ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-PyTorch reference of :func:`moe_align` (same outputs, same padding, stable order)."""
    phys = _physical(ids, num_experts, expert_map)
    n, e = phys.numel(), num_experts
    bound = n + e * (block_m - 1)
    keep = phys >= 0
    cnt = torch.bincount(phys[keep], minlength=e)
    pcnt = (cnt + block_m - 1) // block_m * block_m
    starts = torch.cumsum(pcnt, 0) - pcnt
    order = torch.argsort(torch.where(keep, phys, torch.full_like(phys, e)), stable=True)[: int(keep.sum())]
    owner = phys[order]
    rank = torch.arange(order.numel(), device=phys.device) - (torch.cumsum(cnt, 0) - cnt)[owner]
    sorted_ids = torch.full((bound,), n, dtype=torch.int32, device=phys.device)
    sorted_ids[starts[owner] + rank] = order.to(torch.int32)
    nblk = -(-bound // block_m)
    expert_ids = torch.full((nblk,), -1, dtype=torch.int32, device=phys.device)
    used = torch.repeat_interleave(torch.arange(e, dtype=torch.int32, device=phys.device), pcnt // block_m)
    expert_ids[: used.numel()] = used
    total = pcnt.sum().to(torch.int32).reshape(1)
    return sorted_ids, expert_ids, total


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _experts_of(ids_ptr, map_ptr, offs, numel, n_logical, num_experts, HAS_MAP: tl.constexpr):
        """Physical expert of the slots ``offs`` (``-1``: dropped or past ``numel``)."""
        e = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
        ok = (e >= 0) & (e < n_logical)
        if HAS_MAP:
            e = tl.load(map_ptr + e, mask=ok, other=-1).to(tl.int32)
        return tl.where(ok & (e >= 0) & (e < num_experts), e, -1)

    @triton.jit
    def _layout(cnt, sorted_ptr, expert_ids_ptr, total_ptr, numel, bound, n_blocks,
                BLOCK_M: tl.constexpr, E_P2: tl.constexpr, FILL: tl.constexpr, BLK_CHUNK: tl.constexpr):
        """From per-expert counts: padded starts (returned), total, block owners, sentinel fill."""
        pcnt = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(pcnt, axis=0)
        total = tl.sum(pcnt, axis=0)
        tl.store(total_ptr, total)
        bend = ends // BLOCK_M  # owner of block b = number of experts whose padded run ends by b
        for b0 in range(0, n_blocks, BLK_CHUNK):
            blk = b0 + tl.arange(0, BLK_CHUNK)
            owner = tl.sum((bend[None, :] <= blk[:, None]).to(tl.int32), axis=1)
            owner = tl.where(blk * BLOCK_M < total, owner, -1)
            tl.store(expert_ids_ptr + blk, owner, mask=blk < n_blocks)
        for p0 in range(0, bound, FILL):
            pos = p0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + pos, tl.zeros([FILL], dtype=tl.int32) + numel, mask=pos < bound)
        return ends - pcnt

    # jitted callees are looked up in the caller's module globals (triton is imported lazily, here)
    globals().update(_experts_of=_experts_of, _layout=_layout)

    @triton.jit(do_not_specialize=["numel", "bound", "n_blocks"])
    def align_single_kernel(
        ids_ptr, map_ptr, sorted_ptr, expert_ids_ptr, total_ptr,
        numel, n_logical, num_experts, bound, n_blocks,
        BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr, BLK_CHUNK: tl.constexpr,
        HAS_MAP: tl.constexpr,
    ):
        """Decode sizes: one program, two passes over the slots."""
        experts = tl.arange(0, E_P2)
        cnt = tl.zeros([E_P2], dtype=tl.int32)
        for c0 in range(0, numel, CHUNK):
            e = _experts_of(ids_ptr, map_ptr, c0 + tl.arange(0, CHUNK), numel, n_logical, num_experts, HAS_MAP)
            cnt += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
        run = _layout(cnt, sorted_ptr, expert_ids_ptr, total_ptr, numel, bound, n_blocks,
                      BLOCK_M, E_P2, 1024, BLK_CHUNK)
        tl.debug_barrier()  # sentinels written before the slots overwrite their positions
        for c0 in range(0, numel, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            e = _experts_of(ids_ptr, map_ptr, offs, numel, n_logical, num_experts, HAS_MAP)
            hot = (e[:, None] == experts[None, :]).to(tl.int32)
            pos = tl.sum(hot * (tl.cumsum(hot, axis=0) - hot + run[None, :]), axis=1)
            tl.store(sorted_ptr + pos, offs.to(tl.int32), mask=e >= 0)
            run += tl.sum(hot, axis=0)

    @triton.jit(do_not_specialize=["numel"])
    def align_count_kernel(ids_ptr, map_ptr, counts_ptr, numel, n_logical, num_experts,
                           E_P2: tl.constexpr, CHUNK: tl.constexpr, HAS_MAP: tl.constexpr):
        """Prefill sizes, step 1 (one program per chunk): per-chunk expert counts ``[n_chunks, E_P2]``."""
        c = tl.program_id(0)
        experts = tl.arange(0, E_P2)
        e = _experts_of(ids_ptr, map_ptr, c * CHUNK + tl.arange(0, CHUNK), numel, n_logical, num_experts, HAS_MAP)
        tl.store(counts_ptr + c * E_P2 + experts, tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0))

    @triton.jit(do_not_specialize=["numel", "bound", "n_blocks", "n_chunks"])
    def align_scan_kernel(counts_ptr, base_ptr, sorted_ptr, expert_ids_ptr, total_ptr,
                          numel, bound, n_blocks, n_chunks,
                          BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CB: tl.constexpr, BLK_CHUNK: tl.constexpr):
        """Step 2 (one program): totals, layout, and each chunk's first position per expert."""
        experts = tl.arange(0, E_P2)
        cnt = tl.zeros([E_P2], dtype=tl.int32)
        for c0 in range(0, n_chunks, CB):
            rows = c0 + tl.arange(0, CB)
            part = tl.load(counts_ptr + rows[:, None] * E_P2 + experts[None, :], mask=rows[:, None] < n_chunks, other=0)
            cnt += tl.sum(part, axis=0)
        run = _layout(cnt, sorted_ptr, expert_ids_ptr, total_ptr, numel, bound, n_blocks,
                      BLOCK_M, E_P2, 1024, BLK_CHUNK)
        for c0 in range(0, n_chunks, CB):
            rows = c0 + tl.arange(0, CB)
            m = rows[:, None] < n_chunks
            part = tl.load(counts_ptr + rows[:, None] * E_P2 + experts[None, :], mask=m, other=0)
            tl.store(base_ptr + rows[:, None] * E_P2 + experts[None, :], tl.cumsum(part, axis=0) - part + run[None, :],
                     mask=m)
            run += tl.sum(part, axis=0)

    @triton.jit(do_not_specialize=["numel"])
    def align_scatter_kernel(ids_ptr, map_ptr, base_ptr, sorted_ptr, numel, n_logical, num_experts,
                             E_P2: tl.constexpr, CHUNK: tl.constexpr, HAS_MAP: tl.constexpr):
        """Step 3 (one program per chunk): each slot to its stable position."""
        c = tl.program_id(0)
        experts = tl.arange(0, E_P2)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        e = _experts_of(ids_ptr, map_ptr, offs, numel, n_logical, num_experts, HAS_MAP)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)
        base = tl.load(base_ptr + c * E_P2 + experts)
        pos = tl.sum(hot * (tl.cumsum(hot, axis=0) - hot + base[None, :]), axis=1)
        tl.store(sorted_ptr + pos, offs.to(tl.int32), mask=e >= 0)

    return align_single_kernel, align_count_kernel, align_scan_kernel, align_scatter_kernel


_KERNELS = None
SINGLE_MAX_CHUNKS = 8
"""Up to this many slot chunks the one-program kernel runs (decode); beyond, the three-step path
(parallel counts, one scan over chunks, parallel scatter) keeps prefill alignment off the critical path."""


def moe_align(
    ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None,
    path: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing metadata for expert-blocked GEMMs (see the module docstring); no host sync.
    ``path``: ``"auto"``, ``"single"`` (one launch) or ``"multi"`` (three launches)."""
    global _KERNELS
    check_config("moe_align", pow2={"block_m": block_m})
    if _KERNELS is None:
        _KERNELS = _kernels()
    single, count, scan, scatter = _KERNELS
    flat = ids.reshape(-1).contiguous()
    n, dev = flat.numel(), ids.device
    if n == 0:
        return align_ref(ids, num_experts, block_m, expert_map)
    bound = n + num_experts * (block_m - 1)
    n_blocks = -(-bound // block_m)
    sorted_ids = torch.empty(bound, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    e_p2 = next_pow2(num_experts)
    emap = flat if expert_map is None else expert_map.to(dev, torch.int64).contiguous()
    n_logical = num_experts if expert_map is None else expert_map.numel()
    has_map = expert_map is not None
    blk_chunk = max(16, min(256, 8192 // e_p2))
    chunk = max(16, min(1024, 8192 // e_p2))
    if path == "single" or (path == "auto" and -(-n // chunk) <= SINGLE_MAX_CHUNKS):
        single[(1,)](
            flat, emap, sorted_ids, expert_ids, total, n, n_logical, num_experts, bound, n_blocks,
            BLOCK_M=block_m, E_P2=e_p2, CHUNK=chunk, BLK_CHUNK=blk_chunk, HAS_MAP=has_map, num_warps=8,
        )
        return sorted_ids, expert_ids, total
    chunk = max(16, min(256, 16384 // e_p2))
    n_chunks = -(-n // chunk)
    counts = torch.empty(n_chunks, e_p2, dtype=torch.int32, device=dev)
    base = torch.empty_like(counts)
    count[(n_chunks,)](flat, emap, counts, n, n_logical, num_experts, E_P2=e_p2, CHUNK=chunk, HAS_MAP=has_map,
                       num_warps=4)
    scan[(1,)](counts, base, sorted_ids, expert_ids, total, n, bound, n_blocks, n_chunks,
               BLOCK_M=block_m, E_P2=e_p2, CB=max(1, min(64, 8192 // e_p2)), BLK_CHUNK=blk_chunk, num_warps=8)
    scatter[(n_chunks,)](flat, emap, base, sorted_ids, n, n_logical, num_experts, E_P2=e_p2, CHUNK=chunk,
                         HAS_MAP=has_map, num_warps=4)
    return sorted_ids, expert_ids, total
