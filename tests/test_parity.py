"""Every parallel layout trains what one process trains, and every kind of parallelism broken on purpose is caught.

The table is tests/parity.toml (read it first: one line per layout or control, what each compares and
expects); this module only runs it. A layout row passes when its run exits 0, reports from inside that it
really was that parallel (world size, backend, wrapper, layout, placements: `expect` and the checks below),
and every compared curve stays within the tolerance of the one-process reference at every step. A control
row passes when the same comparison misses by more than control_margin x the tolerance (conftest's
HPCML_TEST_MARGINS records each margin) and, where the run itself can notice, the run fails and says so.

The rows of one reference form one test class (TestDdpSgd, ...; megatron's two: TestMegatron), which
pytest-xdist (--dist loadscope) gives to one test worker whole: each reference runs once, and the classes
spread over the workers.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

from support import megatron_shim
from support.curves import CONTROL_MARGIN, PARITY_RTOL, PARITY_TABLE, caught, curve, max_relative_difference, read_metrics
from support.runs import (REPO, TF_PYTHON, VENV_TF, accelerate_launch, assert_ok, horovodrun, mpiexec, python,
                          recipe_env, run_recipe, tf_single)
from test_warnings import warnings_in

TABLE = tomllib.loads(PARITY_TABLE.read_text())
RECIPES = {"ddp": "ddp/train.py", "accelerate": "accelerate/train.py", "deepspeed": "deepspeed/train.py",
           "megatron_tp_pp": "megatron_tp_pp/train.py", "fsdp_tp_pp": "fsdp_tp_pp/train.py",
           "horovod": "horovod/train.py", "horovod_torch": "horovod/train_torch.py", "tf_mirrored": "tf_mirrored/train.py"}
LAUNCHERS = ("torchrun", "accelerate", "horovodrun", "mpiexec", "devices")
IN_VENV_TF = {"horovod", "horovod_torch", "tf_mirrored"}  # TensorFlow and Horovod: .venv-tf (`make venv-tf`)
EXPORT_READS = {"fsdp_tp_pp": "read a DCP checkpoint (fsdp_tp_pp)",
                "deepspeed": "read a DeepSpeed ZeRO checkpoint"}  # what recipes/export_hf.py says it read


def expand(args: list[str], fixtures: dict[str, str]) -> list[str]:
    """An args list with its "@set" option sets expanded and its {placeholders} filled in."""
    out = []
    for arg in args:
        if arg.startswith("@"):
            out.extend(expand(TABLE["options"][arg[1:]], fixtures))
        else:
            out.append(arg.format(recipes=REPO / "recipes", **fixtures))
    return out


def fixtures_for(row: dict, request) -> dict[str, str]:
    """The session fixtures (a tiny Llama, an HDF5 file, instruction data: made, never downloaded) the row's options
    name."""
    text = json.dumps([TABLE["options"], row["args"]])
    return {name: str(request.getfixturevalue(name)) for name in ("tiny_llama", "fields_file", "sft_data") if f"{{{name}}}" in text}


def launch(row: dict, out_dir: Path, args: list[str], **env: str):
    """The row's recipe on its launcher: one plain process (references), torchrun, accelerate launch, horovodrun,
    MPICH's mpiexec, or one process with its CPU split into --devices N logical devices (MirroredStrategy).
    One process and torchrun's ranks are forked from the test worker's fork server (support/forkserver.py),
    except for a row that checks the log for warnings: a fresh interpreter's import-time warnings count there."""
    real = "quiet" in row.get("checks", [])
    recipe, ranks = REPO / "recipes" / RECIPES[row["recipe"]], row.get("ranks", 1)
    launcher = row.get("launcher", "torchrun" if ranks > 1 else "single")
    if row["recipe"] in IN_VENV_TF:
        assert TF_PYTHON.exists() and (VENV_TF / ".installed").exists(), \
            "no .venv-tf: run `make venv-tf` (make test does), which builds the horovod image for its Horovod wheel"
    if launcher == "single":
        if row["recipe"] in IN_VENV_TF:
            return tf_single(recipe, out_dir, *args, **env)
        return run_recipe(recipe, out_dir, 1, *args, real=real, **env)
    if launcher == "devices":
        return tf_single(recipe, out_dir, *args, "--devices", str(ranks), **env)
    if launcher == "torchrun":
        return run_recipe(recipe, out_dir, ranks, *args, real=real, HPCML_EXPECTED_WORLD_SIZE=str(ranks), **env)
    if launcher == "accelerate":
        return accelerate_launch(recipe, out_dir, ranks, *args, HPCML_EXPECTED_WORLD_SIZE=str(ranks), **env)
    return {"horovodrun": horovodrun, "mpiexec": mpiexec}[launcher](recipe, out_dir, ranks, *args, **env)


def train(row: dict, out_dir: Path, request, **env: str):
    args = expand(row["args"], fixtures_for(row, request))
    if "export" in row.get("checks", []):
        args += ["--export-hf", str(out_dir / "export")]
    return launch(row, out_dir / "run", args, **env)


def assert_subset(expected, actual, where: str = "metrics") -> None:
    """Every key of ``expected`` (nested tables: recursively) has that value in ``actual``."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {actual!r} is not a table"
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} missing: {sorted(actual)}"
            assert_subset(value, actual[key], f"{where}.{key}")
    else:
        assert actual == expected, f"{where} = {actual!r}, expected {expected!r}"


def logits(directory: Path) -> torch.Tensor:
    """The logits of the Hugging Face model saved in ``directory``, loaded on one process, for fixed tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=tokens).logits


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)["model"]


# ---- the references: one run each per test worker, checked once


REFERENCES: dict[str, tuple[dict, Path]] = {}


@pytest.fixture
def reference(request, tmp_path_factory):
    def get(name: str) -> tuple[dict, Path]:
        if name not in REFERENCES:
            row = TABLE["reference"][name]
            out = tmp_path_factory.mktemp(f"reference-{name}")
            assert_ok(train(row, out, request))
            metrics = read_metrics(out / "run")
            if row["recipe"] != "tf_mirrored":
                assert metrics["world_size"] == 1, metrics["world_size"]
            assert_subset(row.get("expect", {}), metrics)
            if "clipped" in row:  # the clip took part: some step's norm (before clipping) was above it
                assert max(curve(metrics, "grad_norm")) > row["clipped"], curve(metrics, "grad_norm")
            recipe_checks(row, metrics)
            REFERENCES[name] = metrics, out
        return REFERENCES[name]
    return get


# ---- what the recipes report from inside, checked on every run of theirs


def recipe_checks(row: dict, metrics: dict) -> None:
    if row["recipe"] == "megatron_tp_pp":  # the CPU placement shim on, every site it rewrote on its allow-list
        megatron_shim.check_sites(metrics)
    if row["recipe"] == "fsdp_tp_pp" and "mesh" in metrics:
        mesh = metrics["mesh"]
        assert mesh["pp"] * mesh["dp_replicate"] * mesh["dp_shard"] * mesh["tp"] == metrics["world_size"], mesh


def test_the_table_is_what_the_tests_use():
    """The tolerance and control margin are the ones the documentation promises (a looser table fails here
    until the docs say so); every id once; every reference and option set a row names exists."""
    assert (PARITY_RTOL, CONTROL_MARGIN) == (1e-5, 100)
    assert "within 1e-5" in (REPO / "README.md").read_text()
    assert "within 1e-5" in (REPO / "docs" / "tests.md").read_text() and "by at least 100×" in (REPO / "docs" / "tests.md").read_text()
    ids = [row["id"] for row in TABLE["layouts"]]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert all(row["reference"] in TABLE["reference"] for row in TABLE["layouts"])
    for row in [*TABLE["layouts"], *TABLE["reference"].values()]:
        assert row["recipe"] in RECIPES, row
        assert row.get("launcher", "torchrun") in LAUNCHERS, row
        expand(row["args"], {"tiny_llama": "", "fields_file": "", "sft_data": ""})  # every "@set" exists
    # every control breaks a kind of parallelism the recipe has a layout for, proven in the same table
    proven = {(row["recipe"], row["reference"]) for row in TABLE["layouts"] if "fault" not in row}
    assert all((row["recipe"], row["reference"]) in proven for row in TABLE["layouts"] if "fault" in row)


def test_the_comparison_fails_a_curve_that_went_nan():
    """max() skips a NaN it meets after the first element: the comparison must not."""
    assert max_relative_difference([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert max_relative_difference([1.0, float("nan")], [1.0, 2.0]) == float("inf")
    assert max_relative_difference([1.0, 2.0], [1.0, float("inf")]) == float("inf")


def layout_matches_one_process(self, row, reference, request, tmp_path):
    ref, ref_dir = reference(row["reference"])
    result = train(row, tmp_path, request)
    assert_ok(result)
    metrics = read_metrics(tmp_path / "run")
    ranks = row["ranks"]

    # It really was parallel: from inside the run, not from how it was launched.
    if row.get("launcher") != "devices":
        assert metrics["world_size"] == ranks
        if row["recipe"] != "horovod_torch":  # (the one recipe that does not gather its ranks' hosts)
            assert len(metrics["hostnames"]) == ranks
    assert_subset(row.get("expect", {}), metrics)
    if "stdout" in row:
        assert row["stdout"] in result.stdout, result.stdout[-3000:]
    if "clipped" in row:  # the clip took part: some step's norm (before clipping) was above it
        assert max(curve(ref, "grad_norm")) > row["clipped"], curve(ref, "grad_norm")
    for name in row.get("same", []):
        same = (set(metrics[name]) == set(ref[name])) if isinstance(ref[name], dict) else metrics[name] == ref[name]
        assert same, (name, metrics[name], ref[name])
    placements = metrics.get("placements", {})
    for parameter, fragments in row.get("placed", {}).items():
        assert all(fragment in placements[parameter] for fragment in fragments), (parameter, placements[parameter])
    if "sharded" in row:
        assert all(f"'{row['sharded']}'" in text for text in placements.values()), placements
    if "tp_cut" in row:  # exactly these layers' weights cut over TP, and nothing else
        cut = sorted(name for name, text in placements.items() if "'tp'" in text)
        assert all(any(f".{layer}.weight" in name for layer in row["tp_cut"]) for name in cut), cut
        assert {layer for layer in row["tp_cut"] if any(f".{layer}.weight" in name for name in cut)} == set(row["tp_cut"]), cut
    # The ranks hold the same parameters (each run checks it inside and records what it measured).
    assert metrics["param_max_abs_diff_across_ranks"] == 0.0
    assert all(check["param_max_abs_diff_across_ranks"] == 0.0 for check in metrics.get("sync_checks", []))
    recipe_checks(row, metrics)

    for name in row["compare"]:
        ours, theirs = curve(metrics, name), curve(ref, name)
        assert len(ours) == len(theirs) > 0, (name, ours, theirs)
        assert max_relative_difference(ours, theirs) <= PARITY_RTOL, (name, ours, theirs)

    checks = row.get("checks", [])
    if "params" in checks:  # the final weights themselves, not only the loss they give
        step = metrics["last_step"]
        theirs = final_weights(ref_dir / "run", step)
        ours = final_weights(tmp_path / "run", step)
        for name, tensor in theirs.items():
            torch.testing.assert_close(ours[name], tensor, rtol=PARITY_RTOL, atol=row.get("params_atol", 1e-6),
                                       msg=lambda detail, name=name: f"{name}: {detail}")
    if "quiet" in checks:
        assert warnings_in(result) == []
    if "export" in checks:
        check_export(row, tmp_path, ref_dir, request)
    if row["recipe"] == "megatron_tp_pp":
        megatron_shim.covered(row["id"])


def check_export(row: dict, out: Path, ref_dir: Path, request) -> None:
    """--export-hf gathered the whole model: its logits are the one-process export's (and not the untrained
    model's); recipes/export_hf.py on the run's own checkpoint writes the same model."""
    export = out / "export"
    torch.testing.assert_close(logits(export), logits(ref_dir / "export"), rtol=PARITY_RTOL, atol=PARITY_RTOL)
    untrained = Path(fixtures_for(row, request)["tiny_llama"])
    assert (logits(export) - logits(untrained)).abs().max() > 1e-3
    again = python(REPO / "recipes" / "export_hf.py", str(out / "run"), "--out", str(out / "again"),
                   env=recipe_env(), timeout=300)
    assert_ok(again)
    assert ("LoRA rank 4" if "lora" in row.get("checks", []) else EXPORT_READS[row["recipe"]]) in again.stdout, again.stdout
    torch.testing.assert_close(logits(out / "again"), logits(export), rtol=0, atol=1e-6)
    if "lora" in row.get("checks", []):  # merged into a plain Llama; the adapters alone kept in DIR/adapter
        from safetensors.torch import load_file
        adapter = load_file(export / "adapter" / "adapter_model.safetensors")
        assert adapter and all("lora_A" in key or "lora_B" in key for key in adapter), sorted(adapter)
        assert not any("lora" in key for key in load_file(export / "model.safetensors"))


def negative_control_is_caught(self, row, reference, request, tmp_path):
    """The same run with one parallelism wrong on purpose (HPCML_TEST_FAULT): the comparison above must fail,
    by far; a run that can see its ranks drift apart must fail itself."""
    ref, _ = reference(row["reference"])
    result = train(row, tmp_path, request, HPCML_TEST_FAULT=row["fault"])
    metrics = read_metrics(tmp_path / "run")
    assert_subset(row.get("expect", {}), metrics)
    difference = max(max_relative_difference(curve(metrics, name), curve(ref, name)) for name in row["compare"])
    assert caught(difference, PARITY_RTOL), (row["compare"], difference)
    if "fails" in row:
        assert result.returncode != 0 and row["fails"] in result.stdout + result.stderr, result.stderr[-3000:]
        assert metrics["param_max_abs_diff_across_ranks"] > 0.0
    else:  # every rank applies the same wrong update: only the comparison with one process sees it
        assert_ok(result)
    if row["recipe"] == "megatron_tp_pp":
        recipe_checks(row, metrics)
        megatron_shim.covered(row["id"])


# ---- one test class per reference (megatron: one for both), its layouts and controls parametrized by row


def group(row: dict) -> str:
    return "megatron" if row["recipe"] == "megatron_tp_pp" else row["reference"]


def pytest_generate_tests(metafunc):
    if "row" in metafunc.fixturenames:
        control = metafunc.definition.originalname == "test_negative_control_is_caught"
        rows = [row for row in TABLE["layouts"] if group(row) == metafunc.cls.group and ("fault" in row) == control]
        metafunc.parametrize("row", [pytest.param(row, id=row["id"], marks=[pytest.mark.tensorflow] * (
            row["recipe"] in IN_VENV_TF)) for row in rows])


for name in dict.fromkeys(group(row) for row in TABLE["layouts"]):
    rows = [row for row in TABLE["layouts"] if group(row) == name]
    members = {"group": name, "__doc__": f"The rows of tests/parity.toml compared with {name}'s one-process run."}
    if any("fault" not in row for row in rows):
        members["test_layout_matches_one_process"] = layout_matches_one_process
    if any("fault" in row for row in rows):
        members["test_negative_control_is_caught"] = negative_control_is_caught
    class_name = "Test" + "".join(part.capitalize() for part in name.split("-"))
    globals()[class_name] = type(class_name, (), members)
