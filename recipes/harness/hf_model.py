"""A Hugging Face causal language model under the harness's model contract (harness/model.py).

Its own module because it imports PyTorch at import time; harness.model imports it only to build one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .errors import ConfigError
from .metrics import transformer_flops_per_token


class CausalLMLoss(torch.nn.Module):
    """``forward(inputs, targets)``: the mean next-token cross-entropy of the model's logits for ``inputs``
    against ``targets`` (the same tokens one position later), in float32, as recipes/gpt.py computes it.
    Not the model's ``labels=``: that shifts the labels once more inside the model, and given ``targets``
    it would train the model to predict the token two positions ahead."""

    def __init__(self, model: torch.nn.Module, seq_len: int):
        super().__init__()
        self.model, self.seq_len = model, seq_len

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # a sum over the trained targets / their number, not cross_entropy's mean: rows with none give 0, not NaN
        total = F.cross_entropy(self.logits(inputs, positions).float().flatten(0, 1), targets.flatten(), reduction="sum")
        return total / (targets != -100).sum().clamp(min=1)  # (-100: the ignore_index, data.IGNORE)

    def logits(self, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: rows that pack several documents (--pack), each token's position in its document.
        Given position ids and no attention mask, transformers confines attention to each document itself
        (masking_utils.find_packed_sequence_indices: a document starts where a position does not follow the
        one before), for its eager and SDPA attention as for flash attention's varlen kernels."""
        return self.model(input_ids=inputs, position_ids=positions, use_cache=False).logits

    @property
    def base(self) -> torch.nn.Module:
        """The Hugging Face model itself (under LoRA, the model peft wraps)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def flops_per_token(self) -> float:
        """6N + 12*L*d*T (harness.transformer_flops_per_token); N leaves out the input embedding, a lookup,
        unless the output layer shares its weight (then it is a matmul too)."""
        model = self.base  # (LoRA's adapters add little; the frozen weights still run forward and backward)
        config = model.config
        n_params = sum(numel(p) for p in model.parameters())
        embedding = model.get_input_embeddings().weight
        output = model.get_output_embeddings()
        if output is None or output.weight is not embedding:
            n_params -= numel(embedding)
        return transformer_flops_per_token(n_params, config.num_hidden_layers, config.hidden_size, self.seq_len)


def numel(parameter: torch.Tensor) -> int:
    """A parameter's size, also where ZeRO-3 loaded the model partitioned (each rank holds a shard)."""
    return getattr(parameter, "ds_numel", parameter.numel())


def with_lora(model: torch.nn.Module, rank: int, seed: int) -> torch.nn.Module:
    """--lora-rank R: peft's LoRA adapters of rank R (alpha 2R, no dropout) on every linear layer but the
    output layer; the model's own weights frozen. The adapters start at zero: the model starts as it was.
    Their A matrices are drawn by ``init_lora`` from ``seed``, so that a model whose weights are still on the
    meta device (the sharded load) gets the same adapters as a whole one."""
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():  # peft 0.21 asks transformers 5.25 a deprecated question: not the user's to act on
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        lora = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                target_modules="all-linear"))
    if not any(p.is_meta for p in lora.parameters()):
        init_lora(lora, seed)
    return lora


def init_lora(model: torch.nn.Module, seed: int) -> None:
    """Every LoRA adapter as peft initialises one (A: Kaiming-uniform, B: zeros), A drawn whole, in the
    order of the parameters' names, from a generator of its own seeded with ``seed``: the same adapters on
    one process and on any layout, where a rank holds only a shard of A (the adapters are small: each is
    drawn whole on every rank, and each rank keeps its part)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if ".lora_A." in name:
            whole = torch.empty(param.shape)
            torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
            set_whole(param, whole)
        elif ".lora_B." in name:
            set_whole(param, torch.zeros(param.shape))


def set_whole(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Set ``param`` (a DTensor shard, or a plain tensor) to its part of ``whole``."""
    from torch.distributed.tensor import distribute_tensor, DTensor

    with torch.no_grad():
        if isinstance(param, DTensor):  # (src_data_rank=None: each rank cuts its own part, no communication)
            param.to_local().copy_(distribute_tensor(whole, param.device_mesh, param.placements,
                                                     src_data_rank=None).to_local())
        else:
            param.copy_(whole)


# ---- the sharded load: a model built on the meta device, cut and sharded, then each rank reads its own part


def empty_model(config, lora_rank: int | None, seq_len: int, seed: int, meta: bool = True) -> CausalLMLoss:
    """The model of ``config`` as from_pretrained builds it, with every parameter on the meta device (no
    memory, no weights read): what a recipe cuts and shards before ``load_weights`` fills each rank's part.
    ``meta`` False: built where tensors are made now (under fake tensors: the memory estimate's whole model)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta") if meta else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if lora_rank:
            model = with_lora(model, lora_rank, seed)
    return CausalLMLoss(model, seq_len)


def weight_files(directory: Path) -> dict[str, Path]:
    """Each tensor name in the model directory's safetensors files -> its file. A sharded index must name
    files that are there; a file must be whole (its header readable, its size what the header says).
    ConfigError, one line, naming the file and what to do."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{index} is not a safetensors index (JSON with a weight_map): save the model again "
                              "with save_pretrained") from None
        files = {name: directory / file for name, file in names.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ConfigError(f"{index} names {file.name}, which is not in {directory}: the download or copy is "
                                  "incomplete; fetch the model's files again")
    elif (directory / "model.safetensors").is_file():
        files = None
    else:
        raise ConfigError(f"{directory} has no safetensors weights (model.safetensors or its index): a sharded load "
                          "reads safetensors; convert the model with save_pretrained(safe_serialization=True)")
    found = {}
    for file in sorted(set(files.values())) if files else [directory / "model.safetensors"]:
        try:
            with safe_open(str(file), framework="pt") as opened:
                keys = list(opened.keys())
        except Exception as error:  # noqa: BLE001 (safetensors' own errors: one line)
            raise ConfigError(f"{file} cannot be read as safetensors ({str(error).splitlines()[0][:120]}): the file is "
                              "cut off or corrupt; fetch the model's files again") from None
        check_whole(file)
        found.update({key: file for key in keys})
    return found


def weights_missing(directory: Path, config, on_disk: dict[str, Path]) -> list[str]:
    """The parameters of ``config``'s model that the files do not hold (a tied weight counts as its twin's):
    those from_pretrained would draw anew, with a warning. Built on the meta device: nothing read, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    twins = parameter_names(model)
    return [names[0] for names in twins.values() if not any(name in on_disk for name in names)]


def parameter_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in ``model`` (a tied weight has two)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def check_whole(file: Path) -> None:
    """A safetensors file is an 8-byte header length, the JSON header, then the data: the last tensor must end
    where the file does (a copy cut short still opens: its header is at the start)."""
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if file.stat().st_size < 8 + length + data_end:
        raise ConfigError(f"{file} is cut off ({file.stat().st_size} bytes of {8 + length + data_end}): the download "
                          "or copy is incomplete; fetch the model's files again")


def load_weights(wrapped: CausalLMLoss, directory: Path, seed: int) -> None:
    """Fill a model from ``empty_model``, cut and sharded as the recipe wants and moved off the meta device
    (``to_empty``), from the model directory's safetensors files: each rank reads only its own parts.

    PyTorch's distributed checkpoint reads them (DCP's HuggingFaceStorageReader): it plans, for every
    parameter, the part this rank holds (a DTensor's shards under any placement, FSDP2's, TP's and both
    together, or the whole of a plain tensor) and reads just those slices through safetensors' slice reads,
    into the parameters in place. No rank holds more than its share plus the slice being read. What the files
    do not hold is initialised as from_pretrained initialises it: the buffers the model computes (rotary
    frequencies) by the model's own _init_weights; a tied weight is its twin; LoRA's adapters by
    ``init_lora``. Any other parameter missing from the files is refused: the model would train from weights
    newly drawn, not the ones on disk."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    model = wrapped.base
    on_disk = weight_files(directory)
    twins = parameter_names(model)
    wanted, missing = {}, []
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        keys = [alias.replace(".base_layer.", ".") for alias in twins[id(param)]]
        key = next((key for key in keys if key in on_disk), None)
        if key is None:
            missing.append(keys[0])
        else:
            wanted[key] = param
    persistent = {name for name, _ in model.state_dict().items()}
    for name, buffer in model.named_buffers():
        if name in persistent and name in on_disk:
            wanted[name] = buffer
    if missing:
        raise ConfigError(f"--model hf:{directory}: its weight files hold no {missing[0]}"
                          + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
                          + ": the model would train from weights newly drawn, not the ones on disk; check that "
                          "config.json and the weights belong to the same model")
    one_process = not (dist.is_available() and dist.is_initialized())
    with torch.no_grad(), warnings.catch_warnings():  # (DCP warns that no_dist assumes one process: it is asked to)
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=one_process)
    for tensor in wanted.values():
        tensor._is_hf_initialized = True
    # the buffers the model computes rather than stores, as from_pretrained recomputes them
    for module in model.modules():
        if module._non_persistent_buffers_set:
            module.__dict__.pop("_is_hf_initialized", None)
            model._init_weights(module)
    if hasattr(wrapped.model, "get_base_model"):  # LoRA
        init_lora(wrapped.model, seed)


# What a Hugging Face model directory holds besides the weights and config.json: the tokenizer, copied from
# the source directory so that the export is a model one can load and use as it is.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


# ---- the sharded export: the model written tensor by tensor, no rank holding more than one of them whole

EXPORT_FILE_BYTES = 5 * 1024**3  # the most one safetensors file of an export holds (save_pretrained's old default)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def exported_tensors(wrapped: CausalLMLoss, whole: Callable[[str], torch.Tensor]):
    """[(name in the Hugging Face files, shape, dtype, producer)] of a model that may be cut and sharded or on
    the meta device: ``whole(name)`` gives the named parameter or buffer of ``wrapped`` whole (a DTensor's
    gather, a checkpoint's read), and a producer calls it when the tensor's turn comes. LoRA's adapters are
    merged into their layers' weights as peft merges them (W + B @ A x scaling); a tied weight is written once."""
    model = wrapped.base
    prefix = "model." + ("base_model.model." if hasattr(wrapped.model, "get_base_model") else "")
    modules = dict(model.named_modules())
    found = []
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        producer = functools.partial(whole, prefix + name)
        owner_name, _, leaf = name.rpartition(".base_layer.")
        owner = modules.get(owner_name) if leaf == "weight" else None
        if owner is not None and "default" in getattr(owner, "lora_A", {}):
            producer = functools.partial(_merged, producer, functools.partial(whole, f"{prefix}{owner_name}.lora_A.default.weight"),
                                         functools.partial(whole, f"{prefix}{owner_name}.lora_B.default.weight"),
                                         owner.scaling["default"])
        shape = tuple(getattr(param, "ds_shape", param.shape))  # (ZeRO-3: the whole shape, not the shard's)
        found.append((name.replace(".base_layer.", "."), shape, param.dtype, producer))
    persistent = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name in persistent:
            found.append((name, tuple(buffer.shape), buffer.dtype, functools.partial(whole, prefix + name)))
    return found


def whole_of(module: torch.nn.Module) -> Callable[[str], torch.Tensor]:
    """name -> that parameter or buffer of ``module`` whole: a DTensor gathered from its shards, a ZeRO-3
    parameter from its partitions (collectives: every rank calls it), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    named = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))

    def whole(name: str) -> torch.Tensor:
        tensor = named[name]
        if hasattr(tensor, "ds_id"):  # DeepSpeed ZeRO-3's partitioned parameter: gathered, copied, released
            import deepspeed

            with deepspeed.zero.GatheredParameters([tensor]):
                return tensor.detach().clone()
        tensor = tensor.detach()
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    return whole


def _merged(weight, lora_a, lora_b, scaling: float) -> torch.Tensor:
    return weight() + (lora_b() @ lora_a()) * scaling


def plan_files(tensors: list, max_bytes: int) -> list[list]:
    """The tensors in files of at most ``max_bytes`` each (a larger tensor alone in one), in order."""
    files, size = [[]], 0
    for entry in tensors:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    return files


def write_safetensors_streaming(path: Path, entries: list) -> None:
    """One safetensors file whose header is written first (the shapes are known before any tensor is), then
    each tensor as its producer gives it, one at a time: the format's own layout (an 8-byte little-endian header
    length, the JSON header padded to 8 bytes, the data), which safetensors and from_pretrained read."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype, _ in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for name, shape, dtype, produce in entries:
            tensor = produce().detach().to("cpu", dtype).contiguous()
            assert tuple(tensor.shape) == shape, (name, tensor.shape, shape)
            if tensor.numel():
                handle.write(tensor.view(torch.uint8).numpy())  # (the tensor's own bytes, not a copy)
            del tensor


def export_streaming(wrapped: CausalLMLoss, whole: Callable[[str], torch.Tensor], source: Path, target: Path, *,
                     rank: int = 0, world_size: int = 1, barrier: Callable[[], None] = lambda: None,
                     max_file_bytes: int = EXPORT_FILE_BYTES) -> list[str] | None:
    """The trained model as a Hugging Face directory, written by every rank together without any of them
    holding it whole: the tensors in files of at most ``max_file_bytes``, file i written by rank i mod the
    world size; each tensor produced in turn on every rank (``whole`` may be a collective: every rank calls it
    for every tensor, in the same order), kept by the file's writer only as long as it takes to write it.
    Then rank 0 writes the index, config.json, the tokenizer files and (LoRA) the adapters alone in
    TARGET/adapter, and renames TARGET.partial to TARGET. Returns the files written (rank 0; None elsewhere)."""
    target = Path(target)
    partial = target.with_name(target.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    files = plan_files(exported_tensors(wrapped, whole), max_file_bytes)
    names = ["model.safetensors"] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                                          for i in range(len(files))]
    for index, (name, entries) in enumerate(zip(names, files)):
        if index % world_size == rank:
            write_safetensors_streaming(partial / name, entries)
        else:
            for entry in entries:
                entry[3]()  # (its part of the gather)
    lora = None
    if hasattr(wrapped.model, "get_base_model"):  # the adapters alone too (small: gathered whole)
        lora = {name: whole(f"model.{name}") for name, _ in wrapped.model.named_parameters() if ".lora_" in name}
    barrier()
    if rank != 0:
        return None
    if len(files) > 1:
        weight_map = {entry[0]: name for name, entries in zip(names, files) for entry in entries}
        total = sum(math.prod(entry[1]) * entry[2].itemsize for entries in files for entry in entries)
        (partial / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    model = wrapped.base
    model.config.save_pretrained(partial)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(partial)
    if lora is not None:
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        (partial / "adapter").mkdir()
        save_file(get_peft_model_state_dict(wrapped.model, state_dict=lora), partial / "adapter" / "adapter_model.safetensors",
                  metadata={"format": "pt"})
        wrapped.model.peft_config["default"].save_pretrained(partial / "adapter")
    return _finish_export(partial, source, target)


def _finish_export(partial: Path, source: Path, target: Path) -> list[str]:
    """The source's tokenizer files beside the weights, then TARGET.partial renamed to TARGET."""
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file() and not (partial / name).exists():
            shutil.copy2(Path(source) / name, partial / name)
    if target.is_dir():
        target.rmdir()  # (empty: checked before the run)
    os.replace(partial, target)
    return sorted(path.name for path in target.iterdir())


def export_hugging_face(wrapped: CausalLMLoss, source: Path, target: Path) -> list[str]:
    """The trained model as a Hugging Face directory (save_pretrained: safetensors and config.json) plus the
    source's tokenizer files; written into TARGET.partial and renamed, so a TARGET that exists is whole.
    A LoRA model (peft): its adapters alone in TARGET/adapter, and the model with them merged into its
    weights in TARGET. Returns the files written."""
    target = Path(target)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = wrapped.model
    if hasattr(model, "merge_and_unload"):  # peft's LoRA
        model.save_pretrained(partial / "adapter", safe_serialization=True)
        model = model.merge_and_unload()
    model.save_pretrained(partial, safe_serialization=True)
    return _finish_export(partial, source, target)
