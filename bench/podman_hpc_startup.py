"""podman-hpc under srun: one container per rank (`podman-hpc run`, what slurm/lib/launch.sh does) against one
container per node with the ranks exec'd into it (`podman-hpc shared-run`, which NERSC suggests under srun).

    # as a user with podman-hpc and IMAGE in their squashed store, on a Slurm cluster (SLURM_CONF set)
    python bench/podman_hpc_startup.py --image hpcml/ddp:cpu --ranks 4 --repeats 5 --out runs/podman-hpc-startup

Measures, alternately (run, shared-run, run, ...), on one node:
- start-up: the wall time of `srun -N1 -n RANKS podman-hpc MODE ... python3 -c <print rank>`, and how many
  ranks printed (a rank whose output is lost counts as missing);
- the time-limit signal: SIGUSR1 sent to the step (`scancel --signal=USR1`, what '#SBATCH --signal' does)
  once every rank is ready; how many ranks received it (the recipes checkpoint on it);
- after every step, the containers it left on its node, which are then removed (a signalled shared-run
  leaves its container behind, "running" in podman's records; once podman's pause process is gone too,
  every podman-hpc command of the user fails on that node: "invalid internal status").
Prints a table and writes OUT/podman_hpc_startup.json. The ratio is shared-run / run, per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HELLO = "import os; print('rank', os.environ['SLURM_PROCID'], 'node', os.environ['SLURM_STEP_NODELIST'], flush=True)"
# Ready, then waits for SIGUSR1 (exits at once when it comes) or gives up after 20 s.
WAIT_FOR_SIGNAL = ("import os, signal, sys, time\n"
                   "rank = os.environ['SLURM_PROCID']\n"
                   "signal.signal(signal.SIGUSR1, lambda *_: (print('rank', rank, 'got USR1', flush=True), sys.exit(0)))\n"
                   "print('rank', rank, 'node', os.environ['SLURM_STEP_NODELIST'], 'ready', flush=True)\n"
                   "time.sleep(20)\n")


def podman_hpc(mode: str, image: str, workdir: Path, script: str) -> list[str]:
    # What the launcher passes (slurm/lib/launch.sh), less the GPU and NCCL modules this machine may lack.
    return ["podman-hpc", *mode.split(), "--network=host", "--ipc=host", "--user", "0:0", "-e", "SLURM_*",
            "-v", f"{workdir}:{workdir}", "-w", str(workdir), image, "python3", "-c", script]


def startup(mode: str, image: str, ranks: int, workdir: Path) -> dict:
    begin = time.perf_counter()
    result = subprocess.run(["srun", "-t", "5", "-N", "1", "-n", str(ranks), *podman_hpc(mode, image, workdir, HELLO)],
                            capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - begin
    reported = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("rank ")}
    return {"seconds": seconds, "ranks_reported": len(reported), "exit_code": result.returncode,
            "containers_left": remove_leftovers(step_node(result.stdout))}


def signal_delivery(mode: str, image: str, ranks: int, workdir: Path) -> dict:
    name = f"podman-hpc-signal-{uuid.uuid4().hex[:8]}"
    step = subprocess.Popen(["srun", "-J", name, "-t", "5", "-N", "1", "-n", str(ranks),
                             *podman_hpc(mode, image, workdir, WAIT_FOR_SIGNAL)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while sum(line.endswith(" ready") for line in lines) < ranks and time.monotonic() < deadline:
        line = step.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
    subprocess.run(["scancel", "--signal=USR1", f"--name={name}"], capture_output=True, timeout=60)
    rest, _ = step.communicate(timeout=120)
    lines += rest.splitlines()
    return {"ranks_ready": sum(line.endswith(" ready") for line in lines),
            "ranks_signalled": sum(line.endswith("got USR1") for line in lines),
            "containers_left": remove_leftovers(step_node("\n".join(lines)))}


def step_node(output: str) -> str | None:
    """The node a step ran on, as its ranks printed it (None when none printed)."""
    nodes = {line.split()[3] for line in output.splitlines() if line.startswith("rank ") and " node " in line}
    return nodes.pop() if len(nodes) == 1 else None


# The user's containers on a node, by the names podman-hpc gives shared-run's (uid-UID-pid-PID; `run --rm`
# ones have random names and go with their rank): listed, then removed. (Not with srun's PMI_FD: podman-hpc
# then adds --preserve-fds to any podman command, which `ps` and `rm` refuse.)
LEFTOVERS = ('unset PMI_FD; names=$(podman-hpc --log-level=error ps -a --filter "name=^uid-$(id -u)-pid-" --format "{{.Names}}")'
             ' && echo "$names" && if [ -n "$names" ]; then podman-hpc --log-level=error rm -f $names >/dev/null; fi')


def remove_leftovers(node: str | None) -> list[str]:
    """The shared-run containers still recorded on NODE after a step, removed; their names."""
    if node is None:
        raise SystemExit("podman_hpc_startup: no rank reported its node: the step did not start")
    found = subprocess.run(["srun", "-t", "2", "-N", "1", "-n", "1", "-w", node, "bash", "-c", LEFTOVERS],
                           capture_output=True, text=True, timeout=120)
    if found.returncode != 0:
        raise SystemExit(f"podman_hpc_startup: cannot list or remove the containers left on {node}: {found.stderr.strip()}")
    return found.stdout.split()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", default="hpcml/ddp:cpu")
    p.add_argument("--ranks", type=int, default=4, help="ranks on the node (Perlmutter: 4, one per GPU)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("runs/podman-hpc-startup"))
    args = p.parse_args()
    if args.ranks < 1 or args.repeats < 1:
        p.error("--ranks and --repeats must be 1 or more")
    modes = ("run --rm", "shared-run")
    results: dict[str, dict] = {mode: {"startup": [], "signal": []} for mode in modes}
    with tempfile.TemporaryDirectory(dir=os.environ.get("SCRATCH")) as tmp:
        workdir = Path(tmp)
        for _ in range(args.repeats):
            for mode in modes:  # alternately, so that drift in the machine's load hits both alike
                results[mode]["startup"].append(startup(mode, args.image, args.ranks, workdir))
        for mode in modes:
            results[mode]["signal"].append(signal_delivery(mode, args.image, args.ranks, workdir))
    run_s = [r["seconds"] for r in results["run --rm"]["startup"]]
    shared_s = [r["seconds"] for r in results["shared-run"]["startup"]]
    summary = {
        "image": args.image, "ranks": args.ranks, "repeats": args.repeats,
        "run_seconds": run_s, "shared_run_seconds": shared_s,
        "shared_run_over_run": statistics.median(s / r for s, r in zip(shared_s, run_s)),
        "run_ranks_reported": [r["ranks_reported"] for r in results["run --rm"]["startup"]],
        "shared_run_ranks_reported": [r["ranks_reported"] for r in results["shared-run"]["startup"]],
        "run_ranks_signalled": results["run --rm"]["signal"][0]["ranks_signalled"],
        "shared_run_ranks_signalled": results["shared-run"]["signal"][0]["ranks_signalled"],
        # containers a step left behind on its node (removed since), over all steps of the mode
        "run_containers_left": sum(len(r["containers_left"]) for kind in results["run --rm"].values() for r in kind),
        "shared_run_containers_left": sum(len(r["containers_left"]) for kind in results["shared-run"].values() for r in kind),
        "raw": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "podman_hpc_startup.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"podman-hpc, {args.ranks} ranks on one node, {args.repeats} pairs ({args.image}):")
    for label, key, seconds in (("run (one container per rank)", "run", run_s), ("shared-run (one per node)", "shared_run", shared_s)):
        print(f"  {label:30s} start-up median {statistics.median(seconds):5.2f} s (min {min(seconds):.2f}, max "
              f"{max(seconds):.2f}); ranks reporting {summary[key + '_ranks_reported']}; SIGUSR1 reached "
              f"{summary[key + '_ranks_signalled']}/{args.ranks} ranks; containers left behind (removed): "
              f"{summary[key + '_containers_left']}")
    print(f"  shared-run / run start-up: {summary['shared_run_over_run']:.2f} (median of the pairs)")
    print(f"  wrote {args.out / 'podman_hpc_startup.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
