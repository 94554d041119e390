"""Will Llama-3-8B and -70B fit on Perlmutter: the table of docs/which-parallelism.md, from config.json alone.

    python bench/fit_table.py --out runs/fit-table          # ~10 minutes here: make fit-table
    python bench/fit_table.py --quick --out /tmp/fit-table   # one layout of the 8B: what the tests run

Nothing is downloaded: each model is its config.json, written here from Meta's published shapes (Llama 3
model card and config: 8B: 32 layers, hidden 4096, MLP 14336, 32 heads, 8 key/value heads, vocabulary 128256;
70B: 80 layers, hidden 8192, MLP 28672, 64 heads, 8 key/value heads). For each layout, recipes/fsdp_tp_pp
--estimate-memory --world N builds the model on fake tensors (no weights) under the real FSDP2/TP code and
tracks two AdamW steps at 1 row of --seq-len tokens per data-parallel rank, bf16 compute, fp32 master weights:
the per-GPU peak, and the host memory a 4-GPU node needs to load (one tensor at a time per rank) and to write
an --async-checkpoint. ZeRO-3 is DeepSpeed's own estimate of its model states
(estimate_zero3_model_states_mem_needs, no offload) plus the same layout's activations from the FSDP2 estimate
(DeepSpeed's engine cannot be built on fake tensors for a Hugging Face model; recipes/deepspeed recomputes
activations only with --pp, so ZeRO-3 has rows without activation checkpointing only). A100-40 and A100-80: 90% of
each GPU usable (harness/memory.py). Writes OUT/fit_table.json and OUT/fit_table.md (bench/fit_table.md is
the last full run's, included in docs/which-parallelism.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "fsdp_tp_pp" / "train.py"
GIB = 2**30
USABLE = 0.9
GPUS = {"A100-40": 40 * GIB, "A100-80": 80 * GIB}

LLAMA_3 = {  # Meta's published shapes (config.json of meta-llama/Meta-Llama-3-8B and -70B)
    "Llama-3-8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8},
    "Llama-3-70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
}
COMMON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
          "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}
# (model, nodes, tp): FSDP2 over the rest of the 4 x nodes GPUs
LAYOUTS = [("Llama-3-8B", 2, 1), ("Llama-3-8B", 4, 1), ("Llama-3-8B", 4, 4),
           ("Llama-3-70B", 8, 1), ("Llama-3-70B", 16, 1), ("Llama-3-70B", 16, 4)]


def write_config(directory: Path, model: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**COMMON, **LLAMA_3[model]}, indent=1) + "\n")
    return directory


def estimate(model_dir: Path, world: int, tp: int, seq_len: int, checkpointing: bool, out: Path) -> dict:
    """recipes/fsdp_tp_pp --estimate-memory for this layout: its JSON (peak bytes by kind, host bytes per rank)."""
    target = out / f"{model_dir.name}-w{world}-tp{tp}-ac{int(checkpointing)}.json"
    command = [sys.executable, str(RECIPE), "--out-dir", str(out / "scratch"), "--model", f"hf:{model_dir}",
               "--tp", str(tp), "--dp-shard", str(world // tp), "--vocab-size", str(COMMON["vocab_size"]),
               "--seq-len", str(seq_len), "--global-batch", str(world // tp), "--estimate-memory", "a100-80",
               "--world", str(world), "--estimate-json", str(target)] + (["--activation-checkpointing"] if checkpointing else [])
    done = subprocess.run(command, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if done.returncode not in (0, 1):  # (1: it does not fit an A100-80; the figures are still written)
        raise SystemExit(f"estimate failed: {' '.join(command)}\n{done.stderr[-2000:]}")
    return json.loads(target.read_text())


def parameters(model: str) -> tuple[int, int]:
    """(the model's parameters, its largest layer's: a decoder layer, or the embedding)."""
    shape = {**COMMON, **LLAMA_3[model]}
    h, m, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * m + 2 * h
    return shape["num_hidden_layers"] * layer + 2 * v * h + h, max(layer, v * h)


def zero3_model_states(model: str, nodes: int) -> tuple[int, int]:
    """DeepSpeed's own estimate of ZeRO-3's model states, no offload, zero.Init: (per GPU, per node's host)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    total, largest = parameters(model)
    host, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=4, num_nodes=nodes,
                                                          cpu_offload=False, zero_init=True)
    return gpu, host


def verdicts(total: int) -> dict[str, bool]:
    return {gpu: total <= USABLE * capacity for gpu, capacity in GPUS.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--quick", action="store_true", help="one layout of the 8B, without activation checkpointing")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    layouts = LAYOUTS[:1] if args.quick else LAYOUTS
    rows = []
    for model, nodes, tp in layouts:
        model_dir = write_config(args.out / "models" / model, model)
        world = 4 * nodes
        for checkpointing in ([False] if args.quick else [False, True]):
            fsdp = estimate(model_dir, world, tp, args.seq_len, checkpointing, args.out)
            host = fsdp["host_bytes_per_rank"]
            name = f"FSDP2 {world // tp}" + (f" x TP {tp}" if tp > 1 else "")
            command = (f"sbatch -N {nodes} slurm/fsdp_tp_pp.sh --model hf:$SCRATCH/models/{model} --tp {tp} "
                       f"--dp-shard {world // tp} --vocab-size 128256 --seq-len {args.seq_len} --global-batch {world // tp}"
                       + (" --activation-checkpointing" if checkpointing else ""))
            rows.append({"model": model, "nodes": nodes, "layout": name, "activation_checkpointing": checkpointing,
                         "gpu_bytes": fsdp["peak_bytes"]["total"], "fits": verdicts(fsdp["peak_bytes"]["total"]),
                         "host_load_bytes_per_node": 4 * host["load"],
                         "host_async_checkpoint_bytes_per_node": 4 * host["async_checkpoint"], "sbatch": command})
            if tp == 1 and not checkpointing:  # ZeRO-3 on the same ranks: DeepSpeed's model states + the same
                # activations (recipes/deepspeed recomputes activations only with --pp: no row with it on)
                states, host_node = zero3_model_states(model, nodes)
                total = states + fsdp["peak_bytes"]["activations"]
                rows.append({"model": model, "nodes": nodes, "layout": f"ZeRO-3 {world}",
                             "activation_checkpointing": checkpointing, "gpu_bytes": total, "fits": verdicts(total),
                             "host_load_bytes_per_node": host_node, "host_async_checkpoint_bytes_per_node": None,
                             "sbatch": (f"sbatch -N {nodes} slurm/deepspeed.sh --model hf:$SCRATCH/models/{model} "
                                        f"--zero-stage 3 --vocab-size 128256 --seq-len {args.seq_len} --global-batch {world}")})
            print(f"{model} {nodes} nodes {name} AC {checkpointing}: {fsdp['peak_bytes']['total'] / GIB:.1f} GiB per GPU",
                  flush=True)
    result = {"date": datetime.date.today().isoformat(), "seq_len": args.seq_len, "rows_per_rank": 1, "rows": rows}
    (args.out / "fit_table.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "fit_table.md").write_text(table(result))
    print(table(result))
    return 0


def table(result: dict) -> str:
    lines = [f"Llama 3 on Perlmutter GPU nodes (4 x A100 each), {result['rows_per_rank']} row of {result['seq_len']} tokens "
             "per data-parallel rank, bf16 compute, fp32 weights and AdamW; estimated from config.json "
             f"(bench/fit_table.py, {result['date']}). Host memory per node besides the processes (256 GB per node).",
             "",
             "| model | nodes | layout | act. ckpt | per GPU | A100-40 | A100-80 | host: load | host: async ckpt "
             "| sbatch (where it fits) |",
             "|---|---:|---|:-:|---:|:-:|:-:|---:|---:|---|"]
    for row in result["rows"]:
        fits = row["fits"]
        gib = lambda value: "-" if value is None else f"{value / GIB:.1f} GiB"  # noqa: E731
        lines.append(f"| {row['model']} | {row['nodes']} | {row['layout']} | {'on' if row['activation_checkpointing'] else 'off'} "
                     f"| {gib(row['gpu_bytes'])} | {'fits' if fits['A100-40'] else 'no'} | {'fits' if fits['A100-80'] else 'no'} "
                     f"| {gib(row['host_load_bytes_per_node'])} | {gib(row['host_async_checkpoint_bytes_per_node'])} "
                     f"| {'`' + row['sbatch'] + '`' if any(fits.values()) else ''} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
