"""A run stopped after step k and started again ends exactly where an uninterrupted run ends."""

from __future__ import annotations

from conftest import assert_ok, losses, read_metrics, run_single, run_torchrun

ARGS = ["--global-batch", "8", "--max-steps", "6", "--checkpoint-every", "2"]


def test_stop_and_resume_gives_the_same_final_loss(tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert_ok(run_torchrun(straight, 2, *ARGS))

    first = run_torchrun(interrupted, 2, *ARGS, "--stop-at-step", "3")
    assert_ok(first)
    assert read_metrics(interrupted)["stopped_early"] is True
    assert read_metrics(interrupted)["last_step"] == 3

    second = run_torchrun(interrupted, 2, *ARGS)
    assert_ok(second)
    assert "resumed from" in second.stdout and "(step 3)" in second.stdout
    resumed = read_metrics(interrupted)
    assert resumed["resumed_from_step"] == 3

    # Same data position, optimizer state and weights: the curves agree step for step, to the bit.
    assert [r["step"] for r in resumed["history"]] == [1, 2, 3, 4, 5, 6]
    assert losses(resumed) == losses(read_metrics(straight))


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    assert_ok(run_single(tmp_path, *ARGS, "--stop-at-step", "2"))
    result = run_single(tmp_path, *ARGS, "--n-embd", "64")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("[ddp] error:") and len(result.stderr.strip().splitlines()) == 1
    assert "use the same settings, a new --out-dir, or --no-resume" in result.stderr
