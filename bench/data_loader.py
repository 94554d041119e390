"""The data path's read throughput: how fast one rank turns a token file into its batches, cold (the file
dropped from the page cache first) and from the page cache, in the training process and with DataLoader
workers reading ahead, against the training throughput the loader must feed, measured in the same run.

    python bench/data_loader.py --out runs/bench-data                 # prepares the stdlib's sources (make data's corpus)
    python bench/data_loader.py --data data/stdlib/tokens --seq-len 1024 --batch 8 --out runs/bench-data
    python bench/data_loader.py --quick --out /tmp/bench-data         # seconds: what the tests run

"Cold" evicts PREFIX.bin from the page cache with posix_fadvise(DONTNEED) (no root needed), so the reads go
to the file system: a local disk here, Lustre ($SCRATCH) on Perlmutter, where the first epoch reads cold.
Each figure is the median of --repeats passes over --batches steps after the first (the workers' start-up;
samples in the recipes' shuffled order: random reads of seq_len + 1 tokens). The training figure is the DDP
recipe on one process on the same data and sequence length; ratio = loader tokens/s / training tokens/s (how
many such trainers one reader keeps fed). Writes OUT/data_loader.json and its table, OUT/data_loader.md (the
docs include bench/data_loader.md, the last full run's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
from harness.data import TokenFileData, step_batches  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=None, help="a token file prefix (default: prepare the stdlib's sources in OUT)")
    p.add_argument("--out", type=Path, default=Path("runs") / "bench-data")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="rows per step (one rank's batch)")
    p.add_argument("--batches", type=int, default=200, help="steps per pass")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers for the read-ahead figure")
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat (the tests)")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_len, args.batches, args.repeats = 256, 20, 1
    return args


def resident_bytes(path: str) -> int | None:
    """How much of ``path`` is in the page cache (util-linux's fincore; None where it is missing)."""
    result = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path], capture_output=True, text=True)
    return int(result.stdout.strip()) if result.returncode == 0 and result.stdout.strip().isdigit() else None


def evict(prefix: Path) -> int | None:
    """Drop PREFIX.bin from the page cache, so the next reads go to the file system; what stayed resident."""
    fd = os.open(f"{prefix}.bin", os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_bytes(f"{prefix}.bin")


def read_pass(prefix: Path, args: argparse.Namespace, workers: int, cold: bool, evicted: list) -> float:
    """Tokens per second of one pass over --batches steps of one rank's batches."""
    import torch

    if cold:
        evicted.append(evict(prefix))
    data = TokenFileData(prefix, args.seq_len, seed=1234)
    options = argparse.Namespace(data_workers=workers)
    batches = step_batches(data, options, range(1, args.batches + 2), args.batch, 0, 1, torch.device("cpu"))
    next(batches)  # the first batch: the workers' start-up, once per run, not the steady rate
    started, count = time.perf_counter(), 0
    for inputs, targets in batches:
        count += inputs.numel()
    return count / (time.perf_counter() - started)


def training_tokens_per_s(prefix: Path, args: argparse.Namespace, out: Path) -> float:
    """The DDP recipe, one process, on the same data and sequence length: its median tokens/s after warm-up."""
    steps = 6 if args.quick else 20
    cmd = [sys.executable, str(REPO / "recipes" / "ddp" / "train.py"), "--data", str(prefix), "--seq-len", str(args.seq_len),
           "--global-batch", str(args.batch), "--max-steps", str(steps), "--checkpoint-every", "0", "--no-resume",
           "--tensorboard", "off", "--out-dir", str(out / "ddp-run")]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    history = json.loads((out / "ddp-run" / "metrics.json").read_text())["history"]
    return statistics.median(record["tokens_per_s"] for record in history[2:])


ROWS = {"cold": "cold (evicted first; the local disk)", "page_cache": "page cache, in the training process",
        "page_cache_workers": "page cache, {workers} DataLoader workers (read-ahead)"}


def markdown(result: dict) -> str:
    """The table of a result, as the docs show it (docs/real-data.md includes bench/data_loader.md)."""
    meta, loader, training = result["meta"], result["loader"], result["training_tokens_per_s"]
    lines = ["| read | tokens/s | × the training it feeds |", "|---|---|---|"]
    lines += [f"| {ROWS[name].format(workers=figure['workers'])} | {figure['tokens_per_s']:,.0f} | {figure['ratio_to_training']:,.0f} |"
              for name, figure in loader.items()]
    lines.append(f"| training: the DDP recipe, 1 CPU rank, same data and sequence length | {training:,.0f} | 1 |")
    lines += ["", f"Measured {meta['date'][:10]} ({meta['mode']} run: {meta['tokens'] / 1e6:.1f} M tokens, batches of "
              f"{meta['batch']} × {meta['seq_len']} tokens, {meta['repeats']} passes of {meta['batches']} batches each, medians)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prefix = args.data
    if prefix is None:
        prefix = args.out / "tokens"
        subprocess.run([sys.executable, str(REPO / "recipes" / "data" / "prepare.py"), "--out", str(prefix),
                        *([str(Path(sysconfig.get_paths()["stdlib"]) / "json")] if args.quick else [])],
                       check=True, timeout=1800)
    figures = {}
    for name, workers, cold in (("cold", 0, True), ("page_cache", 0, False), ("page_cache_workers", args.workers, False)):
        evicted: list = []
        passes = [read_pass(prefix, args, workers, cold, evicted) for _ in range(args.repeats)]
        figures[name] = {"tokens_per_s": statistics.median(passes), "passes": passes, "workers": workers,
                         **({"resident_bytes_after_evict": evicted} if cold else {})}
        print(f"[bench-data] {name:20s} {figures[name]['tokens_per_s']:14,.0f} tokens/s ({workers} workers, "
              f"median of {args.repeats})", flush=True)
    training = training_tokens_per_s(prefix, args, args.out)
    print(f"[bench-data] {'training (ddp, 1 rank)':20s} {training:14,.0f} tokens/s", flush=True)
    for figure in figures.values():
        figure["ratio_to_training"] = figure["tokens_per_s"] / training
    meta = json.loads(Path(f"{prefix}.json").read_text())
    result = {"meta": {"mode": "quick" if args.quick else "full", "data": str(prefix), "tokens": meta["tokens"],
                       "bytes": os.path.getsize(f"{prefix}.bin"), "seq_len": args.seq_len, "batch": args.batch,
                       "batches": args.batches, "repeats": args.repeats,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
              "loader": figures, "training_tokens_per_s": training}
    (args.out / "data_loader.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "data_loader.md").write_text(markdown(result))
    print(f"[bench-data] loader/training: cold {figures['cold']['ratio_to_training']:.0f}x, page cache "
          f"{figures['page_cache']['ratio_to_training']:.0f}x; {args.out / 'data_loader.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
