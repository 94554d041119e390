"""The model a PyTorch recipe trains (``--model``), and the one contract every model meets.

    --model gpt              the stack's GPT (recipes/gpt.py; --n-layer, --n-head, --n-embd)
    --model hf:DIR           a Hugging Face causal language model saved in DIR (config.json and safetensors, as
                             save_pretrained writes them), loaded offline: nothing is downloaded on a node
    --model MODULE:FACTORY   your own: FACTORY(args) from MODULE, a module on PYTHONPATH (mypkg.models:build) or
                             a file (path/to/mymodel.py:build)

The contract: ``module(inputs, targets)`` returns the batch's mean loss, a scalar tensor. ``inputs`` and
``targets`` are what the data gives each step: for token data, (batch, seq_len) token ids and the same
tokens one position later. A Hugging Face model is wrapped (``CausalLMLoss``, harness/hf_model.py) so that
it meets it: the cross-entropy of its logits for ``inputs`` against ``targets``. (Its own ``labels=`` shifts
the labels once more inside the model: given ``targets`` it would learn to predict the token two ahead.)

Optional, for the logs: a ``flops_per_token`` attribute or method (training FLOPs per token, for MFU;
without it the run reports no MFU). Every rank builds the model from the same seed (``build`` is called after
``torch.manual_seed``), and DDP also broadcasts rank 0's weights.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelSpec:
    """What ``--model`` names: how to build it, and what a checkpoint must match to resume into it."""

    name: str  # the --model value, as given
    identity: dict  # compared with a checkpoint's before resuming (harness.resume_file's must_match; its keys
    # sit beside the checkpoint's own, "model" among them: none of them is "model")
    build: Callable[..., "torch.nn.Module"]  # a module meeting the contract above, on the CPU (a Hugging Face
    # model takes from_pretrained's keyword arguments too, e.g. tp_plan and device_mesh)
    vocab_size: int | None = None  # the token ids the model takes (None: not a language model, or unknown)
    # what tensor parallelism must divide, e.g. {"--n-head": 4}: each TP rank takes whole heads (None: the
    # model's TP plan is not known before it is built; recipes/fsdp_tp_pp then defaults to --tp 1)
    tp_divides: dict[str, int] | None = None
    # The sharded load (a Hugging Face model in safetensors; None otherwise): build_empty() is the model with
    # its parameters on the meta device, which the recipe cuts and shards and moves off it (to_empty);
    # load_weights(model) then fills each rank's part from the files (hf_model.load_weights). A memory
    # estimate on fake tensors uses build_empty alone (from config.json; no weights need be there;
    # build_empty(meta=False) under fake tensors: the whole model, fake).
    build_empty: Callable[..., "torch.nn.Module"] | None = None
    load_weights: Callable[["torch.nn.Module"], None] | None = None


def model_spec(args, gpt: Callable | None = None, gpt_config=None) -> ModelSpec:
    """The ModelSpec of ``args.model``: "gpt" builds ``gpt(gpt_config)`` (the recipe's recipes/gpt.py: the harness
    does not import the model), "hf:DIR" a Hugging Face model, "MODULE:FACTORY" the user's. ConfigError, one
    line, for anything that cannot be built."""
    name = getattr(args, "model", "gpt")
    if name == "gpt":
        from dataclasses import asdict

        if getattr(args, "lora_rank", None):
            raise ConfigError("--lora-rank wraps a Hugging Face model's linear layers (peft): use it with --model hf:DIR")
        return ModelSpec("gpt", {"model_cfg": asdict(gpt_config)}, lambda: gpt(gpt_config), gpt_config.vocab_size,
                         {"--n-head": gpt_config.n_head})
    if name.startswith("hf:"):
        return hugging_face_spec(name, args)
    if ":" not in name.strip(":"):
        raise ConfigError(f"--model {name}: use gpt, hf:DIR (a Hugging Face model directory) or MODULE:FACTORY "
                          "(your own, e.g. mymodel.py:build)")
    return user_spec(name, args)


# ---- a Hugging Face model directory


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def hugging_face_spec(name: str, args) -> ModelSpec:
    directory = Path(name.removeprefix("hf:")).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"--model {name}: {directory} is not a directory: give a Hugging Face model directory "
                          "(config.json and model.safetensors, as save_pretrained writes them)")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"--model {name}: {directory} has no config.json: it is not a Hugging Face model directory")
    # (--estimate-memory on fake tensors reads no weights: config.json is all it needs, on a login node)
    estimating = getattr(args, "estimate_memory", None) is not None and getattr(args, "world", None) is not None
    if not estimating and not any((directory / weights).is_file() for weights in WEIGHT_FILES):
        raise ConfigError(f"--model {name}: {directory} has config.json but no weights ({', '.join(WEIGHT_FILES[:2])}): "
                          "save the model with save_pretrained, or download it on a login node first")
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(f"--model {name} needs Hugging Face transformers, which {sys.executable} lacks: "
                          "pip install the pinned version of requirements/frameworks.txt")
    # Nothing from the network on a compute node: a model is a directory, read as it is. And whatever
    # transformers would cache goes under the run, not into a home directory a compute node may not write.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if getattr(args, "out_dir", None) is not None:
        os.environ.setdefault("HF_HOME", str(Path(args.out_dir).absolute() / "hf_home"))
    # (and no progress bar on every rank of a job log for reading a few files)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # transformers asks DeepSpeed (when installed) which accelerator there is; told, it does not log a warning
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"--model {name}: transformers cannot read {config_file} ({first[:160]})") from None
    vocab_size = getattr(config, "vocab_size", None)
    lora_rank = getattr(args, "lora_rank", None)
    if lora_rank is not None:
        if lora_rank < 1:
            raise ConfigError(f"--lora-rank must be at least 1, got {lora_rank}")
        if importlib.util.find_spec("peft") is None:
            raise ConfigError(f"--lora-rank needs Hugging Face peft, which {sys.executable} lacks: pip install the "
                              "pinned version of requirements/frameworks.txt")
    identity = {"model_name": f"hf:{directory.resolve()}", "lora_rank": lora_rank,
                "config_sha256": hashlib.sha256(config_file.read_bytes()).hexdigest()}
    heads = {f"{key} (the model's config)": getattr(config, key) for key in ("num_attention_heads", "num_key_value_heads")
             if isinstance(getattr(config, key, None), int)}

    seed = getattr(args, "seed", 0)

    def build(**load_options) -> "torch.nn.Module":
        import torch
        from transformers import AutoModelForCausalLM

        from .hf_model import CausalLMLoss, with_lora

        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                     **load_options)
        return CausalLMLoss(with_lora(model, lora_rank, seed) if lora_rank else model, args.seq_len)

    def build_empty(meta: bool = True) -> "torch.nn.Module":
        from .hf_model import empty_model

        return empty_model(config, lora_rank, args.seq_len, seed, meta)

    def load_weights(model: "torch.nn.Module") -> None:
        from .hf_model import load_weights as load

        load(model, directory, seed)

    in_safetensors = any((directory / weights).is_file() for weights in WEIGHT_FILES[:2])
    missing = []
    if in_safetensors and not estimating:  # (a shard missing or a file cut short: one line now, not a traceback)
        from .hf_model import weight_files, weights_missing

        missing = weights_missing(directory, config, weight_files(directory))
        # A model whose files lack some of its weights would train from weights newly drawn (transformers only
        # warns, "newly initialized"): not the model on disk, unless the user says that is what they want
        if missing and not getattr(args, "allow_new_weights", False):
            raise ConfigError(f"--model {name}: the weight files in {directory} hold no {missing[0]}"
                              + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + f" of its {type(config).__name__.removesuffix('Config')} architecture: it would "
                              "train from weights newly drawn, not the ones on disk; check that config.json and the "
                              "weights are one model, or add --allow-new-weights if new weights are what you want")
    # (--allow-new-weights with weights missing: the whole load, where from_pretrained draws them as it does)
    sharded = (in_safetensors and not missing) or estimating
    return ModelSpec(name, identity, build, vocab_size, heads or None,
                     build_empty if sharded else None, load_weights if sharded and in_safetensors else None)


# ---- your own model (and dataset: harness.data)


def user_spec(name: str, args) -> ModelSpec:
    factory, _ = import_factory("--model", name)
    if not takes(factory, args):
        raise ConfigError(f"--model {name}: {factory.__name__} must take one argument, the run's options "
                          f"(def {factory.__name__}(args): ... return the module)")

    def build() -> "torch.nn.Module":
        import torch

        try:
            model = factory(args)
        except Exception as error:  # noqa: BLE001 (the user's code: one line, with where it was raised)
            raise ConfigError(f"--model {name}: {factory.__name__}(args) raised {type(error).__name__}: "
                              f"{str(error).strip()[:160]} ({raised_at(error)})") from None
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"--model {name}: {factory.__name__}(args) returned {type(model).__name__}, not a "
                              "torch.nn.Module whose forward(inputs, targets) returns the loss")
        if not takes(model.forward, "inputs", "targets"):
            raise ConfigError(f"--model {name}: {type(model).__name__}.forward must take (inputs, targets) and "
                              "return the batch's mean loss (harness/model.py)")
        check_first_loss(model, name)
        return model

    return ModelSpec(name, {"model_name": name}, build)


def takes(function: Callable, *arguments) -> bool:
    """Can ``function`` be called with these positional arguments (by its signature)?"""
    import inspect

    try:
        inspect.signature(function).bind(*arguments)
    except TypeError:
        return False
    except ValueError:  # (no signature to read: a builtin; let the call say)
        return True
    return True


def raised_at(error: BaseException) -> str:
    """file:line of the innermost frame of the exception's traceback (where the user's code raised it)."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def check_first_loss(model: "torch.nn.Module", name: str) -> None:
    """The contract's other half, checked on the first forward (a hook that then removes itself): the loss is
    one number, a scalar tensor; a loss per token or per row would fail in backward with PyTorch's words."""
    import torch

    def hook(module, inputs, output) -> None:
        handle.remove()
        if not (isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point()):
            shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ConfigError(f"--model {name}: {type(module).__name__}.forward(inputs, targets) returned {shape}, "
                              "not the batch's mean loss (a scalar float tensor): reduce it, e.g. loss.mean()")

    handle = model.register_forward_hook(hook)


def import_factory(option: str, value: str):
    """MODULE:FACTORY -> (the function, its module). MODULE: a file (path/to/mine.py) or a module on
    PYTHONPATH (mypkg.models). ConfigError (one line) when it cannot be had."""
    module_name, _, factory_name = value.rpartition(":")
    if not module_name or not factory_name:
        raise ConfigError(f"{option} {value}: give MODULE:FACTORY, e.g. path/to/mine.py:build or mypkg.mine:build")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"{option} {value}: {path} is not a file")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module  # (so that what it defines pickles: DataLoader workers, checkpoints)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 (whatever the user's module raises on import: one line)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{option} {value}: cannot import {module_name}: {type(error).__name__}: {first[:160]}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ConfigError(f"{option} {value}: {module_name} has no function {factory_name}")
    return factory, module


def model_size(model: "torch.nn.Module") -> tuple[int, float | None]:
    """(parameters, training FLOPs per token or None): what the logs and MFU need."""
    if hasattr(model, "size"):  # the stack's GPT
        return model.size()
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # (ds_numel: ZeRO-3's shards)
    flops = getattr(model, "flops_per_token", None)
    return n_params, (flops() if callable(flops) else flops)


def check_model_vocabulary(spec: ModelSpec, vocab_size: int) -> None:
    """The model must take every token id the data gives: --vocab-size (a token file's ids are checked
    against --vocab-size already, harness.data)."""
    if spec.vocab_size is not None and vocab_size > spec.vocab_size:
        raise ConfigError(f"--model {spec.name} takes {spec.vocab_size} token ids, fewer than --vocab-size {vocab_size}: "
                          f"use --vocab-size {spec.vocab_size} or less (and data tokenized for this model)")


def check_export_option(args, spec: ModelSpec) -> None:
    """--export-hf DIR: a Hugging Face model to export, and a directory that does not hold anything yet."""
    target = getattr(args, "export_hf", None)
    if target is None:
        return
    if not spec.name.startswith("hf:"):
        raise ConfigError(f"--export-hf writes a Hugging Face model directory: it needs --model hf:DIR (this run "
                          f"trains {spec.name}; its checkpoints are in --out-dir)")
    check_export_target(Path(target), "--export-hf")


def check_export_target(target: Path, option: str) -> None:
    """The directory an export writes (``option``: the name the user gave it) must not hold anything yet."""
    if target.is_file() or (target.is_dir() and any(target.iterdir())):
        raise ConfigError(f"{option} {target} exists and is not an empty directory: name a new one "
                          "(an export never overwrites)")
    existing = next(parent for parent in target.absolute().parents if parent.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {target}: cannot create it in {existing}: name a directory you can write")


def export_trained_model(model: "torch.nn.Module", spec: ModelSpec, target: Path, recipe: str) -> None:
    """--export-hf: the trained model (the CausalLMLoss a recipe trained, unwrapped, whole on this rank) as a
    Hugging Face directory that from_pretrained loads, with the source directory's tokenizer (LoRA: its
    adapters merged into the weights, and the adapters alone in DIR/adapter). One rank calls it. A model cut
    and sharded over the ranks: export_sharded_model."""
    from .hf_model import export_hugging_face

    files = export_hugging_face(model, Path(spec.name.removeprefix("hf:")), Path(target))
    print(f"[{recipe}] exported the trained model to {target} ({', '.join(files)}): "
          "AutoModelForCausalLM.from_pretrained loads it", flush=True)


def export_sharded_model(model: "torch.nn.Module", spec: ModelSpec, target: Path, recipe: str, *, rank: int,
                         world_size: int, barrier: Callable[[], None]) -> None:
    """--export-hf from a model cut and sharded over the ranks (FSDP2, TP): every rank calls it; the model is
    written tensor by tensor, each gathered whole in turn and written by one rank, so that no rank holds the
    whole model (hf_model.export_streaming). The directory is the one export_trained_model writes."""
    from .hf_model import export_streaming, whole_of

    files = export_streaming(model, whole_of(model), Path(spec.name.removeprefix("hf:")), Path(target), rank=rank,
                             world_size=world_size, barrier=barrier)
    if rank == 0:
        print(f"[{recipe}] exported the trained model to {target} ({', '.join(files)}), written by {world_size} "
              "rank(s) a tensor at a time: AutoModelForCausalLM.from_pretrained loads it", flush=True)
