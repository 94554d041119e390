"""slurm/lib/vet_node.py, a node's check before the ranks start, run as the launcher runs it (a real process):
its one-line answer per node, and a failure for each check that can fail on a CPU machine. (The network plugin
is checked by the preflight's own function, tests/unit/test_harness_image_checks.py; the GPU checks need a GPU.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from support.runs import REPO

VET = REPO / "slurm" / "lib" / "vet_node.py"


def vet(answers, **env: str) -> tuple[int, str]:
    answers.mkdir(exist_ok=True)
    base = {"PATH": os.environ["PATH"], "HPCML_ALLOW_CPU": "1"}
    result = subprocess.run([sys.executable, str(VET), str(answers)], capture_output=True, text=True, env={**base, **env},
                            timeout=120)
    return result.returncode, (answers / socket.gethostname()).read_text()


def test_a_good_node_says_what_it_checked(tmp_path):
    code, answer = vet(tmp_path / "answers")
    assert code == 0 and answer.startswith("ok ") and "GB free, run directory writable (" in answer, answer
    assert os.listdir(tmp_path / "answers") == [socket.gethostname()]  # (the write probe removed again)


@pytest.mark.parametrize("env, reason", [
    ({"HPCML_VET_MIN_FREE_GB": "1000000"}, "of memory available, below HPCML_VET_MIN_FREE_GB=1e+06"),
    ({"HPCML_TEST_BAD_NODE": "@3", "SLURM_NODEID": "3"}, "the tests' probe (HPCML_TEST_BAD_NODE) says this node is bad"),
    ({"HPCML_TEST_BAD_NODE": socket.gethostname()}, "the tests' probe (HPCML_TEST_BAD_NODE) says this node is bad"),
], ids=["memory", "probe-by-index", "probe-by-name"])
def test_a_bad_node_fails_with_one_line(tmp_path, env, reason):
    code, answer = vet(tmp_path / "answers", **env)
    assert code == 1 and answer.startswith("failed ") and reason in answer and answer.count("\n") == 1, answer


def test_another_node_in_the_probe_is_not_this_one(tmp_path):
    assert vet(tmp_path / "answers", HPCML_TEST_BAD_NODE="@1", SLURM_NODEID="0")[0] == 0

