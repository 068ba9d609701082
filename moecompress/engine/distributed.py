"""Runs over several processes with ``torch.distributed`` (launched by ``torchrun``): who this rank is,
the process group, and the few collectives the engine uses, all on tensors (no pickle).

``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT``, which
``init_process_group`` reads itself); ``cli.py`` reads them into a :class:`Launch`, the executor turns it
into a :class:`Ranks` once it knows the compute device (gloo on CPU, NCCL on CUDA) and
:class:`~moecompress.engine.context.RunContext` holds it. World size 1 is :data:`SINGLE`: no process
group, every helper the identity, the code path of one process.

The rule (``docs/distributed.md``): calibration is data-parallel (rank ``r`` runs the batches
``b % N == r``; every statistic is merged round by round, batch after batch, in the single process's
order, so the bits are the same); rank 0 alone takes the locks, writes the statistics cache, the output,
the journal and the atomic rename; in the layer loop the experts of a layer are sharded across the ranks
(:mod:`moecompress.engine.shard`, point to point: :meth:`Ranks.send_bytes`). A collective that
fails because another rank died raises :class:`~moecompress.errors.Interrupted`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch

from moecompress.errors import Interrupted, RecipeError

TIMEOUT = timedelta(hours=6)
"""How long a collective waits for the other ranks (rank 0 may calibrate a large layer meanwhile)."""


@dataclass(frozen=True)
class Launch:
    """What ``torchrun`` says about this process (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 0
    """The ranks on this host (``0``: not said, taken as ``world_size``)."""

    @property
    def ranks_here(self) -> int:
        """How many ranks share this host's memory."""
        return self.local_world_size or self.world_size

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Launch:
        """The launch of ``env`` (``os.environ``); without ``WORLD_SIZE`` (or at 1) one process."""
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local = int(env.get("LOCAL_RANK", str(rank)))
            here = int(env.get("LOCAL_WORLD_SIZE", "0"))
        except ValueError:
            raise RecipeError(
                f"RANK/WORLD_SIZE/LOCAL_RANK must be integers (got {env.get('RANK')!r}/{env.get('WORLD_SIZE')!r}/"
                f"{env.get('LOCAL_RANK')!r}); launch with torchrun"
            ) from None
        if world < 1 or not 0 <= rank < world or local < 0:
            raise RecipeError(
                f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local} is not a valid launch; use torchrun"
            )
        return cls(rank, world, local, max(here, 0))


@dataclass(frozen=True)
class Ranks:
    """This process among ``world_size`` ranks; ``device``: the device its collectives' tensors live on."""

    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes: the statistics cache, the output, the journal, the rename."""
        return self.rank == 0

    def share(self, n: int) -> list[int]:
        """The items of ``range(n)`` this rank runs: ``i % world_size == rank``."""
        return list(range(self.rank, n, self.world_size))

    def rounds(self, n: int) -> int:
        """How many rounds ``n`` items take (one item per rank per round)."""
        return -(-n // self.world_size)

    def barrier(self) -> None:
        if self.world_size > 1:
            _guard(self, "barrier", lambda: torch.distributed.barrier())

    def all_gather_bytes(self, blob: bytes) -> list[bytes]:
        """Every rank's ``blob``, in rank order (variable sizes: lengths first, then padded bytes)."""
        if self.world_size == 1:
            return [blob]
        return [p.numpy().tobytes() for p in self.all_gather_buffers(blob)]

    def all_gather_buffers(self, blob: bytes) -> list[torch.Tensor]:
        """:meth:`all_gather_bytes` as uint8 host tensors, the bytes as received (not copied into ``bytes``: read
        them with :func:`~moecompress.io.shard_format.load_buffer`). The blob is copied once, into the padded
        tensor the collective sends; nothing is zeroed (a part is only read up to its rank's length)."""
        if self.world_size == 1:
            return [_buffer(blob)]
        dev = torch.device(self.device)
        size = torch.tensor([len(blob)], dtype=torch.int64, device=dev)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        _guard(self, "all_gather", lambda: torch.distributed.all_gather(sizes, size))
        top = max(int(s) for s in sizes)
        mine = torch.empty(top, dtype=torch.uint8, device=dev)
        if blob:
            mine[: len(blob)] = _buffer(blob).to(dev)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        _guard(self, "all_gather", lambda: torch.distributed.all_gather(parts, mine))
        return [p[: int(s)].cpu() for p, s in zip(parts, sizes)]

    def all_gather_f64(self, values: list[float], length: int) -> list[list[float]]:
        """Every rank's ``values`` (at most ``length`` of them; float64, exact), in rank order."""
        if self.world_size == 1:
            return [list(values)]
        dev = torch.device(self.device)
        mine = torch.full((length + 1,), float("nan"), dtype=torch.float64, device=dev)
        mine[0] = len(values)
        if values:
            mine[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.float64)
        parts = [torch.zeros_like(mine) for _ in range(self.world_size)]
        _guard(self, "all_gather", lambda: torch.distributed.all_gather(parts, mine))
        return [p[1 : 1 + int(p[0])].cpu().tolist() for p in parts]

    def all_sum_int(self, value: int) -> int:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=torch.device(self.device))
        _guard(self, "all_reduce", lambda: torch.distributed.all_reduce(t))
        return int(t)

    def broadcast_ints(self, values: list[int], length: int) -> list[int]:
        """Rank 0's ``values`` (``length`` of them, int64) on every rank."""
        if self.world_size == 1:
            return list(values)
        t = torch.zeros(length, dtype=torch.int64, device=torch.device(self.device))
        if self.is_writer:
            t[:] = torch.tensor(values, dtype=torch.int64)
        _guard(self, "broadcast", lambda: torch.distributed.broadcast(t, src=0))
        return [int(x) for x in t.cpu()]

    def send_bytes(self, blob: bytes, dst: int) -> None:
        """``blob`` to rank ``dst`` (its length first, then the bytes; :meth:`recv_bytes` there)."""
        dev = torch.device(self.device)
        size = torch.tensor([len(blob)], dtype=torch.int64, device=dev)
        _guard(self, "send", lambda: torch.distributed.send(size, dst))
        if blob:
            with warnings.catch_warnings():  # read-only bytes: the send only reads them (no copy)
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(blob, dtype=torch.uint8).to(dev)
            _guard(self, "send", lambda: torch.distributed.send(data, dst))

    def isend_bytes(self, blob: bytes, dst: int) -> Sending:
        """:meth:`send_bytes` without waiting: ``wait()`` on the result waits for rank ``dst`` to receive. gloo's
        ``send`` returns only once the receiver has posted its receive (a send of 8 bytes to a rank that
        received 1 s later took 1.0 s, measured), so a rank that sends before its next piece of work waits
        for the receiver first; this one works meanwhile."""
        dev = torch.device(self.device)
        size = torch.tensor([len(blob)], dtype=torch.int64, device=dev)
        held: list[object] = [size, blob]
        works = [_guard(self, "send", lambda: torch.distributed.isend(size, dst))]
        if blob:
            with warnings.catch_warnings():  # read-only bytes: the send only reads them (no copy)
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(blob, dtype=torch.uint8).to(dev)
            held.append(data)
            works.append(_guard(self, "send", lambda: torch.distributed.isend(data, dst)))
        return Sending(self, works, held)

    def recv_bytes(self, src: int) -> bytes:
        """The next blob rank ``src`` sends this rank (:meth:`send_bytes`)."""
        return self.recv_buffer(src).numpy().tobytes()

    def recv_buffer(self, src: int) -> torch.Tensor:
        """The next blob rank ``src`` sends this rank, as a uint8 host tensor (not copied into ``bytes``)."""
        dev = torch.device(self.device)
        size = torch.zeros(1, dtype=torch.int64, device=dev)
        _guard(self, "recv", lambda: torch.distributed.recv(size, src))
        data = torch.empty(int(size), dtype=torch.uint8, device=dev)
        if data.numel():
            _guard(self, "recv", lambda: torch.distributed.recv(data, src))
        return data.cpu()

    def from_writer(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=torch.device(self.device))
        _guard(self, "broadcast", lambda: torch.distributed.broadcast(t, src=0))
        return bool(int(t))


@dataclass
class Sending:
    """A message :meth:`Ranks.isend_bytes` started: its sends, and what they read (held until they are done)."""

    ranks: Ranks
    works: list
    held: list

    def wait(self) -> None:
        """Until rank ``dst`` has received it (:class:`~moecompress.errors.Interrupted` if it is gone)."""
        for w in self.works:
            _guard(self.ranks, "send", w.wait)
        self.works, self.held = [], []


SINGLE = Ranks()
"""One process: no process group."""


def _buffer(blob: bytes) -> torch.Tensor:
    """``blob`` as a uint8 tensor over its bytes (read-only: only read, never written; no copy)."""
    if not blob:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(blob, dtype=torch.uint8)


def _guard(ranks: Ranks, what: str, call):
    try:
        return call()
    except (RuntimeError, ValueError) as err:  # DistBackendError / DistNetworkError are RuntimeErrors
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise Interrupted(
            f"rank {ranks.rank} of {ranks.world_size}: {what} failed, another rank stopped or is unreachable ({first})"
        ) from None


def start(launch: Launch, device: str) -> Ranks:
    """The process group of ``launch`` (NCCL when ``device`` is CUDA, else gloo), started once; returns
    :data:`SINGLE` at world size 1. On CUDA each rank computes on ``cuda:LOCAL_RANK``."""
    if launch.world_size == 1:
        return SINGLE
    dist = torch.distributed
    if not dist.is_available():
        raise RecipeError(f"this PyTorch {torch.__version__} has no torch.distributed; run one process")
    cuda = torch.device(device).type == "cuda"
    if cuda:
        if launch.local_rank >= torch.cuda.device_count():
            raise RecipeError(
                f"LOCAL_RANK={launch.local_rank} but this host has {torch.cuda.device_count()} CUDA device(s); "
                "use --nproc_per_node at most the device count"
            )
        torch.cuda.set_device(launch.local_rank)
        device = f"cuda:{launch.local_rank}"
    if not dist.is_initialized():
        try:
            dist.init_process_group(
                "nccl" if cuda else "gloo", rank=launch.rank, world_size=launch.world_size, timeout=TIMEOUT
            )
        except (RuntimeError, ValueError) as err:
            first = (str(err).strip().splitlines() or ["?"])[0][:200]
            raise RecipeError(
                f"rank {launch.rank} of {launch.world_size}: cannot join the process group ({first}); launch with "
                "torchrun (it sets MASTER_ADDR and MASTER_PORT)"
            ) from None
    return Ranks(launch.rank, launch.world_size, device if cuda else "cpu")


def stop(ranks: Ranks) -> None:
    """Leave the process group of :func:`start` (nothing at world size 1)."""
    if ranks.world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
