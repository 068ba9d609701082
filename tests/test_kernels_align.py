"""K1 ``moe_align`` (and the shared launch checks) under the Triton interpreter on CPU, on CUDA unchanged.

Index outputs are compared exactly with ``align_ref``; ``align_ref`` itself is checked against the
definition (per-expert slot sets, padding, block owners) so the two cannot agree on a wrong answer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_device import forward_on

from moecompress.kernels._launch import KernelConfigError, check_config, next_pow2, smem_bytes
from moecompress.kernels.moe_align import align_ref, moe_align

pytestmark = pytest.mark.interpreter


def _check_definition(ids, num_experts, block, expert_map, out):
    """``out`` = (sorted, expert_ids, total) satisfies K1's definition for ``ids``."""
    sorted_ids, expert_ids, total = (t.cpu() for t in out)
    flat = ids.reshape(-1).cpu()
    n = flat.numel()
    n_logical = num_experts if expert_map is None else expert_map.numel()
    phys = [
        -1 if not 0 <= int(i) < n_logical else (int(i) if expert_map is None else int(expert_map[int(i)]))
        for i in flat
    ]
    phys = [p if 0 <= p < num_experts else -1 for p in phys]
    assert sorted_ids.numel() == n + num_experts * (block - 1)
    assert expert_ids.numel() == -(-sorted_ids.numel() // block)
    pos = 0
    for e in range(num_experts):
        mine = [s for s, p in enumerate(phys) if p == e]
        padded = -(-len(mine) // block) * block
        assert sorted_ids[pos : pos + len(mine)].tolist() == mine  # stable order inside the expert
        assert (sorted_ids[pos + len(mine) : pos + padded] == n).all()
        assert (expert_ids[pos // block : (pos + padded) // block] == e).all()
        pos += padded
    assert int(total[0]) == pos
    assert (sorted_ids[pos:] == n).all() and (expert_ids[pos // block :] == -1).all()


CASES = [
    # (T, k, E, block, kind)
    (1, 1, 4, 16, "uniform"),
    (3, 2, 7, 16, "uniform"),
    (7, 4, 16, 16, "dropped"),
    (33, 2, 8, 16, "one_expert"),
    (33, 4, 16, 32, "empty_experts"),
    (7, 7, 7, 16, "k_equals_E"),
    (33, 8, 64, 16, "uniform"),
    (33, 8, 128, 16, "dropped"),
]


def _ids(t, k, e, kind, gen):
    if kind == "k_equals_E":
        return torch.stack([torch.randperm(e, generator=gen) for _ in range(t)])
    ids = torch.randint(0, e, (t, k), generator=gen)
    if kind == "dropped":  # routing policies drop with id == E; negative ids are dropped too
        ids[0, 0], ids[-1, -1], ids[t // 2, 0] = e, -1, e + 5
    elif kind == "one_expert":
        ids[:] = e - 1
    elif kind == "empty_experts":
        ids = ids % 3 * 5  # experts 0, 5, 10 only
    return ids


@pytest.mark.parametrize(("t", "k", "e", "block", "kind"), CASES)
def test_align_equals_reference(t, k, e, block, kind):
    gen = torch.Generator().manual_seed(t * 100 + e)
    ids = _ids(t, k, e, kind, gen)
    ref = align_ref(ids, e, block)
    _check_definition(ids, e, block, None, ref)
    for path in ("single", "multi"):  # one program (decode) and the three-step path (prefill, several chunks)
        got = forward_on(moe_align, ids, e, block, path=path)
        for a, b in zip(got, ref):
            assert a.dtype == torch.int32
            assert torch.equal(a.cpu(), b), path


def test_align_expert_map_duplicates_and_minus_one():
    """Merged experts: logical ids remapped (duplicates in one token, ``-1`` entries drop the slot)."""
    gen = torch.Generator().manual_seed(3)
    emap = torch.tensor([0, 0, 2, -1, 1, 3, 3, 2, 5, 4])
    ids = torch.randint(0, 11, (33, 3), generator=gen)  # 10 = dropped logical id
    ids[0] = torch.tensor([0, 1, 1])  # both map to physical 0 in one token
    ref = align_ref(ids, 6, 16, emap)
    _check_definition(ids, 6, 16, emap, ref)
    for path in ("single", "multi"):
        for a, b in zip(forward_on(moe_align, ids, 6, 16, emap, path=path), ref):
            assert torch.equal(a.cpu(), b)


def test_align_matches_guide_formula_without_drops():
    """On ids with no drops the reference equals KERNELS.md §4's ``align_ref`` (truncated to its length)."""
    ids = torch.randint(0, 7, (7, 2), generator=torch.Generator().manual_seed(1))
    flat, n, block, e = ids.flatten(), ids.numel(), 16, 7
    cnt = torch.bincount(flat, minlength=e)
    pcnt = (cnt + block - 1) // block * block
    starts = torch.cumsum(pcnt, 0) - pcnt
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(n) - (torch.cumsum(cnt, 0) - cnt)[flat[order]]
    guide = torch.full((int(pcnt.sum()),), n, dtype=torch.int32)
    guide[starts[flat[order]] + rank] = order.to(torch.int32)
    s, eids, total = align_ref(ids, e, block)
    assert int(total) == guide.numel() and torch.equal(s[: guide.numel()], guide)
    owners = torch.repeat_interleave(torch.arange(e, dtype=torch.int32), pcnt // block)
    assert torch.equal(eids[: owners.numel()], owners)


def test_align_empty_input():
    s, eids, total = forward_on(moe_align, torch.zeros(0, 2, dtype=torch.int64), 4, 16)
    assert int(total) == 0 and (s == 0).all() and (eids == -1).all() and s.numel() == 4 * 15


def test_align_rejects_non_power_of_two_block():
    with pytest.raises(KernelConfigError, match=r"block_m=12 must be a power of two"):
        forward_on(moe_align, torch.zeros(1, 1, dtype=torch.int64), 4, 12)


def test_launch_checks():
    check_config("ok", pow2={"BM": 16}, dot={"BM": 16}, smem=smem_bytes(64, 64, 64, 3, 2, 2))
    with pytest.raises(KernelConfigError, match=r"tl\.dot dimension BN=8"):
        check_config("k", pow2={"BN": 8}, dot={"BN": 8})
    with pytest.raises(KernelConfigError, match="shared memory estimate"):
        check_config("k", pow2={}, smem=smem_bytes(128, 256, 128, 4, 2, 2))
    with pytest.raises(KernelConfigError, match="bf16 atomics"):
        check_config("k", pow2={}, atomic_dtype=torch.bfloat16)
    assert [next_pow2(n) for n in (0, 1, 3, 16, 17)] == [1, 1, 4, 16, 32]
