"""Tiny quantised releases for tests: :func:`moecompress.testing.save_tiny`'s models with their weights
quantised by each format's own rules, written in that format's on-disk layout.

- :func:`save_fp8_block`: DeepSeek-V3/R1 FP8 (``F8_E4M3`` weights, ``F32`` 128x128 ``weight_scale_inv``,
  per-block scale ``amax / 448``) on every Linear but the routers, embeddings and ``lm_head``;
- :func:`save_compressed_tensors`: compressed-tensors ``float-quantized`` FP8 or ``pack-quantized``
  int4/int8, scales from the library's ``calculate_qparams`` and tensors from its own compressors;
- :func:`save_mxfp4`: gpt-oss MXFP4 experts (one e8m0 exponent per 32 values along the input, e2m1 codes
  two per byte, low nibble first: the layout transformers' ``convert_moe_packed_tensors`` decodes).

Each returns the bf16/f32 model it started from. Shapes of the tests are chosen so that 128-blocks are
partial (hidden 192 = 128 + 64).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moecompress.testing import save_tiny

FP8_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
UNQUANTISED = (
    "embed_tokens",
    "lm_head",
    "norm",
    "layernorm",
    ".mlp.gate.weight",
    ".router.",
    "shared_expert_gate",
)


def quantisable(name: str, t: torch.Tensor) -> bool:
    """The Linear weights a release quantises: 2-D ``.weight`` of everything but routers, embeddings,
    norms and the LM head."""
    return name.endswith(".weight") and t.dim() == 2 and not any(s in name for s in UNQUANTISED)


def _tiny_tensors(model_type: str, **kw) -> tuple[object, dict[str, torch.Tensor], dict, Path]:
    tmp = Path(tempfile.mkdtemp(prefix="moecompress-q-"))
    model = save_tiny(model_type, tmp, **kw)
    return (
        model,
        load_file(str(tmp / "model.safetensors")),
        json.loads((tmp / "config.json").read_text()),
        tmp,
    )


def _write(path: str | Path, tensors: dict[str, torch.Tensor], cfg: dict, tmp: Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tmp.iterdir():
        if f.name not in ("model.safetensors", "config.json", "model.safetensors.index.json"):
            (path / f.name).write_bytes(f.read_bytes())
    shutil.rmtree(tmp, ignore_errors=True)


# -- FP8 block (DeepSeek-V3) -----------------------------------------------------------------------
def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F8_E4M3 weight, F32 scale_inv)``: each block scaled by ``amax / 448`` (DeepSeek's rule)."""
    b0, b1 = block
    rows, cols = w.shape
    s0, s1 = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = torch.zeros(s0 * b0, s1 * b1, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(s0, b0, s1, b1)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view(s0 * b0, s1 * b1)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def save_fp8_block(model_type: str, path: str | Path, *, block: tuple[int, int] = (128, 128), **kw):
    """:func:`save_tiny` with every Linear weight in DeepSeek-V3's FP8 block-scaled layout."""
    model, tensors, cfg, tmp = _tiny_tensors(model_type, **kw)
    out: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        if quantisable(k, t):
            out[k], out[f"{k}_scale_inv"] = quantize_fp8_block(t, block)
        else:
            out[k] = t
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
    }  # fmt: skip
    _write(path, out, cfg, tmp)
    return model


# -- compressed-tensors ----------------------------------------------------------------------------
def ct_scheme(kind: str):
    """A compressed-tensors scheme and format: ``fp8-channel``, ``fp8-block``, ``w4-group``,
    ``w4-asym`` (int4 with zero points) or ``w8-channel``."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = {
        "fp8-channel": dict(num_bits=8, type="float", strategy="channel", symmetric=True),
        "fp8-block": dict(
            num_bits=8, type="float", strategy="block", block_structure=[128, 128], symmetric=True
        ),
        "w4-group": dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True),
        "w4-asym": dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False),
        "w8-channel": dict(num_bits=8, type="int", strategy="channel", symmetric=True),
    }[kind]
    fmt = "float-quantized" if kind.startswith("fp8") else "pack-quantized"
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(dynamic=False, **args)), fmt


def _ct_qparams(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    from compressed_tensors.quantization.utils import calculate_qparams

    rows, cols = w.shape
    w = w.float()
    if args.strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    elif args.strategy == "group":
        g = args.group_size
        v = torch.zeros(rows, math.ceil(cols / g) * g)
        v[:, :cols] = w
        v = v.view(rows, -1, g)
        lo, hi = v.amin(dim=2), v.amax(dim=2)
    else:  # block (zero padding leaves min <= 0 <= max, which calculate_qparams enforces anyway)
        b0, b1 = args.block_structure
        v = torch.zeros(math.ceil(rows / b0) * b0, math.ceil(cols / b1) * b1)
        v[:rows, :cols] = w
        v = v.view(v.shape[0] // b0, b0, v.shape[1] // b1, b1)
        lo, hi = v.amin(dim=(1, 3)), v.amax(dim=(1, 3))
    return calculate_qparams(lo, hi, args)


def save_compressed_tensors(model_type: str, path: str | Path, kind: str = "w4-group", **kw):
    """:func:`save_tiny` with every Linear weight compressed by compressed-tensors' own compressor for
    :func:`ct_scheme` ``kind`` (routers, embeddings and ``lm_head`` left dense and ignored)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    scheme, fmt = ct_scheme(kind)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    model, tensors, cfg, tmp = _tiny_tensors(model_type, **kw)
    out: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        if not quantisable(k, t):
            out[k] = t
            continue
        scale, zp = _ct_qparams(t, scheme.weights)
        local = {"weight": t.float(), "weight_scale": scale, "weight_zero_point": zp}
        module = k.removesuffix(".weight")
        out.update({f"{module}.{n}": v for n, v in compressor.compress(local, scheme).items()})
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
        ignore=["lm_head", "re:.*mlp\\.gate$", "re:.*router$"],
    )  # fmt: skip
    cfg["quantization_config"] = config.to_dict()
    _write(path, out, cfg, tmp)
    return model


# -- MXFP4 (gpt-oss) -------------------------------------------------------------------------------
def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U8 blocks [..., R, C/32, 16], U8 scales [..., R, C/32])`` of ``w`` ``[..., R, C]`` (out-major):
    per 32 values the exponent ``ceil(log2(amax / 6))`` (e8m0, bias 127) and the nearest e2m1 codes."""
    *lead, rows, cols = w.shape
    v = w.float().reshape(*lead, rows, cols // 32, 32)
    amax = v.abs().amax(dim=-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = v / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - E2M1).abs().argmin(dim=-1).to(torch.uint8)  # nearest value (+0 before -0)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def save_mxfp4(path: str | Path, **kw):
    """:func:`save_tiny` of ``gpt_oss`` with its experts in the released MXFP4 layout (``intermediate_size``
    and ``hidden_size`` must be multiples of 32)."""
    model, tensors, cfg, tmp = _tiny_tensors("gpt_oss", **kw)
    out: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[f"{k}_blocks"], out[f"{k}_scales"] = quantize_mxfp4(t.transpose(1, 2))
        else:
            out[k] = t
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    _write(path, out, cfg, tmp)
    return model
