"""What the image must provide for this job, checked once, in the image, before any rank starts.

- ``check_network_plugin``: the site's NCCL network plugin (Perlmutter: NERSC's aws-ofi-nccl, injected by
  Shifter's or podman-hpc's module) loads in this image. NERSC builds it once per CUDA major and it links that
  major's CUDA runtime, so the CUDA 12 build does not load in a CUDA 13 image; on one node NCCL says so in an
  INFO line and goes on over NVLink, on 2+ nodes it stops at start-up ("Failed to initialize any NET
  plugin"), minutes into the allocation. slurm/lib/launch.sh runs the recipe's ``--preflight`` in the image
  with the job's modules: this opens the plugin there, as NCCL would, and names the module to use.
- ``check_compiler``: ``--compile`` (torch.compile: Inductor, and Triton on a GPU) builds its kernels with a C or
  C++ compiler and Python's headers at run time; without them the first step fails deep inside Inductor.

PyTorch is not imported here: the TensorFlow recipes use this module too.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from .contract import CONTAINER_RUNTIME_ENV
from .errors import ConfigError

# NERSC's network plugin module for each CUDA major, as each runtime names it (NERSC's slurm-ray-cluster README,
# May 2026). slurm/lib/network.sh (nccl_plugin_module) has the same table, to choose podman-hpc's flag.
PLUGIN_MODULES = {
    "shifter": {12: "nccl-plugin", 13: "nccl-cu13-plugin"},
    "podman-hpc": {12: "nccl", 13: "nccl-cu13"},
}
CUDA_MAJORS = (13, 12)  # the CUDA runtimes an image may carry, newest first


def cuda_runtime_major() -> int | None:
    """The CUDA major of the runtime this image gives its ranks, None without one (a cpu image). Asked after the
    framework's import: torch's CUDA wheels load their libcudart (not on the loader's path) then, and the
    loader finds NGC's in the toolkit; the plugin resolves its own libcudart the same way."""
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if cuda:
        return int(cuda.split(".")[0])
    for major in CUDA_MAJORS:
        try:
            ctypes.CDLL(f"libcudart.so.{major}")
            return major
        except OSError:
            continue
    return None


def plugin_file(setting: str) -> str:
    """The file NCCL opens for NCCL_NET_PLUGIN: a file name as given, else libnccl-net-<name>.so."""
    return setting if setting.endswith(".so") or "/" in setting else f"libnccl-net-{setting}.so"


def loaded_from(name: str) -> str:
    """Where the loader found the library ``name`` in this process (its path in /proc/self/maps)."""
    base = os.path.basename(name)
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split(None, 5)[-1] if line.count(" ") >= 5 else ""
            if os.path.basename(path) == base:
                return path
    except OSError:
        pass
    return name


def how_to_load(runtime: str, module: str) -> str:
    if runtime == "shifter":
        return f"submit with '#SBATCH --module=gpu,{module}'"
    return f"set HPCML_NCCL_MODULE={module} (podman-hpc --{module})"


def check_network_plugin(environ: dict[str, str] | None = None) -> str | None:
    """Open the job's network plugin in this image as NCCL would; a line for the preflight's log, None when
    the job loads no plugin (one node, NCCL_NET= to allow TCP, no plugin module). ConfigError, with the
    loader's own reason and the module to use, when it does not load or is the build of another CUDA major."""
    env = os.environ if environ is None else environ
    module = env.get("HPCML_NCCL_MODULE_LOADED", "")
    runtime = env.get(CONTAINER_RUNTIME_ENV, "")
    if not env.get("NCCL_NET") or not module:
        return None
    described = f"Shifter's {module} module" if runtime == "shifter" else f"podman-hpc's --{module}"
    major = cuda_runtime_major()
    if major is None:
        return f"network plugin: not opened, this image has no CUDA runtime (its ranks use gloo, not NCCL; {described})"
    site = PLUGIN_MODULES.get(runtime, {})
    use = (how_to_load(runtime, site[major]) if major in site and site[major] != module else
           f"load the site's build of the plugin for CUDA {major} (HPCML_NCCL_MODULE names it)")
    name = plugin_file(env.get("NCCL_NET_PLUGIN") or "libnccl-net.so")
    try:
        ctypes.CDLL(name)
    except OSError as error:
        raise ConfigError(f"NCCL_NET='{env['NCCL_NET']}' but the network plugin of {described} does not load in this "
                          f"CUDA {major} image: {error}; {use}") from None
    built_for = {name: cuda for cuda, name in site.items()}.get(module)
    chosen = env.get("HPCML_NCCL_MODULE")  # a site whose modules are named otherwise: loading is the test
    if not chosen and built_for is not None and built_for != major:
        raise ConfigError(f"{described} is the CUDA {built_for} build of the network plugin and this image is CUDA "
                          f"{major}: {use}")
    return f"network plugin {loaded_from(name)} loads ({described}, CUDA {major} image)"


def check_compiler(device: str) -> None:
    """``--compile`` where torch.compile can build its kernels: a C++ compiler on the CPU (Inductor's C++
    backend), a C compiler on a GPU (Triton's launcher), and Python's headers for both."""
    names = ("CXX", ("g++", "c++", "clang++")) if device == "cpu" else ("CC", ("cc", "gcc", "clang"))
    variable, programs = names
    compiler = os.environ.get(variable) or next((p for p in programs if shutil.which(p)), None)
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = []
    if compiler is None or shutil.which(compiler.split()[0]) is None:
        missing.append(f"a {'C++' if device == 'cpu' else 'C'} compiler ({variable}, or {'/'.join(programs)} on PATH)")
    if not headers.is_file():
        missing.append(f"Python's headers ({headers})")
    if missing:
        raise ConfigError(f"--compile builds torch.compile's kernels at run time and needs {' and '.join(missing)}, "
                          f"which this environment lacks: drop --compile (the images train in eager mode), or run "
                          f"where they are installed (Debian: apt-get install g++ python3-dev)")
