"""All-reduce bandwidth across a job: the measurement of nccl-tests' all_reduce_perf, through PyTorch.

    sbatch slurm/nccl_check.sh                 # Perlmutter: 2 nodes x 4 GPUs, in the ddp image (make nccl-check)
    torchrun --standalone --nproc_per_node=4 bench/allreduce.py --out-dir runs/allreduce
    srun -N 2 --ntasks-per-node=1 python bench/allreduce.py --out-dir runs/allreduce --max-bytes 4M   # CPU/gloo

For each message size it times --iters all-reduces (after --warmup) and reports, like all_reduce_perf,
algbw = bytes / time and busbw = algbw * 2(n-1)/n. On GPU (NCCL) it then fails (exit 1, one line) when
NCCL used its TCP socket transport instead of the libfabric (Slingshot) plugin, read from NCCL's own
debug log, or when busbw at the largest size is below --min-busbw (default 50 GB/s; about 70 GB/s was
measured on Perlmutter between two nodes at 4 GiB). Rank 0 writes OUT_DIR/allreduce.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import harness  # noqa: E402

NAME = "allreduce"
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def size_in_bytes(text: str) -> int:
    number, unit = (text[:-1], text[-1].upper()) if text[-1].upper() in UNITS else (text, "")
    try:
        value = int(number) * UNITS.get(unit, 1)
    except ValueError:
        raise harness.ConfigError(f"'{text}' is not a size (e.g. 1M, 4G)") from None
    if value < 4:
        raise harness.ConfigError(f"size '{text}' is smaller than one float32")
    return value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("runs/allreduce"))
    p.add_argument("--min-bytes", default="1M")
    p.add_argument("--max-bytes", default="4G")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--min-busbw", type=float, default=50.0, help="GB/s at the largest size, checked on GPU only")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--preflight", type=int, default=None, metavar="WORLD_SIZE")
    args = p.parse_args()
    low, high = size_in_bytes(args.min_bytes), size_in_bytes(args.max_bytes)
    if low > high or args.iters < 1 or args.warmup < 0:
        raise harness.ConfigError("need --min-bytes <= --max-bytes, --iters >= 1 and --warmup >= 0")
    if args.preflight is not None:
        if args.preflight < 2:
            raise harness.ConfigError(f"an all-reduce check needs at least 2 ranks, the job has {args.preflight}")
        # (in the image with the job's modules: the network plugin is opened here too, harness/image_checks.py)
        return harness.preflight_line(NAME, args, f"{args.preflight} ranks, {args.min_bytes} to {args.max_bytes}", None)

    env = harness.detect_dist_env()
    if env.world_size < 2:
        raise harness.ConfigError("an all-reduce check needs at least 2 ranks")
    if env.rank == 0:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    # NCCL's own account of the transport it chose, one file per process (read back by rank 0 below): at
    # INFO or more, whatever the job set (a launcher's WARN would hide the NET/ lines the check reads).
    if os.environ.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        os.environ["NCCL_DEBUG"] = "INFO"
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    os.environ.setdefault("NCCL_DEBUG_FILE", str(args.out_dir.resolve() / "nccl.%h.%p.log"))
    device, backend = harness.setup_torch_distributed(env, args.timeout_s)
    factor = 2 * (env.world_size - 1) / env.world_size

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    results = []
    size = low
    while size <= high:
        buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(buffer)
        synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(buffer)
        synchronize()
        seconds = (time.perf_counter() - start) / args.iters
        # every rank contributed ones, reduced --warmup + --iters times: a wrong reduction shows here
        expected = float(env.world_size) ** (args.warmup + args.iters)
        correct = bool(torch.allclose(buffer[:8].double().cpu(), torch.full((8,), expected, dtype=torch.float64), rtol=1e-3)) \
            if expected < 3e38 else None
        algbw = size / seconds / 1e9
        results.append({"bytes": size, "time_us": seconds * 1e6, "algbw_gbs": algbw, "busbw_gbs": algbw * factor,
                        "correct": correct})
        if env.rank == 0:
            print(f"[{NAME}] {size:>12d} B  {seconds * 1e6:10.1f} us  algbw {algbw:8.2f} GB/s  busbw {algbw * factor:8.2f} GB/s",
                  flush=True)
        del buffer
        size *= 4

    status, problems = 0, []
    if env.rank == 0:
        transport = "gloo (CPU)"
        if backend == "nccl":
            log_text = "".join(p.read_text(errors="replace") for p in args.out_dir.glob(f"nccl.*.{os.getpid()}.log"))
            transport = "libfabric (NET/OFI)" if "NET/OFI" in log_text else ("TCP sockets (NET/Socket)" if "NET/Socket" in log_text
                                                                              else "unknown (no NET line in NCCL's log)")
            if "NET/OFI" not in log_text:
                problems.append(f"NCCL did not use the libfabric plugin: transport {transport}; load the nccl-plugin module")
            if results[-1]["busbw_gbs"] < args.min_busbw:
                problems.append(f"busbw {results[-1]['busbw_gbs']:.1f} GB/s at {results[-1]['bytes']} B is below "
                                f"--min-busbw {args.min_busbw} GB/s")
        if any(r["correct"] is False for r in results):
            problems.append("an all-reduce returned a wrong sum")
        harness.atomic_write_bytes(args.out_dir / "allreduce.json", (json.dumps({
            **harness.describe_run(env, backend, device, "none"), "transport": transport, "results": results,
            "problems": problems}, indent=1) + "\n").encode())
        for problem in problems:
            print(f"[{NAME}] error: {problem}", file=sys.stderr, flush=True)
        status = 1 if problems else 0
    flag = torch.tensor([status], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    dist.barrier()
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    harness.main_entry(NAME, main)
