"""slurm/ddp.sh, unchanged, on the local Slurm cluster (tests/cluster/local_slurm.sh): the negative controls.

Every node is its own host (network + UTS namespace), so a job whose ranks do not find each other across
nodes fails here as it would on Perlmutter. The layouts that must pass, bare and in the image, are cells
of the container test matrix (tests/matrix.toml, tests/test_matrix.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY, ddp_image, recipe_env, run, sbatch_recipe, shifter_pull  # noqa: F401 (ddp_image: a fixture)

pytestmark = pytest.mark.slurm
RECIPE_ARGS = [*TINY, "--max-steps", "4", "--global-batch", "8", "--checkpoint-every", "0"]


def sbatch(cluster: dict, tmp_path: Path, *options: str, recipe_args=RECIPE_ARGS, **env: str):
    return sbatch_recipe(cluster, tmp_path, "ddp", *options, recipe_args=recipe_args, **env)


def test_negative_control_localhost_rendezvous_fails_across_nodes(slurm_cluster, tmp_path):
    """The mistake the separate hosts exist to catch: each node meeting at its own localhost."""
    code, state, log = sbatch(slurm_cluster, tmp_path, "-N", "2", "--ntasks-per-node", "1", "-t", "2",
                              recipe_args=[*RECIPE_ARGS, "--timeout-s", "15"], MASTER_ADDR="localhost")
    assert code != 0 and state == "FAILED", log
    assert "done: step" not in log


def test_unknown_runtime_fails_before_any_rank(slurm_cluster, tmp_path):
    code, state, log = sbatch(slurm_cluster, tmp_path, "-N", "1", "--ntasks-per-node", "2", CONTAINER_RUNTIME="docker")
    assert code == 2 and state == "FAILED", log
    assert "launch: error: unknown CONTAINER_RUNTIME 'docker'" in log
    assert "[ddp]" not in log and "launch: srun" not in log


def test_batch_not_divisible_by_world_size_fails_with_one_line(slurm_cluster, tmp_path):
    code, state, log = sbatch(slurm_cluster, tmp_path, "-N", "2", "--ntasks-per-node", "2",
                              recipe_args=[*TINY, "--global-batch", "10"])
    assert code != 0 and state == "FAILED", log
    assert "[ddp] error: --global-batch 10 is not divisible by the world size 4" in log
    assert "Traceback" not in log and "world_size=4" not in log


@pytest.mark.containers
def test_shifter_image_is_resolved_at_submission_as_shifter_does(slurm_cluster, ddp_image, tmp_path):
    """The Shifter SPANK plugin (stand-in): `--image=docker:NAME` is looked up in the image gateway when
    sbatch runs, and the job gets the image's ID with type "id", as on Perlmutter; an image the gateway does
    not have aborts sbatch (no job, no allocation spent)."""
    shifter_pull("ddp")
    out = tmp_path / "probe.out"
    result = run(["sbatch", "--wait", "-o", str(out), "--image=docker:hpcml/ddp:cpu", "--module=gpu,nccl-plugin", "--wrap",
                  "echo image=$SLURM_SPANK_SHIFTER_IMAGE type=$SLURM_SPANK_SHIFTER_IMAGETYPE module=$SLURM_SPANK_SHIFTER_MODULE"],
                 env=recipe_env(**slurm_cluster), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    image_id = run(["podman", "image", "inspect", "--format", "{{.Id}}", "hpcml/ddp:cpu"]).stdout.strip()
    assert out.read_text().strip() == f"image={image_id} type=id module=gpu,nccl-plugin"
    missing = run(["sbatch", "--parsable", "--image=docker:hpcml/no-such:cpu", "--wrap", "true"],
                  env=recipe_env(**slurm_cluster), cwd=tmp_path, timeout=120)
    assert missing.returncode != 0 and missing.stdout.strip() == "", missing.stdout
    assert "Failed to lookup image" in missing.stderr and "shifterimg pull docker:hpcml/no-such:cpu" in missing.stderr
