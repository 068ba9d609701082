"""Orthogonal input rotations for quantisation (CodeQuant's AOS, QuaRot's randomised Hadamard).

A rotation ``R`` (``[H, H]``, orthogonal) acts on row vectors: ``x' = x R``. A linear layer reading
``x`` keeps its function when its weight is stored as ``W' = W R`` (``W' x' = W R Rᵀ x = W x``).
Rotations spread activation outliers over all channels, so a per-token min-max quantiser loses less:

    Q_b(x) = clamp(round((x − min x) / s), 0, 2^b − 1) · s + min x,     s = (max x − min x) / (2^b − 1)

per token over its whole row (asymmetric). :func:`learn_rotation` minimises
``mean ‖x R − Q_b(x R)‖²`` over calibration tokens with the Cayley parametrisation of
``torch.nn.utils.parametrizations.orthogonal`` and Adam, starting from :func:`hadamard` (CodeQuant,
arXiv 2604.10496, AOS; no straight-through estimator: the gradient flows through ``x R`` and through
the min/max, not through the rounding).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrizations
from torch.nn.utils.parametrizations import _is_orthogonal, _make_orthogonal


def fake_quant_tokens(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``Q_b(x)``: per-row (token) asymmetric min-max quantisation to ``bits`` bits, dequantised."""
    levels = (1 << bits) - 1
    lo = x.amin(dim=-1, keepdim=True)
    hi = x.amax(dim=-1, keepdim=True)
    s = ((hi - lo) / levels).clamp_min(1e-12)
    q = torch.clamp(torch.round((x - lo) / s), 0, levels)
    return q * s + lo


def quant_error(x: torch.Tensor, bits: int) -> float:
    """Relative error ``‖x − Q_b(x)‖² / ‖x‖²`` of per-token quantisation."""
    x = x.double()
    return float(((x - fake_quant_tokens(x, bits)) ** 2).sum() / (x**2).sum().clamp_min(1e-30))


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """A randomised Hadamard rotation ``[n, n]`` (float64, orthogonal): ``diag(±1) · (H_{2^a} ⊗ Q_m) / √2^a``
    for ``n = 2^a · m`` with ``m`` odd, where ``H`` is Sylvester's Hadamard matrix and ``Q_m`` a random
    orthogonal ``m × m`` matrix (``Q_1 = 1``: a plain Hadamard for powers of two; QuaRot uses special
    Hadamard matrices of orders 12, 20, 28, ... instead of ``Q_m``)."""
    g = torch.Generator().manual_seed(seed)
    a = (n & -n).bit_length() - 1
    p, m = 1 << a, n >> a
    h = _sylvester(p) / math.sqrt(p)
    if m > 1:
        q, r = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
        h = torch.kron(h.contiguous(), (q * torch.sign(torch.diagonal(r))).contiguous())
    signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
    return signs[:, None] * h


def learn_rotation(
    x: torch.Tensor,
    *,
    bits: int = 4,
    steps: int = 100,
    lr: float = 1e-3,
    init: torch.Tensor | None = None,
    batch: int = 256,
    seed: int = 0,
) -> tuple[torch.Tensor, list[float]]:
    """Learn ``R`` minimising ``mean ‖x R − Q_bits(x R)‖²`` on tokens ``x`` ``[T, H]`` (fp32 compute).
    Returns ``(R [H, H] float64, per-step losses)``. ``init`` (orthogonal) is the starting point
    (identity when ``None``).

    The parametrisation is that of ``torch.nn.utils.parametrizations.orthogonal(..., "cayley")`` on an
    ``nn.Linear`` (what this function used before, :func:`learn_rotation_reference`): a parameter ``X``
    (from ``−I``), ``A = tril(X) − tril(X)ᵀ``, ``W = base · (I − A/2)⁻¹ (I + A/2)`` with ``base = initᵀ``,
    ``R = Wᵀ``, Adam on ``X``. Only the batch's rotated tokens are formed, never ``W``:
    ``x Wᵀ = ((x − x A / 2) (I + A/2)⁻¹) baseᵀ`` (``Aᵀ = −A``), one ``H × H`` factorisation and
    matrix products with the batch per step instead of an ``H × H`` solve with ``H`` right-hand sides
    and two ``H³`` products (about 3x less work at ``H = 2048``); the same function in exact
    arithmetic, so the losses and ``R`` equal the reference's to float32 rounding
    (``tests/test_codequant.py``)."""
    h = x.shape[1]
    start = torch.eye(h) if init is None else init.float()
    base = start.T.contiguous()  # nn.Linear computes x Wᵀ, so W = Rᵀ
    base = base.clone() if _is_orthogonal(base) else _make_orthogonal(base)  # as the parametrisation does
    param = torch.zeros(h, h)
    param.diagonal().fill_(-1.0)  # the parametrisation's right inverse of an orthogonal W: X = −I
    param.requires_grad_(True)
    opt = torch.optim.Adam([param], lr=lr)
    eye = torch.eye(h)
    g = torch.Generator().manual_seed(seed)
    xf = x.float()
    scale = float(xf.pow(2).mean().clamp_min(1e-30))
    base_t = base.T
    losses = []
    for _ in range(steps):
        idx = torch.randperm(xf.shape[0], generator=g)[:batch]
        lo = param.tril()
        a = lo - lo.mT
        xb = xf[idx]
        u = torch.addmm(xb, xb, a, alpha=-0.5)  # x (I − A/2)
        y = torch.linalg.solve(torch.add(eye, a, alpha=0.5), u, left=False) @ base_t
        loss = (y - fake_quant_tokens(y, bits)).pow(2).mean() / scale
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        lo = param.tril()
        a = lo - lo.mT
        w = base @ torch.linalg.solve(torch.add(eye, a, alpha=-0.5), torch.add(eye, a, alpha=0.5))
        r = w.T.double()
    # re-orthogonalise in float64 (the Cayley map is orthogonal up to fp32 rounding)
    u, _, vh = torch.linalg.svd(r)
    return u @ vh, losses


def learn_rotation_reference(
    x: torch.Tensor,
    *,
    bits: int = 4,
    steps: int = 100,
    lr: float = 1e-3,
    init: torch.Tensor | None = None,
    batch: int = 256,
    seed: int = 0,
) -> tuple[torch.Tensor, list[float]]:
    """:func:`learn_rotation` through ``torch.nn.utils.parametrizations.orthogonal`` on an ``nn.Linear``
    (the formulation it replaced; the oracle of its tests)."""
    h = x.shape[1]
    lin = nn.Linear(h, h, bias=False)
    parametrizations.orthogonal(lin, orthogonal_map="cayley")
    start = torch.eye(h) if init is None else init.float()
    with torch.no_grad():
        lin.weight = start.T.contiguous()  # nn.Linear computes x Wᵀ, so W = Rᵀ
    opt = torch.optim.Adam([p for p in lin.parameters() if p.requires_grad], lr=lr)
    g = torch.Generator().manual_seed(seed)
    xf = x.float()
    scale = float(xf.pow(2).mean().clamp_min(1e-30))
    losses = []
    for _ in range(steps):
        idx = torch.randperm(xf.shape[0], generator=g)[:batch]
        y = lin(xf[idx])
        loss = (y - fake_quant_tokens(y, bits)).pow(2).mean() / scale
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        r = lin.weight.T.double()
    u, _, vh = torch.linalg.svd(r)
    return u @ vh, losses
