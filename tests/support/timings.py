"""Where a test run's time went: every test's set-up, call and tear-down, the worker it ran on, the tier's total
against its budget, and a fixed CPU benchmark of the machine, so that two runs on two machines can be compared.

conftest.py wires it into pytest: each run writes runs/test-durations/<time>.json (and latest.json) and prints
one line with the total. To read a record:

    python tests/support/timings.py runs/test-durations/latest.json            # minutes by module and by kind
    python tests/support/timings.py OLD.json NEW.json                          # the same, before and after
    python tests/support/timings.py --write-scopes RECORD.json                 # tests/scope_durations.json

The tests are scheduled longest scope first from tests/scope_durations.json (a whole default-tier run's record,
committed so that a new machine schedules as well as an old one).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

# The default tier's budget on a fresh clone (CI stops a run at 90 min; set-up comes on top). Printed, not
# enforced: a slow machine is not a failing test. The calibration below says how slow the machine was.
BUDGET_MIN = {"warm": 35.0, "cold": 45.0}
KINDS = ("containers", "slurm", "tensorflow")  # a test's kind: the first of its markers found here, else "unit"


def calibrate() -> float:
    """Seconds a fixed single-core workload takes (pure Python and hashing): ~0.3 s on this project's 2-core
    machines when idle. A run's times divided by it compare machines of different speeds."""
    started = time.perf_counter()
    total = 0
    for i in range(3_000_000):
        total += i * i % 7
    digest = hashlib.sha256()
    block = bytes(range(256)) * 4096
    for _ in range(64):
        digest.update(block)
    return round(time.perf_counter() - started, 3)


def kind_of(keywords) -> str:
    return next((kind for kind in KINDS if kind in keywords), "unit")


class Recorder:
    """A pytest plugin, registered in the process that sees every report (the xdist controller, or the only
    one): collects each test's durations and writes the record at the end. conftest.py registers it; with
    `-p timings` (tests/support on the path) it registers itself, writing to $HPCML_TIMINGS_DIR."""

    def __init__(self, out_dir: Path, root: Path):
        self.out_dir, self.root = out_dir, root
        self.started = time.time()
        self.calibration_s = calibrate()
        self.tests: dict[str, dict] = {}
        self.skipped: list[tuple[str, str]] = []

    def pytest_runtest_logreport(self, report) -> None:
        node = getattr(report, "node", None)  # xdist's controller: the worker that ran it
        worker = node.gateway.id if node is not None else "main"
        entry = self.tests.setdefault(report.nodeid, {"nodeid": report.nodeid, "worker": worker,
                                                      "kind": kind_of(report.keywords), "outcome": "passed"})
        entry[report.when] = round(report.duration, 3)
        if report.failed:
            entry["outcome"] = "failed"
        elif report.skipped:
            entry["outcome"] = "skipped"
            reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped.append((report.nodeid, reason.removeprefix("Skipped: ")))
        if report.when == "teardown":
            entry["stop"] = round(time.time() - self.started, 1)

    def pytest_terminal_summary(self, terminalreporter, config) -> None:
        """The run's time against its budget, where the record is, and, loudly, every test it did not run."""
        if not self.tests:
            return
        path = self.write(config.getoption("markexpr", ""), getattr(config.option, "randomly_seed", None))
        shown = path.relative_to(self.root) if path.is_relative_to(self.root) else path
        terminalreporter.write_line(
            f"hpcml: {len(self.tests)} tests in {(time.time() - self.started) / 60:.1f} min (the default tier's budget on "
            f"a fresh clone: {BUDGET_MIN['warm']:.0f} min warm, {BUDGET_MIN['cold']:.0f} cold, set-up included); machine "
            f"calibration {self.calibration_s} s; per test: {shown} (python tests/support/timings.py {shown})", bold=True)
        for test, reason in self.skipped:
            terminalreporter.write_line(f"NOT RUN: {test}: {reason}", red=True, bold=True)

    def write(self, markexpr: str, seed) -> Path:
        wall = time.time() - self.started
        tests = sorted(self.tests.values(), key=lambda t: t["nodeid"])
        record = {"meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
                           "wall_s": round(wall, 1), "markexpr": markexpr, "randomly_seed": seed,
                           "calibration_s": self.calibration_s, "budget_min": BUDGET_MIN,
                           "workers": sorted({t["worker"] for t in tests}), "tests": len(tests),
                           "not_run": [{"test": t, "reason": r} for t, r in self.skipped]},
                  "tests": tests}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / time.strftime("%Y%m%dT%H%M%S.json", time.gmtime(self.started))
        path.write_text(json.dumps(record, indent=1) + "\n")
        (self.out_dir / "latest.json").write_text(path.read_text())
        return path


def register(config, out_dir: Path, root: Path) -> None:
    """The recorder, in the process that sees every report (not on an xdist worker)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(Recorder(out_dir, root), "hpcml-timings")


def pytest_configure(config):  # (when loaded as a plugin itself: `-p timings`)
    register(config, Path(os.environ.get("HPCML_TIMINGS_DIR", "test-durations")), Path.cwd())


def seconds(test: dict) -> float:
    return test.get("setup", 0.0) + test.get("call", 0.0) + test.get("teardown", 0.0)


def by(record: dict, key) -> dict[str, tuple[int, float]]:
    """{group: (tests, minutes)} over the record's tests, grouped by ``key(test)``."""
    groups: dict[str, list[float]] = defaultdict(list)
    for test in record["tests"]:
        groups[key(test)].append(seconds(test))
    return {name: (len(times), sum(times) / 60) for name, times in groups.items()}


def module(test: dict) -> str:
    return test["nodeid"].split("::")[0].removeprefix("tests/")


def table(records: list[dict], key, title: str) -> str:
    """A Markdown table, one column pair (tests, minutes) per record, the largest rows first (of the last record)."""
    groups = [by(record, key) for record in records]
    names = sorted(set().union(*groups), key=lambda name: -groups[-1].get(name, (0, 0.0))[1])
    head = f"| {title} | " + " | ".join("tests | min" for _ in records) + " |"
    rule = "|---|" + "---:|---:|" * len(records)
    rows = [f"| {name} | " + " | ".join(f"{g[name][0]} | {g[name][1]:.1f}" if name in g else "- | -" for g in groups) + " |"
            for name in names]
    totals = "| **all (test-minutes, both workers)** | " + " | ".join(
        f"{sum(n for n, _ in g.values())} | {sum(m for _, m in g.values()):.1f}" for g in groups) + " |"
    return "\n".join([head, rule, *rows, totals])


def summary(record: dict) -> str:
    meta = record["meta"]
    return (f"{meta['started']}: {meta['tests']} tests in {meta['wall_s'] / 60:.1f} min on {len(meta['workers'])} workers "
            f"(calibration {meta['calibration_s']} s)")


SCOPES = Path(__file__).resolve().parents[1] / "scope_durations.json"
UNKNOWN_SCOPE_S = 60.0  # a scope no record has timed yet (a new test file): scheduled as a middling one


def scope_of(nodeid: str) -> str:
    """pytest-xdist's --dist loadscope unit: the test's module, or its class (the parity table's references)."""
    return nodeid.rsplit("::", 1)[0]


def scope_seconds(record: dict) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for test in record["tests"]:
        totals[scope_of(test["nodeid"])] += seconds(test)
    return {scope: round(total, 1) for scope, total in sorted(totals.items())}


def longest_scopes_first(items: list, durations: dict[str, float]) -> None:
    """Orders ``items`` (pytest's, in place) by their scope's recorded seconds, longest first; the order inside
    a scope is kept (pytest-randomly's). With --no-loadscope-reorder, xdist hands the scopes out in this
    order: the longest start first, and no long one is left to run alone at the end."""
    items.sort(key=lambda item: -durations.get(scope_of(item.nodeid), UNKNOWN_SCOPE_S))


def main(paths: list[str]) -> None:
    records = [json.loads(Path(path).read_text()) for path in paths]
    for path, record in zip(paths, records):
        print(f"- {path}: {summary(record)}")
    print()
    print(table(records, module, "module"))
    print()
    print(table(records, lambda test: test["kind"], "kind"))
    slowest = sorted(records[-1]["tests"], key=seconds, reverse=True)[:15]
    print("\nslowest (last record):")
    for test in slowest:
        print(f"  {seconds(test):7.1f} s  {test['worker']}  {test['nodeid']}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write-scopes":  # the scheduling order from a whole run's record
        SCOPES.write_text(json.dumps(scope_seconds(json.loads(Path(sys.argv[2]).read_text())), indent=1) + "\n")
        print(f"wrote {SCOPES}")
    elif len(sys.argv) < 2:
        sys.exit("usage: python tests/support/timings.py RECORD.json [RECORD.json ...] | --write-scopes RECORD.json")
    else:
        main(sys.argv[1:])
