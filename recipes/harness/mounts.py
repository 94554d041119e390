"""The host paths a run reads, named once, and checked where the ranks will read them.

Under podman and podman-hpc (slurm/lib/runtime.sh) a container sees only the directories the launcher
mounted: the repository, the working directory, RUN_DIR and CONTAINER_MOUNTS, at the same paths. The launcher
passes that list as HPCML_CONTAINER_MOUNTS; the recipe's preflight, which runs in the container after
``--config`` is read, checks every path the ranks will read against it. So a data set, a model directory or a
config file named in a TOML file is checked exactly as one on the command line, and the launcher never
parses a recipe's options. Shifter mounts the site's file systems itself; the bare runtime reads the host.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from .contract import CONTAINER_MOUNTS_ENV, CONTAINER_RUNTIME_ENV
from .errors import ConfigError


def paths_read(args: argparse.Namespace) -> dict[str, Path]:
    """{the option as the user gives it: the host path behind it} for every file or directory outside
    --out-dir that the ranks will read: --config, --data (a token file's directory, or with --dataset the
    path itself), --model hf:DIR, --model and --dataset FILE.py:FACTORY."""
    found: dict[str, Path] = {}
    if getattr(args, "config", None) is not None:
        found[f"--config {args.config}"] = Path(args.config)
    data = getattr(args, "data", "synthetic")
    if data != "synthetic":
        # a token file is PREFIX.json/.idx/.bin: its directory; with --dataset, whatever the factory reads
        found[f"--data {data}"] = Path(data) if getattr(args, "dataset", None) else Path(data).parent
    for option in ("model", "dataset"):
        value = getattr(args, option, None) or ""
        if value.startswith("hf:"):
            found[f"--{option} {value}"] = Path(value.removeprefix("hf:"))
        elif ":" in value and (value.rsplit(":", 1)[0].endswith(".py") or "/" in value.rsplit(":", 1)[0]):
            found[f"--{option} {value}"] = Path(value.rsplit(":", 1)[0])  # (a module on PYTHONPATH: not a path)
    return {what: Path(os.path.abspath(path.expanduser())) for what, path in found.items()}


def check_paths_visible(args: argparse.Namespace, environ=os.environ) -> None:
    """Every path in ``paths_read`` inside a directory the launcher mounted into the container (podman,
    podman-hpc); with --dataset, --data readable here (no recipe can check what the user's factory reads
    before it runs it). ConfigError, one line that names the CONTAINER_MOUNTS that fixes it."""
    runtime, mounted = environ.get(CONTAINER_RUNTIME_ENV, ""), [m for m in environ.get(CONTAINER_MOUNTS_ENV, "").split(":") if m]
    for what, path in paths_read(args).items():
        if runtime in ("podman", "podman-hpc") and mounted and not any(path.is_relative_to(m) for m in mounted):
            # (a token file's entry is its directory already; a model directory or a file: the one it is in)
            directory = path if what.startswith("--data") and not getattr(args, "dataset", None) else path.parent
            raise ConfigError(f"{what} is not in any directory mounted into the {runtime} containers ({', '.join(mounted)}): "
                              f"mount its directory: add {directory} to CONTAINER_MOUNTS")
    data = getattr(args, "data", "synthetic")
    if getattr(args, "dataset", None) and data != "synthetic" and not os.access(data, os.R_OK):
        raise ConfigError(f"--data {os.path.abspath(data)} is not readable on {socket.gethostname()}: put it on a file "
                          "system every node mounts (Perlmutter: under $SCRATCH)")
