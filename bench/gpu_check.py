"""GPU check: tokens/s and MFU of a ~1.3B-parameter GPT: the DDP recipe (eager, torch.compile), Megatron (TP=1)
and the PyTorch-native recipe (FSDP2 over every GPU; TP over the GPUs of the node), all bf16 and NCCL.

    python bench/gpu_check.py --out runs/gpu-check            # every GPU of this machine, one rank each
    python bench/gpu_check.py --out runs/gpu-check --nproc 1  # one GPU
    python bench/gpu_check.py --out runs/gpu-check --only megatron-tp1
    python bench/gpu_check.py --out runs/gpu-check --only fsdp2 --only tp-node
    make gpu-check

Run it on a GPU machine (a lent H200, a Perlmutter node: `srun -N 1 -G 4 --pty ...`). It writes
OUT/gpu_check.json with the GPU, the driver-visible CUDA and NCCL versions and, per mode, tokens/s per
GPU and MFU against the data-sheet bf16 peak (recipes/harness/metrics.py: GPU_PEAK_FLOPS), rank 0's peak GPU
memory (allocated and reserved) and the data loader's share of the step time. Without a GPU it
measures nothing, says so, and exits 2: there is no CPU fallback that could be mistaken for a result.
The Megatron recipe runs the same GPT shape at TP=1 (one model per GPU, DP over the GPUs), with
Transformer Engine's layers where TE is installed (the megatron:cuda image) and megatron's own otherwise;
the report says which. Megatron's MFU counts 6N + 12*L*d*T FLOPs per token, as the DDP recipe's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# ~1.3B parameters: 24 layers, width 2048, 16 heads, 1024 tokens, GPT-2's padded vocabulary.
MODEL = ["--n-layer", "24", "--n-embd", "2048", "--n-head", "16", "--seq-len", "1024", "--vocab-size", "50304"]
MEGATRON_MODEL = ["--num-layers", "24", "--hidden-size", "2048", "--num-heads", "16", "--seq-len", "1024",
                  "--vocab-size", "50304", "--tp", "1", "--pp", "1", "--micro-batch", "4"]
# mode -> (recipe, its arguments besides the batch)
MODES = {
    "eager": ("ddp", MODEL),
    "compile": ("ddp", [*MODEL, "--compile"]),
    "megatron-tp1": ("megatron_tp_pp", MEGATRON_MODEL),
    # recipes/fsdp_tp_pp: FSDP2 (bf16 parameters, fp32 reductions) over every GPU; then TP over them
    # (its default under torchrun: TP = the ranks of the node). Untied head: slightly more parameters.
    "fsdp2": ("fsdp_tp_pp", [*MODEL, "--tp", "1"]),
    "tp-node": ("fsdp_tp_pp", MODEL),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: every visible GPU)")
    p.add_argument("--batch-per-gpu", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--only", choices=sorted(MODES), action="append", help="run only this mode (repeatable)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.date.today().isoformat(), "torch": torch.__version__}
    if not torch.cuda.is_available():
        report["gpu"] = None
        report["result"] = "no GPU on this machine: nothing measured"
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
        print("gpu-check: error: no CUDA device here; run this on a GPU machine", file=sys.stderr)
        return 2
    nproc = args.nproc or torch.cuda.device_count()
    report.update(gpu=torch.cuda.get_device_name(0), gpus=nproc, cuda=torch.version.cuda,
                  nccl=".".join(map(str, torch.cuda.nccl.version())), model=MODEL, batch_per_gpu=args.batch_per_gpu)
    modes = args.only or list(MODES)
    for mode in modes:
        recipe, recipe_args = MODES[mode]
        out = args.out / mode
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(REPO / "recipes" / recipe / "train.py"), "--out-dir", str(out), "--no-resume", "--checkpoint-every", "0",
               "--max-steps", str(args.steps), "--global-batch", str(args.batch_per_gpu * nproc), "--log-every", "5",
               *recipe_args]
        print(f"gpu-check: {mode}: {' '.join(cmd[3:])}", flush=True)
        status = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "8"}).returncode
        if status != 0:
            report[mode] = {"error": f"exit code {status}"}
            continue
        metrics = json.loads((out / "metrics.json").read_text())
        # Leave out the first 5 steps: CUDA/NCCL warm-up, and torch.compile's compilation.
        steady = metrics["history"][5:]
        tokens_per_s = sum(r["tokens_per_s"] for r in steady) / len(steady)
        report[mode] = {"tokens_per_s_per_gpu": tokens_per_s / nproc, "mfu": sum(r["mfu"] for r in steady) / len(steady),
                        "peak_flops_per_gpu": metrics["summary"]["peak_flops_per_device"],
                        "peak_source": metrics["summary"]["peak_source"], "backend": metrics["backend"],
                        "world_size": metrics["world_size"], "final_loss": metrics["summary"]["final_loss"],
                        "recipe": recipe, "layout": metrics.get("layout"), "n_params": metrics.get("n_params"),
                        # rank 0's peak (torch.cuda.max_memory_allocated/reserved) and the loader's share of the steps
                        "peak_memory": metrics.get("peak_memory"), "data_wait_share": metrics.get("data_wait_share")}
        print(f"gpu-check: {mode}: {report[mode]['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, "
              f"MFU {100 * report[mode]['mfu']:.1f}%", flush=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpu-check: wrote {args.out / 'gpu_check.json'}")
    return 0 if all("error" not in report.get(mode, {}) for mode in modes) else 1


if __name__ == "__main__":
    sys.exit(main())
