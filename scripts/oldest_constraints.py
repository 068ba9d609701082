"""Print pip constraints pinning the torch-independent dependencies to the oldest releases
``pyproject.toml`` allows (CI's lane 3 installs with them, so the lower bounds stay true)::

    python scripts/oldest_constraints.py > constraints.txt && pip install -e . -c constraints.txt

Each pinned dependency must have a ``>=`` lower bound; one without is an error, not a silent skip.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PINNED = ("transformers", "safetensors", "huggingface_hub", "pydantic", "numpy")


def oldest(pyproject: Path) -> dict[str, str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    found = {}
    for dep in deps:
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", dep)
        if m and m.group(1).replace("-", "_").lower() in PINNED:
            found[m.group(1)] = m.group(2)
    missing = [p for p in PINNED if p not in {k.replace("-", "_").lower() for k in found}]
    if missing:
        raise SystemExit(f"pyproject.toml: no '>=' lower bound for {missing}")
    return found


def main() -> int:
    for name, version in oldest(Path(__file__).resolve().parents[1] / "pyproject.toml").items():
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
