"""megatron-core on CPU runs through recipes/megatron_tp_pp/cpu_placement_shim.py, which rewrites CUDA placements
and records where. Every site it rewrote must be on the checked-in allow-list (tests/megatron_shim_sites.txt),
and every entry there must still be needed by some run: the tests that run megatron (test_parity.py's megatron
rows, test_megatron.py's resume and bf16 runs, on whichever test workers) record the sites their runs saw and
that they passed in $HPCML_TEST_RUN_DIR, and conftest checks the list once, at the end of the whole run,
when every one of them passed."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

from support.curves import PARITY_TABLE
from support.runs import REPO

ALLOW_LIST = REPO / "tests" / "megatron_shim_sites.txt"
RUN_DIR_ENV = "HPCML_TEST_RUN_DIR"  # one directory per test run, shared by its workers (conftest sets it)


def allowed() -> set[str]:
    lines = (line.strip() for line in ALLOW_LIST.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def covering_tests() -> set[str]:
    """Every megatron row of the parity table, and test_megatron.py's resume, async-checkpoint and bf16 tests."""
    rows = tomllib.loads(PARITY_TABLE.read_text())["layouts"]
    return {row["id"] for row in rows if row["recipe"] == "megatron_tp_pp"} | {"resume", "async-checkpoint", "bf16"}


def _record(**entry) -> None:
    if os.environ.get(RUN_DIR_ENV):
        with open(Path(os.environ[RUN_DIR_ENV]) / "megatron-shim.jsonl", "a") as out:
            out.write(json.dumps(entry) + "\n")


def check_sites(metrics: dict) -> None:
    """The shim was on, and rewrote only sites on the allow-list (recorded for the end-of-run check)."""
    assert metrics["cpu_placement_shim"] is True
    sites = set(metrics["cpu_placement_shim_sites"])
    _record(seen=sorted(sites))
    unexpected = sites - allowed()
    assert not unexpected, (f"megatron-core made CUDA assumptions the shim is not allowed to rewrite: {sorted(unexpected)}; "
                            f"check that each is placement only, then add it to {ALLOW_LIST.name}")


def covered(test: str) -> None:
    """``test`` (a covering test) passed."""
    _record(covered=test)


def unused_entries(run_dir: Path) -> list[str] | None:
    """The allow-list entries no run of this test run needed; None when not every covering test passed
    (a subset of the suite, or a failure: nothing to conclude)."""
    path = run_dir / "megatron-shim.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if {entry["covered"] for entry in entries if "covered" in entry} < covering_tests():
        return None
    seen = {site for entry in entries for site in entry.get("seen", [])}
    return sorted(allowed() - seen)
