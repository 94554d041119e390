"""What start-up, checkpoints and gradient all-reduces cost at 64-512 Perlmutter nodes: a model fitted to the
scale tier's measured figures (2-16 local nodes) and built on Perlmutter's published network and file-system
figures, with its fit error.

    make test-scale                                                     # measures, then runs this
    python bench/scale_model.py --out runs/scale      # the committed runs of the tier (bench/scale_timings/*.json), pooled

Inputs (each named in the JSON with its source):
- measured here (--timings: one or more runs of tests/test_scale.py, pooled): per node count, the launcher's preflight, srun + runtime to
  the Python process, imports, the rendezvous after the last rank arrived, setup + the first step, the
  time-limit signal to the requeued job's first step. Every local "node" shares this host's CPUs: a figure
  that grows only because more processes share them (imports, the first step) is turned into its one-rank
  value (wall time x CPUs / ranks, with more ranks than CPUs) instead of being extrapolated;
- measured here, now: how many files and directories one rank's `import torch` opens and lists (Python's
  audit hooks): from a bare venv on a shared file system every one is a metadata request, from an image
  (a squashfs mounted on each node) none is;
- published: Slingshot-11 on Perlmutter GPU nodes (4 NICs per node, 200 Gb/s = 25 GB/s each way per NIC),
  NCCL's own per-step latencies for inter-node rings and trees (its tuning model), Perlmutter scratch's
  aggregate bandwidth (>5 TB/s).

Models:
- a start-up component c(N) is fitted as constant, a + b log2 N and a + b N (least squares). Fit error: the
  RMS relative residual over the measured points, and the error of predicting the largest node count from
  the others (hold-out), which chooses the form (the simplest within 2 points of the best). A component no
  form predicts within 50% (noise above its growth) is projected as its largest measured value (form "max");
- all-reduce of M bytes over N nodes (α–β): ring 2(N-1)α_ring + 2(N-1)/N · M/B, tree 2⌈log2 N⌉α_tree + 2M/B,
  B = a node's 4 NICs together (NCCL runs one ring/tree per NIC; NVLink inside a node is left out);
- checkpoint of S bytes: S / min(N · node write bandwidth, the file system's aggregate);
- requeue: from the time-limit signal to the requeued batch script as measured here (Slurm holds a requeued
  job until its step credentials expire, cred_expire, 120 s by default, then schedules it), plus the start-up;
- image lookups per job start: 1 (slurm/lib/launch.sh resolves the image once) against 4N (every rank
  asking Shifter's gateway).

Writes OUT/scale_model.json, OUT/scale_model.md (the tables docs/scale.md quotes) and OUT/scale_model.png.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECTED_NODES = (64, 128, 256, 512)
GPUS_PER_NODE = 4

# Published figures, each with where it comes from.
PERLMUTTER = {
    "nics_per_node": {"value": 4, "source": "NERSC Perlmutter architecture: 4 Slingshot-11 NICs per GPU node, one per A100"},
    "nic_bandwidth_bytes_s": {"value": 25e9, "source": "Slingshot-11: 200 Gb/s per NIC each way (De Sensi et al., SC20, arXiv:2008.08886)"},
    "ring_step_latency_s": {"value": 9.6e-6,
                            "source": "NCCL's tuning model, inter-node ring step, Simple protocol (src/graph/tuning.cc hwLat NET)"},
    "tree_step_latency_s": {"value": 50e-6,
                            "source": "NCCL's tuning model, inter-node tree step, Simple protocol (a 256 kB chunk; same table)"},
    "nvlink_bandwidth_bytes_s": {"value": 300e9, "source": "NVIDIA A100: NVLink 3, 600 GB/s per GPU in both directions together"},
    "scratch_bandwidth_bytes_s": {"value": 5e12, "source": "docs.nersc.gov, Perlmutter scratch: aggregate bandwidth >5 TB/s"},
}
# Models whose gradients and checkpoints the projections are for (parameters; bf16 gradients; a checkpoint of
# fp32 weights and Adam's two moments = 12 bytes per parameter), and DDP's default bucket.
MODELS = {"GPT-2 124M": 124e6, "1.3B": 1.3e9, "7B": 7e9}
DDP_BUCKET_BYTES = 25 * 2**20
CHECKPOINT_BYTES_PER_PARAM = 12
GRADIENT_BYTES_PER_PARAM = 2
# Tensor parallelism all-reduces the activations of every layer: 2 in the forward and 2 in the backward pass
# (Megatron-LM's column/row split), each of micro-batch x sequence x hidden bf16 values. For the 1.3B shape:
TP_SHAPE = {"layers": 24, "hidden": 2048, "seq_len": 2048, "micro_batch": 1, "tp": 4}
# A node's write rate for a checkpoint as measured here (bench/checkpoint_save.json: DCP, 2 ranks, one node's
# local disk, serialisation included): the lower bound beside the network and file system's peak.
CHECKPOINT_BENCH = REPO / "bench" / "checkpoint_save.json"

FORMS = {"constant": None, "log2": math.log2, "linear": float}
NO_TREND_ERROR = 0.5  # a hold-out error above this: no form fits; the largest measured value is projected
# Start-up components measured per run, and whether they are fitted against N or reduced to one rank's cost
# (those that grow here only because every local node shares this host's CPUs).
FITTED = ("preflight_s", "srun_to_process_s", "rendezvous_after_last_arrival_s")
PER_RANK = ("imports_s", "setup_and_first_step_s")


def fit(nodes: list[int], values: list[float]) -> dict:
    """The best of FORMS for values(nodes) by least squares (a node count may repeat: several runs), with its
    RMS relative error and the mean relative error of predicting the largest node count from the others."""
    def solve(xs: list[int], ys: list[float], form: str) -> tuple[float, float]:
        if FORMS[form] is None:
            return sum(ys) / len(ys), 0.0
        fx = [FORMS[form](x) for x in xs]
        mean_f, mean_y = sum(fx) / len(fx), sum(ys) / len(ys)
        var = sum((f - mean_f) ** 2 for f in fx)
        slope = sum((f - mean_f) * (y - mean_y) for f, y in zip(fx, ys)) / var if var else 0.0
        return mean_y - slope * mean_f, slope

    def predict(a: float, b: float, form: str, n: int) -> float:
        return a if FORMS[form] is None else a + b * FORMS[form](n)

    results = {}
    for form in FORMS:
        a, b = solve(nodes, values, form)
        rms = math.sqrt(sum(((predict(a, b, form, n) - y) / y) ** 2 for n, y in zip(nodes, values)) / len(nodes))
        largest = max(nodes)
        held = [(n, y) for n, y in zip(nodes, values) if n != largest]
        held_a, held_b = solve([n for n, _ in held], [y for _, y in held], form)
        targets = [y for n, y in zip(nodes, values) if n == largest]
        hold_out = sum(abs(predict(held_a, held_b, form, largest) - y) / y for y in targets) / len(targets)
        results[form] = {"a": a, "b": b, "rms_relative_error": rms, "hold_out_relative_error": hold_out}
    # The form that predicts the largest node count best from the smaller ones (what a projection does);
    # between near-equals (within 2 points), the simpler one.
    best = min(results, key=lambda form: results[form]["hold_out_relative_error"])
    for form in FORMS:  # constant, log2, linear: simplest first
        if results[form]["hold_out_relative_error"] <= results[best]["hold_out_relative_error"] + 0.02:
            best = form
            break
    if results[best]["hold_out_relative_error"] > NO_TREND_ERROR:
        # No form predicts it: noise larger than any growth over the measured counts. Projected as its
        # largest measured value, and said so (form "max").
        return {"form": "max", **results[best], "forms": results,
                "projected": {n: max(values) for n in (*sorted(set(nodes)), *PROJECTED_NODES)}}
    return {"form": best, **results[best], "forms": results,
            "projected": {n: predict(results[best]["a"], results[best]["b"], best, n)
                          for n in (*sorted(set(nodes)), *PROJECTED_NODES)}}


def ring_allreduce_s(nbytes: float, nodes: int, alpha: float, bandwidth: float) -> float:
    return 2 * (nodes - 1) * alpha + 2 * (nodes - 1) / nodes * nbytes / bandwidth


def tree_allreduce_s(nbytes: float, nodes: int, alpha: float, bandwidth: float) -> float:
    return 2 * math.ceil(math.log2(nodes)) * alpha + 2 * nbytes / bandwidth


def checkpoint_s(nbytes: float, nodes: int, node_bandwidth: float, aggregate: float) -> float:
    return nbytes / min(nodes * node_bandwidth, aggregate)


def tp_allreduces_per_microbatch_s(bandwidth: float, alpha: float) -> float:
    """The activation all-reduces of one micro-batch through every layer, TP_SHAPE["tp"] ranks in a ring."""
    shape = TP_SHAPE
    nbytes = shape["micro_batch"] * shape["seq_len"] * shape["hidden"] * 2
    one = 2 * (shape["tp"] - 1) * alpha + 2 * (shape["tp"] - 1) / shape["tp"] * nbytes / bandwidth
    return 4 * shape["layers"] * one


def import_metadata_requests(python: str, module: str = "torch") -> dict:
    """Files opened and directories listed by one `import MODULE` (Python's audit events): the metadata
    requests each rank sends a shared file system when it imports from a bare venv there."""
    probe = f"""
import json, sys
counts = {{"open": 0, "os.listdir": 0, "os.scandir": 0}}
def hook(event, args):
    if event in counts:
        counts[event] += 1
sys.addaudithook(hook)
import {module}
print(json.dumps({{"files_opened": counts["open"], "directories_listed": counts["os.listdir"] + counts["os.scandir"],
                  "modules": len(sys.modules)}}))
"""
    result = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise SystemExit(f"scale_model: error: {python} cannot import {module}: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def per_rank(value: float, ranks: int, cpus: int) -> float:
    """One rank's cost from a wall time measured with `ranks` processes sharing `cpus` CPUs."""
    return value * min(ranks, cpus) / ranks if ranks > cpus else value


def model(tier_runs: list[dict], imports: dict, checkpoint_bench: dict) -> dict:
    """The model from one or more runs of the scale tier (their figures pooled: each node count measured once
    per run)."""
    cpus = {timings["host"]["cpus"] for timings in tier_runs}
    if len(cpus) != 1:
        raise SystemExit(f"scale_model: error: the timings come from hosts with {sorted(cpus)} CPUs: pool runs of one host only")
    cpus = cpus.pop()
    runs = [(index, key, run) for index, timings in enumerate(tier_runs, 1) for key, run in timings["runs"].items()]
    ddp = sorted(({**run, "tier_run": index} for index, key, run in runs if key.startswith("ddp-")),
                 key=lambda run: (run["nodes"], run["tier_run"]))
    if len({run["nodes"] for run in ddp}) < 3:
        raise SystemExit(f"scale_model: error: {len(ddp)} DDP runs in the timings, 3 node counts at least needed: run make test-scale")
    nodes = [run["nodes"] for run in ddp]

    def measured(name: str) -> dict:
        return {n: [run[name] for run in ddp if run["nodes"] == n] for n in sorted(set(nodes))}

    startup = {name: {"measured": measured(name), **fit(nodes, [run[name] for run in ddp])} for name in FITTED}
    one_rank = {name: {"measured": measured(name),
                       "per_rank_s": [per_rank(run[name], run["ranks"], cpus) for run in ddp]} for name in PER_RANK}
    for entry in one_rank.values():
        entry["projected_per_rank_s"] = sum(entry["per_rank_s"]) / len(entry["per_rank_s"])

    p = {name: entry["value"] for name, entry in PERLMUTTER.items()}
    node_bandwidth = p["nics_per_node"] * p["nic_bandwidth_bytes_s"]
    measured_write = checkpoint_bench["sync"]["checkpoint_bytes"] / checkpoint_bench["sync"]["blocking_s"]
    requeued = [run["signal_to_requeued_batch_s"] for _, key, run in runs if key.startswith("requeue-")]
    if not requeued:
        raise SystemExit("scale_model: error: no requeue figures in the timings: run make test-scale")
    requeue_to_batch = sum(requeued) / len(requeued)
    projections = {}
    for n in PROJECTED_NODES:
        launch = sum(startup[name]["projected"][n] for name in FITTED)
        ranks_imports = one_rank["imports_s"]["projected_per_rank_s"]
        first_step = one_rank["setup_and_first_step_s"]["projected_per_rank_s"]
        requests = GPUS_PER_NODE * n * (imports["files_opened"] + imports["directories_listed"])
        projections[n] = {
            "startup_s": launch + ranks_imports + first_step,
            "startup_parts_s": {**{name: startup[name]["projected"][n] for name in FITTED},
                                "imports_s (one rank, node-local files)": ranks_imports, "setup_and_first_step_s": first_step},
            "bare_venv_import_metadata_requests": requests,
            "image_lookups_per_job_start": {"resolved_once (slurm/lib/launch.sh)": 1, "every_rank": GPUS_PER_NODE * n},
            "requeue_to_first_step_s": requeue_to_batch + launch + ranks_imports + first_step,
            "allreduce_s": {
                model_name: {
                    "ddp_bucket": {"ring": ring_allreduce_s(DDP_BUCKET_BYTES, n, p["ring_step_latency_s"], node_bandwidth),
                                   "tree": tree_allreduce_s(DDP_BUCKET_BYTES, n, p["tree_step_latency_s"], node_bandwidth)},
                    "all_gradients": {
                        "ring": ring_allreduce_s(params * GRADIENT_BYTES_PER_PARAM, n, p["ring_step_latency_s"], node_bandwidth),
                        "tree": tree_allreduce_s(params * GRADIENT_BYTES_PER_PARAM, n, p["tree_step_latency_s"], node_bandwidth)},
                } for model_name, params in MODELS.items()},
            "checkpoint_s": {model_name: {
                "network_and_file_system_peak": checkpoint_s(params * CHECKPOINT_BYTES_PER_PARAM, n, node_bandwidth,
                                                             p["scratch_bandwidth_bytes_s"]),
                "at_the_node_rate_measured_here": checkpoint_s(params * CHECKPOINT_BYTES_PER_PARAM, n, measured_write,
                                                               p["scratch_bandwidth_bytes_s"]),
            } for model_name, params in MODELS.items()},
        }
    tensor_parallel = {
        "shape": TP_SHAPE,
        "inside_a_node_s": tp_allreduces_per_microbatch_s(p["nvlink_bandwidth_bytes_s"], 0.0),
        "across_nodes_s": tp_allreduces_per_microbatch_s(p["nic_bandwidth_bytes_s"], p["ring_step_latency_s"]),
    }
    tensor_parallel["ratio"] = tensor_parallel["across_nodes_s"] / tensor_parallel["inside_a_node_s"]
    requeue = {}
    for _, key, run in runs:
        if key.startswith("requeue-"):
            requeue.setdefault(run["nodes"], []).append(run["signal_to_requeued_first_step_s"])
    return {
        "inputs": {"measured_here": {"host_cpus": cpus, "tier_runs": len(tier_runs), "ddp_node_counts": sorted(set(nodes)),
                                     "ddp_runs": ddp, "import_torch": imports,
                                     "signal_to_requeued_first_step_s": requeue,
                                     "signal_to_requeued_batch_s_mean": requeue_to_batch},
                   "perlmutter": PERLMUTTER,
                   "models_parameters": MODELS, "ddp_bucket_bytes": DDP_BUCKET_BYTES,
                   "checkpoint_bytes_per_parameter": CHECKPOINT_BYTES_PER_PARAM,
                   "checkpoint_node_write_bytes_s_measured_here": measured_write,
                   "gradient_bytes_per_parameter": GRADIENT_BYTES_PER_PARAM},
        "fits": startup,
        "per_rank": one_rank,
        "fit_error": {name: {"form": startup[name]["form"], "rms_relative_error": startup[name]["rms_relative_error"],
                             "hold_out_relative_error": startup[name]["hold_out_relative_error"]} for name in FITTED},
        "tensor_parallel_per_microbatch": tensor_parallel,
        "projections": projections,
    }


def markdown(result: dict) -> str:
    """The fit and the projections as the docs quote them (docs/scale.md; tests/test_scale_model.py checks they agree)."""
    measured = result["inputs"]["measured_here"]
    nodes = measured["ddp_node_counts"]
    lines = ["| nodes | tier run | submission to the first step (s) | preflight (s, share) | srun + runtime (s) | imports (s) | "
             "ranks' arrival spread (s) | rendezvous after the last (s) | setup + first step (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in measured["ddp_runs"]:
        lines.append(f"| {run['nodes']} | {run['tier_run']} | {run['submission_to_first_step_s']:.1f} | {run['preflight_s']:.1f} "
                     f"({100 * run['preflight_share']:.0f}%) | {run['srun_to_process_s']:.2f} | {run['imports_s']:.1f} | "
                     f"{run['arrival_spread_s']:.1f} | {run['rendezvous_after_last_arrival_s']:.2f} | "
                     f"{run['setup_and_first_step_s']:.1f} |")
    requeue = measured["signal_to_requeued_first_step_s"]
    if requeue:
        lines += ["", "From the time-limit signal to the requeued job's first step (s): "
                  + ", ".join(f"{' and '.join(f'{value:.0f}' for value in requeue[n])} at {n} nodes"
                              for n in sorted(requeue, key=int)) + "."]
    lines += ["", "| start-up part | form | RMS error | hold-out error | measured at " + ", ".join(map(str, nodes))
              + " nodes (s; one value per tier run) |",
             "|---|---|---|---|---|"]
    for name, entry in result["fits"].items():
        values = ", ".join("/".join(f"{value:.2f}" for value in entry["measured"][n]) for n in nodes)
        lines.append(f"| {name} | {entry['form']} | {100 * entry['rms_relative_error']:.0f}% | "
                     f"{100 * entry['hold_out_relative_error']:.0f}% | {values} |")
    for name, entry in result["per_rank"].items():
        per_rank = ", ".join(f"{value:.2f}" for value in entry["per_rank_s"])  # (in the order of the first table)
        lines.append(f"| {name} (one rank's share of the CPUs) | per rank | | | {per_rank} |")
    lines += ["", "| nodes (GPUs) | start-up to the first step (s) | requeue to the first step (s) | "
                  "25 MB bucket, ring / tree (ms) | 1.3B bf16 gradients, ring / tree (ms) | "
                  "7B checkpoint: at the rate measured here / network and file-system peak (s) |",
              "|---|---|---|---|---|---|"]
    for n, row in result["projections"].items():
        bucket, grads = row["allreduce_s"]["1.3B"]["ddp_bucket"], row["allreduce_s"]["1.3B"]["all_gradients"]
        checkpoint = row["checkpoint_s"]["7B"]
        lines.append(f"| {n} ({GPUS_PER_NODE * n}) | {row['startup_s']:.1f} | {row['requeue_to_first_step_s']:.0f} | "
                     f"{bucket['ring'] * 1e3:.2f} / {bucket['tree'] * 1e3:.2f} | {grads['ring'] * 1e3:.1f} / {grads['tree'] * 1e3:.1f} | "
                     f"{checkpoint['at_the_node_rate_measured_here']:.2f} / {checkpoint['network_and_file_system_peak']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, entry in result["fits"].items():
        measured = sorted((int(n), value) for n, values in entry["measured"].items() for value in values)
        line = left.plot([n for n, _ in measured], [v for _, v in measured], "o", label=f"{name} ({entry['form']})")
        left.plot([int(n) for n in entry["projected"]], list(entry["projected"].values()), "-", color=line[0].get_color())
    left.set(xscale="log", xlabel="nodes", ylabel="seconds", title="launch and rendezvous: measured (dots), fitted")
    left.legend(fontsize=7)
    nodes = list(PROJECTED_NODES)
    for model_name in MODELS:
        for algo, style in (("ring", "-"), ("tree", "--")):
            middle.plot(nodes, [result["projections"][n]["allreduce_s"][model_name]["all_gradients"][algo] * 1e3 for n in nodes],
                        style, label=f"{model_name} {algo}")
    for algo, style in (("ring", "-"), ("tree", "--")):
        middle.plot(nodes, [result["projections"][n]["allreduce_s"]["GPT-2 124M"]["ddp_bucket"][algo] * 1e3 for n in nodes],
                    style, color="gray", label=f"25 MB bucket {algo}")
    middle.set(xscale="log", yscale="log", xlabel="nodes", ylabel="ms", title="all-reduce of the bf16 gradients")
    middle.legend(fontsize=7)
    for model_name in MODELS:
        for bound, style in (("network_and_file_system_peak", "--"), ("at_the_node_rate_measured_here", "-")):
            right.plot(nodes, [result["projections"][n]["checkpoint_s"][model_name][bound] for n in nodes], style,
                       label=f"{model_name}, {bound.replace('_', ' ')}")
    right.set(xscale="log", yscale="log", xlabel="nodes", ylabel="seconds", title="checkpoint write (weights + Adam)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timings", type=Path, nargs="+", default=sorted((REPO / "bench" / "scale_timings").glob("*.json")),
                        help="one or more runs of the scale tier, pooled (runs/scale/timings.json; the committed runs: "
                             "bench/scale_timings/*.json)")
    parser.add_argument("--out", type=Path, default=Path("runs") / "scale")
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose `import torch` is counted")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.timings if not path.is_file()]
    if missing or not args.timings:
        parser.error(f"no timings file {' '.join(missing)}: run `make test-scale` (writes runs/scale/timings.json) or pass "
                     "--timings bench/scale_timings/*.json")
    result = model([json.loads(path.read_text()) for path in args.timings], import_metadata_requests(args.python),
                   json.loads(CHECKPOINT_BENCH.read_text()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale_model.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "scale_model.md").write_text(markdown(result))
    if not args.no_plot:
        plot(result, args.out / "scale_model.png")
    for name, error in result["fit_error"].items():
        print(f"fit {name:34s} {error['form']:8s} RMS {100 * error['rms_relative_error']:5.1f}%  "
              f"hold-out {100 * error['hold_out_relative_error']:5.1f}%")
    print(f"{'nodes':>6s} {'start-up s':>10s} {'requeue s':>9s} {'1.3B ring ms':>12s} {'1.3B tree ms':>12s} "
          f"{'bucket ring ms':>14s} {'bucket tree ms':>14s} {'7B ckpt s':>9s} {'venv metadata':>13s}")
    for n, row in result["projections"].items():
        grads, bucket = row["allreduce_s"]["1.3B"]["all_gradients"], row["allreduce_s"]["1.3B"]["ddp_bucket"]
        print(f"{n:6d} {row['startup_s']:10.1f} {row['requeue_to_first_step_s']:9.1f} {grads['ring'] * 1e3:12.1f} "
              f"{grads['tree'] * 1e3:12.1f} {bucket['ring'] * 1e3:14.2f} {bucket['tree'] * 1e3:14.2f} "
              f"{row['checkpoint_s']['7B']['at_the_node_rate_measured_here']:9.2f} {row['bare_venv_import_metadata_requests']:13,d}")
    print(f"model in {args.out / 'scale_model.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
