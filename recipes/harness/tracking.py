"""Experiment trackers for nodes without a network: Weights & Biases offline and MLflow in a local file.

    --tracker tensorboard,wandb,mlflow     (default: tensorboard; 'none': metrics.json only)

- wandb: offline mode, the run's files in OUT_DIR/wandb: one offline-run-* directory per checkpoint (see
  below), all with the same run id; `wandb sync OUT_DIR/wandb/offline-run-*` from a login node uploads
  them into one W&B run. WANDB_PROJECT names the project (default "hpcml").
- mlflow: a SQLite store, OUT_DIR/mlflow.db (MLflow's file store is in maintenance mode; one writer, rank
  0, so SQLite's locking is not in the way). MLFLOW_EXPERIMENT_NAME names the experiment (default
  "hpcml"). See it with `mlflow ui --backend-store-uri sqlite:///OUT_DIR/mlflow.db` where the full mlflow
  package is installed (the images carry mlflow-skinny, which writes and reads but serves no UI).

Only the logging rank tracks. The trackers receive the steps when a checkpoint is published and at the
end of the run, not step by step: a run that dies and resumes from its last checkpoint then records each
step exactly once (the steps the failed attempt ran after that checkpoint are run again, and only the
second time reach the trackers; its log and metrics.json say what it did). The run ids go into the
checkpoint (``MetricsLogger.checkpoint_state``), so a resumed run continues the same W&B and MLflow run.
The names are TensorBoard's: train/loss, train/lr, train/tokens_per_s, ..., eval/loss.

W&B writes its offline file from a service process (wandb-core) that buffers it (15 s between writes) and
dies with the job step: a rank 0 killed seconds after a checkpoint left an empty file, the checkpoint's steps
lost from W&B although the resumed run would not run them again. wandb has no public flush, so each
checkpoint's steps go into a W&B run segment that is finished (written out) before training goes on:
0.1 s per checkpoint once the service is up (0.5 s for the first), measured on CPU here.
"""

from __future__ import annotations

import importlib.util
import os
import time
import uuid
from pathlib import Path

from .errors import ConfigError

TRACKERS = ("tensorboard", "wandb", "mlflow")
# What each needs installed (every image has them; the bare environment's requirements/cpu.txt too).
TRACKER_PACKAGES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}
INSTALL = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny sqlalchemy alembic"}


def parse_trackers(value: str) -> list[str]:
    """--tracker: a comma-separated list of TRACKERS, or 'none'."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if names == ["none"]:
        return []
    unknown = [name for name in names if name not in TRACKERS]
    if unknown or not names:
        raise ConfigError(f"--tracker {value!r}: use a comma-separated list of {', '.join(TRACKERS)}, or none")
    return list(dict.fromkeys(names))


def check_trackers_installed(trackers: list[str]) -> None:
    """Refuse a tracker whose packages are missing, before any rank starts."""
    for name in trackers:
        missing = [package for package in TRACKER_PACKAGES[name] if importlib.util.find_spec(package) is None]
        if missing:
            raise ConfigError(f"--tracker {name} needs {', '.join(missing)} (every image has it): "
                              f"pip install {INSTALL[name]}, or leave {name} out of --tracker")


def scalars(record: dict) -> dict[str, float]:
    """A step record of metrics.json as tracker scalars: eval_loss as eval/loss, the rest as train/<key>."""
    named = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        named["eval/loss" if key == "eval_loss" else f"train/{key}"] = float(value)
    return named


def run_name(recipe: str, out_dir: Path) -> str:
    """The name a tracker shows: the recipe and the Slurm job (or the run directory's name)."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"{recipe}-{job}" if job else f"{recipe}-{Path(out_dir).resolve().name}"


class WandbTracker:
    """One W&B run, offline, in OUT_DIR/wandb; ``run_id``: the run to continue (a resume), else a new id."""

    name = "wandb"

    def __init__(self, out_dir: Path, run_id: str | None, title: str, config: dict):
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self._out_dir, self._title, self._config = Path(out_dir), title, config

    def log(self, records: list[dict]) -> None:
        """``records`` in one segment of the run, on disk when this returns (the module's docstring says why)."""
        import wandb

        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hpcml"), id=self.run_id, resume="allow",
                         name=self._title, config=self._config, dir=str(self._out_dir), mode="offline",
                         settings=wandb.Settings(console="off", silent=True))
        for record in records:
            run.log(scalars(record), step=record["step"])
        run.finish()

    def close(self) -> None:
        pass  # (every segment is finished already)


class MlflowTracker:
    """One MLflow run in the SQLite store OUT_DIR/mlflow.db; ``run_id``: the run to continue, else a new run
    (created now: MLflow chooses the id, and the first checkpoint must carry it)."""

    name = "mlflow"

    def __init__(self, out_dir: Path, run_id: str | None, title: str, config: dict):
        import logging

        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # (its INFO lines about creating the tables)
        self.store = f"sqlite:///{Path(out_dir).resolve() / 'mlflow.db'}"
        self._client = MlflowClient(tracking_uri=self.store)
        if run_id is not None and self._run_exists(run_id):
            self._client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        if run_id is not None:  # (OUT_DIR/mlflow.db removed or replaced since the checkpoint)
            print(f"[tracking] MLflow run {run_id} of the checkpoint is not in {self.store}: a new run continues it",
                  flush=True)
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "hpcml")
        experiment = self._client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(experiment_name)
        self.run_id = self._client.create_run(experiment_id, run_name=title).info.run_id
        from mlflow.entities import Param

        # (MLflow caps a parameter's value at 6000 characters; the options are short)
        self._client.log_batch(self.run_id, params=[Param(key, str(value)[:6000]) for key, value in config.items()])

    def _run_exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self._client.get_run(run_id)
            return True
        except MlflowException:
            return False

    def log(self, records: list[dict]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, record["step"]) for record in records for key, value in scalars(record).items()]
        for start in range(0, len(metrics), 1000):  # (log_batch takes at most 1000 metrics)
            self._client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED")


def open_trackers(trackers: list[str], out_dir: Path, run_ids: dict, title: str, config: dict) -> list:
    """The W&B and MLflow trackers of --tracker (TensorBoard is MetricsLogger's own writer), continuing the
    runs in ``run_ids`` (a resumed checkpoint's) where they name one."""
    kinds = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    return [kinds[name](out_dir, run_ids.get(name), title, config) for name in trackers if name in kinds]
