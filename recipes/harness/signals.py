"""Time limits and preemption: SIGUSR1 or SIGTERM ends the run cleanly after the current step.

The sbatch files ask Slurm for SIGUSR1 shortly before the time limit (--signal=USR1@T). A recipe that gets
it finishes its step, checkpoints, writes OUT_DIR/STOP_MARKER ("SIGUSR1 after step N") and exits 0 (a
non-zero exit would make srun kill the ranks still finishing); slurm/lib/launch.sh then requeues the job,
and the requeued run resumes from the checkpoint. SIGTERM (preemption, scancel) is handled the same way.
"""

from __future__ import annotations

import signal
from pathlib import Path

from .checkpoint import atomic_write_bytes
from .contract import STOP_MARKER
from .errors import stderr_line

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """Records SIGUSR1/SIGTERM from the moment it is created; ``received`` is the signal number (0: none).

    Signals reach the ranks at slightly different moments, so the ranks agree on when to stop: after each
    step every rank contributes what it received and all stop at the same step (run.TrainingRun).
    """

    def __init__(self, recipe: str, rank: int):
        self.recipe, self.rank, self.received = recipe, rank, 0
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if not self.received:
            stderr_line(f"[{self.recipe}] rank {self.rank}: {signal.Signals(signum).name} received: "
                        "checkpointing after this step, then exiting")
        self.received = max(self.received, int(signum))

    @staticmethod
    def write_marker(out_dir: Path, signum: int, step: int) -> None:
        atomic_write_bytes(Path(out_dir) / STOP_MARKER, f"{signal.Signals(signum).name} after step {step}\n".encode())
