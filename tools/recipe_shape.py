"""How each recipe's train.py reads, by measures anyone can recount: rerun after a change to a recipe.

    python tools/recipe_shape.py                       # every recipe, as a table
    python tools/recipe_shape.py --json                # the same, as JSON
    python tools/recipe_shape.py --at 5386f11          # the recipes as they were at a commit (git show)

Code lines: not blank, not a comment, not a docstring, not an import. main's lines: its first to its last
line. The mean line length and the share of lines over 100 characters are of all non-blank lines.
(Which share of the code is about the framework is a reader's judgement, not counted here.)
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def skipped_lines(tree: ast.Module) -> set[int]:
    """The lines of docstrings and imports."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found |= set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return found


def shape(source: str) -> dict:
    tree = ast.parse(source)
    skipped = skipped_lines(tree)
    lines = source.splitlines()
    code = [text for number, text in enumerate(lines, start=1)
            if text.strip() and not text.strip().startswith("#") and number not in skipped]
    main = next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"), None)
    written = [line for line in lines if line.strip()]
    return {"code_lines": len(code), "main_lines": (main.end_lineno - main.lineno + 1) if main else None,
            "mean_line_length": round(sum(len(line) for line in written) / len(written), 1),
            "over_100": round(sum(len(line) > 100 for line in written) / len(written), 3)}


def recipe_sources(commit: str | None) -> dict[str, str]:
    if commit is None:
        return {path.parent.name: path.read_text() for path in sorted((REPO / "recipes").glob("*/train.py"))}
    listed = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", "-r", commit, "recipes"],
                            capture_output=True, text=True, check=True).stdout.split()
    return {Path(name).parent.name: subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{name}"],
                                                   capture_output=True, text=True, check=True).stdout
            for name in listed if name.endswith("/train.py") and name.count("/") == 2}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--at", default=None, metavar="COMMIT", help="the recipes as they were at COMMIT")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = {name: shape(source) for name, source in recipe_sources(args.at).items()}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print("| recipe | code lines | main's lines | mean line length | lines over 100 |")
    print("|---|---:|---:|---:|---:|")
    for name, row in result.items():
        print(f"| {name} | {row['code_lines']} | {row['main_lines']} | {row['mean_line_length']} | {row['over_100']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
