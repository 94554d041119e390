"""tests/support/timings.py: a real pytest run (one test passes, one skips, one fails), alone and with two xdist
workers, writes every test's durations with the worker that ran it, says loudly what it did not run, and the
reader's tables add up; the scheduling order puts the longest scope first."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from support import timings
from support.runs import REPO

SAMPLE = """
import time
import pytest

def test_passes():
    time.sleep(0.2)

def test_skips():
    pytest.skip("this machine's cpuset is not writable")

def test_fails():
    assert False
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two workers"])
def test_a_run_records_every_test_and_names_what_it_did_not_run(tmp_path, workers):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    out = tmp_path / "durations"
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "timings", "-p", "no:randomly", "-p", "no:cacheprovider",
                             *workers, "test_sample.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests" / "support"),
                                 "HPCML_TIMINGS_DIR": str(out)})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]  # (the failing test)
    assert "NOT RUN: test_sample.py::test_skips: this machine's cpuset is not writable" in result.stdout, result.stdout
    assert "hpcml: 3 tests in " in result.stdout
    record = json.loads((out / "latest.json").read_text())
    tests = {test["nodeid"]: test for test in record["tests"]}
    assert {name: test["outcome"] for name, test in tests.items()} == {
        "test_sample.py::test_passes": "passed", "test_sample.py::test_skips": "skipped", "test_sample.py::test_fails": "failed"}
    assert tests["test_sample.py::test_passes"]["call"] >= 0.2
    assert all({"setup", "teardown", "worker", "kind"} <= set(test) for test in tests.values())
    assert record["meta"]["not_run"] == [{"test": "test_sample.py::test_skips", "reason": "this machine's cpuset is not writable"}]
    assert record["meta"]["calibration_s"] > 0 and record["meta"]["wall_s"] > 0.2
    expected_workers = {"gw0", "gw1"} if workers else {"main"}
    assert {test["worker"] for test in tests.values()} <= expected_workers and set(record["meta"]["workers"]) <= expected_workers
    by_module = timings.by(record, timings.module)
    assert by_module["test_sample.py"][0] == 3
    assert by_module["test_sample.py"][1] == pytest.approx(sum(map(timings.seconds, tests.values())) / 60)


def test_the_longest_scope_starts_first_and_a_scope_keeps_its_order():
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in (
        "tests/test_a.py::test_1", "tests/test_parity.py::TestX::test_l[1]", "tests/test_a.py::test_2",
        "tests/test_b.py::test_1", "tests/test_parity.py::TestX::test_l[2]")]
    timings.longest_scopes_first(items, {"tests/test_a.py": 10.0, "tests/test_parity.py::TestX": 300.0})
    assert [item.nodeid for item in items] == [
        "tests/test_parity.py::TestX::test_l[1]", "tests/test_parity.py::TestX::test_l[2]",  # 300 s
        "tests/test_b.py::test_1",  # not timed yet: UNKNOWN_SCOPE_S (60 s)
        "tests/test_a.py::test_1", "tests/test_a.py::test_2"]  # 10 s
