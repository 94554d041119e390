"""A failed step's class from what its ranks recorded (slurm/lib/healing.sh: classify_failure, in bash itself),
and what the ranks record (recipes/harness/outcome.py, through main_entry in a real process).

The launcher restarts a job only for a node's failure; these cases say how each class is recognised:
a rank that recorded nothing after it started (killed, or killed while it hung) -> its node; the hardware's
error in an exception -> its node; any other exception or a bad option on any rank -> the program's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from support.runs import REPO

sys.path.insert(0, str(REPO / "recipes"))
from harness import outcome  # noqa: E402

HEALING = REPO / "slurm" / "lib" / "healing.sh"


def classify(tmp_path, records: dict[int, list[str]], **env: str) -> dict:
    """classify_failure's answer for ranks that wrote these lines (rank -> lines)."""
    directory = tmp_path / "outcomes"
    directory.mkdir(exist_ok=True)
    for rank, lines in records.items():
        (directory / f"rank_{rank}").write_text("".join(line + "\n" for line in lines))
    script = (f'source "{HEALING}"; classify_failure "{directory}"; '
              'echo "$FAILURE_CLASS"; echo "${FAILURE_NODES[*]}"; echo "${FAILURE_RANKS[*]}"; echo "$FAILURE_STEP"; '
              'echo "$FAILURE_CAUSE"')
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env})
    assert result.returncode == 0, result.stderr
    klass, nodes, ranks, step, cause = result.stdout.split("\n")[:5]
    return {"class": klass, "nodes": nodes.split(), "ranks": ranks.split(), "step": int(step), "cause": cause}


def test_a_rank_killed_while_the_others_saw_their_collective_fail_is_its_nodes_failure(tmp_path):
    answer = classify(tmp_path, {0: ["started nid1 10", "collective nid1 step=55 Connection reset by peer"],
                                 1: ["started nid2 11"],
                                 2: ["started nid3 12", "collective nid3 step=54 Connection reset by peer"]})
    assert answer == {"class": "node", "nodes": ["nid2"], "ranks": ["1"], "step": 55,
                      "cause": "rank 1 on nid2 died or hung (no outcome recorded: killed by a signal)"}


def test_every_rank_of_a_node_silent_blames_that_node_once(tmp_path):
    answer = classify(tmp_path, {0: ["started nid1 10", "collective nid1 step=7 timed out"],
                                 1: ["started nid1 11", "collective nid1 step=7 timed out"],
                                 2: ["started nid2 12"], 3: ["started nid2 13"]})
    assert (answer["class"], answer["nodes"], answer["ranks"]) == ("node", ["nid2"], ["2", "3"])


@pytest.mark.parametrize("records", [
    {0: ["started nid1 10"], 1: ["started nid2 11"]},  # every node silent: which one failed?
    {0: ["started nid1 10"]},  # one node
    {},  # no rank started
    {0: ["started nid1 10", "collective nid1 step=7 Timed out"], 1: ["started nid2 11", "collective nid2 step=7 reset"]},
    {0: ["started nid1 10", "done nid1 step=7 exit 0"], 1: ["started nid2 11", "done nid2 step=7 exit 0"]},
], ids=["all-silent", "one-node", "none-started", "every-collective-failed", "every-rank-done"])
def test_nothing_to_tell_which_node_is_unknown_and_never_restarted(tmp_path, records):
    assert classify(tmp_path, records)["class"] == "unknown"


def test_an_exception_on_any_rank_is_the_programs_even_when_another_rank_is_silent(tmp_path):
    answer = classify(tmp_path, {0: ["started nid1 10", "program nid1 step=5 ValueError: a bug"],
                                 1: ["started nid2 11"]})
    assert answer == {"class": "program", "nodes": ["nid1"], "ranks": ["0"], "step": 5,
                      "cause": "rank 0 on nid1: ValueError: a bug"}


def test_a_bad_option_is_the_programs(tmp_path):
    assert classify(tmp_path, {0: ["started nid1 10", "bad-input nid1 step=0 --lr must be positive"],
                               1: ["started nid2 11", "collective nid2 step=0 reset"]})["class"] == "program"


def test_the_hardwares_own_error_is_its_nodes(tmp_path):
    answer = classify(tmp_path, {0: ["started nid1 10", "collective nid1 step=9 reset"],
                                 1: ["started nid2 11", "node nid2 step=9 RuntimeError: CUDA error: uncorrectable ECC error encountered"]})
    assert (answer["class"], answer["nodes"]) == ("node", ["nid2"])


def test_the_negative_control_takes_the_programs_error_for_a_nodes(tmp_path):
    records = {0: ["started nid1 10", "program nid1 step=5 ValueError: a bug"], 1: ["started nid2 11", "collective nid2 step=5 x"]}
    assert classify(tmp_path, records, HPCML_TEST_FAULT="program-error-as-node")["class"] == "node"


RANK = textwrap.dedent("""
    import sys
    sys.path.insert(0, {recipes!r})
    import harness
    from harness import outcome

    def main():
        outcome.note_step(7)
        {body}
        return 0

    harness.main_entry("test", main)
""")


@pytest.mark.parametrize("body, code, last", [
    ("pass", 0, "done {host} step=7 exit 0"),
    ("raise harness.ConfigError('--lr must be positive')", 2, "bad-input {host} step=7 --lr must be positive"),
    ("raise ValueError('a bug')", 1, "program {host} step=7 ValueError: a bug"),
    ("raise RuntimeError('CUDA error: uncorrectable ECC error encountered')", 1,
     "node {host} step=7 RuntimeError: CUDA error: uncorrectable ECC error encountered"),
    ("sys.exit(3)", 3, "program {host} step=7 exit 3"),
    ("raise outcome.NodeFault('rank 3 on h is a straggler')", 1, "node {host} step=7 rank 3 on h is a straggler"),
], ids=["done", "bad-input", "exception", "hardware", "exit-code", "straggler-left-out"])
def test_each_rank_records_how_it_ended(tmp_path, body, code, last):
    import socket

    script = tmp_path / "rank.py"
    script.write_text(RANK.format(recipes=str(REPO / "recipes"), body=body))
    env = {"PATH": "/usr/bin:/bin", "HPCML_RANK_OUTCOMES": str(tmp_path), "SLURM_PROCID": "3"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == code, result.stderr
    lines = (tmp_path / "rank_3").read_text().splitlines()
    host = socket.gethostname()
    assert lines[0].startswith(f"started {host} ") and lines[1:] == [last.format(host=host)]


def test_outside_a_launcher_step_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("HPCML_RANK_OUTCOMES", raising=False)
    monkeypatch.chdir(tmp_path)
    outcome.started()
    outcome.ended("done")
    assert list(tmp_path.iterdir()) == []


def test_metrics_summarise_the_incidents(tmp_path):
    assert outcome.incidents_summary(tmp_path) is None
    lines = [{"class": "node", "nodes": ["nid2"], "action": "restarted"}, {"class": "node", "nodes": ["nid4", "nid2"]},
             {"class": "program", "nodes": ["nid1"]}]
    (tmp_path / "incidents.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = outcome.incidents_summary(tmp_path)
    assert summary == {"count": 3, "by_class": {"node": 2, "program": 1}, "nodes_left_out": ["nid2", "nid4"],
                       "file": str(tmp_path / "incidents.jsonl")}
