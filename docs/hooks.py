"""MkDocs hooks: pages that show data files instead of copies of them.

- `<!-- validated -->` becomes the tables of docs/validated.toml (what has run where), `<!-- test-runs -->` its
  record of how long the test suite took;
- `<!-- include PATH -->` becomes the text of PATH (a results table a benchmark wrote, e.g. bench/RESULTS.md),
  with its first heading dropped (the page has its own).
The test suite builds the site with --strict and checks that the pages show exactly these files.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INCLUDE = re.compile(r"<!-- include (\S+) -->")


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def validated_tables(path: Path = REPO / "docs" / "validated.toml") -> str:
    record = tomllib.loads(path.read_text())
    lines = ["| recipe | runtime | hardware | date | commit | what ran | figure |", "|---|---|---|---|---|---|---|"]
    for run in record["ran"]:
        commit = f"`{run['commit']}`" + (" (recorded)" if run.get("recorded") else "")
        lines.append("| " + " | ".join(cell(v) for v in (run["recipe"], run["runtime"], run["hardware"], run["date"]))
                     + f" | {commit} | {cell(run['what'])} | {cell(run['figure']) or '–'} |")
    lines += ["", "Not yet run where it must, and the command that checks it (more in [GPU checks](gpu-checks.md)):", "",
              "| not yet | check |", "|---|---|"]
    lines += [f"| {cell(item['what'])} | `{item['check']}` |" for item in record["not_yet"]]
    return "\n".join(lines)


def test_run_table(path: Path = REPO / "docs" / "validated.toml") -> str:
    lines = ["| where | date | commit | tests | set-up | suite | in all |", "|---|---|---|---|---|---|---|"]
    for run in tomllib.loads(path.read_text())["test_run"]:
        setup, suite = run.get("setup_min"), run.get("suite_min")
        total = run.get("total_min", (setup or 0) + (suite or 0))
        minutes = lambda value: f"{value:.1f} min" if value is not None else "–"  # noqa: E731
        lines.append(f"| {cell(run['where'])} | {run['date']} | `{run['commit']}` | {run['tests']} | {minutes(setup)} | "
                     f"{minutes(suite)} | **{total:.1f} min** |")
    return "\n".join(lines)


def included(match: re.Match) -> str:
    text = (REPO / match.group(1)).read_text()
    return re.sub(r"\A# .*\n", "", text)


def on_page_markdown(markdown: str, **_) -> str:
    markdown = markdown.replace("<!-- validated -->", validated_tables()).replace("<!-- test-runs -->", test_run_table())
    return INCLUDE.sub(included, markdown)
