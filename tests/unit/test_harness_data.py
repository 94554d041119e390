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


def test_a_micro_batch_with_no_trained_token_adds_nothing_to_the_step_not_nan():
    """Instruction data: a micro-batch whose rows are all prompt (every target -100) weighs 0 in the step's loss
    (token_weights); its loss must then be 0 with no gradient. cross_entropy's mean over no target is 0/0 = NaN,
    and NaN x 0 is NaN: one such micro-batch made the step's logged loss NaN (the control; its gradients were
    right, 0 from that micro-batch)."""
    import torch.nn.functional as F

    from gpt import GPT, GPTConfig, cross_entropy
    from harness.data import IGNORE

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, n_embd=16))
    inputs = torch.randint(0, 32, (2, 2, 8))
    trained = torch.randint(0, 32, (2, 8))
    prompt_only = torch.full((2, 8), IGNORE)
    micro_targets = [prompt_only, trained]
    weights = harness.loss_weights(micro_targets, masked=True)
    assert [float(w) for w in weights] == [0.0, 1.0]  # (all the step's trained tokens are the second's)

    def step(loss_of) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = sum(loss_of(model.logits(rows), targets) * weight for rows, targets, weight in zip(inputs, micro_targets, weights))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = step(cross_entropy)
    model.zero_grad(set_to_none=True)
    alone = cross_entropy(model.logits(inputs[1]), trained)
    alone.backward()
    assert torch.isfinite(loss) and torch.allclose(loss, alone, rtol=1e-6)
    assert all(torch.allclose(g, p.grad, rtol=1e-5, atol=1e-8) for g, p in zip(grads, model.parameters()))
    assert float(cross_entropy(model.logits(inputs[0]), prompt_only).detach()) == 0.0
    assert torch.allclose(alone, F.cross_entropy(model.logits(inputs[1]).flatten(0, 1), trained.flatten()), rtol=1e-6)

    control, control_grads = step(lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    assert torch.isnan(control) and all(torch.allclose(g, c) for g, c in zip(grads, control_grads))
