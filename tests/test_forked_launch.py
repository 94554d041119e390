"""The tests' forked launches (support/forkserver.py) are the real ones: each PyTorch recipe trained on 2 ranks
forked and under the real torchrun gives the same losses to the bit and reports the same layout; a refusal
gives the same exit code and line; a probe sees the same interpreter state (threads, argv, path, __name__,
working directory, environment). The control: a setting read when a library loads (OMP_NUM_THREADS, read
by OpenMP in the parent) differs between the two ways, and the probe's comparison catches it; the client
refuses such a request in one line, so that a test cannot be fooled by it.

Every other test that starts a recipe on this machine outside Slurm and containers uses the forked launch
(HPCML_TEST_LAUNCH=real: the real one everywhere, e.g. to compare a whole run of the suite).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.curves import read_metrics
from support.runs import REPO, ForkServer, python, recipe_env, run, torchrun

SMALL = ["--seq-len", "32", "--max-steps", "3", "--log-every", "1"]
GPT = [*SMALL, "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--global-batch", "4"]
TWO_RANKS = {  # recipe -> options of a 2-rank run
    "ddp": GPT,
    "accelerate": GPT,
    "deepspeed": [*GPT, "--zero-stage", "2"],
    "fsdp_tp_pp": [*GPT, "--tp", "2"],
    "megatron_tp_pp": [*SMALL, "--num-layers", "2", "--tp", "2"],
}
REPORTED = ("world_size", "backend", "model_wrapper", "layout", "mesh", "parallel")  # those a recipe reports

PROBE = """
import json, os, sys, torch
print(json.dumps({"threads": torch.get_num_threads(), "argv": sys.argv[1:], "path0": sys.path[0], "name": __name__,
                  "cwd": os.getcwd(), "file": __file__, "rank": os.environ.get("RANK"), "marker": os.environ.get("PROBE_MARKER"),
                  "stdin": sys.stdin.read(), "main_loaded": "__main__" in sys.modules}))
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


@pytest.mark.parametrize("recipe", sorted(TWO_RANKS))
def test_two_forked_ranks_train_as_torchrun_s(recipe, tmp_path):
    script = REPO / "recipes" / recipe / "train.py"
    curves = {}
    for way in ("forked", "real"):
        result = torchrun(script, 2, "--out-dir", str(tmp_path / way), *TWO_RANKS[recipe], real=way == "real",
                          env=recipe_env(HPCML_EXPECTED_WORLD_SIZE="2"))
        assert result.returncode == 0, f"{way}:\n{result.stderr[-3000:]}"
        metrics = read_metrics(tmp_path / way)
        curves[way] = ([record["loss"] for record in metrics["history"]],
                       {key: metrics[key] for key in REPORTED if key in metrics})
    assert curves["forked"][1]["world_size"] == 2, curves["forked"][1]
    assert curves["forked"] == curves["real"]  # the losses to the bit, and the layout each reports


@pytest.mark.parametrize("recipe", sorted(TWO_RANKS))
def test_a_refusal_is_the_same_line_and_exit_code(recipe, tmp_path):
    script = REPO / "recipes" / recipe / "train.py"
    args = ["--out-dir", str(tmp_path / "run"), "--max-steps", "0"]
    forked = python(script, *args, timeout=120)
    real = run([sys.executable, str(script), *args], env=recipe_env(), timeout=120)
    assert real.returncode == 2 and real.stderr.startswith(f"[{recipe}] error: "), real.stderr
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)


def probe(tmp_path, way: str, **env: str) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    full = recipe_env(**env)
    if way == "real":
        result = run([sys.executable, str(script), "a", "b c"], env=full, cwd=tmp_path, timeout=120, stdin=subprocess.DEVNULL)
    elif way == "forked":
        result = python(script, "a", "b c", env=full, cwd=tmp_path, timeout=120)
    else:  # straight to the server, past the client's check (the control)
        result = ForkServer.get().run(script, ["a", "b c"], [full], timeout=120, cwd=tmp_path, check_env=False)
    assert result.returncode == int(env.get("PROBE_EXIT", "0")), result.stderr
    return json.loads(result.stdout)


def test_a_forked_process_sees_what_a_fresh_interpreter_sees(tmp_path):
    forked, real = probe(tmp_path, "forked", PROBE_MARKER="x", PROBE_EXIT="3"), probe(tmp_path, "real", PROBE_MARKER="x",
                                                                                    PROBE_EXIT="3")
    assert forked == real
    assert real["threads"] == 1 and real["marker"] == "x" and real["name"] == "__main__" and real["argv"] == ["a", "b c"]


def test_the_probe_catches_a_setting_the_parent_already_read(tmp_path):
    """The negative control: OpenMP reads OMP_NUM_THREADS when torch loads, in the parent; a forked process
    asked for 2 threads keeps the parent's 1, and the comparison above sees it. The client refuses it."""
    real, forked = probe(tmp_path, "real", OMP_NUM_THREADS="2"), probe(tmp_path, "unchecked", OMP_NUM_THREADS="2")
    assert real["threads"] == 2 and forked["threads"] == 1 and forked != real
    with pytest.raises(AssertionError, match="OMP_NUM_THREADS=2 cannot reach a forked process"):
        python(tmp_path / "probe.py", env=recipe_env(OMP_NUM_THREADS="2"))


def test_a_rank_that_fails_stops_the_others_and_fails_the_launch(tmp_path):
    """torchrun's rule: one rank fails, the others are stopped (here rank 1 exits 3 before the rendezvous, so
    rank 0 would wait at it until its timeout), and the launch fails, naming the rank and its exit code."""
    script = tmp_path / "one_fails.py"
    script.write_text("import os, sys, torch.distributed as dist\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit(3)\n"
                      "dist.init_process_group('gloo', timeout=__import__('datetime').timedelta(seconds=600))\n")
    result = torchrun(script, 2, timeout=60)
    assert result.returncode == 1 and "forked rank 1 failed: exitcode  : 3" in result.stderr, result.stderr
    assert "forked rank 0 failed: exitcode  : -15" in result.stderr, result.stderr  # stopped by SIGTERM


def test_a_launch_past_its_time_is_killed(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        python(script, timeout=5)
    assert expired.value.output == "started\n"
