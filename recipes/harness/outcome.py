"""How each rank of a job step ended, written where the launcher reads it when the step fails.

The launcher (slurm/lib/healing.sh) must tell a node's failure from the program's: a node's is worth a restart
without that node, the program's would fail the same way again and only burn the allocation. A rank knows how it
ended, unless it was killed or hung; so each rank writes, into the directory the launcher names
(HPCML_RANK_OUTCOMES, one per step), a file ``rank_<R>`` with two lines at most:

    started HOST PID                      when the recipe's main starts
    OUTCOME HOST step=S DETAIL            when it ends, OUTCOME being one of
        done        the recipe returned (exit 0 or its own code)
        bad-input   a ConfigError (one line, exit 2): the program's
        program     any other exception or exit in this process: the program's
        collective  a collective failed because another rank died or hung (exit 4): not this rank's fault
        node        an exception that says the hardware failed (NODE_FAULT_SIGNS: an uncorrectable ECC error,
                    a GPU that fell off the bus): the node's

A rank with only its first line died of a signal (killed, the node's out-of-memory killer, a segfault) or was
killed while it hung: the launcher blames its node. Nothing is written outside a launcher-managed step.
"""

from __future__ import annotations

import json
import os
import socket

from .contract import RANK_OUTCOMES_ENV

# What an exception says when the hardware under it failed rather than the program (CUDA's and NVML's texts for
# the Xid errors that retire a GPU). Any other exception is the program's.
NODE_FAULT_SIGNS = ("uncorrectable ECC error", "GPU has fallen off the bus", "GPU is lost",
                    "CUDA-capable device(s) is/are busy or unavailable", "NVML_ERROR_GPU_IS_LOST")

class NodeFault(Exception):
    """This rank's node is at fault (a straggler left out, --leave-stragglers): recorded as the node's, one line."""


_step = 0  # the step this rank was in (TrainingRun sets it): the incident record's step


def note_step(step: int) -> None:
    global _step
    _step = step


def _record_path() -> str | None:
    directory = os.environ.get(RANK_OUTCOMES_ENV)
    if not directory:
        return None
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    return os.path.join(directory, f"rank_{rank}")


def _append(line: str) -> None:
    path = _record_path()
    if path is None:
        return
    try:
        with open(path, "a") as record:
            record.write(line + "\n")
    except OSError:  # (the record helps the launcher; a run directory that cannot take it must not fail the run)
        pass


def started() -> None:
    _append(f"started {socket.gethostname()} {os.getpid()}")


def ended(outcome: str, detail: str = "") -> None:
    first_line = (detail.strip().splitlines() or [""])[0][:300]
    _append(f"{outcome} {socket.gethostname()} step={_step} {first_line}".rstrip())


def exception_outcome(error: BaseException) -> str:
    """``node`` for an exception that says the hardware failed, else ``program``."""
    text = f"{type(error).__name__}: {error}"
    return "node" if isinstance(error, NodeFault) or any(sign in text for sign in NODE_FAULT_SIGNS) else "program"


def incidents_summary(run_dir: str | os.PathLike) -> dict | None:
    """What RUN_DIR/incidents.jsonl (the launcher's record of failed steps) holds, for metrics.json: how many,
    of which class, the nodes left out, and the restarts made; None without incidents."""
    path = os.path.join(run_dir, "incidents.jsonl")
    try:
        with open(path) as lines:
            incidents = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError):
        return None
    if not incidents:
        return None
    by_class: dict[str, int] = {}
    for incident in incidents:
        by_class[incident.get("class", "unknown")] = by_class.get(incident.get("class", "unknown"), 0) + 1
    return {"count": len(incidents), "by_class": by_class,
            "nodes_left_out": sorted({node for i in incidents if i.get("class") == "node" for node in i.get("nodes", [])}),
            "file": path}
