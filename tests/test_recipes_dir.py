"""Every example recipe in recipes/ parses and dry-runs (on a tiny checkpoint of the same family)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import save_tiny

import moecompress as mc
from moecompress.engine.recipe import load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def test_there_are_example_recipes():
    assert len(RECIPES) >= 2


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_parses_and_dry_runs(tmp_path, path):
    save_tiny("qwen3_moe", tmp_path / "m")
    overrides = [f"model={tmp_path / 'm'}", f"output={tmp_path / 'out'}", "calibration.source=random"]
    recipe = load_recipe(path, overrides)
    assert recipe.steps
    res = mc.apply(path, overrides, dry_run=True, progress=False)
    assert res.dry_run and res.report["dry_run"]["moe_layers"] == [0, 1, 2]
    assert not (tmp_path / "out").exists()
