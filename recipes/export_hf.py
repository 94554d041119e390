"""A checkpoint of a Hugging Face fine-tuning run (--model hf:DIR) as a Hugging Face model directory.

    python recipes/export_hf.py runs/ddp --out $SCRATCH/my-llama-tuned            # the run's newest checkpoint
    python recipes/export_hf.py runs/fsdp_tp_pp/checkpoints/step_00000020 --out $SCRATCH/my-llama-step20

It reads the checkpoints of every recipe that takes --model hf:DIR: recipes/ddp (step_N.pt), accelerate
(save_state), DeepSpeed ZeRO 0-3 (every rank's shards) and fsdp_tp_pp (DCP, saved in any layout), in one
process, on the CPU, with no process group and no GPU. fsdp_tp_pp's DCP checkpoints are streamed: the model
is built empty and each tensor read, written and dropped in turn, so a login node exports a model larger than
its memory; the others are read whole (a login node will do for a model that fits its memory).
The model is the one the checkpoint records (the hf:DIR it started from, and --lora-rank), which must still
be where it was: --model hf:DIR names it if it moved. It writes what --export-hf writes at the end of a run:
safetensors and config.json, the source's tokenizer files, and for LoRA the adapters merged into the weights
(and alone in OUT/adapter); from_pretrained loads it with the trained model's logits.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # recipes/: the harness
import harness  # noqa: E402
from harness.checkpoint import check_manifest, TRAINER_STATE  # noqa: E402
from harness.model import check_export_target  # noqa: E402

RECIPE = "export_hf"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.new_parser(__doc__)
    p.add_argument("checkpoint", type=Path, help="a checkpoint (step_N.pt or a step_N directory), or a run's --out-dir")
    p.add_argument("--out", type=Path, required=True, help="the Hugging Face model directory to write (must not exist)")
    p.add_argument("--model", default=None, metavar="hf:DIR",
                   help="the model the run started from (default: the one the checkpoint records)")
    return p.parse_args(argv)


def find_checkpoint(path: Path) -> Path:
    """A checkpoint file or directory; a run's --out-dir (or its checkpoints/): the newest one in it."""
    if path.is_file() or (path / TRAINER_STATE).is_file():
        return path
    for directory in (path / "checkpoints", path):
        newest = [found for found in (harness.latest_checkpoint(directory), harness.latest_checkpoint_dir(directory))
                  if found is not None]
        if newest:
            return max(newest, key=lambda found: found.name.removesuffix(".pt"))
    raise harness.ConfigError(f"{path} is neither a checkpoint (step_N.pt, or a step_N directory with {TRAINER_STATE}) "
                              "nor a run directory that holds one: give the run's --out-dir or a checkpoint in it")


def read_record(checkpoint: Path) -> tuple[dict, dict | None]:
    """(what the run recorded about its model, the weights where they sit in the same file)."""
    if checkpoint.is_file():
        import torch

        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        return state, state["model"]
    return json.loads((checkpoint / TRAINER_STATE).read_text()), None


def load_weights(model, checkpoint: Path, weights: dict | None) -> str:
    """The checkpoint's trained weights into ``model`` (a fresh spec.build()); returns the format read."""
    import torch

    if weights is not None:  # recipes/ddp: one file, the model's state dict
        model.load_state_dict(weights)
        return "the DDP recipe's checkpoint file"
    if (checkpoint / ".metadata").is_file():  # fsdp_tp_pp: DCP, keyed "model.<parameter name>" in any layout
        import torch.distributed.checkpoint as dcp

        wanted = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
        with warnings.catch_warnings():  # (DCP says it assumes one process, which is what no_dist asks for)
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wanted, checkpoint_id=str(checkpoint), no_dist=True)
        model.load_state_dict({name.removeprefix("model."): tensor for name, tensor in wanted.items()})
        return "a DCP checkpoint (fsdp_tp_pp)"
    for name in ("pytorch_model.bin", "model.safetensors"):  # accelerate's save_state
        if (checkpoint / name).is_file():
            if name.endswith(".bin"):
                model.load_state_dict(torch.load(checkpoint / name, map_location="cpu", weights_only=True))
            else:
                from safetensors.torch import load_file

                model.load_state_dict(load_file(checkpoint / name))
            return "accelerate's save_state"
    if any(checkpoint.glob("zero_pp_rank_*_mp_rank_*_optim_states.pt")):  # DeepSpeed ZeRO 1-3: every rank's shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name))
        return "a DeepSpeed ZeRO checkpoint"
    if (checkpoint / "mp_rank_00_model_states.pt").is_file():  # DeepSpeed without ZeRO: the whole model
        model.load_state_dict(torch.load(checkpoint / "mp_rank_00_model_states.pt", map_location="cpu",
                                         weights_only=False)["module"])
        return "a DeepSpeed checkpoint"
    raise harness.ConfigError(f"{checkpoint} holds no model weights this command reads (DDP's step_N.pt, accelerate's, "
                              "DeepSpeed's or DCP files)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_export_target(args.out, "--out")  # (before reading a checkpoint that may take a while)
    checkpoint = find_checkpoint(args.checkpoint)
    if checkpoint.is_dir():
        check_manifest(checkpoint)  # (a shard lost or cut short: one line, not a loader's stack trace)
    record, weights = read_record(checkpoint)
    name = args.model or record.get("model_name")
    if not name or not str(name).startswith("hf:"):
        trained = name or "the stack's GPT"
        raise harness.ConfigError(f"{checkpoint} is not from a Hugging Face model (--model hf:DIR): it trained "
                                  f"{trained}; its checkpoints are the model")
    # the model as the run built it: its directory, its LoRA adapters (the sequence length only feeds MFU)
    options = argparse.Namespace(model=name, lora_rank=record.get("lora_rank"), seq_len=1)
    spec = harness.model_spec(options)
    if args.model is None and record.get("config_sha256") != spec.identity["config_sha256"]:
        raise harness.ConfigError(f"{name.removeprefix('hf:')}/config.json has changed since the run wrote {checkpoint}: "
                                  "give the directory the run started from with --model hf:DIR")
    about = f"(step {record.get('step')}, model {name}" + (f", LoRA rank {record['lora_rank']}" if record.get("lora_rank") else "") + ")"
    if (checkpoint / ".metadata").is_file() and spec.build_empty is not None:
        # fsdp_tp_pp's DCP checkpoint: streamed, a tensor at a time, into the model built empty (no weights held)
        from harness.hf_model import export_streaming

        print(f"[{RECIPE}] read a DCP checkpoint (fsdp_tp_pp), a tensor at a time: {checkpoint} {about}", flush=True)
        files = export_streaming(spec.build_empty(), dcp_tensors(checkpoint), Path(name.removeprefix("hf:")), args.out)
        print(f"[{RECIPE}] exported the trained model to {args.out} ({', '.join(files)}): "
              "AutoModelForCausalLM.from_pretrained loads it", flush=True)
        return 0
    model = spec.build()
    source = load_weights(model, checkpoint, weights)
    print(f"[{RECIPE}] read {source}: {checkpoint} {about}", flush=True)
    harness.export_trained_model(model, spec, args.out, RECIPE)
    return 0


def dcp_tensors(checkpoint: Path):
    """name -> that parameter of the model (as fsdp_tp_pp names it, without DCP's "model." prefix) read whole
    from a DCP checkpoint written in any layout: DCP reads and joins just that tensor's shards."""
    import torch
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata

    def whole(name: str) -> torch.Tensor:
        key = f"model.{name}"
        if key not in saved:
            raise harness.ConfigError(f"{checkpoint} holds no {key}: it is not a checkpoint of the model it records "
                                      "(give the directory the run started from with --model hf:DIR)")
        tensor = torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
        with warnings.catch_warnings():  # (DCP says it assumes one process, which is what no_dist asks for)
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({key: tensor}, checkpoint_id=str(checkpoint), no_dist=True)
        return tensor

    return whole


if __name__ == "__main__":
    harness.main_entry(RECIPE, main)
