"""The command line every recipe shares: its options, TOML config files, the checks made before any rank
starts, and the entry point that turns bad input into one line and exit code 2.

A recipe adds its own options to its parser first (so ``--help`` opens with what that framework needs),
then ``parse_recipe_args`` adds the shared groups (``add_run_options``: run directory, checkpoints,
stopping, logging; ``add_data_options``; ``add_model_options``: --model) and parses.
``validate_run`` checks those; the recipe checks its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tomllib
from pathlib import Path
from typing import Callable

from .contract import CONTAINER_RUNTIME_ENV, EXIT_BAD_INPUT, LOGIN_NODE_CHECK_ENV, NSYS_ENV, PREFLIGHT_RECORD_ENV
from .data import check_data_option, masked_data, user_dataset
from . import outcome
from .errors import ConfigError, stderr_line
from .image_checks import check_compiler, check_network_plugin
from .launch import (check_gpus_visible, check_ranks_per_gpu, exit_after_leaving_the_group, exit_on_collective_failure,
                     failed_collective_rank, slurm_gave_gpus)
from .metrics import check_tensorboard_writer, tensorboard_dir
from .mounts import check_paths_visible, paths_read
from .tracking import check_trackers_installed, parse_trackers
from .profiling import profile_steps


def exit_on_config_error(recipe: str, error: ConfigError) -> None:
    """One line on stderr, exit code 2: what users see instead of a stack trace."""
    stderr_line(f"[{recipe}] error: {error}")
    sys.exit(EXIT_BAD_INPUT)


def main_entry(recipe: str, main: Callable[[], int]) -> None:
    """Run ``main`` and exit with its code. Bad input (ConfigError) is one line and exit 2; a collective that
    failed because another rank died or hung is one line naming this rank and exit 4 (launch.py). How it ended
    is recorded for the launcher (outcome.py), which restarts a job only for a node's failure."""
    outcome.started()
    try:
        code = main()
    except ConfigError as error:
        outcome.ended("bad-input", str(error))
        exit_on_config_error(recipe, error)
    except outcome.NodeFault as fault:
        outcome.ended("node", str(fault))
        stderr_line(f"[{recipe}] error: {fault}")
        sys.exit(1)
    except SystemExit as stop:
        outcome.ended("done" if stop.code in (None, 0) else "program", f"exit {stop.code}")
        raise
    except BaseException as error:
        rank = failed_collective_rank(error) if isinstance(error, Exception) else None
        if rank is None:
            outcome.ended(outcome.exception_outcome(error), f"{type(error).__name__}: {error}")
            raise
        outcome.ended("collective", str(error))
        exit_on_collective_failure(recipe, error, rank)
    outcome.ended("done" if code == 0 else "program", f"exit {code}")
    exit_after_leaving_the_group(code)  # (a multi-rank run that left its process group: exits here)
    sys.exit(code)


def new_parser(doc: str) -> argparse.ArgumentParser:
    """The recipe's parser, with its module docstring (the launch commands) as the --help text."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_run_options(p: argparse.ArgumentParser, recipe: str, collective_timeout: bool = True, profile: bool = True) -> None:
    """Options of the run rather than of the model: where it writes, how often it checkpoints, when it stops."""
    g = p.add_argument_group("run options (every recipe)")
    g.add_argument("--max-steps", type=int, default=30)
    g.add_argument("--seed", type=int, default=1234, help="seeds the weights and the synthetic data")
    g.add_argument("--out-dir", type=Path, default=Path("runs") / recipe, help="checkpoints and metrics.json")
    g.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: only at the end)")
    g.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out-dir")
    g.add_argument("--stop-at-step", type=int, default=None,
                   help="checkpoint and exit after this step, as if the allocation ended; rerun to continue")
    g.add_argument("--log-every", type=int, default=10,
                   help="steps between loss lines; the ranks average their losses (one all-reduce) this often")
    g.add_argument("--straggler-factor", type=float, default=STRAGGLER_FACTOR, metavar="F",
                   help="name a rank whose forward pass is F times the ranks' median or slower, 3 syncs in a row "
                        "(log and metrics.json; 0: off)")
    g.add_argument("--leave-stragglers", action="store_true",
                   help="a straggler ends the run after a checkpoint, as a failed node: under slurm/ with spare nodes "
                        "(HPCML_SPARE_NODES) the run goes on without its node")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="TensorBoard event files (rank 0; default OUT_DIR/tensorboard; 'off': none)")
    g.add_argument("--tracker", default="tensorboard", metavar="LIST",
                   help="where rank 0 tracks the run, comma-separated: tensorboard, wandb (offline: OUT_DIR/wandb, "
                        "`wandb sync` later), mlflow (OUT_DIR/mlflow.db); 'none': metrics.json only")
    if collective_timeout:
        g.add_argument("--timeout-s", type=float, default=300.0,
                       help="process-group timeout: a collective that waits longer fails the job")
    if profile:
        g.add_argument("--profile", default=None, metavar="START:END",
                       help="record steps START to END with torch.profiler: OUT_DIR/profile/rank<R>.pt.trace.json "
                            "per rank (Perfetto, TensorBoard); on a GPU also Nsight Systems' range (HPCML_NSYS=1)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (default: data sheet on GPU, measured matmul on CPU)")
    g.add_argument("--config", type=Path, default=None,
                   help="a TOML file of these options (keys as here, without '--'); the command line wins")
    g.add_argument("--preflight", type=int, default=None, metavar="WORLD_SIZE",
                   help="only check the options (and a checkpoint to resume) for this many ranks, then exit")


# --straggler-factor's default: above the largest ratio of one rank's forward time to the other ranks' median
# that a run without a fault kept for 3 syncs in a row on this project's 2-core test machine, with a margin: 1.97
# at 2 ranks and 1.80 at 4 ranks in bench/stragglers.json's 20 runs (some beside other tests; 1.5 would have named
# a rank in 5 of them), 1.49 and 1.88 in 20 runs before; a rank slowed by the tests' fault kept 15-32. A quieter
# cluster can go lower: measure it there (bench/stragglers.py).
STRAGGLER_FACTOR = 2.5
OPTIMIZERS = ("adamw", "sgd")


def add_optimizer_option(p: argparse.ArgumentParser, default: str = "adamw") -> None:
    """--optimizer adamw|sgd (run.torch_optimizer builds it for the PyTorch recipes)."""
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=default,
                   help="adamw (no weight decay), or plain SGD at --lr: Adam is nearly blind to a gradient of the "
                        "wrong scale, SGD is not (the parity tests train with sgd)")


LR_SCHEDULES = ("constant", "cosine")


def add_schedule_options(p: argparse.ArgumentParser, clip_grad: bool = True) -> None:
    """What fine-tuning needs from the loop (run.learning_rate, run.clip_gradients): a learning-rate schedule
    and gradient clipping. Both follow the step number, so a resumed run continues them exactly.
    ``clip_grad=False``: the recipe's framework clips, under its own --clip-grad (Megatron's optimizer)."""
    g = p.add_argument_group("learning rate and gradients")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="after the warmup: constant --lr, or cosine from --lr down to --lr/10 at --max-steps")
    g.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                   help="rise linearly to --lr over the first N steps (0: start at --lr)")
    if not clip_grad:
        return
    g.add_argument("--clip-grad", type=float, default=0.0, metavar="NORM",
                   help="scale the gradients down to this global norm when they exceed it (0: no clipping); the "
                        "norm before clipping is logged as grad_norm")


def check_schedule_options(args: argparse.Namespace) -> None:
    if not hasattr(args, "lr_schedule"):
        return
    if args.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps must be 0 (no warmup) or more, got {args.warmup_steps}")
    if not (args.clip_grad >= 0 and math.isfinite(args.clip_grad)):
        raise ConfigError(f"--clip-grad must be 0 (no clipping) or a positive norm, got {args.clip_grad}")


def schedule_identity(args: argparse.Namespace) -> dict:
    """What a checkpoint must share with the run that resumes it for the schedule to continue where it was:
    the schedule, its warmup and (cosine) the step it ends at."""
    return {"lr_schedule": args.lr_schedule, "warmup_steps": args.warmup_steps,
            **({"schedule_end_step": args.max_steps} if args.lr_schedule == "cosine" else {})}


def add_data_options(p: argparse.ArgumentParser, user_datasets: bool = False, packing: bool = False) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", default="synthetic", metavar="PREFIX",
                   help="synthetic (default), or a token file: PREFIX.bin/.idx/.json as recipes/data/prepare.py "
                        "writes them (megatron's indexed-dataset format; e.g. make data: data/stdlib/tokens); "
                        "with --dataset: whatever your factory reads (args.data)")
    if user_datasets:
        g.add_argument("--dataset", default=None, metavar="MODULE:FACTORY",
                       help="your own data: FACTORY(args, split) -> a map-style torch Dataset of (inputs, targets) "
                            "tensor pairs, for split 'train' and 'validation' (e.g. recipes/examples/fields.py:dataset)")
    if packing:
        g.add_argument("--pack", action="store_true",
                       help="instruction data (prepare.py --chat): pack whole conversations into each --seq-len window "
                            "instead of one padded conversation per row; attention stays within each conversation")
    g.add_argument("--seq-len", type=int, default=64)
    g.add_argument("--vocab-size", type=int, default=256)
    g.add_argument("--data-workers", type=int, default=-1, metavar="N",
                   help="processes that read batches ahead (PyTorch recipes; default -1: 2 on a GPU, 0 on a CPU)")
    g.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="evaluate on the validation data every N steps and after the last one (0: never); the loss "
                        "is averaged over the data-parallel ranks, logged, and kept in metrics.json")
    g.add_argument("--eval-batches", type=int, default=4, metavar="K",
                   help="global batches per evaluation: the validation data's first K, the same every time")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--model and what goes with it (harness/model.py): the stack's GPT, a Hugging Face model directory or the
    user's own module. The GPT's own options (--n-layer, ...) are the GPT's: recipes/gpt.py adds them."""
    g = p.add_argument_group("model (--model; the stack's GPT by default)")
    g.add_argument("--model", default="gpt", metavar="gpt|hf:DIR|MODULE:FACTORY",
                   help="gpt: the stack's GPT (its options below); hf:DIR: a Hugging Face causal LM saved in DIR "
                        "(offline); MODULE:FACTORY: your own, FACTORY(args) -> a torch.nn.Module whose "
                        "forward(inputs, targets) returns the loss (harness/model.py)")
    g.add_argument("--export-hf", type=Path, default=None, metavar="DIR",
                   help="with --model hf:...: at the end, the trained model as a Hugging Face directory "
                        "(safetensors, config, the source's tokenizer files) that from_pretrained loads")
    g.add_argument("--allow-new-weights", action="store_true",
                   help="with --model hf:...: train even where the model's files lack weights of its architecture "
                        "(they start newly drawn, as transformers draws them); refused otherwise")
    g.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="with --model hf:...: train LoRA adapters of rank R (peft) instead of the whole model "
                        "(recipes/ddp and recipes/fsdp_tp_pp); --export-hf merges them into the weights")


def parse_recipe_args(p: argparse.ArgumentParser, recipe: str, argv: list[str] | None,
                      model_options: Callable[[argparse.ArgumentParser], None] | None = None,
                      collective_timeout: bool = True, lora: bool = False, profile: bool = True,
                      loss_masks: bool = False, packing: bool = False) -> argparse.Namespace:
    """The shared option groups after the recipe's own, then the command line (and --config) parsed.
    ``loss_masks``: the recipe trains instruction data (a token file with a loss mask, data.ConversationData);
    ``packing``: and packs it (--pack: the model takes each token's position in its conversation).
    ``model_options``: the stack's model adds its options (recipes/gpt.py: GPTConfig.add_arguments); with it
    the recipe takes --model, --dataset, --export-hf and --lora-rank (which it refuses unless ``lora``).
    ``collective_timeout``: --timeout-s (PyTorch's groups); ``profile``: --profile (torch.profiler)."""
    add_run_options(p, recipe, collective_timeout, profile)
    add_data_options(p, user_datasets=model_options is not None, packing=packing)
    if model_options is not None:
        add_model_options(p)
        model_options(p)
    args = parse_args_with_config(p, argv)
    # every path the ranks read, in the directories the container mounts (after --config: one check for both)
    check_paths_visible(args)
    require_at_least_one(args, "seq_len", "vocab_size", "eval_batches")
    if getattr(args, "lora_rank", None) is not None and not lora:
        raise ConfigError(f"--lora-rank: recipes/ddp and recipes/fsdp_tp_pp fine-tune with LoRA; {recipe} does not "
                          "(yet): train the whole model here, or use one of those")
    if args.eval_every < 0:
        raise ConfigError(f"--eval-every must be 0 (no evaluation) or more, got {args.eval_every}")
    if args.data_workers < -1:
        raise ConfigError(f"--data-workers must be 0 (read in the training process) or more, or -1 (auto), got {args.data_workers}")
    # on every rank and in the preflight: before any rank starts
    if getattr(args, "dataset", None):
        for split in ("train", "validation") if args.eval_every > 0 else ("train",):
            user_dataset(args, split)
    else:
        check_data_option(args.data, args.vocab_size, args.seq_len, evaluates=args.eval_every > 0,
                          loss_masks=recipe if not loss_masks else None)
    if getattr(args, "pack", False):
        if args.model != "gpt" and not args.model.startswith("hf:"):
            raise ConfigError(f"--pack needs a model that takes each token's position in its conversation (gpt, hf:DIR); "
                              f"--model {args.model} takes (inputs, targets): leave out --pack")
        if not masked_data(args):
            raise ConfigError("--pack packs instruction data's conversations (a --data prepared with prepare.py --chat); "
                              "other data is packed already (a token file is cut into full windows): leave out --pack")
    return args


def require_at_least_one(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def require_positive(args: argparse.Namespace, *names: str) -> None:
    """Positive and finite (argparse's float() takes "inf" and "nan")."""
    for name in names:
        value = getattr(args, name)
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive finite number, got {value}")


def require_divisible(what: str, value: int, divisor: int, by: str, option: str = "--global-batch") -> None:
    """``value`` must be a multiple of ``divisor``; the message names the next multiple up as the fix."""
    if value % divisor:
        raise ConfigError(f"{what} {value} is not divisible by {by}; use a multiple of {divisor} "
                          f"(e.g. {option} {-(-value // divisor) * divisor})")


def validate_run(args: argparse.Namespace, world_size: int | None, framework: str = "torch") -> None:
    """The shared options (those parse_recipe_args added), for ``world_size`` ranks (None: not known yet),
    before any rank starts. ``framework`` "tensorflow": its TensorBoard writer (tf.summary) needs no package
    of its own."""
    require_at_least_one(args, "max_steps", "log_every", "seq_len", "vocab_size")
    if world_size is not None and world_size < 1:  # --preflight 0, or a launcher that says so
        raise ConfigError(f"the world size must be at least 1 rank, got {world_size}")
    if hasattr(args, "n_embd"):  # the stack's GPT (GPTConfig.add_arguments)
        require_at_least_one(args, "n_layer", "n_head", "n_embd")
        if args.n_embd % args.n_head:
            raise ConfigError(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    check_schedule_options(args)
    if hasattr(args, "timeout_s"):
        require_positive(args, "timeout_s")
    if args.peak_tflops is not None:
        require_positive(args, "peak_tflops")
    for option, path in (("--out-dir", Path(args.out_dir)), ("--tensorboard", tensorboard_dir(args))):
        if path is not None and path.exists() and not path.is_dir():
            raise ConfigError(f"{option} {path} exists and is not a directory: name a directory (it is created if missing)")
    if args.checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every must be 0 (only at the end) or more, got {args.checkpoint_every}")
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= args.max_steps:
        raise ConfigError(f"--stop-at-step must be between 1 and --max-steps {args.max_steps}")
    profile_steps(args)
    if os.environ.get(NSYS_ENV) == "1" and not getattr(args, "profile", None):  # (slurm/lib/runtime.sh)
        raise ConfigError("HPCML_NSYS=1 captures the steps of the recipe's --profile START:END: add it (e.g. --profile 10:12)"
                          if hasattr(args, "profile") else "HPCML_NSYS=1 captures a recipe's --profile steps, which this "
                          "recipe does not have: leave HPCML_NSYS out")
    trackers = parse_trackers(args.tracker)
    if args.tensorboard not in (None, "off") and "tensorboard" not in trackers:
        raise ConfigError(f"--tensorboard {args.tensorboard} names a directory for TensorBoard, which --tracker "
                          f"{args.tracker} leaves out: add tensorboard to --tracker, or drop --tensorboard")
    check_trackers_installed([name for name in trackers if name != "tensorboard"])
    if tensorboard_dir(args) is not None and framework == "torch":
        check_tensorboard_writer()
    if getattr(args, "compile", False):
        import torch

        check_compiler("cuda" if torch.version.cuda and (torch.cuda.is_available() or slurm_gave_gpus()) else "cpu")
    check_ranks_per_gpu()
    # slurm/preflight.sh runs on a login node, which may have no GPU: there, the build only.
    check_gpus_visible(framework, build_only=args.preflight is not None and os.environ.get(LOGIN_NODE_CHECK_ENV) == "1")


def preflight_line(recipe: str, args: argparse.Namespace, summary: str, resume_from: Path | None,
                   layout: dict[str, int] | None = None) -> int:
    """What ``--preflight`` prints when the options are fine (slurm/lib/launch.sh shows it); exit code 0. It runs
    in the image with the job's modules, once per job: the network plugin is opened here (image_checks.py).
    Where the launcher asks for it (PREFLIGHT_RECORD_ENV: RUN_DIR/preflight.json), the same answer as JSON:
    the world size and layout, every path the ranks will read, the checkpoint it resumes, the plugin, and every
    option as the ranks will see it after --config (what ran, in one place)."""
    plugin = check_network_plugin()
    if plugin:
        print(f"[{recipe}] preflight: {plugin}", flush=True)
    print(f"[{recipe}] preflight: {summary}" + (f"; will resume from {resume_from}" if resume_from else ""), flush=True)
    record = os.environ.get(PREFLIGHT_RECORD_ENV)
    if record:
        answer = {"recipe": recipe, "world_size": args.preflight, "layout": layout or {"dp": args.preflight},
                  "summary": summary, "resume_from": str(resume_from) if resume_from else None,
                  "network_plugin": plugin, "container": os.environ.get(CONTAINER_RUNTIME_ENV, "none"),
                  "paths_read": {what: str(path) for what, path in paths_read(args).items()},
                  "options": {name: value if isinstance(value, (bool, int, float, type(None))) else str(value)
                              for name, value in sorted(vars(args).items())}}
        Path(record).write_text(json.dumps(answer, indent=1) + "\n")
    return 0


def parse_args_with_config(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; a ``--config FILE.toml`` gives defaults that the command line overrides.

    Keys are the option names without '--' (dashes or underscores). An unknown key, a value of the wrong
    type or a file that is not TOML is a ConfigError naming the file and the key.
    """
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if path is None:
        return args
    check_paths_visible(argparse.Namespace(config=path))  # (the file itself, in the container's mounts)
    try:
        values = tomllib.loads(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"cannot read --config {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config {path} is not valid TOML: {error}") from None
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config", "preflight")}
    defaults = {}
    for key, value in values.items():
        dest = key.replace("-", "_")
        if dest not in actions:
            known = ", ".join(sorted(name.replace("_", "-") for name in actions))
            raise ConfigError(f"unknown option '{key}' in --config {path}; known: {known}")
        action = actions[dest]
        flag = isinstance(action, argparse._StoreTrueAction)
        wanted = bool if flag else (action.type or str)
        acceptable = {bool: (bool,), int: (int,), float: (int, float)}.get(wanted, (str,))
        if not isinstance(value, acceptable) or (isinstance(value, bool) and wanted is not bool):
            raise ConfigError(f"'{key}' in --config {path} must be {'true/false' if flag else wanted.__name__}, "
                              f"got {value!r}")
        value = value if flag else wanted(value)
        if action.choices and value not in action.choices:
            raise ConfigError(f"'{key}' in --config {path} must be one of {list(action.choices)}, got {value!r}")
        defaults[dest] = value
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)
