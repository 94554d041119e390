"""The harness in layers: no module imports one above it (no cycle), and the model imports no harness."""

from __future__ import annotations

import sys
from pathlib import Path


from support.runs import REPO

sys.path.insert(0, str(REPO / "recipes"))


# The harness in layers: a module imports only modules of lower layers (function-level imports included), so
# the graph has no cycle and a reader can start at the bottom. recipes/gpt.py, the model, imports no harness.
HARNESS_LAYERS = {
    "errors": 0, "contract": 0,
    "checkpoint": 1, "faults": 1, "outcome": 1, "image_checks": 1, "launch": 1, "memory": 1, "mounts": 1,
    "tracking": 1,
    "signals": 2, "metrics": 2, "profiling": 2,
    "hf_model": 3, "run": 3,
    "model": 4,
    "data": 5,
    "cli": 6,
    "__init__": 7,
}


def harness_imports(path: Path) -> set[str]:
    """The harness modules ``path`` imports, anywhere in it (relative imports: from .x, from . import x)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {alias.name for alias in node.names}
    return found


def test_the_harness_imports_only_downward_and_the_model_not_at_all():
    modules = {path.stem: path for path in (REPO / "recipes" / "harness").glob("*.py")}
    assert set(modules) == set(HARNESS_LAYERS), "a harness module without a layer: add it to HARNESS_LAYERS"
    upward = {(name, imported) for name, path in modules.items() for imported in harness_imports(path)
              if HARNESS_LAYERS[imported] >= HARNESS_LAYERS[name]}
    assert not upward, f"imports at or above the importer's layer: {sorted(upward)}"
    gpt = (REPO / "recipes" / "gpt.py").read_text()
    assert "harness" not in {line.split()[1].split(".")[0] for line in gpt.splitlines() if line.startswith(("import ", "from "))}
