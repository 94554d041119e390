"""The recipes' overhead at every world size: each recipe against a bare loop of its own framework at 1, 2 and
4 gloo ranks, on the GPT and on a Hugging Face Llama.

    python bench/ranks.py --out runs/bench-ranks                  # ~10 min here per recipe: make bench-ranks
    python bench/ranks.py --quick --out /tmp/bench-ranks          # about a minute: what the tests run
    python bench/ranks.py --recipes ddp accelerate --ranks 1 2    # a part of it
    python bench/ranks.py --ranks 1 --out runs/bench-ranks-gpu    # on a GPU machine: a GPU per rank (NCCL)

bench/run.py's overhead figure is measured on one process, where the harness's per-step collectives were
no-ops; at 2 ranks and more they are not. Here the bare loop (bench/bare_loop.py under torchrun: the
framework's minimal form, DDP / accelerate / DeepSpeed ZeRO-2 / FSDP2, and its own loss read every step, no other
collective; for Megatron bench/bare_megatron_loop.py: megatron-core's GPT under PyTorch's DDP)
and the recipe (its defaults: --log-every 10) run on the same model, rows and optimizer, alternated (the bare
loop first in every other pair), one thread per rank; a 4-rank run on this 2-core machine is oversubscribed,
which is where a needless synchronisation costs most. The figure: samples/s of the recipe / of the bare loop,
each the median of a run's steps after warm-up, where a step's time is its whole period (start to start);
the median of --repeats pairs and their spread. Both loops must train the same model: the recipe's loss on
every step equals the bare loop's ranks' mean (within 1e-5). Goal >= 0.97 everywhere. On a GPU machine both loops take
a GPU per rank (NCCL): there the bare loop's loss read every step is a host-device synchronisation, which the
recipe makes once per --log-every steps (not yet run on a GPU). Writes OUT/ranks.json and OUT/ranks.md
(bench/ranks.md is the last full run's, included in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from run import in_turn, make_llama, max_rel_diff, ratio_summary, run, steady_samples_per_s, WARMUP_STEPS  # noqa: E402

OVERHEAD_TARGET = 0.97
LOSS_TOLERANCE = 1e-5  # the recipe's loss on every step against the bare loop's ranks' mean
# recipe -> (the bare loop's framework options, the recipe's own options for plain data parallelism)
RECIPES = {"ddp": (("--framework", "ddp"), ()), "accelerate": (("--framework", "accelerate"), ()),
           "deepspeed": (("--framework", "deepspeed", "--zero-stage", "2"), ("--zero-stage", "2")),
           "fsdp_tp_pp": (("--framework", "fsdp", "--untie-embeddings"), ("--tp", "1")),
           # megatron-core's GPT under PyTorch's DDP in the bare loop; the recipe at TP 1, PP 1, one micro-batch
           # per rank and step, and no clipping (the bare loop does not clip)
           "megatron_tp_pp": ((), ("--clip-grad", "0"))}
BARE_LOOPS = {"megatron_tp_pp": "bare_megatron_loop.py"}  # (the others: bare_loop.py)
MODELS = {"megatron_tp_pp": ("gpt",)}  # (the others: the GPT and a Hugging Face Llama)
NOT_MEASURED = {
    "megatron_tp_pp on a Hugging Face model": "the recipe builds megatron-core's own GPT only",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs") / "bench-ranks")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat, ddp's GPT at 1 and 2 ranks: the tests")
    p.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=None, help="default: all (--quick: ddp)")
    p.add_argument("--ranks", nargs="+", type=int, default=None, help="world sizes (default 1 2 4; --quick 1 2)")
    p.add_argument("--models", nargs="+", choices=("gpt", "hf"), default=None, help="default: both (--quick: gpt)")
    p.add_argument("--repeats", type=int, default=None, help="alternated pairs per cell (default 5; --quick 1)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 20; --quick 8)")
    p.add_argument("--merge", type=Path, default=None, metavar="RANKS_JSON",
                   help="keep the cells of an earlier ranks.json that this run does not measure again")
    args = p.parse_args(argv)
    defaults = ((["ddp"], [1, 2], ["gpt"], 1, 8) if args.quick else (list(RECIPES), [1, 2, 4], ["gpt", "hf"], 5, 20))
    for name, value in zip(("recipes", "ranks", "models", "repeats", "steps"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def launch(nproc: int, script: Path, options: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, str(script), *options]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *options]


def model_options(recipe: str, model: str, quick: bool, hf_dir: Path) -> list[str]:
    layers, width, heads, seq = (2, 32, 2, 32) if quick else (4, 128, 4, 128)
    if model == "hf":
        return ["--model", f"hf:{hf_dir}", "--seq-len", str(seq)]
    if recipe == "megatron_tp_pp":  # (Megatron-LM's option names)
        return ["--seq-len", str(seq), "--num-layers", str(layers), "--num-heads", str(heads), "--hidden-size", str(width)]
    return ["--seq-len", str(seq), "--n-layer", str(layers), "--n-head", str(heads), "--n-embd", str(width)]


def recipe_run(recipe: str, work: Path, name: str, nproc: int, model: list[str], batch: int, steps: int) -> dict:
    out = work / name
    micro_batch = ["--micro-batch", str(batch)] if recipe == "megatron_tp_pp" else []  # (one per rank and step)
    run(timeout=600, cmd=launch(nproc, REPO / "recipes" / recipe / "train.py",
               ["--out-dir", str(out), "--no-resume", "--checkpoint-every", "0", "--tracker", "none", *RECIPES[recipe][1],
                *model, *micro_batch, "--global-batch", str(batch * nproc), "--max-steps", str(steps)]))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == nproc, f"{recipe}: a world of {metrics['world_size']}, not {nproc}"
    return {"samples_per_s": steady_samples_per_s(metrics["history"]), "losses": [r["loss"] for r in metrics["history"]],
            "syncs": metrics["syncs"], "wrapper": metrics["model_wrapper"]}


def bare_run(recipe: str, work: Path, name: str, nproc: int, model: list[str], batch: int, steps: int) -> dict:
    out = work / f"{name}.json"
    options = [o for o in RECIPES[recipe][0] if o != "--untie-embeddings" or "--model" not in model]  # (GPT only)
    run(timeout=600, cmd=launch(nproc, REPO / "bench" / BARE_LOOPS.get(recipe, "bare_loop.py"),
               ["--out", str(out), *options, *model, "--global-batch", str(batch * nproc), "--max-steps", str(steps)]))
    result = json.loads(out.read_text())
    assert result["world_size"] == nproc, f"bare loop: a world of {result['world_size']}, not {nproc}"
    per_rank = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(nproc)]
    return {"samples_per_s": steady_samples_per_s(result["history"]),
            "losses": [statistics.fmean(step) for step in zip(*per_rank)]}  # (the ranks' mean: the global loss)


def measure(recipe: str, work: Path, label: str, nproc: int, model: list[str], batch: int, steps: int, repeats: int) -> dict:
    pairs = [in_turn(i, lambda: recipe_run(recipe, work, f"{label}-recipe-{i}", nproc, model, batch, steps),
                     lambda: bare_run(recipe, work, f"{label}-bare-{i}", nproc, model, batch, steps))
             for i in range(repeats)]
    recipes, bares = [p[0] for p in pairs], [p[1] for p in pairs]
    differ = max(max_rel_diff(r["losses"], b["losses"]) for r, b in pairs)
    if differ > LOSS_TOLERANCE:  # (a faster loop that trains another model is no comparison)
        raise SystemExit(f"bench: error: {label}: the recipe's and the bare loop's losses differ by {differ:.2e} "
                         f"(relative; at most {LOSS_TOLERANCE}): they did not train the same model")
    overhead = ratio_summary([r["samples_per_s"] for r in recipes], [b["samples_per_s"] for b in bares])
    return {**overhead, "ranks": nproc, "meets_target": overhead["ratio"] >= OVERHEAD_TARGET,
            "recipe_samples_per_s": [r["samples_per_s"] for r in recipes],
            "bare_samples_per_s": [b["samples_per_s"] for b in bares],
            "recipe_syncs": recipes[0]["syncs"], "recipe_wrapper": recipes[0]["wrapper"],
            "loss_max_rel_diff": differ}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    batch = 4 if args.quick else 8
    import torch

    result = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                       "quick": args.quick, "host": platform.node(), "threads_per_rank": 1, "repeats": args.repeats,
                       "steps": args.steps, "warmup_steps_excluded": WARMUP_STEPS, "per_rank_batch": batch},
              "target": OVERHEAD_TARGET, "not_measured": NOT_MEASURED, "cells": []}
    with tempfile.TemporaryDirectory(prefix="hpcml-bench-ranks-") as tmp:
        work = Path(tmp)
        if "hf" in args.models:
            result["meta"]["hf_model"] = make_llama(work / "llama", quick=True)  # (2 layers, width 64: short steps)
        for recipe in args.recipes:
            for model in (model for model in args.models if model in MODELS.get(recipe, ("gpt", "hf"))):
                options = model_options(recipe, model, args.quick, work / "llama")
                for nproc in args.ranks:
                    print(f"bench: {recipe}, {model}, {nproc} rank(s): recipe vs bare loop ...", flush=True)
                    cell = measure(recipe, work, f"{recipe}-{model}-{nproc}", nproc, options, batch, args.steps,
                                   args.repeats)
                    result["cells"].append({"recipe": recipe, "model": model, **cell})
                    write(args, result)  # (after each cell: a run cut short keeps what it measured)
    write(args, result)
    print(table(result), end="")
    return 0


def write(args: argparse.Namespace, result: dict) -> None:
    """OUT/ranks.json and OUT/ranks.md of the cells measured so far (with --merge, an earlier run's others)."""
    result = {**result, "meta": dict(result["meta"]), "cells": list(result["cells"])}
    if args.merge:  # (an earlier run's cells, where this one measured nothing)
        measured = {(cell["recipe"], cell["model"], cell["ranks"]) for cell in result["cells"]}
        earlier = json.loads(args.merge.read_text())
        result["cells"] = [cell for cell in earlier["cells"]
                           if (cell["recipe"], cell["model"], cell["ranks"]) not in measured] + result["cells"]
        result["meta"]["merged_from"] = earlier["meta"]
    (args.out / "ranks.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "ranks.md").write_text(table(result))


def table(result: dict) -> str:
    cells, meta = result["cells"], result["meta"]
    ranks = sorted({cell["ranks"] for cell in cells})
    rows = sorted({(cell["recipe"], cell["model"]) for cell in cells}, key=lambda row: (list(RECIPES).index(row[0]), row[1]))
    lines = ["| recipe | model | " + " | ".join(f"{n} rank{'s' if n > 1 else ''}" for n in ranks) + " |",
             "|---|---|" + "---:|" * len(ranks)]
    for recipe, model in rows:
        found = {cell["ranks"]: cell for cell in cells if (cell["recipe"], cell["model"]) == (recipe, model)}
        lines.append(f"| {recipe} | {'Hugging Face Llama' if model == 'hf' else 'GPT'} | " + " | ".join(
            f"{found[n]['ratio']:.3f} ({min(found[n]['ratios']):.2f}-{max(found[n]['ratios']):.2f})"
            + ("" if found[n]["meets_target"] else " below") if n in found else "–" for n in ranks) + " |")
    worst = max(cell["loss_max_rel_diff"] for cell in cells)
    syncs = sorted({cell["recipe_syncs"] for cell in cells})
    repeats = sorted({len(cell["ratios"]) for cell in cells})
    lines += ["", f"Recipe / bare loop samples per second (the median of {' or '.join(map(str, repeats))} alternated pairs "
              f"per cell, the lowest "
              f"and highest pair in brackets; goal {result['target']}), {meta['steps']} steps per run, the first "
              f"{meta['warmup_steps_excluded']} left out, {meta['per_rank_batch']} rows per rank, one thread per rank; the "
              f"same model trained (losses within {worst:.1e}); the recipe's ranks met "
              f"{syncs[0] if len(syncs) == 1 else f'{syncs[0]}-{syncs[-1]}'} times in "
              f"{meta['steps']} steps. Not measured: "
              + "; ".join(f"{name}: {why}" for name, why in result["not_measured"].items()) + f". {meta['date'][:10]}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
