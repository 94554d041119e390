"""recipes/harness/checkpoint.py: atomic, pruned checkpoints, and a damaged one refused."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from support.runs import REPO

sys.path.insert(0, str(REPO / "recipes"))
import harness  # noqa: E402


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    for step in (10, 20, 30):
        harness.save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    assert [p.name for p in harness.list_checkpoints(tmp_path)] == ["step_00000020.pt", "step_00000030.pt"]

    class ExplodesWhilePickled:
        def __reduce__(self):
            raise RuntimeError("crash in the middle of writing")

    with pytest.raises(RuntimeError, match="crash in the middle"):
        harness.save_checkpoint(tmp_path, 40, {"step": 40, "payload": torch.zeros(1000), "bad": ExplodesWhilePickled()})
    latest = harness.latest_checkpoint(tmp_path)
    assert latest.name == "step_00000030.pt"  # the half-written step 40 is never picked
    assert torch.load(latest)["step"] == 30
    assert any(p.name.startswith(".step_00000040.pt.tmp") for p in tmp_path.iterdir())


def test_a_checkpoint_directory_with_a_missing_or_short_file_is_refused(tmp_path):
    from harness.checkpoint import check_manifest, write_manifest

    checkpoint = tmp_path / "step_00000002"
    (checkpoint / "shards").mkdir(parents=True)
    (checkpoint / "shards" / "rank0.pt").write_bytes(b"x" * 100)
    (checkpoint / "state.json").write_text("{}")
    write_manifest(checkpoint)
    check_manifest(checkpoint)  # whole
    (checkpoint / "shards" / "rank0.pt").write_bytes(b"x" * 60)
    with pytest.raises(harness.ConfigError, match=r"is damaged: shards/rank0.pt has 60 bytes where 100 were written; "
                                                  r"move .*step_00000002 away"):
        check_manifest(checkpoint)
    (checkpoint / "shards" / "rank0.pt").unlink()
    with pytest.raises(harness.ConfigError, match="is damaged: shards/rank0.pt is missing"):
        check_manifest(checkpoint)


def test_a_checkpoint_written_in_the_background_is_published_only_once_written(tmp_path):
    """ShardedCheckpoints (--async-checkpoint): while the framework's write is pending the checkpoint is not
    published (a crash then resumes the one before); its state is the one of the save's step, though the
    history grew meanwhile; `published` runs after the rename; a failed write publishes nothing."""
    from concurrent.futures import Future

    seen = []
    checkpoints = harness.ShardedCheckpoints(tmp_path, writes_state=True, is_rank0=True, barrier=lambda: None,
                                             published=lambda step: seen.append((step, harness.latest_checkpoint_dir(tmp_path).name)))
    history = [{"step": 1}, {"step": 2}]
    writing = Future()

    def write_shards(staging):
        (staging / "shard.distcp").write_bytes(b"x" * 100)
        return writing

    checkpoints.save(2, write_shards, {"history": history})
    history.append({"step": 3})  # training goes on
    assert harness.latest_checkpoint_dir(tmp_path) is None and seen == []
    writing.set_result(None)
    checkpoints.wait()
    published = tmp_path / "step_00000002"
    assert seen == [(2, "step_00000002")] and harness.latest_checkpoint_dir(tmp_path) == published
    assert json.loads((published / harness.TRAINER_STATE).read_text())["history"] == [{"step": 1}, {"step": 2}]
    assert json.loads((published / "manifest.json").read_text())["shard.distcp"] == 100
    checkpoints.wait()  # nothing pending: nothing again
    assert seen == [(2, "step_00000002")] and len(checkpoints.blocking_s) == 1

    failing = Future()
    checkpoints.save(4, lambda staging: failing, {"history": history})
    failing.set_exception(OSError("disk quota exceeded"))
    with pytest.raises(OSError, match="quota"):
        checkpoints.wait()
    assert harness.latest_checkpoint_dir(tmp_path) == published and seen == [(2, "step_00000002")]
