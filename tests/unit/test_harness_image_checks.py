"""recipes/harness/image_checks.py: the site's network plugin opened as NCCL would open it, and --compile's compiler.

The plugins are the local cluster's stand-ins of NERSC's two aws-ofi-nccl builds (tests/cluster/nccl_net_plugin:
compiled here, each linking a stub CUDA runtime of its major). Each case runs in its own interpreter, because
the dynamic loader reads LD_LIBRARY_PATH when a process starts: the plugin module's directory (what Shifter's
and podman-hpc's modules put there) and the image's CUDA runtime (a stub of that major standing in for torch's
wheel or NGC's toolkit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.runs import REPO

PROBE = """
import json, sys
sys.path.insert(0, {recipes!r})
from harness.errors import ConfigError
from harness.image_checks import check_network_plugin
try:
    print(json.dumps({{"line": check_network_plugin()}}))
except ConfigError as error:
    print(json.dumps({{"error": str(error)}}))
"""


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> dict[int, Path]:
    """DIR/lib/libnccl-net.so (the plugin module) and DIR/cudart/libcudart.so.N (its major's runtime), per major."""
    built = {}
    for major in (12, 13):
        directory = tmp_path_factory.mktemp(f"plugin-cu{major}")
        result = subprocess.run(["bash", str(REPO / "tests/cluster/nccl_net_plugin/build.sh"), str(major), str(directory),
                                 str(directory / "cudart")],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        built[major] = directory
    return built


def check(module: str, plugin: Path | None, image_cuda: list[Path], runtime: str = "shifter", **env: str) -> dict:
    """check_network_plugin in a process whose loader sees the module's plugin and the image's CUDA runtimes."""
    path = [str(plugin / "lib")] if plugin else []
    path += [str(directory / "cudart") for directory in image_cuda]
    environment = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": ":".join(path), "NCCL_NET": "AWS Libfabric",
                   "NCCL_NET_PLUGIN": "libnccl-net.so", "HPCML_CONTAINER_RUNTIME": runtime,
                   "HPCML_NCCL_MODULE_LOADED": module, **env}
    # The loader without its cache (ld.so --inhibit-cache): LD_LIBRARY_PATH and the system's own directories
    # only, so that a CUDA toolkit installed on this machine is not taken for the image's runtime.
    loader = next(path for path in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1") if Path(path).exists())
    result = subprocess.run([loader, "--inhibit-cache", os.path.realpath(sys.executable), "-c",
                             PROBE.format(recipes=str(REPO / "recipes"))], env=environment,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_plugin_of_the_images_cuda_major_loads_and_is_named(plugins):
    seen = check("nccl-cu13-plugin", plugins[13], [plugins[13]])
    assert seen == {"line": f"network plugin {plugins[13] / 'lib' / 'libnccl-net.so'} loads "
                            "(Shifter's nccl-cu13-plugin module, CUDA 13 image)"}
    seen = check("nccl-plugin", plugins[12], [plugins[12]])  # NGC TensorFlow's CUDA 12, the horovod image
    assert seen["line"].endswith("loads (Shifter's nccl-plugin module, CUDA 12 image)"), seen


def test_the_cuda_12_plugin_in_a_cuda_13_image_is_refused_with_the_loaders_reason_and_the_module_to_use(plugins):
    """The first multi-node job's failure, caught before any rank: the loader's own message, and the module."""
    seen = check("nccl-plugin", plugins[12], [plugins[13]])
    assert seen["error"] == ("NCCL_NET='AWS Libfabric' but the network plugin of Shifter's nccl-plugin module does not "
                             "load in this CUDA 13 image: libcudart.so.12: cannot open shared object file: No such file "
                             "or directory; submit with '#SBATCH --module=gpu,nccl-cu13-plugin'"), seen
    seen = check("nccl", plugins[12], [plugins[13]], runtime="podman-hpc")
    assert "podman-hpc's --nccl does not load" in seen["error"] and "HPCML_NCCL_MODULE=nccl-cu13" in seen["error"], seen


def test_a_plugin_of_another_major_is_refused_even_where_it_happens_to_load(plugins):
    """An image carrying both runtimes loads either build; NCCL would then run the CUDA 12 plugin beside
    CUDA 13, which NERSC's README says not to do: the module must match the image's major."""
    seen = check("nccl-plugin", plugins[12], [plugins[13], plugins[12]])
    assert seen["error"] == ("Shifter's nccl-plugin module is the CUDA 12 build of the network plugin and this image is "
                             "CUDA 13: submit with '#SBATCH --module=gpu,nccl-cu13-plugin'"), seen


def test_a_site_naming_its_modules_otherwise_is_checked_by_loading_only(plugins):
    seen = check("ofi-cu13", plugins[13], [plugins[13]], HPCML_NCCL_MODULE="ofi-cu13")
    assert seen["line"].endswith("loads (Shifter's ofi-cu13 module, CUDA 13 image)"), seen
    seen = check("ofi-cu12", plugins[12], [plugins[13]], HPCML_NCCL_MODULE="ofi-cu12")
    assert "libcudart.so.12: cannot open shared object file" in seen["error"], seen


def test_no_plugin_to_open_without_a_network_a_module_or_cuda(plugins):
    assert check("nccl-cu13-plugin", plugins[13], [plugins[13]], NCCL_NET="") == {"line": None}  # one node, or TCP
    assert check("", plugins[13], [plugins[13]]) == {"line": None}  # no plugin module (the launcher's own check)
    seen = check("nccl-cu13-plugin", plugins[13], [])  # a cpu image: gloo, no NCCL
    assert seen["line"].startswith("network plugin: not opened, this image has no CUDA runtime"), seen


def test_the_module_tables_of_the_launcher_and_the_check_agree():
    """slurm/lib/network.sh chooses podman-hpc's flag and names Shifter's module; the check names them in its
    messages: one table each side, which must be the same."""
    sys.path.insert(0, str(REPO / "recipes"))
    from harness.image_checks import PLUGIN_MODULES

    for runtime, modules in PLUGIN_MODULES.items():
        for major, module in modules.items():
            script = f'source "{REPO}/slurm/lib/network.sh"; nccl_plugin_module {runtime} {major}'
            answer = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
            assert answer.stdout.strip() == module, (runtime, major, answer.stdout, answer.stderr)


def test_compile_needs_a_compiler_and_pythons_headers(monkeypatch, tmp_path):
    sys.path.insert(0, str(REPO / "recipes"))
    from harness.errors import ConfigError
    from harness.image_checks import check_compiler

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on it
    with pytest.raises(ConfigError) as refused:
        check_compiler("cpu")
    assert str(refused.value).startswith("--compile builds torch.compile's kernels at run time and needs a C++ compiler "
                                         "(CXX, or g++/c++/clang++ on PATH)"), refused.value
    with pytest.raises(ConfigError, match=r"needs a C compiler \(CC, or cc/gcc/clang on PATH\)"):
        check_compiler("cuda")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    check_compiler("cpu")  # this machine has g++ and the interpreter's headers
    check_compiler("cuda")
