#!/usr/bin/env python
"""The walk of one recipe step's config through the engine, from ``executor.apply`` to the writer
(issue 37: "a newcomer cannot see where a layer's work happens").

A tiny Qwen3-MoE checkpoint is compressed with one step (``rtn``) by chunks of experts (``--chunk``, 0:
whole layers) while ``sys.setprofile`` watches every Python call. The *walk* is the sequence of calls into
``moecompress`` whose arguments hold the step (a ``Step``, a list of them or the step's config object),
from ``executor.apply`` until the first routed-expert tensor of the step reaches ``ShardWriter``; the
writer's file ends it. A function counts once, at its first entry (the loops over layers and steps
repeat the same walk), and a method whose only hold on the step is ``self`` (the step's accessors) is
not a place the step travels to. Reported, over that sequence with consecutive calls in one file collapsed:

- ``files``: distinct files of the walk;
- ``returns``: entries into a file the walk had already left;
- ``climbs``: entries into a file from a walk parent (the nearest enclosing call of the walk) whose file
  the entered file imports (transitively, module-level imports): a lower module calling back into a
  higher one;
- the same three from the layer loop on (``stream_layers``'s first call), the part a layer's work takes.

    python benchmarks/config_walk.py [--chunk 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_of(path: Path, pkg: Path) -> str | None:
    try:
        rel = path.resolve().relative_to(pkg.resolve().parent)
    except ValueError:
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph(pkg: Path) -> dict[str, set[str]]:
    """Module → the moecompress modules it imports at module level (``from x import y`` counts ``x`` and,
    when ``x.y`` is a module, ``x.y``)."""
    files = {}
    for f in pkg.rglob("*.py"):
        mod = _module_of(f, pkg)
        if mod is not None:
            files[mod] = f
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        deps: set[str] = set()
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module in files:
                    deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in files}
        graph[mod] = deps
    return graph


def imports_transitively(graph: dict[str, set[str]], a: str, b: str) -> bool:
    """Whether module ``a`` imports ``b``, directly or through others."""
    seen, todo = set(), [a]
    while todo:
        m = todo.pop()
        for d in graph.get(m, ()):
            if d == b:
                return True
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return False


def measure(walk: list[tuple[str, bool]]) -> dict:
    """``walk``: (module, climb) per move of the reader, in order; ``climb``: a call into a module that
    imports its caller's."""
    seq: list[str] = []
    climbs = 0
    for mod, climb in walk:
        climbs += climb
        if not seq or seq[-1] != mod:
            seq.append(mod)
    seen: set[str] = set()
    returns = 0
    for mod in seq:
        returns += mod in seen
        seen.add(mod)
    return {"files": len(seen), "returns": returns, "climbs": climbs, "sequence": seq}


def trace(chunk: int, root: Path, graph: dict[str, set[str]]) -> tuple[list, int]:
    from tiny import save_tiny  # tests/tiny.py: the tests' tiny checkpoints

    import moecompress as mc
    from moecompress.engine.recipe import Step

    model = root / "model"
    save_tiny("qwen3_moe", model)
    steps = [{"rtn": {"bits": 4, "group_size": 16}}]
    rec = {"model": str(model), "output": str(root / "out"), "steps": steps, "expert_chunk": chunk or "off",
           "calibration": {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 4,
                           "cache_dir": str(root / "cache")}}  # fmt: skip
    pkg = Path(mc.__file__).resolve().parent
    walk: list[tuple[str, bool]] = []
    stack: list[tuple[object, str]] = []  # the moecompress frames now running: (frame, module)
    shown: list[tuple[object, str]] = []  # the stack at the reader's last stop
    configs: list = []
    entered: set = set()
    state = {"done": False, "loop_at": -1}

    def carries(frame) -> bool:
        for k, v in frame.f_locals.items():
            if k == "self":  # the step's own accessors (``label``, ``spec``, ...): not a place it travels to
                continue
            if isinstance(v, Step):
                return True
            if isinstance(v, (list, tuple)) and v and all(isinstance(x, Step) for x in v):
                return True
            if configs and any(v is c for c in configs):
                return True
        return False

    def stop() -> None:
        """The reader goes from the last stop to this one: up to the common caller, then down."""
        p = 0
        while p < min(len(shown), len(stack)) and shown[p][0] is stack[p][0]:
            p += 1
        if p < len(shown) and p > 0:
            walk.append((stack[p - 1][1], False))
        for i in range(p, len(stack)):
            caller = stack[i - 1][1] if i > 0 else None
            mod = stack[i][1]
            walk.append((mod, caller is not None and caller != mod and imports_transitively(graph, mod, caller)))
        shown[:] = stack

    def prof(frame, event, arg):
        if state["done"]:
            return
        if event == "call":
            f = Path(frame.f_code.co_filename)
            mod = _module_of(f, pkg) if f.suffix == ".py" else None
            if mod is None:
                return
            stack.append((frame, mod))
            name = frame.f_code.co_name
            if mod == "moecompress.io.writer" and name in ("add", "append") and "experts" in str(
                frame.f_locals.get("name", "")
            ):
                stop()
                state["done"] = True
                return
            if mod == "moecompress.engine.layer_loop" and name == "stream_layers" and state["loop_at"] < 0:
                stop()
                state["loop_at"] = len(walk) - 1
            key = (mod, frame.f_code.co_firstlineno)
            if key in entered:  # loops over layers and steps: each function counts at its first entry
                return
            if (name == "apply" and mod == "moecompress.engine.executor" and not walk) or carries(frame):
                entered.add(key)
                if not configs:
                    for v in frame.f_locals.values():
                        for s in v if isinstance(v, (list, tuple)) else [v]:
                            if isinstance(s, Step):
                                configs.append(s.config)
                stop()
        elif event == "return" and stack and stack[-1][0] is frame:
            stack.pop()

    sys.setprofile(prof)
    try:
        mc.apply(rec, progress=False)
    finally:
        sys.setprofile(None)
    return walk, state["loop_at"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=2, help="experts per chunk (0: whole layers)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import moecompress as mc

    graph = import_graph(Path(mc.__file__).resolve().parent)
    with tempfile.TemporaryDirectory() as d:
        walk, loop_at = trace(args.chunk, Path(d), graph)
    out = {"chunk": args.chunk, "whole": measure(walk),
           "layer_loop": measure(walk[loop_at:]) if loop_at >= 0 else None}  # fmt: skip
    for part in ("whole", "layer_loop"):
        m = out[part]
        if m:
            print(f"{part}: {m['files']} files, {m['returns']} returns, {m['climbs']} climbs")
            print("   " + " → ".join(x.removeprefix("moecompress.") for x in m["sequence"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
