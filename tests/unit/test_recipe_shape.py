"""tools/recipe_shape.py counts what it says it counts: code lines without docstrings, comments and imports;
main's length; line lengths. And it measures every recipe, now and at an earlier commit."""

from __future__ import annotations

import sys

from support.runs import REPO

sys.path.insert(0, str(REPO / "tools"))
from recipe_shape import recipe_sources, shape  # noqa: E402

SAMPLE = '''"""A recipe.

Launch: python train.py
"""
import torch
from pathlib import (
    Path,
)


def main() -> int:
    """Train."""
    # a comment
    model = torch.nn.Linear(2, 2)

    return 0  # done
''' + "x = '" + "y" * 120 + "'\n"


def test_it_counts_code_not_docstrings_comments_or_imports():
    measured = shape(SAMPLE)
    # code: def main, model = ..., return 0, x = ... (the docstrings, the comment and the imports are not)
    assert measured["code_lines"] == 4 and measured["main_lines"] == 6
    written = [line for line in SAMPLE.splitlines() if line.strip()]
    assert measured["over_100"] == round(1 / len(written), 3)
    assert measured["mean_line_length"] == round(sum(map(len, written)) / len(written), 1)


def test_every_recipe_is_measured_now_and_at_a_commit():
    recipes = {path.parent.name for path in (REPO / "recipes").glob("*/train.py")}
    assert set(recipe_sources(None)) == recipes
    assert set(recipe_sources("HEAD")) == recipes  # (the committed files, by git show)
