"""``codequant`` on a layer held by chunks of experts (:mod:`moecompress.passes.codequant`): what every chunk
reads of the layer (:class:`Prelude`: the rotation, the routing of the calibration tokens), the
configuration a chunk cannot run, and the layer's report made from its chunks'."""

from __future__ import annotations

import dataclasses

import torch

from moecompress.engine.spec import PassConfig, shifted_ids
from moecompress.ir import MoELayer
from moecompress.methods.codebooks import Routing


@dataclasses.dataclass(frozen=True)
class Prelude:
    """What a layer held by chunks of experts computes once for every chunk
    (:func:`~moecompress.passes.codequant.prelude`): the
    rotation (``None``: none) and its report, the whole layer's routing of the fit and validation tokens,
    and (:meth:`chunk`) the id of the chunk's first expert in the layer."""

    rotation: torch.Tensor | None
    info: dict
    fit: Routing
    val: Routing
    first: int = 0

    def chunk(self, a: int, b: int) -> Prelude:
        return dataclasses.replace(self, fit=self.fit.rows(a, b), val=self.val.rows(a, b), first=a)


def refuse_shared(shell: MoELayer, cfg: PassConfig) -> str | None:
    """By chunks of experts the shared expert cannot be changed (it is fine-tuned with every expert)."""
    if cfg.shared and shell.shared is not None:
        return ("quantises the shared expert (shared: true), which a layer held by chunks of experts cannot "
                "change; set shared: false to keep it dense")  # fmt: skip
    return None


def merge_codequant(infos: list[dict], bnds: list[tuple[int, int]], cfg: PassConfig) -> dict:
    """A layer's info from its chunks' (``bnds``: each chunk's ``(a, b)``): the protected ids in the layer's
    numbering, bytes and counts summed (the rotation once), the rotation's report (the layer's, the same
    in every chunk), each chunk's own errors and best step listed (``*_per_chunk``), their means weighted
    by the chunks' quantised experts, and ``best_step`` the largest; units fine-tuned together (``team``)
    report the layer's errors and steps, which every unit has."""
    first = infos[0]
    out: dict = {"protected": shifted_ids(infos, bnds, "protected"), "bits": first["bits"]}
    out.update({k: v for k, v in first.items() if k == "rotation" or k.startswith("act_error")
                or k == "rotation_loss_first_last"})  # fmt: skip
    for key in ("bytes_before", "bytes_after", "routed_params", "quantised_experts"):
        out[key] = sum(i[key] for i in infos)
    out["bytes_after"] += first.get("rotation_bytes", 0)
    out["bytes_per_param"] = out["bytes_after"] / out["routed_params"] if out["routed_params"] else 0.0
    n = [i["quantised_experts"] for i in infos]
    if first.get("team"):  # fine-tuned together (stats.team): the layer's errors and steps, in every unit
        out.update({k: first.get(k) for k in ("val_error_kmeans", "val_error_final", "fit_loss_first",
                                              "fit_loss_last", "best_step", "steps_run")})  # fmt: skip
        out["router_kl"] = 0.0
        return out
    for key in ("val_error_kmeans", "val_error_final", "fit_loss_first", "fit_loss_last"):
        vals = [i.get(key) for i in infos]
        out[f"{key}_per_chunk"] = vals
        pairs = [(v, k) for v, k in zip(vals, n) if v is not None and k]
        out[key] = sum(v * k for v, k in pairs) / sum(k for _, k in pairs) if pairs else None
    out["best_step_per_chunk"] = [i.get("best_step") for i in infos]
    out["steps_run_per_chunk"] = [i.get("steps_run") for i in infos]
    out["steps_run"] = max((i.get("steps_run") or 0 for i, k in zip(infos, n) if k), default=0)
    out["best_step"] = max((i.get("best_step") or 0 for i, k in zip(infos, n) if k), default=0)
    out["router_kl"] = 0.0
    return out
