"""Run unmodified megatron-core on a machine without a CUDA device: a placement-only shim. CPU runs only.

megatron-core has no CPU path: it creates tensors with ``device="cuda"`` (or ``torch.cuda.current_device()``),
moves tensors with ``.cuda()``, keeps its dropout RNG states in CUDA generators and asserts that gradients
are ``torch.cuda.FloatTensor``. Its math, layers, communication and pipeline schedules are plain torch and
torch.distributed, and run on CPU with gloo as they are. This shim changes *where* tensors live, nothing else:

- a ``torch.overrides.TorchFunctionMode`` turns a CUDA device in factory calls (``torch.zeros(...,
  device="cuda")``) and in ``Tensor.to(...)`` into the CPU, makes ``Tensor.cuda()`` return the tensor, and
  answers ``Tensor.type()`` with the CUDA type name (so ``== "torch.cuda.FloatTensor"`` holds for a CPU
  float tensor, which is what that check is about: the dtype);
- ``torch.cuda.current_device()`` answers 0 (the index megatron passes on as a device, turned into the CPU
  above) and ``torch.cuda.synchronize()`` does nothing (CPU work is synchronous);
- megatron's CUDA RNG states tracker is replaced by one that keeps the same named states in CPU generators.

Every rewrite is recorded with the megatron file that asked for it (``sites()``); the tests compare that set
with a checked-in allow-list (tests/megatron_shim_sites.txt), so a megatron-core upgrade that adds a new CUDA
assumption fails loudly instead of being patched here silently. GPU runs never import this module.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

_SITES: set[tuple[str, str]] = set()
_MODE: "_CpuPlacementMode | None" = None
_THIS_FILE = str(Path(__file__).resolve())
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)

# Torch functions whose ``device=`` argument says where a new tensor is created.
_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.arange, torch.rand, torch.randn,
    torch.randint, torch.randperm, torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
    torch.as_tensor, torch.linspace, torch.eye, torch.empty_strided,
}


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # an index, as torch.cuda.current_device() returns: a CUDA device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _record(what: str) -> None:
    """Note the first caller outside torch and this file: the library site that asked for CUDA."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != _THIS_FILE and not filename.startswith(_TORCH_DIR) and "contextlib" not in filename:
            break
        frame = frame.f_back
    filename = frame.f_code.co_filename if frame is not None else "?"
    marker = "/megatron/core/"
    site = "megatron/core/" + filename.split(marker, 1)[1] if marker in filename else f"outside megatron: {filename}"
    _SITES.add((site, what))


class _CpuPlacementMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)  # pinning is for host-to-GPU copies
            _record(f"{func.__name__}(device=cuda)")
        elif func is torch.Tensor.cuda:
            _record("Tensor.cuda()")
            return args[0]
        elif func is torch.Tensor.to:
            if args[1:] and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
                _record("Tensor.to(cuda)")
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
                _record("Tensor.to(device=cuda)")
        elif func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            _record("Tensor.type()")
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """megatron's CudaRNGStatesTracker interface (add, fork, get/set_states, reset), on the CPU generator.

    Named states (data-parallel, tensor-parallel, expert) are seeded exactly as megatron seeds its CUDA ones;
    ``fork`` swaps the CPU default generator's state in and out, as megatron swaps the CUDA generator's.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _current_device() -> int:
    _record("torch.cuda.current_device()")
    return 0


def _synchronize(device=None) -> None:
    _record("torch.cuda.synchronize()")


def enable() -> None:
    """Turn the shim on for the rest of the process. Refuses where a CUDA device exists: GPU runs use CUDA."""
    global _MODE
    if torch.cuda.is_available():
        raise RuntimeError("cpu_placement_shim is for machines without a CUDA device; this one has one")
    if _MODE is not None:
        return
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True  # initialize_rng_tracker() keeps ours
    _MODE = _CpuPlacementMode()
    _MODE.__enter__()  # for the whole process: every megatron call from here on runs under it


def is_enabled() -> bool:
    return _MODE is not None


def sites() -> list[str]:
    """What the shim rewrote so far, one ``file: rewrite`` line per site, sorted."""
    return sorted(f"{site}: {what}" for site, what in _SITES)
