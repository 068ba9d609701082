"""The package's shape: no import cycle (imports inside functions counted), method maths free of engine
types, explicit tables instead of registration, and a folder tree that equals the one the docs show."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

import moecompress.layouts as layouts_pkg
from moecompress.engine.spec import PassSpec
from moecompress.layouts.base import Layout
from moecompress.passes import BUILTIN_PASSES, BUILTIN_STAGES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"moecompress": ROOT / "moecompress", "moecompress.kernels": ROOT / "kernels",
            "moecompress.calibration": ROOT / "calibration"}  # fmt: skip
OPTIONAL = {"tensorly", "matplotlib", "compressed_tensors", "datasets", "triton", "lm_eval", "accelerate"}
LAZY_OK = {"moecompress.cli"}  # the CLI loads its commands lazily (start-up time)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for f in root.rglob("*.py"):
            parts = [p for p in f.relative_to(root).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod: str, path: Path) -> list[tuple[str, bool, str]]:
    """``(imported module or top-level name, inside a function, raw name)`` for every import of ``mod``."""
    tree = ast.parse(path.read_text())
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                for a in child.names:
                    found.append((_resolve(a.name) or a.name, inner, a.name))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package
                    for _ in range(child.level - 1):
                        up = up.rpartition(".")[0]
                    base = f"{up}.{base}" if base else up
                for a in child.names:
                    target = _resolve(f"{base}.{a.name}") or _resolve(base)
                    found.append((target or base, inner, base))
            visit(child, inner)

    visit(tree, False)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_the_package_has_no_import_cycle():
    edges = defaultdict(set)
    for m, imps in GRAPH.items():
        for target, nested, _ in imps:
            if target in MODULES and target != m and not (nested and m in LAZY_OK):
                edges[m].add(target)
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def strong(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in MODULES:
        if v not in index:
            strong(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_graph_sees_imports_inside_functions():
    """The checker itself: a function-level import is an edge (so a hidden cycle cannot pass)."""
    nested = [(m, t) for m, imps in GRAPH.items() for t, inner, _ in imps if inner and t in MODULES]
    assert nested, "no function-level import found at all: the AST walk is broken"


def test_optional_dependencies_are_imported_only_inside_functions():
    bad = [(m, raw) for m, imps in GRAPH.items() for _, nested, raw in imps
           if raw.split(".")[0] in OPTIONAL and not nested]  # fmt: skip
    assert not bad, f"optional dependencies imported at module level (breaks the core install): {bad}"


def test_method_maths_is_free_of_engine_types():
    for m, imps in GRAPH.items():
        if m.startswith("moecompress.methods"):
            engine = [t for t, _, _ in imps if t.startswith(("moecompress.engine", "moecompress.passes"))]
            assert not engine, f"{m} imports {engine}"
            assert "PassError" not in MODULES[m].read_text(), f"{m} raises PassError (use MethodError)"


LOWER = ("moecompress.ir", "moecompress.layouts", "moecompress.reference", "moecompress.adapters", "moecompress.io",
         "moecompress.calibration")  # fmt: skip
UPPER = ("moecompress.engine", "moecompress.passes", "moecompress.runtime", "moecompress.report", "moecompress.hub",
         "moecompress.tools")  # fmt: skip


def test_lower_layers_do_not_import_upper_ones():
    for m, imps in GRAPH.items():
        if m.startswith(LOWER):
            up = [t for t, _, _ in imps if t.startswith(UPPER)]
            assert not up, f"{m} imports {up}"
        if m.startswith("moecompress.passes"):
            engine = [t for t, _, _ in imps if t.startswith("moecompress.engine") and t != "moecompress.engine.spec"]
            assert not engine, f"{m} sees the engine beyond engine.spec: {engine}"


def test_no_registration_by_import_side_effect():
    for m, path in MODULES.items():
        text = path.read_text()
        assert not re.search(r"^\w+\[[^\]]+\]\s*=", text, re.M), f"{m} writes into a module-level table"
        assert "register_pass" not in text, m


def test_the_tables_list_every_pass_and_layout():
    pass_files = {p.stem for p in (ROOT / "moecompress" / "passes").glob("*.py")} - {
        "__init__", "neuron_pruning", "expert_merging", "merge_budget", "merge_plan", "merge_units", "tdmoe_chunks",
        "codequant_chunks"}  # fmt: skip
    modules = {spec.fn.__module__.rpartition(".")[2] for spec in [*BUILTIN_PASSES.values(), *BUILTIN_STAGES.values()]}
    assert modules == pass_files, "every pass file has its SPEC in BUILTIN_PASSES (or BUILTIN_STAGES)"
    assert all(isinstance(s, PassSpec) and name == s.name for name, s in BUILTIN_PASSES.items())
    layout_files = {p.stem for p in (ROOT / "moecompress" / "layouts").glob("*.py")} - {"__init__", "base", "bitpack"}
    kinds = {cls.__module__.rpartition(".")[2] for cls in layouts_pkg.LAYOUTS.values()}
    assert kinds == layout_files and all(issubclass(c, Layout) for c in layouts_pkg.LAYOUTS.values())


def _documented_tree() -> tuple[set[str], set[str]]:
    """``(directories, files)`` named in the ``text`` block under '## The tree' of docs/architecture.md:
    a line starting with ``name/`` opens a directory at its indentation (two spaces a level), other
    names ending in ``.py`` are files of the directory above them; ``#`` starts a comment."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc.split("## The tree", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    dirs, files, stack = set(), set(), []
    for line in block.splitlines():
        code = line.split("#", 1)[0].rstrip()
        if not code.strip():
            continue
        depth, tokens = (len(code) - len(code.lstrip())) // 2, code.split()
        if tokens[0].endswith("/"):
            stack = [*stack[:depth], tokens[0].rstrip("/")]
            dirs.add("/".join(stack) + "/")
            base, tokens = stack, tokens[1:]
        else:
            base = stack[:depth]
        files |= {"/".join([*base, t]) for t in tokens if t.endswith(".py")}
    return dirs, files


def test_the_documented_tree_equals_the_real_one():
    dirs, files = _documented_tree()
    real = {str(f.relative_to(ROOT)) for top in ("moecompress", "kernels", "calibration") for f in (ROOT / top).rglob("*.py")}
    real_dirs = {str(Path(f).parent) + "/" for f in real}
    assert files == real, f"missing from the docs: {sorted(real - files)}; not in the tree: {sorted(files - real)}"
    assert dirs == real_dirs, f"directories: missing {sorted(real_dirs - dirs)}, extra {sorted(dirs - real_dirs)}"


@pytest.mark.parametrize("name", sorted(BUILTIN_PASSES))
def test_every_pass_documents_itself(name):
    spec = BUILTIN_PASSES[name]
    doc = __import__(spec.fn.__module__, fromlist=["_"]).__doc__ or ""
    assert "Example step" in doc and "statistics" in doc.lower(), f"{name}: docstring lacks the example or statistics"
    assert spec.summary, f"{name}: the pass function needs a one-line docstring"
