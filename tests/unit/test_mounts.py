"""recipes/harness/mounts.py: every host path a run reads, checked in its container against the directories the
launcher mounted (slurm/lib/runtime.sh passes them as HPCML_CONTAINER_MOUNTS), whether the option came from the
command line or from --config. Runs the real check on this machine's files with the container's environment."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from support.runs import REPO

sys.path.insert(0, str(REPO / "recipes"))
from harness.errors import ConfigError  # noqa: E402
from harness.mounts import check_paths_visible, paths_read  # noqa: E402


def run_args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"config": None, "data": "synthetic", "model": "gpt", "dataset": None, **given})


def in_container(runtime: str, *mounted) -> dict[str, str]:
    return {"HPCML_CONTAINER_RUNTIME": runtime, "HPCML_CONTAINER_MOUNTS": ":".join(map(str, mounted))}


def test_every_path_a_run_reads_is_named_with_its_option(tmp_path):
    args = run_args(config=tmp_path / "run.toml", data=str(tmp_path / "data" / "tokens"),
                    model=f"hf:{tmp_path}/models/llama", dataset=f"{tmp_path}/code/fields.py:dataset")
    assert paths_read(args) == {f"--config {tmp_path}/run.toml": tmp_path / "run.toml",
                                f"--data {tmp_path}/data/tokens": tmp_path / "data" / "tokens",  # (--dataset reads it)
                                f"--model hf:{tmp_path}/models/llama": tmp_path / "models" / "llama",
                                f"--dataset {tmp_path}/code/fields.py:dataset": tmp_path / "code" / "fields.py"}
    # a token file is PREFIX.json/.idx/.bin: its directory; a module on PYTHONPATH is no path; relative: from here
    assert paths_read(run_args(data="data/tokens", model="mypkg.models:build")) == {"--data data/tokens": Path.cwd() / "data"}
    assert paths_read(run_args()) == {}


@pytest.mark.parametrize("runtime", ["podman", "podman-hpc"])
def test_a_path_outside_the_mounts_is_one_line_naming_the_mount_that_fixes_it(tmp_path, runtime):
    data, models = tmp_path / "data", tmp_path / "models"
    cases = [(run_args(data=str(data / "tokens")), f"--data {data}/tokens", data),
             (run_args(config=tmp_path / "conf" / "run.toml"), f"--config {tmp_path}/conf/run.toml", tmp_path / "conf"),
             (run_args(model=f"hf:{models}/llama"), f"--model hf:{models}/llama", models),
             (run_args(model=f"{models}/mine.py:build"), f"--model {models}/mine.py:build", models)]
    for args, what, directory in cases:
        with pytest.raises(ConfigError) as refused:
            check_paths_visible(args, in_container(runtime, REPO, tmp_path / "run"))
        assert str(refused.value) == (f"{what} is not in any directory mounted into the {runtime} containers "
                                      f"({REPO}, {tmp_path}/run): mount its directory: add {directory} to CONTAINER_MOUNTS")
        check_paths_visible(args, in_container(runtime, REPO, directory))  # mounted: fine
        check_paths_visible(args, in_container(runtime, REPO, tmp_path))  # (or a directory above it)


def test_no_mount_check_where_the_host_or_the_site_mounts_the_paths(tmp_path):
    args = run_args(data=str(tmp_path / "elsewhere" / "tokens"), model="mypkg.models:build")
    for environ in ({}, in_container("none", REPO), in_container("shifter", REPO)):
        check_paths_visible(args, environ)
    check_paths_visible(run_args(model="mypkg.models:build"), in_container("podman-hpc", REPO))  # (no path)


def test_your_datasets_file_must_be_readable_before_your_factory_runs(tmp_path):
    """--dataset MODULE:FACTORY reads --data as it likes (a file or a directory): readable here, or one line."""
    fields = tmp_path / "fields.h5"
    fields.write_bytes(b"\x89HDF\r\n\x1a\n")
    check_paths_visible(run_args(dataset="recipes/examples/fields.py:dataset", data=str(fields)), {})
    with pytest.raises(ConfigError, match=f"^--data {tmp_path}/no.h5 is not readable on .*: put it on a file system every "
                                          r"node mounts \(Perlmutter: under \$SCRATCH\)$"):
        check_paths_visible(run_args(dataset="recipes/examples/fields.py:dataset", data=str(tmp_path / "no.h5")), {})
