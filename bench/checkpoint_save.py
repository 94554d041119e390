"""How long a checkpoint holds training up: the FSDP2 recipe's DCP save, written in the foreground (training
waits for the files) against --async-checkpoint (training waits only for the copy of the state to CPU
memory; the files are written in the background while the next steps run), measured in the same run.

    python bench/checkpoint_save.py --out runs/bench-checkpoint           # 2 ranks, a 4 x 512 GPT (~30M parameters)
    python bench/checkpoint_save.py --quick --out /tmp/bench-checkpoint    # seconds: what the tests run

Each mode trains --steps steps on --ranks ranks (torchrun, gloo on CPU; NCCL on a GPU node) with a checkpoint
every 2 steps; the recipe records each save's blocking time (metrics.json: checkpoint_blocking_s, from the
save's start until training may go on, the wait for a previous pending save included). The figure is the
median over the saves, and the checkpoint's size on disk; ratio = async / sync. The steps' own time is kept
too (mean_step_time_s, steps_and_saves_s): a background write shares the CPU with the steps it overlaps. Both
runs must have the same losses (the background write must not change training). Writes
OUT/checkpoint_save.json (bench/checkpoint_save.json: the last full run's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "fsdp_tp_pp" / "train.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs") / "bench-checkpoint")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--quick", action="store_true", help="a small model, few steps (the tests)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.n_layer, args.n_embd = 6, 2, 128
    return args


def train(args: argparse.Namespace, out_dir: Path, *extra: str) -> dict:
    shutil.rmtree(out_dir, ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
               str(RECIPE), "--tp", "1", "--out-dir", str(out_dir), "--max-steps", str(args.steps),
               "--checkpoint-every", "2", "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", "4",
               "--seq-len", "64", "--global-batch", str(2 * args.ranks), "--tracker", "none", "--log-every", "100", *extra]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        sys.exit(f"checkpoint_save: {' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    metrics = json.loads((out_dir / "metrics.json").read_text())
    checkpoint = sorted((out_dir / "checkpoints").iterdir())[-1]
    size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    blocking = metrics["checkpoint_blocking_s"]
    return {"blocking_s": statistics.median(blocking), "saves": blocking, "checkpoint_bytes": size,
            "mean_step_time_s": statistics.mean(r["step_time_s"] for r in metrics["history"][1:]),
            # what the run took, steps and saves (a write in the background may slow the steps it overlaps)
            "steps_and_saves_s": sum(r["step_time_s"] for r in metrics["history"]) + sum(blocking),
            "losses": [r["loss"] for r in metrics["history"]], "async": metrics["async_checkpoint"],
            "n_params": metrics["n_params"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sync = train(args, args.out / "sync")
    background = train(args, args.out / "async", "--async-checkpoint")
    if sync["losses"] != background["losses"] or sync["async"] or not background["async"]:
        sys.exit("checkpoint_save: the async run trained differently from the sync run (or a mode did not apply)")
    result = {
        "meta": {"mode": "quick" if args.quick else "full", "recipe": "fsdp_tp_pp (FSDP2, DCP)", "ranks": args.ranks,
                 "steps": args.steps, "checkpoint_every": 2, "n_layer": args.n_layer, "n_embd": args.n_embd,
                 "n_params": sync["n_params"], "device": "cpu (gloo)",
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        "sync": {k: v for k, v in sync.items() if k not in ("losses", "async", "n_params")},
        "async": {k: v for k, v in background.items() if k not in ("losses", "async", "n_params")},
        "ratio_async_to_sync_blocking": background["blocking_s"] / sync["blocking_s"],
        "same_losses": True,
    }
    (args.out / "checkpoint_save.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"checkpoint_save: {sync['checkpoint_bytes'] / 1e6:.0f} MB checkpoint, training held up "
          f"{sync['blocking_s'] * 1e3:.0f} ms (sync) vs {background['blocking_s'] * 1e3:.0f} ms (async) per save, "
          f"ratio {result['ratio_async_to_sync_blocking']:.2f}; {args.out / 'checkpoint_save.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
