"""What a run's metrics.json says, and how two runs are compared: curves, relative differences, controls."""

from __future__ import annotations

import json
import math
import os
import tomllib
from pathlib import Path


def read_metrics(out_dir: Path) -> dict:
    return json.loads((out_dir / "metrics.json").read_text())


def losses(metrics: dict) -> list[float]:
    return [record["loss"] for record in metrics["history"]]


def grad_norms(metrics: dict) -> list[float]:
    """The global gradient norm of every step (before clipping), as the recipes log it."""
    return [record["grad_norm"] for record in metrics["history"]]


def curve(metrics: dict, name: str) -> list[float]:
    """One logged quantity (loss, eval_loss, grad_norm, lr) over the steps that logged it, in step order."""
    return [record[name] for record in metrics["history"] if name in record]


def eval_losses(metrics: dict) -> list[float]:
    """The validation losses of a run (--eval-every), in step order."""
    return [record["eval_loss"] for record in metrics["history"] if "eval_loss" in record]


def max_relative_difference(a: list[float], b: list[float]) -> float:
    """Largest per-step relative difference of two loss curves of the same length; infinite where either
    is not a finite number (max() skips a NaN it meets after the first element: a curve that went NaN
    midway would pass a parity check)."""
    assert len(a) == len(b) and a, (a, b)
    if not all(math.isfinite(x) for x in (*a, *b)):
        return math.inf
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# Every parity check: a distributed run against one process on the same data and weights, per step, relative
# (float32 sums in another order differ by ~1e-7; a wrong gradient scale by 1e-3 and more). Defined once, in
# the parity table, for every comparison of two runs in the tests.
PARITY_TABLE = Path(__file__).resolve().parents[1] / "parity.toml"
_TABLE = tomllib.loads(PARITY_TABLE.read_text())
PARITY_RTOL: float = _TABLE["tolerance"]
CONTROL_MARGIN: int = _TABLE["control_margin"]  # a negative control must miss its check's tolerance by this factor
MARGINS_FILE_ENV = "HPCML_TEST_MARGINS"  # set: every control's measured margin is appended there (JSON lines)


def caught(difference: float, tolerance: float) -> bool:
    """A negative control's run differs from the right one by more than CONTROL_MARGIN x ``tolerance``. The
    margin (difference / tolerance) goes to $HPCML_TEST_MARGINS, when set, with the test that measured it."""
    if os.environ.get(MARGINS_FILE_ENV):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(os.environ[MARGINS_FILE_ENV], "a") as out:
            out.write(json.dumps({"test": test, "difference": difference, "tolerance": tolerance,
                                  "margin": difference / tolerance}) + "\n")
    return difference > CONTROL_MARGIN * tolerance


