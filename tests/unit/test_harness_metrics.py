"""recipes/harness/metrics.py: the FLOPs formula behind MFU, and the CPU's measured peak."""

from __future__ import annotations

import sys

import torch

from support.runs import REPO

sys.path.insert(0, str(REPO / "recipes"))
import harness  # noqa: E402


def test_flops_formula():
    # 6N + 12 L d T with N = 1e6, L = 2, d = 64, T = 32
    assert harness.transformer_flops_per_token(1_000_000, 2, 64, 32) == 6e6 + 12 * 2 * 64 * 32


def test_cpu_peak_is_measured():
    flops, source = harness.peak_flops(torch.device("cpu"), torch.float32)
    assert flops > 1e8 and source.startswith("measured")
    assert harness.peak_flops(torch.device("cpu"), torch.float32, override_tflops=2.0) == (2e12, "--peak-tflops")
