"""The ``Tucker`` layout: a bank of experts factorised with shared output and input factors.

For the factorised experts ``m`` (``members[e] = m``) of one projection::

    W_e ≈ U_out · C_m · U_inᵀ        U_out [out, r2], C_m [r2, r3], U_in [in, r3]

with per-expert cores ``C`` ``[M, r2, r3]`` (the expert-mode factor folded in), or a shared core
``G`` ``[r1, r2, r3]`` and an expert factor ``U_e`` ``[M, r1]`` (``C_m = Σ_j U_e[m, j] G_j``) when the
expert mode is truncated. Experts with ``members[e] = -1`` (protected super experts) are stored exactly, as dense weights in
``exact`` ``[P, out, in]`` (in id order), and never enter the shared factors.

The forward never rebuilds dense weights (``encode``/``partial``/``decode``, see
:func:`moecompress.reference.experts_forward`): ``z = x·U_in`` once per token, ``C_m z`` per routed
(token, expert) pair, and ``U_out`` once per token after the top-k weighted sum in rank space (down
projection) or per pair (gate/up, whose activation needs the full output).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moecompress.errors import LayoutError
from moecompress.layouts.base import Layout, meta_members, meta_tensor


@dataclass(frozen=True, eq=False)
class Tucker(Layout):
    u_out: torch.Tensor
    u_in: torch.Tensor
    core: torch.Tensor
    members: torch.Tensor
    exact: torch.Tensor | None = None
    u_expert: torch.Tensor | None = None
    kind: ClassVar[str] = "tucker"
    shared: ClassVar[frozenset[str]] = frozenset({"u_out", "u_in"})

    def __post_init__(self) -> None:
        r2, r3 = self.u_out.shape[1], self.u_in.shape[1]
        if self.core.dim() != 3 or tuple(self.core.shape[1:]) != (r2, r3):
            raise LayoutError(f"Tucker core {tuple(self.core.shape)} does not match ranks ({r2}, {r3})")
        if self.u_expert is not None and self.u_expert.shape[1] != self.core.shape[0]:
            raise LayoutError(
                f"Tucker expert factor {tuple(self.u_expert.shape)} vs core {tuple(self.core.shape)}"
            )
        if self.members.device.type == "meta":
            return
        m = self.members.tolist()
        n_fact = self.core.shape[0] if self.u_expert is None else self.u_expert.shape[0]
        dense_ids = [e for e, k in enumerate(m) if k < 0]
        if sorted(k for k in m if k >= 0) != list(range(n_fact)):
            raise LayoutError(f"Tucker members {m} must index each of the {n_fact} factorised experts once")
        n_dense = 0 if self.exact is None else self.exact.shape[0]
        if len(dense_ids) != n_dense:
            raise LayoutError(f"Tucker: {len(dense_ids)} experts marked dense but {n_dense} dense weights")
        object.__setattr__(self, "_dense_index", {e: i for i, e in enumerate(dense_ids)})

    @classmethod
    def meta_like(
        cls, experts: int, out: int, inn: int, ranks: tuple[int, int, int], *, factorised: int, dtype: torch.dtype
    ) -> Tucker:
        """Shapes only (``meta``): ``factorised`` experts with ranks ``(r1, r2, r3)`` (``r1 == factorised``:
        per-expert cores), the rest exact."""
        r1, r2, r3 = ranks
        fold = r1 == factorised
        return cls(
            meta_tensor(out, r2, dtype=dtype), meta_tensor(inn, r3, dtype=dtype),
            meta_tensor(factorised if fold else r1, r2, r3, dtype=dtype), meta_members(experts),
            meta_tensor(experts - factorised, out, inn, dtype=dtype) if experts > factorised else None,
            None if fold else meta_tensor(factorised, r1, dtype=dtype),
        )  # fmt: skip

    @property
    def shape(self) -> tuple[int, int, int]:
        return (int(self.members.shape[0]), int(self.u_out.shape[0]), int(self.u_in.shape[0]))

    @property
    def dtype(self) -> torch.dtype:
        return self.u_out.dtype

    @property
    def ranks(self) -> tuple[int, int, int]:
        r1 = self.core.shape[0]
        return (int(r1), int(self.u_out.shape[1]), int(self.u_in.shape[1]))

    def core_of(self, m: int) -> torch.Tensor:
        """``C_m`` ``[r2, r3]``."""
        if self.u_expert is None:
            return self.core[m]
        return torch.einsum("j,jab->ab", self.u_expert[m], self.core)

    def expert(self, e: int) -> torch.Tensor:
        m = int(self.members[e])
        if m < 0:
            return self.exact[self._dense_index[e]]  # type: ignore[index, attr-defined]
        return self.u_out @ self.core_of(m) @ self.u_in.T

    def encode(self, x: torch.Tensor) -> Any:
        x = x.to(self.dtype)
        return x @ self.u_in, (x if self.exact is not None else None)

    def partial(
        self, ctx: Any, e: int, tok: torch.Tensor, *, rows=None, cols=None
    ) -> tuple[str, torch.Tensor]:
        if rows is not None or cols is not None:
            raise LayoutError("Tucker experts have no live-width cut (they are never neuron-pruned)")
        z, x = ctx
        m = int(self.members[e])
        if m < 0:
            return "out", F.linear(x[tok], self.exact[self._dense_index[e]])  # type: ignore[index, attr-defined]
        return "rank", F.linear(z[tok], self.core_of(m))

    def decode(self, space: str, value: torch.Tensor) -> torch.Tensor:
        return F.linear(value.to(self.dtype), self.u_out) if space == "rank" else value

    def apply(
        self, x: torch.Tensor, e: int, *, rows: int | None = None, cols: int | None = None
    ) -> torch.Tensor:
        tok = torch.arange(x.shape[0], device=x.device)
        space, value = self.partial(self.encode(x), e, tok, rows=rows, cols=cols)
        return self.decode(space, value)

    def cast(self, dtype: torch.dtype) -> Tucker:
        if self.dtype == dtype:
            return self
        f = {k: getattr(self, k) for k in ("u_out", "u_in", "core", "exact", "u_expert")}
        return dataclasses.replace(self, **{k: None if v is None else v.to(dtype) for k, v in f.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "u_out": self.u_out,
            "u_in": self.u_in,
            "core": self.core,
            "members": self.members.to(torch.int64),
        }
        if self.exact is not None:
            out["exact"] = self.exact
        if self.u_expert is not None:
            out["u_expert"] = self.u_expert
        return out

    def meta(self) -> dict[str, Any]:
        return {"kind": self.kind, "shape": list(self.shape), "ranks": list(self.ranks),
                "dtype": str(self.dtype).removeprefix("torch.")}  # fmt: skip

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Tucker:
        missing = {"u_out", "u_in", "core", "members"} - set(tensors)
        if missing:
            raise LayoutError(f"Tucker layout lacks tensors {sorted(missing)}; got {sorted(tensors)}")
        return cls(tensors["u_out"], tensors["u_in"], tensors["core"], tensors["members"].to(torch.int64),
                   tensors.get("exact"), tensors.get("u_expert"))  # fmt: skip
