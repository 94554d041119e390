"""recipes/harness/data.py: synthetic tokens and a user's dataset, each rank its rows of the same global batch."""

from __future__ import annotations

import sys

import torch

from support.runs import REPO

sys.path.insert(0, str(REPO / "recipes"))
import harness  # noqa: E402


def test_synthetic_batches_are_deterministic_and_split_by_rank():
    data = harness.SyntheticTokens(vocab_size=50, seq_len=16, seed=3)
    inputs, targets = data.global_batch(step=5, batch_size=8)
    again, _ = data.global_batch(step=5, batch_size=8)
    other, _ = data.global_batch(step=6, batch_size=8)
    assert torch.equal(inputs, again) and not torch.equal(inputs, other)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    halves = [data.local_batch(5, 8, rank, 2)[0] for rank in range(2)]
    assert torch.equal(torch.cat(halves), inputs)
    assert int(inputs.max()) < 50


def test_a_users_dataset_gives_each_rank_its_rows_of_the_same_global_batch():
    """DatasetBatches (--dataset): rank r's rows of step s are rows [r*b, (r+1)*b) of the global batch, at any
    world size; the order is a seeded permutation per epoch, and a step past an epoch wraps into the next."""
    from harness.data import DatasetBatches

    items = [(torch.full((2,), float(i)), torch.tensor(float(i))) for i in range(10)]
    data = DatasetBatches(items, seed=5)
    inputs, targets = data.global_batch(3, 4)  # samples 12..15: epoch 1, positions 2..5
    assert torch.equal(inputs[:, 0], targets) and sorted(set(targets.tolist())) == sorted(targets.tolist())
    assert targets.tolist() == [float(data.order(1)[p]) for p in range(2, 6)]
    for world in (1, 2, 4):
        parts = [data.local_batch(3, 4, rank, world)[1] for rank in range(world)]
        assert torch.equal(torch.cat(parts), targets)
    assert sorted(data.order(0).tolist()) == list(range(10)) and not torch.equal(data.order(0), data.order(1))
