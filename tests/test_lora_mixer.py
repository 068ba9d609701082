"""``lora_heal`` on attention: LoRA-Mixer routed adapters (stored, wrapped in by ``moecompress.load``)
and the plain-LoRA baseline at equal trainable parameters (merged, stock output)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tiny import save_tiny
from torch import nn

import moecompress as mc
from moecompress.errors import CheckpointError
from moecompress.io.checkpoint import open_checkpoint
from moecompress.passes.lora_heal import LoraHealConfig
from moecompress.runtime.lora_mixer import CONFIG_KEY, FILE, RoutedLoRALinear
from moecompress.training.attention_lora import PlainLoRALinear, attach, equal_rank, targets
from moecompress.training.stage import _parameters
from moecompress.training.student import build_model

CAL = {"source": "random", "samples": 8, "seq_len": 8}
SMALL = {"steps": 3, "lr": 1e-2, "samples": 6, "holdout": 2, "seq_len": 8, "batch": 2}
IDS = torch.randint(3, 128, (3, 12), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixer")
    save_tiny("qwen3_moe", root / "m")
    out = root / "p"
    mc.apply({"model": str(root / "m"), "output": str(out), "calibration": CAL,
              "steps": [{"heapr": {"ratio": 0.5}}]}, progress=False)  # fmt: skip
    return out


def _heal(src, out, **kw):
    # the teacher is the unpruned model: healed against itself, kd's gradient is exactly zero and nothing moves
    teacher = src.parent / "m"
    step = {"lora_heal": {**SMALL, **({"teacher": str(teacher)} if teacher.is_dir() else {}), **kw}}
    mc.apply({"model": str(src), "output": str(out), "calibration": CAL, "steps": [step]}, progress=False)
    return json.loads((out / "steps" / "01-lora_heal" / "report.json").read_text())["summary"]


@pytest.mark.parametrize("target", ["attention_routed", "attention"])
def test_zero_initialised_b_gives_logits_bit_identical_to_the_base(pruned, target):
    model, _ = build_model(open_checkpoint(pruned))
    with torch.no_grad():
        want = model(IDS).logits
    mods, _ = attach(model, LoraHealConfig(target=target), {})
    kind = RoutedLoRALinear if target == "attention_routed" else PlainLoRALinear
    assert len(mods) == 4 * len(model.model.layers) and all(isinstance(m, kind) for m in mods.values())
    assert all(p.abs().sum() > 0 for n, p in mods[next(iter(mods))].named_parameters() if "lora_a" in n)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)
        for m in mods.values():  # a non-zero B does change the output: the wrappers are live
            m.lora_b.fill_(0.01)
        assert not torch.allclose(model(IDS).logits, want)


def test_each_token_uses_exactly_top_k_experts_with_weights_summing_to_one():
    mod = RoutedLoRALinear(nn.Linear(16, 8), experts=5, rank=2, top_k=2, scale=1.0)
    with torch.no_grad():
        mod.router.copy_(torch.randn(5, 16, generator=torch.Generator().manual_seed(0)))
    g = mod.gates(torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1)))
    assert g.shape == (2, 7, 5)
    assert torch.equal((g > 0).sum(-1), torch.full((2, 7), 2))
    assert torch.allclose(g.sum(-1), torch.ones(2, 7))
    assert len({tuple(r) for r in (g > 0).reshape(-1, 5).tolist()}) > 1  # routing depends on the token


def test_plain_lora_has_equal_trainable_parameters(pruned):
    model, _ = build_model(open_checkpoint(pruned))
    cfg = LoraHealConfig(target="attention_routed", lora_experts=4, lora_rank=8)
    names = targets(model, cfg.lora_modules)
    shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in names}
    routed = {n: 4 * 8 * (o + i) + 4 * i for n, (o, i) in shapes.items()}
    plain = {n: equal_rank(4, 8, i, o) * (o + i) for n, (o, i) in shapes.items()}
    for n, (o, i) in shapes.items():
        assert abs(plain[n] - routed[n]) <= (o + i) / 2, n
    _, p_routed = attach(model, cfg, {})
    model2, _ = build_model(open_checkpoint(pruned))
    _, p_plain = attach(model2, cfg.model_copy(update={"target": "attention"}), {})
    assert sum(p.numel() for p in p_routed) == sum(routed.values())
    assert sum(p.numel() for p in p_plain) == sum(plain.values())
    assert abs(sum(plain.values()) - sum(routed.values())) / sum(routed.values()) < 0.02


def test_routed_adapters_load_and_give_the_in_memory_students_logits(pruned, tmp_path, monkeypatch):
    from moecompress.training import stage

    kept = {}
    real = stage._parameters

    def spy(model, moes, cfg, ckpt):
        kept["model"] = model
        return real(model, moes, cfg, ckpt)

    monkeypatch.setattr(stage, "_parameters", spy)
    summary = _heal(pruned, tmp_path / "o", target="attention_routed")
    assert summary["target"] == "attention_routed" and summary["trainable_params"] > 0
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg[CONFIG_KEY]["kind"] == "lora_mixer" and (tmp_path / "o" / FILE).is_file()
    stored = load_file(tmp_path / "o" / FILE)
    assert any(k.endswith("lora_b") and v.abs().sum() > 0 for k, v in stored.items()), "training moved no B"
    assert torch.equal(load_file(tmp_path / "o" / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"],
                       load_file(pruned / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    loaded = mc.load(tmp_path / "o")
    assert type(loaded.model.layers[0].self_attn.q_proj) is RoutedLoRALinear
    assert nn.Linear.forward is torch.nn.modules.linear.Linear.forward  # composition, no patching
    base = mc.load(pruned)
    with torch.no_grad():
        want, got, before = kept["model"](IDS).logits, loaded(IDS).logits, base(IDS).logits
    tol = torch.finfo(torch.float32).eps * 64 * 3 * float(want.abs().max())
    assert (want - got).abs().max() <= tol
    assert (got - before).abs().max() > 100 * tol  # the adapters are what makes the difference


def test_plain_attention_lora_merges_into_a_stock_checkpoint(pruned, tmp_path, monkeypatch):
    from moecompress.training import stage

    kept = {}
    real = stage._parameters
    monkeypatch.setattr(stage, "_parameters", lambda m, *a: kept.setdefault("m", m) and real(m, *a))
    _heal(pruned, tmp_path / "o", target="attention")
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert CONFIG_KEY not in cfg and not (tmp_path / "o" / "adapters").exists()
    old, new = load_file(pruned / "model.safetensors"), load_file(tmp_path / "o" / "model.safetensors")
    assert not torch.equal(old["model.layers.0.self_attn.q_proj.weight"], new["model.layers.0.self_attn.q_proj.weight"])
    assert all(torch.equal(old[k], new[k]) for k in old if "self_attn" not in k)
    loaded = mc.load(tmp_path / "o")
    assert type(loaded.model.layers[0].self_attn.q_proj) is nn.Linear
    with torch.no_grad():
        want, got = kept["m"](IDS).logits, loaded(IDS).logits
    assert (want - got).abs().max() <= torch.finfo(torch.float32).eps * 64 * 3 * float(want.abs().max())


def test_a_missing_adapter_file_is_one_clear_line(pruned, tmp_path):
    _heal(pruned, tmp_path / "o", target="attention_routed", steps=1)
    shutil.rmtree(tmp_path / "o" / "adapters")
    with pytest.raises(CheckpointError) as err:
        mc.load(tmp_path / "o")
    assert "lora_mixer.safetensors" in str(err.value) and "\n" not in str(err.value)


def test_attention_targets_accept_layouts_that_expert_lora_refuses(pruned, tmp_path):
    steps = [{"rtn": {"bits": 4}}, {"lora_heal": {**SMALL, "target": "experts"}}]
    rec = {"model": str(pruned), "output": str(tmp_path / "x"), "calibration": CAL, "steps": steps}
    with pytest.raises(mc.MoecompressError, match="dense or ragged"):
        mc.apply(rec, dry_run=True, progress=False)
    steps[1]["lora_heal"]["target"] = "attention_routed"
    mc.apply(rec, dry_run=True, progress=False)


def test_unknown_attention_projection_names_the_field(pruned):
    model, moes = build_model(open_checkpoint(pruned))
    with pytest.raises(mc.MoecompressError, match=r"lora_modules.*qkv"):
        _parameters(model, moes, LoraHealConfig(target="attention", lora_modules=("qkv",)), open_checkpoint(pruned))


def test_a_later_per_layer_step_carries_the_routed_adapters(pruned, tmp_path):
    _heal(pruned, tmp_path / "o", target="attention_routed", steps=1)
    mc.apply({"model": str(tmp_path / "o"), "output": str(tmp_path / "q"), "calibration": CAL,
              "steps": [{"rtn": {"bits": 4}}]}, progress=False)  # fmt: skip
    assert (tmp_path / "q" / FILE).read_bytes() == (tmp_path / "o" / FILE).read_bytes()
    assert json.loads((tmp_path / "q" / "config.json").read_text())[CONFIG_KEY]["kind"] == "lora_mixer"
    loaded = mc.load(tmp_path / "q")
    assert type(loaded.model.layers[0].self_attn.q_proj) is RoutedLoRALinear


def test_an_adapter_block_naming_a_file_outside_is_refused(pruned, tmp_path):
    _heal(pruned, tmp_path / "o", target="attention_routed", steps=1)
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    cfg[CONFIG_KEY]["file"] = "../elsewhere.safetensors"
    (tmp_path / "o" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not a file inside the checkpoint"):
        open_checkpoint(tmp_path / "o").adapter_files()


def _spy_student(monkeypatch) -> dict:
    from moecompress.training import stage

    kept, real = {}, stage._parameters
    monkeypatch.setattr(stage, "_parameters", lambda m, *a: kept.setdefault("m", m) and real(m, *a))
    return kept


@pytest.fixture(scope="module")
def healed(pruned, tmp_path_factory):
    out = tmp_path_factory.mktemp("healed") / "o"
    _heal(pruned, out, target="attention_routed", steps=1)
    return out


@pytest.mark.parametrize("train_adapters", [True, False])
def test_a_distill_after_routed_lora_heal_trains_the_stored_adapters(healed, tmp_path, monkeypatch, train_adapters):
    kept = _spy_student(monkeypatch)
    step = {"distill": {**SMALL, "method": "sft", "train_adapters": train_adapters}}
    mc.apply({"model": str(healed), "output": str(tmp_path / "d"), "calibration": CAL, "steps": [step]},
             progress=False)  # fmt: skip
    assert type(kept["m"].model.layers[0].self_attn.q_proj) is RoutedLoRALinear  # in the training forward
    before, after = load_file(healed / FILE), load_file(tmp_path / "d" / FILE)
    assert set(before) == set(after)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert bool(moved) is train_adapters, moved
    assert json.loads((tmp_path / "d" / "config.json").read_text())[CONFIG_KEY]["modules"]
    loaded = mc.load(tmp_path / "d")
    with torch.no_grad():
        want, got = kept["m"](IDS).logits, loaded(IDS).logits
    assert (want - got).abs().max() <= torch.finfo(torch.float32).eps * 64 * 3 * float(want.abs().max())


def test_routed_lora_heal_twice_trains_the_same_adapters_on(healed, tmp_path):
    summary = _heal(healed, tmp_path / "p", target="attention_routed", method="sft", steps=1)
    before, after = load_file(healed / FILE), load_file(tmp_path / "p" / FILE)
    assert set(before) == set(after) and summary["trainable_params"] == sum(v.numel() for v in before.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(mc.MoecompressError, match="already has routed attention adapters"):
        _heal(healed, tmp_path / "q", target="attention", steps=1)


def test_load_balance_term_is_one_when_uniform_and_grows_when_routing_collapses():
    from moecompress.methods.lora import load_balance_loss

    uniform = torch.zeros(6, 3)  # p = 1/3 everywhere; 6 tokens x top-1 spread evenly over 3 experts
    assert torch.allclose(load_balance_loss(uniform, torch.tensor([[0], [1], [2], [0], [1], [2]])), torch.tensor(1.0))
    peaked = torch.tensor([[4.0, 0.0, 0.0]]).expand(6, 3)  # every token prefers expert 0
    got = load_balance_loss(peaked, torch.zeros(6, 1, dtype=torch.int64))
    p0 = torch.tensor([4.0, 0.0, 0.0]).softmax(0)[0]
    assert torch.allclose(got, 3 * p0) and got > 2.5
    logits = torch.randn(5, 4, requires_grad=True)
    load_balance_loss(logits, logits.topk(2, dim=-1).indices).backward()
    assert logits.grad.abs().sum() > 0  # trains the router through p-bar


def test_router_balance_loss_is_added_with_its_weight_and_moves_the_routers(pruned, tmp_path):
    on = _heal(pruned, tmp_path / "on", target="attention_routed", steps=1)
    off = _heal(pruned, tmp_path / "off", target="attention_routed", steps=1, lora_balance=0.0)
    assert on["lora_balance"] == 0.01 and off["lora_balance"] == 0.0 and off["balance_first"] is None
    assert on["balance_first"] >= 1.0  # >= 1, equality only for perfectly balanced routing
    assert on["loss_first"] == pytest.approx(off["loss_first"] + 0.01 * on["balance_first"], rel=1e-6)
    a, b = load_file(tmp_path / "on" / FILE), load_file(tmp_path / "off" / FILE)
    assert any(k.endswith(".router") and not torch.equal(a[k], b[k]) for k in a)
