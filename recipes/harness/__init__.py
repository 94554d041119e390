"""The small harness every recipe trains on: only what all of them need, split by concern.

    errors      ConfigError (bad input) and stderr_line: the bottom layer, imported by every other module
    contract    what the launcher (slurm/lib/contract.sh) and the recipes say to each other: exit codes, the
                stop marker, the environment the launcher exports
    cli         the shared options (parse_recipe_args), TOML configs, the checks before any rank starts
                (validate_run, require_*), main_entry (bad input: one line, exit 2)
    mounts      the host paths a run reads (--config, --data, --model, --dataset), each checked against the
                directories the launcher mounted into its container
    launch      rank layout (torchrun or srun), the expected world size, the PyTorch process group, the
                collectives of the logs and the end-of-run proof, a failed collective as one line (exit 4)
    data        --data: synthetic tokens or a token file; step s is the same global batch at any world size;
                step_batches (read ahead by --data-workers); the validation batches --eval-every evaluates
    metrics     rank 0's step lines, metrics.json, TensorBoard events, FLOPs per token and peak (MFU)
    tracking    --tracker: W&B offline and MLflow (SQLite) runs on nodes without a network, continued on resume
    model       --model: the contract a model meets (forward(inputs, targets) -> loss), a Hugging Face model
                directory (hf_model: its loss) or the user's own MODULE:FACTORY
    checkpoint  atomic checkpoint files and directories; which checkpoint a rerun resumes
    signals     SIGUSR1/SIGTERM: stop after the step, checkpoint, leave the stop marker
    run         TrainingRun: the step range, checkpoint cadence, the stop agreement and the end of a run;
                the optimizer of --optimizer (adamw, or sgd for the parity tests), the learning-rate schedule
                and gradient clipping; a rank's validation loss
    faults      the tests' negative controls that are not options (HPCML_TEST_FAULT)

Recipes put ``recipes/`` on ``sys.path`` and ``import harness``; the names below are the ones they use.
No module imports PyTorch or TensorFlow at import time (the TensorFlow recipes load no torch).
"""

from .checkpoint import (
    atomic_write_bytes, CRASH_DURING_CHECKPOINT_ENV, latest_checkpoint, latest_checkpoint_dir,
    list_checkpoint_dirs, list_checkpoints, publish_checkpoint_dir, restore_rng_state, resume_dir, resume_file,
    rng_state, save_checkpoint, save_checkpoint_dir, save_sharded_checkpoint, ShardedCheckpoints,
    staging_checkpoint_dir, TRAINER_STATE,
)
from .cli import (
    add_data_options, add_model_options, add_optimizer_option, add_run_options, add_schedule_options,
    schedule_identity,
    main_entry, new_parser,
    parse_args_with_config, parse_recipe_args, preflight_line, require_at_least_one, require_divisible,
    require_positive, validate_run,
)
from . import faults, memory
from .errors import ConfigError, stderr_line
from .data import (ConversationData, masked_data, numpy_batches, numpy_token_batch, step_batches, SyntheticTokens, tf_step_batches,
                   loss_weights, token_weights, TokenFileData, training_data, validation_data,
                   validation_loss)
from .launch import (
    all_hostnames, average_across_ranks, check_expected_world_size, detect_dist_env, DistEnv, expand_hostlist,
    EXPECTED_WORLD_SIZE_ENV, gather_from_ranks, gpu_for_local_rank, leave_process_group, max_difference_across_ranks,
    mean_across_ranks, nodes_in_job, ranks_per_node, setup_torch_distributed, tp_size,
)
from .metrics import (describe_run, gpu_peak_flops, MetricsLogger, peak_flops, start_metrics, tensorboard_dir,
                      transformer_flops_per_token)
from .model import (check_export_option, check_model_vocabulary, export_sharded_model, export_trained_model, model_size,
                    model_spec, ModelSpec)
from .profiling import HostMemory, peak_memory, phase
from .run import clip_gradients, learning_rate, set_learning_rate, torch_optimizer, TrainingRun
from .signals import STOP_MARKER, STOP_SIGNALS, StopRequest

__all__ = [
    "faults", "memory",
    "add_data_options", "add_model_options", "add_optimizer_option", "add_run_options", "add_schedule_options",
    "clip_gradients", "learning_rate", "schedule_identity", "set_learning_rate",
    "all_hostnames", "atomic_write_bytes", "average_across_ranks",
    "check_expected_world_size", "check_export_option", "check_model_vocabulary", "ConfigError", "CRASH_DURING_CHECKPOINT_ENV",
    "describe_run", "detect_dist_env", "DistEnv", "expand_hostlist", "EXPECTED_WORLD_SIZE_ENV", "export_sharded_model",
    "export_trained_model", "gather_from_ranks", "gpu_for_local_rank", "HostMemory", "gpu_peak_flops", "latest_checkpoint",
    "latest_checkpoint_dir", "leave_process_group",
    "list_checkpoint_dirs", "list_checkpoints", "main_entry", "max_difference_across_ranks",
    "mean_across_ranks", "MetricsLogger", "model_size", "model_spec", "ModelSpec", "new_parser", "nodes_in_job", "numpy_batches",
    "numpy_token_batch",
    "parse_args_with_config", "parse_recipe_args", "peak_flops", "peak_memory", "phase", "preflight_line", "publish_checkpoint_dir",
    "ranks_per_node", "tp_size", "require_at_least_one", "require_divisible", "require_positive", "restore_rng_state",
    "resume_dir", "resume_file", "rng_state", "save_checkpoint", "save_checkpoint_dir",
    "save_sharded_checkpoint", "setup_torch_distributed", "ShardedCheckpoints", "staging_checkpoint_dir", "start_metrics",
    "stderr_line", "step_batches", "STOP_MARKER", "STOP_SIGNALS", "StopRequest", "SyntheticTokens", "tensorboard_dir",
    "tf_step_batches", "loss_weights", "token_weights", "TokenFileData", "ConversationData", "masked_data",
    "torch_optimizer", "training_data", "TRAINER_STATE", "TrainingRun",
    "transformer_flops_per_token", "validate_run", "validation_data", "validation_loss",
]
