"""A node's check before the ranks start: one task per node, in the job's image with its modules, in seconds.

    python3 slurm/lib/vet_node.py ANSWERS_DIR     (slurm/lib/healing.sh runs it: srun --ntasks-per-node=1)

Writes ANSWERS_DIR/<hostname>: "ok WHAT WAS CHECKED" or "failed WHY" (one line), and exits 0 or 1. A node that
fails is left out of the job (a spare takes its place) before any rank is placed on it. Checks, each where it
applies:

- the GPUs Slurm gave the node are all visible, and each takes a small allocation and a matrix product (a GPU
  with pending retired pages or row remapping, per `nvidia-smi -q`, fails too). GPU only: not yet run on a GPU;
  on a GPU node `HPCML_VET_NODES=1 sbatch -N 2 --gpus-per-node 4 slurm/ddp.sh` runs it;
- the site's NCCL network plugin loads in the image (recipes/harness/image_checks.py), and on Perlmutter the
  node's Slingshot devices (/dev/cxi*) are there;
- the node has HPCML_VET_MIN_FREE_GB (default 1) of memory available, and the run directory takes a write,
  fsync, read back and delete;
- the tests' probe: HPCML_TEST_BAD_NODE names a node that fails, by host name or as @I, the job's I-th node
  (from 0): a stand-in for a broken GPU on this project's CPU-only test cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def gpus_expected() -> int:
    """The GPUs Slurm gave this node (0: none, or the job trains on the CPU by request)."""
    if os.environ.get("HPCML_ALLOW_CPU") == "1":
        return 0
    count = os.environ.get("SLURM_GPUS_ON_NODE", "")
    return int(count) if count.isdigit() else 0


def check_gpus(expected: int) -> str:
    import torch

    visible = torch.cuda.device_count()
    if visible != expected:
        raise RuntimeError(f"{visible} of the {expected} GPUs Slurm gave this node are visible")
    for index in range(visible):
        with torch.cuda.device(index):
            a = torch.randn(256, 256, device="cuda")
            if not torch.isfinite(a @ a).all():
                raise RuntimeError(f"GPU {index}: a matrix product gave non-finite values")
            torch.cuda.synchronize()
    if shutil.which("nvidia-smi"):
        report = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=60).stdout
        # ("Pending Page Blacklist : Yes" on older GPUs, "Pending : Yes" under "Remapped Rows" on A100 and later)
        if re.search(r"Pending(?: Page Blacklist)?\s*:\s*Yes", report):
            raise RuntimeError("nvidia-smi -q reports a pending page retirement or row remapping: the GPU needs a reset")
    return f"{visible} GPUs"


def check_network() -> list[str]:
    checked = []
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    from harness.errors import ConfigError
    from harness.image_checks import check_network_plugin

    try:
        plugin = check_network_plugin()
    except ConfigError as error:
        raise RuntimeError(str(error)) from None
    if plugin:
        checked.append(plugin)
    if os.environ.get("NERSC_HOST") == "perlmutter" and int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) > 1:
        devices = sorted(Path("/dev").glob("cxi*"))
        if not devices:
            raise RuntimeError("no Slingshot devices (/dev/cxi*): the node's network is down")
        checked.append(f"{len(devices)} cxi devices")
    return checked


def check_memory_and_disk(run_dir: Path) -> list[str]:
    minimum = float(os.environ.get("HPCML_VET_MIN_FREE_GB", "1"))
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:")) / 2**20
    if available < minimum:
        raise RuntimeError(f"{available:.1f} GB of memory available, below HPCML_VET_MIN_FREE_GB={minimum:g}")
    probe = run_dir / f".vet-{socket.gethostname()}-{os.getpid()}"
    payload = os.urandom(4096)
    try:
        with open(probe, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        if probe.read_bytes() != payload:
            raise RuntimeError(f"{run_dir}: a file written here reads back different")
    except OSError as error:
        raise RuntimeError(f"{run_dir}: cannot write, sync and read a file ({error.strerror})") from None
    finally:
        probe.unlink(missing_ok=True)
    return [f"{available:.0f} GB free", "run directory writable"]


def vet(run_dir: Path) -> str:
    bad = os.environ.get("HPCML_TEST_BAD_NODE", "")
    if bad and bad in (socket.gethostname(), f"@{os.environ.get('SLURM_NODEID')}"):
        raise RuntimeError("the tests' probe (HPCML_TEST_BAD_NODE) says this node is bad")
    checked = []
    expected = gpus_expected()
    if expected:
        checked.append(check_gpus(expected))
    checked += check_network()
    checked += check_memory_and_disk(run_dir)
    return ", ".join(checked)


def main() -> int:
    answers = Path(sys.argv[1])
    started = time.monotonic()
    try:
        line, code = f"ok {vet(answers)}", 0
    except Exception as error:  # noqa: BLE001 (any failure here is this node's: say it in one line)
        line, code = f"failed {str(error).splitlines()[0] if str(error) else type(error).__name__}", 1
    line += f" ({time.monotonic() - started:.1f} s)"
    (answers / socket.gethostname()).write_text(line + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
