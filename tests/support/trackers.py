"""The tracked runs read back through the trackers' own libraries: MLflow's client, and W&B's own record type
(wandb's protobuf ``Record``) over the .wandb file.

W&B 0.31 ships no reader for an offline run (a local-run API is a pull request upstream, wandb#12745;
`wandb sync --view` is gone), so ``wandb_history`` cuts the file into its records itself: the file is a
LevelDB-style log (a 7-byte header ':W&B', 0xBEE1, version 0; 32 KiB blocks; each piece a 7-byte header:
CRC32C, length, type FULL/FIRST/MIDDLE/LAST) whose payloads wandb decodes as its Record messages. The
values are wandb's own (the history items' JSON), not parsed from text.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

WANDB_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    """The Record messages of one .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == WANDB_HEADER, f"{path} is not a W&B run file: it starts {data[:7]!r}"
    offset, pieces = 7, []
    while offset + 7 <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < 7:  # (a block's tail too short for a piece header is padding)
            offset += left_in_block
            continue
        length, kind = struct.unpack("<HB", data[offset + 4:offset + 7])
        payload = data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind == 0 and length == 0:  # (zero padding at the end of the written part)
            continue
        pieces.append(payload)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def wandb_history(wandb_dir: Path) -> tuple[set[str], list[tuple[int, dict]]]:
    """Every offline attempt of the runs in ``wandb_dir`` (OUT_DIR/wandb): the run ids and the history rows
    (step, {name: value}) in the order they were logged."""
    run_ids, rows = set(), []
    for run_file in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(run_file):
            if record.HasField("run"):
                run_ids.add(record.run.run_id)
            if record.HasField("history"):
                values = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
                rows.append((record.history.step.num, {k: v for k, v in values.items() if not k.startswith("_")}))
    return run_ids, rows


def mlflow_history(run_dir: Path, metric: str) -> tuple[list, list[tuple[int, float]]]:
    """The MLflow runs in OUT_DIR/mlflow.db and ``metric``'s (step, value) entries of the one run, by step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    runs = [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]
    entries = client.get_metric_history(runs[0].info.run_id, metric) if len(runs) == 1 else []
    return runs, sorted((entry.step, entry.value) for entry in entries)


def tracking_errors(out: Path, metrics: dict) -> list[str]:
    """What is wrong with the tracked runs of ``out`` against its metrics.json (nothing: [])."""
    wrong = []
    expected = {record["step"]: record["loss"] for record in metrics["history"]}
    eval_expected = {record["step"]: record["eval_loss"] for record in metrics["history"] if "eval_loss" in record}

    run_ids, rows = wandb_history(out / "wandb")
    if len(run_ids) != 1:
        wrong.append(f"W&B: run ids {run_ids}, expected one run")
    repeated = [step for step, count in Counter(step for step, _ in rows).items() if count > 1]
    if repeated:
        wrong.append(f"W&B: steps {repeated} recorded more than once")
    tracked = {step: values["train/loss"] for step, values in rows}
    if tracked != expected:
        wrong.append(f"W&B train/loss {tracked} != metrics.json's {expected}")
    if {step: values["eval/loss"] for step, values in rows if "eval/loss" in values} != eval_expected:
        wrong.append("W&B eval/loss differs from metrics.json's")

    runs, entries = mlflow_history(out, "train/loss")
    if len(runs) != 1 or runs[0].info.status != "FINISHED":
        wrong.append(f"MLflow: {[(r.info.run_id, r.info.status) for r in runs]}, expected one FINISHED run")
    repeated = [step for step, count in Counter(step for step, _ in entries).items() if count > 1]
    if repeated:
        wrong.append(f"MLflow: steps {repeated} recorded more than once")
    if dict(entries) != expected:
        wrong.append(f"MLflow train/loss {dict(entries)} != metrics.json's {expected}")
    if dict(mlflow_history(out, "eval/loss")[1]) != eval_expected:
        wrong.append("MLflow eval/loss differs from metrics.json's")
    return wrong
