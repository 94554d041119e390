"""The documentation: the site builds strictly, shows its data files as they are, and names only what exists.

- `mkdocs build --strict` (the pinned MkDocs and Material of requirements/docs.txt, in .venv-docs): a broken
  link, a missing page or an anchor that is not there fails the build;
- "what has run where" is docs/validated.toml, rendered into docs/validated.md by docs/hooks.py: every row
  of the file is on the built page, and no other page says what has or has not run (the scan is shown to
  catch such a sentence);
- the benchmark tables on the site are bench/RESULTS.md and bench/data_loader.md as the benchmarks wrote them
  (included, not copied);
- every repository path the README and the pages name exists (`make` targets: tests/test_workflows.py);
- the README stays short (≤ 250 lines), and every page is in the site's navigation.
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from support.runs import REPO

DOCS = REPO / "docs"
MKDOCS = REPO / ".venv-docs" / "bin" / "mkdocs"
PAGES = sorted(DOCS.rglob("*.md"))
# Sentences that say where something has or has not run belong in docs/validated.toml only.
RAN_CLAIM = re.compile(r"\b(?:has|have|had) (?:not |never )?(?:yet )?(?:been )?(?:run|built)\b|\bnot yet run\b|\bnever run\b"
                       r"|\buntested\b|\bnot built here\b|\bran on (?:a|one|\d+) (?:GPU|H100|H200|A100)", re.IGNORECASE)
RAN_CLAIM_ALLOWED = {DOCS / "validated.md"}
# A path in code that starts at one of the repository's top-level entries.
TOP_LEVEL = ("recipes/", "slurm/", "containers/", "tests/", "bench/", "docs/", "requirements/", ".ci/", ".github/")
PATH_IN_CODE = re.compile(r"(?<![\w/.$-])((?:" + "|".join(re.escape(t) for t in TOP_LEVEL) + r")[\w./-]*\w)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    assert MKDOCS.exists(), "no .venv-docs: run `make venv-docs` (make test does)"
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(out)], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "WARNING" not in result.stderr, result.stderr
    return out


def page_text(site: Path, page: str) -> str:
    """The visible text of a built page, tags dropped and entities decoded."""
    body = (site / page / "index.html").read_text() if page else (site / "index.html").read_text()
    body = body[body.index("<article"):body.index("</article>")]
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", body)))


def test_the_site_builds_strictly_with_every_page_in_its_navigation(site):
    nav = (REPO / "mkdocs.yml").read_text()
    for page in PAGES:
        assert f": {page.relative_to(DOCS)}" in nav, f"{page.relative_to(REPO)} is not in mkdocs.yml's nav"
        built = site / ("" if page.name == "index.md" else page.relative_to(DOCS).with_suffix("").as_posix()) / "index.html"
        assert built.exists(), built


def test_what_has_run_where_is_the_data_file_as_it_is(site):
    record = tomllib.loads((DOCS / "validated.toml").read_text())
    assert record["ran"] and record["not_yet"] and record["test_run"]
    shown = page_text(site, "validated")
    for run in record["ran"]:
        for key in ("recipe", "runtime", "hardware", "date", "commit", "what", "figure"):
            assert str(run[key]) in shown, (key, run[key])
    for item in record["not_yet"]:
        assert item["what"] in shown and item["check"] in shown, item
    assert "<!-- validated -->" not in (site / "validated" / "index.html").read_text()
    timings = page_text(site, "tests")
    for run in record["test_run"]:
        assert run["where"] in timings and run["commit"] in timings, run


def ran_claims(text: str) -> list[str]:
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"what has run (?:so far, and what has not, is in|where)", "", text, flags=re.IGNORECASE)  # the pointer
    return [m.group(0) for m in RAN_CLAIM.finditer(text)]


def test_no_other_page_says_what_has_or_has_not_run():
    # The scan catches such a sentence (a negative control for the check itself):
    assert ran_claims("The FSDP config has not run anywhere yet.") and ran_claims("Nothing has run on a GPU yet; untested.")
    assert ran_claims("the cuda flavor has not been built") and not ran_claims("each run reports its world size")
    assert not ran_claims("see [What has run\nwhere](validated.md)")
    found = {str(page.relative_to(REPO)): ran_claims(page.read_text())
             for page in [REPO / "README.md", *PAGES] if page not in RAN_CLAIM_ALLOWED}
    assert {page: claims for page, claims in found.items() if claims} == {}, \
        "say it in docs/validated.toml (the 'What has run where' page) instead"


def test_the_benchmark_tables_are_the_results_file_included(site):
    results = (REPO / "bench" / "RESULTS.md").read_text()
    source = (DOCS / "benchmarks.md").read_text()
    assert "<!-- include bench/RESULTS.md -->" in source and "| deepspeed" not in source  # included, not copied
    shown = page_text(site, "benchmarks")
    for row in (line for line in results.splitlines() if line.startswith("| ") and "---" not in line):
        first_cell = row.split("|")[1].strip().replace("`", "")
        assert first_cell in shown, first_cell


def test_the_data_loader_table_is_its_results_file_included(site):
    """docs/real-data.md includes bench/data_loader.md, which is bench/data_loader.py's rendering of the committed
    bench/data_loader.json (a figure edited by hand, or a JSON replaced without its table, fails here)."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    from data_loader import markdown

    result = json.loads((REPO / "bench" / "data_loader.json").read_text())
    assert result["meta"]["mode"] == "full"
    assert markdown(result) == (REPO / "bench" / "data_loader.md").read_text()
    assert "<!-- include bench/data_loader.md -->" in (DOCS / "real-data.md").read_text()
    shown = page_text(site, "real-data")
    assert f"{result['training_tokens_per_s']:,.0f}" in shown and f"{result['loader']['cold']['tokens_per_s']:,.0f}" in shown


def test_the_fit_table_is_its_results_file_included(site):
    """docs/which-parallelism.md includes bench/fit_table.md, bench/fit_table.py's rendering of the committed
    bench/fit_table.json: Llama-3-8B and -70B, each layout with and without activation checkpointing."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    from fit_table import LAYOUTS, table

    result = json.loads((REPO / "bench" / "fit_table.json").read_text())
    assert table(result) == (REPO / "bench" / "fit_table.md").read_text()
    assert {(row["model"], row["nodes"]) for row in result["rows"]} == {(model, nodes) for model, nodes, _ in LAYOUTS}
    assert "<!-- include bench/fit_table.md -->" in (DOCS / "which-parallelism.md").read_text()
    shown = page_text(site, "which-parallelism")
    assert "Llama-3-70B" in shown and f"{result['rows'][0]['gpu_bytes'] / 2**30:.1f} GiB" in shown


def paths_named(text: str) -> set[str]:
    code = re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
    named = set()
    for snippet in code:
        for path in PATH_IN_CODE.findall(snippet):
            if not re.search(r"[<>*{}$]|IMAGE|NAME|XXXX|/R\b|rank_$", path):  # placeholders and patterns
                named.add(path.rstrip("."))
    return named


def test_every_path_the_readme_and_the_docs_name_exists():
    assert {"recipes/ddp/train.py", "slurm/ddp.sh"} <= paths_named("`recipes/ddp/train.py` and\n```bash\nsbatch slurm/ddp.sh\n```")
    missing = {}
    for page in [REPO / "README.md", *PAGES]:
        absent = sorted(p for p in paths_named(page.read_text()) if not (REPO / p).exists())
        if absent:
            missing[str(page.relative_to(REPO))] = absent
    assert missing == {}


def test_the_readme_is_short_and_links_to_the_pages():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    assert all((REPO / link).exists() for link in linked), linked
    assert {"docs/perlmutter.md", "docs/validated.md", "docs/tests.md", "docs/your-model-and-data.md"} <= linked
