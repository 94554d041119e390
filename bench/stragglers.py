"""The straggler check's false-positive rate on this machine, and its detection of a slow rank.

    python bench/stragglers.py [--runs 10] [--ranks 2 4] [--out bench/stragglers.json]

Runs the DDP recipe (torchrun, gloo, real processes) --runs times per world size without a fault, and 3 times
with HPCML_TEST_FAULT=slow-rank (rank 1 sleeps 30 ms in each forward pass), each with --log-every 5 over 200
steps (about 40 syncs). Records, per run, the largest ratio of one rank's forward time to the other ranks'
median that the rank kept 3 syncs in a row (metrics.json: straggler_worst_ratio), and the ranks named. The
default --straggler-factor (recipes/harness/cli.py) sits above every fault-free run's ratio; the false-positive
rate is the share of fault-free runs that named a rank (false_positives: at the default factor of the runs;
fault_free_runs_named_by_factor: at other factors, from the recorded ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "ddp" / "train.py"
ARGS = ["--seq-len", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--global-batch", "8",
        "--max-steps", "200", "--log-every", "5", "--checkpoint-every", "0"]


sys.path.insert(0, str(REPO / "recipes"))
from harness.cli import STRAGGLER_FACTOR  # noqa: E402  (the runs' --straggler-factor: the default)


def one_run(ranks: int, fault: str | None, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HPCML_ALLOW_CPU": "1"}
    env.pop("HPCML_TEST_FAULT", None)
    if fault:
        env["HPCML_TEST_FAULT"] = fault
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), str(RECIPE),
                             "--out-dir", str(out), *ARGS], env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"the run failed:\n{result.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    return {"worst_ratio": metrics["straggler_worst_ratio"], "named": [s["rank"] for s in metrics["stragglers"]],
            "syncs": metrics["syncs"]}


FACTORS = (1.5, 2.0, 2.5, 3.0)


def by_factor(ratios: list[float]) -> dict[str, int]:
    """How many runs a factor would have named a rank in (their ratio above it; the check's 2-ms floor aside)."""
    return {f"{factor:g}": sum(1 for ratio in ratios if ratio > factor) for factor in FACTORS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "stragglers.json")
    args = p.parse_args()
    table = {}
    with tempfile.TemporaryDirectory() as scratch:
        for ranks in args.ranks:
            runs = {}
            for fault, count in ((None, args.runs), ("slow-rank", 3)):
                records = [one_run(ranks, fault, Path(scratch) / f"{ranks}-{fault}-{i}") for i in range(count)]
                runs[fault or "none"] = records
                print(ranks, fault, [(r["worst_ratio"], r["named"]) for r in records], flush=True)
            clean = runs["none"]
            table[str(ranks)] = {
                "fault_free_runs": len(clean),
                "false_positives": sum(1 for r in clean if r["named"]),
                "fault_free_worst_ratios": sorted(r["worst_ratio"] for r in clean),
                "slow_rank_named": [r["named"] for r in runs["slow-rank"]],
                "slow_rank_worst_ratios": [r["worst_ratio"] for r in runs["slow-rank"]],
                "fault_free_runs_named_by_factor": by_factor([r["worst_ratio"] for r in clean]),
                "slow_rank_runs_named_by_factor": by_factor([r["worst_ratio"] for r in runs["slow-rank"]]),
            }
    args.out.write_text(json.dumps({"what": "forward-time ratio of a rank to the others' median, 3 syncs in a row; "
                                            "DDP recipe, gloo, this machine", "straggler_factor_in_runs": STRAGGLER_FACTOR,
                                    "by_ranks": table}, indent=2) + "\n")
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
