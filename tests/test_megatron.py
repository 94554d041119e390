"""The Megatron-core recipe: every TP x PP x DP layout trains what one process trains, the distributed
checkpoint resumes (in the same layout and in another one), every bad layout is refused with one line,
and the parity check catches a wrong pipeline (negative control).

Reference: 1 process (TP 1, PP 1), global batch 8 in 4 micro-batches of 2. Parallel: 2 or 4 gloo ranks
under torchrun, real megatron-core on CPU through recipes/megatron_tp_pp/cpu_placement_shim.py.
Tolerance: relative difference of the per-step loss <= 1e-5 over 4 steps (measured here: <= 1e-7);
parameters that ranks share (DP replicas, TP-replicated norms and biases) bitwise identical, checked
inside the run. Every site the shim rewrote must be on the checked-in allow-list.
Optimizer: plain SGD (lr 1.0, no clipping), which a gradient of the wrong scale cannot pass (Adam and a
norm clip both hide one); with the distributed optimizer, which is Adam only, the global gradient norm of
every step is compared as well (within the same tolerance). Negative controls, each caught by the same comparison with a margin of 100x the
tolerance or more: TP without its output all-reduce, DP replicas whose gradients are summed instead of
averaged (plain and with the distributed optimizer), DP replicas never reduced (plain: the replicas also
drift apart; distributed optimizer), PP 2's micro-batches summed instead of averaged, batched p2p with
virtual stages; and a resume without the optimizer state, caught by the resume comparison.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from conftest import (PARITY_RTOL, caught, EVAL, REPO, assert_ok, eval_losses, free_port, grad_norms, losses,
                      max_relative_difference, read_metrics, recipe_env, run)

RECIPE = REPO / "recipes" / "megatron_tp_pp" / "train.py"
SHIM_ALLOW_LIST = REPO / "tests" / "megatron_shim_sites.txt"
STEPS = ["--seq-len", "32", "--max-steps", "4", "--checkpoint-every", "0", "--log-every", "1",
         "--optimizer", "sgd", "--lr", "1.0", "--clip-grad", "0", *EVAL]
# megatron-core's distributed optimizer is Adam only: its runs compare the global gradient norm of every
# step as well, which a gradient of the wrong scale cannot pass either.
ADAM = [*STEPS, "--optimizer", "adamw", "--lr", "3e-3"]
SEEN_SHIM_SITES: set[str] = set()  # every run of this module adds what the shim rewrote
COVERING_TESTS: set[str] = set()  # the tests whose runs together use every path the allow-list names


def torchrun(out_dir, nproc: int, *args: str, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(RECIPE), "--out-dir", str(out_dir), *args]
    return run(cmd, env=recipe_env(HPCML_EXPECTED_WORLD_SIZE=str(nproc), **env), timeout=300)


def single(out_dir, *args: str):
    return run([sys.executable, str(RECIPE), "--out-dir", str(out_dir), *args], env=recipe_env(), timeout=300)


def assert_refused_by_every_rank(out_dir, nproc: int, *args: str, fragment: str) -> None:
    """Every rank refuses on its own, with the one line and exit code 2, before any process group exists.

    Each rank is started alone with torchrun's variables (no other rank, no rendezvous): under torchrun the
    first refusal makes the agent stop the others, so whether they print their line is a race. A rank that
    did not refuse would wait for the others at the rendezvous, and fail by the timeout instead."""
    for rank in range(nproc):
        result = run([sys.executable, str(RECIPE), "--out-dir", str(out_dir), *args], timeout=120,
                     env=recipe_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                                    MASTER_PORT=str(free_port()), HPCML_EXPECTED_WORLD_SIZE=str(nproc)))
        errors = [line for line in result.stderr.splitlines() if line.startswith("[megatron_tp_pp] error: ")]
        assert result.returncode == 2 and len(errors) == 1 and fragment in errors[0], (rank, result.stderr)
        assert "Traceback" not in result.stderr, (rank, result.stderr)
    # And through torchrun itself: the job fails with the rank's exit code 2, not with a traceback of the recipe.
    result = torchrun(out_dir, nproc, *args)
    errors = [line for line in result.stderr.splitlines() if line.startswith("[megatron_tp_pp] error: ")]
    assert result.returncode != 0 and errors and all(fragment in line for line in errors), result.stderr
    assert "exitcode  : 2" in result.stderr and "train.py\", line" not in result.stderr, result.stderr
    assert not (Path(out_dir) / "metrics.json").exists()


def allowed_shim_sites() -> set[str]:
    lines = (line.strip() for line in SHIM_ALLOW_LIST.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def checked_metrics(out_dir) -> dict:
    """The run's metrics, after the checks every run must pass: shim on, its sites allowed, replicas equal."""
    metrics = read_metrics(out_dir)
    assert metrics["cpu_placement_shim"] is True and metrics["backend"] == "gloo"
    sites = set(metrics["cpu_placement_shim_sites"])
    SEEN_SHIM_SITES.update(sites)
    unexpected = sites - allowed_shim_sites()
    assert not unexpected, (f"megatron-core made CUDA assumptions the shim is not allowed to rewrite: {sorted(unexpected)}; "
                            f"check that each is placement only, then add it to {SHIM_ALLOW_LIST.name}")
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0
    return metrics


def difference(metrics: dict, reference: dict) -> float:
    """The largest relative difference of the per-step loss, the per-step global gradient norm and the
    validation loss (forward only through the schedule, averaged over DP)."""
    return max(max_relative_difference(losses(metrics), losses(reference)),
               max_relative_difference(grad_norms(metrics), grad_norms(reference)),
               max_relative_difference(eval_losses(metrics), eval_losses(reference)))


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    runs = {}
    for name, steps in (("sgd", STEPS), ("adam", ADAM)):
        out = tmp_path_factory.mktemp(f"reference-{name}")
        assert_ok(single(out, *steps))
        metrics = checked_metrics(out)
        assert metrics["world_size"] == 1 and metrics["layout"]["tp"] == metrics["layout"]["pp"] == 1
        assert [r["step"] for r in metrics["history"]] == [1, 2, 3, 4] and all(n > 0 for n in grad_norms(metrics))
        assert len(eval_losses(metrics)) == 2
        runs[name] = metrics
    return runs


@pytest.fixture(scope="module")
def reference(references) -> dict:
    return references["sgd"]


LAYOUTS = {
    "tp2": (2, ["--tp", "2"], {"tp": 2, "pp": 1, "dp": 1}),
    "pp2": (2, ["--pp", "2"], {"tp": 1, "pp": 2, "dp": 1}),
    "pp2-vp2": (2, ["--pp", "2", "--vp", "2"], {"tp": 1, "pp": 2, "dp": 1, "vp": 2}),
    "tp2-pp2": (4, ["--tp", "2", "--pp", "2"], {"tp": 2, "pp": 2, "dp": 1}),
    "dp2-tp2-distributed-optimizer": (4, ["--tp", "2", "--distributed-optimizer"], {"tp": 2, "pp": 1, "dp": 2}),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(references, tmp_path, name):
    nproc, args, layout = LAYOUTS[name]
    optimizer = "adam" if "--distributed-optimizer" in args else "sgd"
    reference = references[optimizer]
    assert_ok(torchrun(tmp_path, nproc, *(ADAM if optimizer == "adam" else STEPS), *args))
    metrics = checked_metrics(tmp_path)
    # It really was this parallel: from inside the run, megatron's own groups and wrapper.
    assert metrics["world_size"] == nproc and len(metrics["hostnames"]) == nproc
    assert {key: metrics["layout"][key] for key in layout} == layout
    assert metrics["layout"]["num_microbatches"] == 8 // (2 * layout["dp"])
    assert metrics["model_wrapper"] == "DistributedDataParallel"
    assert metrics["n_params"] == reference["n_params"]  # the whole model, counted from its pieces
    if "--distributed-optimizer" in args:
        assert metrics["config"]["distributed_optimizer"] is True
    assert [r["step"] for r in metrics["history"]] == [1, 2, 3, 4]
    assert difference(metrics, reference) <= PARITY_RTOL
    COVERING_TESTS.add(name)


def test_batched_p2p_with_virtual_stages_is_refused_and_caught(reference, tmp_path):
    """PP 2 + virtual stages + batched p2p swaps activations silently (exit 0, wrong losses). The recipe
    refuses it; forced through, the parity check must see the loss go wrong (the negative control)."""
    assert_refused_by_every_rank(tmp_path / "refused", 2, *STEPS, "--pp", "2", "--vp", "2", "--batch-p2p-comm",
                                 fragment="drop --batch-p2p-comm")

    forced = tmp_path / "forced"
    assert_ok(torchrun(forced, 2, *STEPS, "--pp", "2", "--vp", "2", "--batch-p2p-comm", HPCML_TEST_FAULT="batch-p2p-with-vp"))
    metrics = checked_metrics(forced)
    assert metrics["config"]["batch_p2p_comm"] is True and metrics["layout"]["vp"] == 2
    assert caught(max_relative_difference(losses(metrics), losses(reference)), PARITY_RTOL)
    COVERING_TESTS.add("batched-p2p")


@pytest.mark.parametrize("nproc, args, control", [
    (2, ["--tp", "2"], "tp-no-reduce"),
    (2, [], "grad-sum"),
    (4, ["--tp", "2", "--distributed-optimizer"], "grad-sum"),
    (2, [], "no-grad-allreduce"),
    (2, ["--distributed-optimizer"], "no-grad-allreduce"),
    (2, ["--pp", "2"], "accum-sum"),
])
def test_negative_controls_are_caught(references, tmp_path, nproc, args, control):
    optimizer = "adam" if "--distributed-optimizer" in args else "sgd"
    result = torchrun(tmp_path, nproc, *(ADAM if optimizer == "adam" else STEPS), *args, HPCML_TEST_FAULT=control)
    metrics = read_metrics(tmp_path)
    assert metrics["world_size"] == nproc and metrics["config"]["distributed_optimizer"] == ("--distributed-optimizer" in args)
    assert caught(difference(metrics, references[optimizer]), PARITY_RTOL)
    # Replicas drift apart, and the run itself fails: DP never reduced (plain), and TP without its all-reduce
    # (what TP replicates, the norms, sees different inputs on each TP rank). The distributed optimizer
    # gathers every replica's parameters from the shards: equal, and wrong.
    if control == "tp-no-reduce" or (control == "no-grad-allreduce" and "--distributed-optimizer" not in args):
        assert result.returncode != 0 and metrics["param_max_abs_diff_across_ranks"] > 0.0
    else:
        assert_ok(result)


def test_checkpoint_resume_same_and_other_layout(tmp_path):
    """Stop at step 3, resume to 6: the later losses are those of the uninterrupted run; megatron's
    distributed checkpoint of a PP 2 run also resumes as TP 2 (resharded on load)."""
    steps = ["--seq-len", "32", "--max-steps", "6", "--checkpoint-every", "2"]
    uninterrupted = tmp_path / "uninterrupted"
    assert_ok(torchrun(uninterrupted, 2, *steps, "--pp", "2"))
    expected = losses(checked_metrics(uninterrupted))

    interrupted = tmp_path / "interrupted"
    assert_ok(torchrun(interrupted, 2, *steps, "--pp", "2", "--stop-at-step", "3"))
    assert checked_metrics(interrupted)["last_step"] == 3
    assert sorted(p.name for p in (interrupted / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    other_layout, control = tmp_path / "other-layout", tmp_path / "resume-without-optimizer"
    shutil.copytree(interrupted, other_layout)
    shutil.copytree(interrupted, control)

    resumed = torchrun(interrupted, 2, *steps, "--pp", "2")
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout and "step_00000003" in resumed.stdout
    metrics = checked_metrics(interrupted)
    assert metrics["resumed_from_step"] == 3 and [r["step"] for r in metrics["history"]] == [1, 2, 3, 4, 5, 6]
    assert losses(metrics) == expected  # same layout: bit for bit

    resharded = torchrun(other_layout, 2, *steps, "--tp", "2")
    assert_ok(resharded)
    metrics = checked_metrics(other_layout)
    assert metrics["layout"]["tp"] == 2 and metrics["layout"]["pp"] == 1 and metrics["resumed_from_step"] == 3
    assert max_relative_difference(losses(metrics)[3:], expected[3:]) <= PARITY_RTOL

    # The control: the same resume without the optimizer state (Adam's moments) must fail the comparison.
    assert_ok(torchrun(control, 2, *steps, "--pp", "2", HPCML_TEST_FAULT="resume-fresh-optimizer"))
    defective = losses(checked_metrics(control))
    assert defective[:3] == expected[:3] and caught(max_relative_difference(defective[3:], expected[3:]), PARITY_RTOL)
    COVERING_TESTS.add("resume")


def test_bf16_the_gpu_dtype_trains_checkpoints_and_resumes(tmp_path):
    """bf16 (the default on a GPU) as Megatron-LM runs it: every parameter bf16 (the local spec's LayerNorm
    included, which once stayed fp32: CUDA's layer norm refused it, and the mixed-precision optimizer's
    checkpoint failed), fp32 master weights in the optimizer, and a resume that continues the same curve."""
    steps = [*STEPS[:STEPS.index("--optimizer")], "--dtype", "bf16", "--checkpoint-every", "2"]
    uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    assert_ok(single(uninterrupted, *steps))
    metrics = checked_metrics(uninterrupted)
    assert metrics["dtype"] == "torch.bfloat16" and metrics["parameter_dtypes"] == ["torch.bfloat16"], metrics
    assert metrics["optimizers"] == ["Float16OptimizerWithFloat16Params"] and metrics["model_wrapper"] == "DistributedDataParallel"
    assert_ok(single(interrupted, *steps, "--stop-at-step", "2"))
    resumed = single(interrupted, *steps)
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout and losses(read_metrics(interrupted)) == losses(metrics)
    COVERING_TESTS.add("bf16")


def test_resume_refuses_another_model(tmp_path):
    assert_ok(single(tmp_path, "--seq-len", "32", "--max-steps", "2", "--checkpoint-every", "1"))
    result = single(tmp_path, "--seq-len", "32", "--max-steps", "4", "--num-layers", "2")
    assert result.returncode == 2 and "was written with" in result.stderr and "--no-resume" in result.stderr, result.stderr


def preflight(world_size: int, *args: str, **env):
    return run([sys.executable, str(RECIPE), "--preflight", str(world_size), "--out-dir", "/nonexistent/x", *args],
               env=recipe_env(**env), timeout=120)


@pytest.mark.parametrize("world_size, args, fragment", [
    (6, ["--tp", "2", "--pp", "2"], "world size 6 is not divisible by TP x PP = 2 x 2 = 4"),
    (4, ["--tp", "4", "--num-heads", "6", "--hidden-size", "96"], "--num-heads 6 is not divisible by --tp 4"),
    (2, ["--tp", "2", "--hidden-size", "65", "--num-heads", "2"], "--hidden-size 65 is not divisible by --tp 2"),
    (1, ["--hidden-size", "66", "--num-heads", "4"], "--hidden-size 66 is not divisible by --num-heads 4"),
    (2, ["--tp", "2", "--vocab-size", "255"], "--vocab-size 255 is not divisible by --tp 2"),
    (2, ["--pp", "2", "--num-layers", "3"], "--num-layers 3 is not divisible by --pp 2"),
    (4, ["--pp", "2", "--vp", "2", "--num-layers", "6"], "--num-layers 6 is not divisible by PP x VP = 2 x 2 = 4"),
    (4, ["--tp", "2", "--global-batch", "6"], "--global-batch 6 is not divisible by --micro-batch 2 x DP 2 = 4"),
    (2, ["--pp", "2", "--vp", "2", "--batch-p2p-comm"], "drop --batch-p2p-comm"),
    (2, ["--vp", "2"], "--vp 2 needs --vp >= 2 and --pp >= 2"),
    (1, ["--clip-grad", "-1"], "--clip-grad must be 0 (no clipping) or a positive norm, got -1.0"),
    (1, ["--lr", "0"], "--lr must be a positive finite number, got 0.0"),
    (1, ["--lr", "inf"], "--lr must be a positive finite number, got inf"),
    (2, ["--optimizer", "sgd", "--distributed-optimizer"], "distributed optimizer is Adam only"),
])
def test_bad_layout_is_refused_with_one_line(world_size, args, fragment):
    result = preflight(world_size, *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("[megatron_tp_pp] error: ") and fragment in lines[0], lines[0]


def test_tp_across_nodes_warns_but_runs(tmp_path):
    result = preflight(8, "--tp", "8", "--num-heads", "8", SLURM_NTASKS_PER_NODE="4")
    assert result.returncode == 0, result.stderr
    assert "--tp 8 is more than the 4 ranks per node" in result.stderr and "Slingshot" in result.stderr
    assert "preflight: TP 8 x PP 1 x DP 1 = 8 ranks" in result.stdout
    quiet = preflight(8, "--tp", "4", "--pp", "2", SLURM_TASKS_PER_NODE="4(x2)")
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr


def test_world_that_does_not_fit_is_refused_before_megatron_starts(tmp_path):
    """Not only in the preflight: the ranks themselves refuse, each with the same line, no traceback."""
    assert_refused_by_every_rank(tmp_path, 2, *STEPS, "--tp", "2", "--pp", "2",
                                 fragment="world size 2 is not divisible by TP x PP = 2 x 2 = 4")


def test_shim_rewrites_placement_only_and_records_where():
    """The shim on its own: CUDA placements become CPU ones, nothing else changes, every rewrite is noted."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(RECIPE.parent)!r})
import cpu_placement_shim as shim
shim.enable()
x = torch.zeros(3, device="cuda")
y = torch.ones(2, dtype=torch.float64).cuda()
z = torch.arange(4).to(torch.cuda.current_device())
assert x.device.type == y.device.type == z.device.type == "cpu"
assert y.dtype == torch.float64 and z.tolist() == [0, 1, 2, 3]
assert torch.ones(1).type() == "torch.cuda.FloatTensor" and torch.ones(1).type(torch.float64).dtype == torch.float64
torch.cuda.synchronize()
before = list(shim.sites())
torch.zeros(2, device="cpu") + torch.randn(2)
assert shim.sites() == before  # CPU placements are left alone and not recorded
print("\\n".join(before))
"""
    result = run([sys.executable, "-c", code], env=recipe_env(), timeout=120)
    assert_ok(result)
    recorded = result.stdout.strip().splitlines()
    assert all(line.startswith("outside megatron: <string>: ") for line in recorded), recorded
    assert {line.split(": ", 2)[2] for line in recorded} == {
        "zeros(device=cuda)", "Tensor.cuda()", "torch.cuda.current_device()", "Tensor.to(cuda)", "Tensor.type()",
        "torch.cuda.synchronize()"}


@pytest.fixture(scope="module", autouse=True)
def every_allowed_shim_site_is_still_needed():
    """After the last test of this module, in whatever order they ran (make test shuffles them): once the
    layout, resume and batched-p2p tests have all run and passed, every allow-list entry must have been
    needed by one of their runs. An entry no run needs any more (megatron dropped that CUDA assumption) is
    removed from the list, so the list stays the truth. Fails as an error at the module's teardown."""
    yield
    if COVERING_TESTS == {*LAYOUTS, "resume", "batched-p2p", "bf16"}:
        unused = allowed_shim_sites() - SEEN_SHIM_SITES
        assert not unused, f"{SHIM_ALLOW_LIST.name} allows sites no run needed any more: remove {sorted(unused)}"
