"""slurm/ddp.sh, unchanged, on the local Slurm cluster (tests/cluster/local_slurm.sh): the negative controls.

Every node is its own host (network + UTS namespace), so a job whose ranks do not find each other across
nodes fails here as it would on Perlmutter. The layouts that must pass, bare and in the image, are cells
of the container test matrix (tests/matrix.toml, tests/test_matrix.py).
"""

from __future__ import annotations

import json
import re
import os
import sys
from pathlib import Path

import pytest

from support.cluster import CLUSTER_DIR, job_state, sbatch_recipe, shifter_pull, submit_recipe
from support.runs import container_env, recipe_env, REPO, run, TINY

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


def test_a_batch_file_runs_by_hand_in_an_interactive_allocation(slurm_cluster, tmp_path):
    """The docs' interactive route: `salloc ...`, then `bash slurm/ddp.sh` inside the allocation. The same file
    starts its ranks on the allocation's nodes (2 nodes, one rank each, each on its own host) and trains."""
    env = container_env(**{**slurm_cluster, "CONTAINER_RUNTIME": "none", "RUN_DIR": str(tmp_path / "run")})
    result = run(["salloc", "-N", "2", "--ntasks-per-node", "1", "-t", "5", "bash", "slurm/ddp.sh", *RECIPE_ARGS],
                 env=env, cwd=REPO, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "launch: srun" in log and "[ddp] done: step 4/4" in log, log[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and len(set(metrics["hostnames"])) == 2, metrics["hostnames"]


def test_a_cluster_without_shifter_takes_the_batch_files_through_submit_sh(slurm_cluster, tmp_path):
    """Another Slurm cluster: the same controller and nodes seen through a slurm.conf without Shifter's SPANK
    plugin. sbatch refuses the file's `#SBATCH --module=gpu,nccl-cu13-plugin` there (the defect a user of any other
    cluster meets first); slurm/submit.sh submits it without the Shifter-only lines, and the job trains."""
    etc = tmp_path / "etc"
    etc.mkdir()
    for name in ("gres.conf", "cgroup.conf"):
        (etc / name).write_text((CLUSTER_DIR / "etc" / name).read_text())
    (etc / "plugstack.conf").write_text("")  # no SPANK plugin: no --image, no --module
    conf = re.sub(r"(?m)^PlugStackConfig=.*$", f"PlugStackConfig={etc / 'plugstack.conf'}",
                  (CLUSTER_DIR / "etc" / "slurm.conf").read_text())
    (etc / "slurm.conf").write_text(conf)
    env = container_env(**{**slurm_cluster, "SLURM_CONF": str(etc / "slurm.conf"), "CONTAINER_RUNTIME": "none",
                           "RUN_DIR": str(tmp_path / "run")})
    options = ["--parsable", "--wait", "-t", "5", "-N", "2", "--ntasks-per-node", "1", "-o", str(tmp_path / "%x-%j.out")]
    refused = run(["sbatch", *options, "slurm/ddp.sh", *RECIPE_ARGS], env=env, cwd=REPO, timeout=60)
    assert refused.returncode != 0 and "unrecognized option '--module=gpu,nccl-cu13-plugin'" in refused.stderr, refused.stderr
    submitted = run(["slurm/submit.sh", *options, "slurm/ddp.sh", *RECIPE_ARGS], env=env, cwd=REPO, timeout=420)
    assert "goes without its #SBATCH --image/--module lines" in submitted.stderr, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    assert submitted.returncode == 0 and job_id.isdigit() and job_state(job_id) == "COMPLETED", submitted.stderr
    log = (tmp_path / f"ddp-{job_id}.out").read_text()
    assert "[ddp] done: step 4/4" in log, log[-3000:]
    assert len(set(json.loads((tmp_path / "run" / "metrics.json").read_text())["hostnames"])) == 2


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


# What NVIDIA's recent PyTorch images set in their environment (NCCL_NET_PLUGIN: NCCL then loads only
# libnccl-net-<name>.so, never the site's libnccl-net.so), and other settings an image may carry.
IMAGE_SETTINGS = {"NCCL_NET_PLUGIN": "aws-ofi", "NCCL_DEBUG": "INFO", "FI_CXI_RX_MATCH_MODE": "software"}


@pytest.fixture(scope="module")
def image_with_its_own_settings(ddp_image, tmp_path_factory) -> str:
    """The ddp image as a CUDA 13 image stands to the site's network plugin, seconds to build: IMAGE_SETTINGS in
    its ENV, a CUDA 13 runtime on its loader's path (the stub the stand-in plugin links; the cuda image's is
    torch's nvidia-cuda-runtime wheel) and the label containers/images.sh stamps on a CUDA 13 image."""
    context = tmp_path_factory.mktemp("image-settings")
    built = run(["bash", str(REPO / "tests/cluster/nccl_net_plugin/build.sh"), "13", str(context / "module"), str(context)])
    assert built.returncode == 0, built.stderr
    multiarch = run(["gcc", "-print-multiarch"]).stdout.strip()
    settings = " ".join(f"{name}={value}" for name, value in IMAGE_SETTINGS.items())
    (context / "Containerfile").write_text(f"FROM localhost/hpcml/ddp:cpu\nENV {settings}\n"
                                           f"COPY libcudart.so.13 /usr/lib/{multiarch}/\n"
                                           'LABEL io.hpcml.version.cuda="13.0"\n')
    built = run(["podman", "build", "-q", "-t", "localhost/hpcml/ddp-settings:cpu", str(context)], env=container_env(),
                timeout=300)
    assert built.returncode == 0, built.stderr
    return "ddp-settings"


def shadowing_numpy(directory: Path, where: str) -> None:
    """A numpy that fails on import, saying where it came from."""
    (directory / "numpy").mkdir(parents=True)
    (directory / "numpy" / "__init__.py").write_text(f"raise ImportError('numpy from {where} shadowed the image')\n")


@pytest.mark.containers
@pytest.mark.parametrize("runtime", ["shifter", "podman-hpc"])
def test_the_launchers_settings_and_the_images_packages_win_in_the_container(slurm_cluster, image_with_its_own_settings,
                                                                              request, tmp_path, runtime):
    """slurm/ddp.sh on 2 nodes as a normal user, in an image that sets NCCL_NET_PLUGIN, NCCL_DEBUG and an FI_CXI
    setting, with a PYTHONPATH and a user site (PYTHONUSERBASE) that each hold a numpy that cannot be imported:
    rank 0 logs the launcher's values as it sees them inside the container (under Shifter the image's won
    before: the launcher now names them with --env), the image's numpy is the one used (Shifter passed
    PYTHONPATH and the user site in before: the job failed), and under Shifter every rank starts the image
    by its ID (the launcher resolved the name once)."""
    image = image_with_its_own_settings
    if runtime == "shifter":
        shifter_pull(image)
        user = request.getfixturevalue("cluster_user")
    else:
        user = request.getfixturevalue("squashed_images")(image)
    work = user.work_dir(tmp_path)
    shadowing_numpy(work / "pythonpath", "PYTHONPATH")
    shadowing_numpy(work / "userbase" / "lib" / "python3.11" / "site-packages", "the user site")
    run(["chown", "-R", f"{user.uid}:{user.gid}", str(work)])
    code, state, log = sbatch_recipe(slurm_cluster, work, "ddp", "-N", "2", "--ntasks-per-node", "1", user=user,
                                     recipe_args=[*RECIPE_ARGS, "--global-batch", "4"], CONTAINER_RUNTIME=runtime,
                                     CONTAINER_IMAGE=f"hpcml/{image}:cpu", PYTHONPATH=str(work / "pythonpath"),
                                     PYTHONUSERBASE=str(work / "userbase"))
    assert (code, state) == (0, "COMPLETED"), log
    assert "shadowed the image" not in log
    seen = re.search(r"^ *0: \[launch\] rank 0 sees (.*)$", log, re.M)
    assert seen, log
    settings = dict(word.split("=", 1) for word in seen.group(1).split(" ") if "=" in word)
    launchers = {"NCCL_NET_PLUGIN": "libnccl-net.so", "NCCL_DEBUG": "WARN", "FI_CXI_RX_MATCH_MODE": "hybrid"}
    assert {name: settings.get(name) for name in IMAGE_SETTINGS} == launchers, seen.group(0)
    recorded = json.loads((work / "run" / "metrics.json").read_text())["network_settings"]
    assert {name: recorded.get(name) for name in IMAGE_SETTINGS} == launchers
    assert recorded["NCCL_NET"] == "AWS Libfabric"  # (2 nodes)
    # The module of the image's CUDA major (Shifter: the file's #SBATCH line; podman-hpc: from the image's label),
    # opened in the image by the preflight, once, before any rank
    module = "Shifter's nccl-cu13-plugin module" if runtime == "shifter" else "podman-hpc's --nccl-cu13"
    where = "nccl-cu13-plugin" if runtime == "shifter" else "nccl-cu13"
    assert log.count(f"[ddp] preflight: network plugin /opt/udiImage/modules/{where}/lib/libnccl-net.so loads "
                     f"({module}, CUDA 13 image)\n") == 1, log
    if runtime == "podman-hpc":  # the launcher read the label from the squashed store (a cpu image: none)
        script = 'source slurm/lib/launch.sh; for i in "$@"; do echo "[$(labelled_cuda_major podman-hpc "$i")]"; done'
        majors = user.run(["bash", "-c", script, "-", f"hpcml/{image}:cpu", "hpcml/ddp:cpu"], timeout=60)
        assert majors.stdout.split() == ["[13]", "[]"], majors.stdout + majors.stderr
    if runtime == "shifter":
        srun = next(line for line in log.splitlines() if line.startswith("launch: srun "))
        assert re.search(r" --image=id:[0-9a-f]{64} ", srun) and "--image=docker:" not in srun, srun
        assert re.search(rf"image=docker:hpcml/{image}:cpu id:[0-9a-f]{{64}} \(from CONTAINER_IMAGE\)", log), log


@pytest.mark.containers
@pytest.mark.parametrize("runtime", ["shifter", "podman-hpc"])
def test_the_network_plugin_of_another_cuda_major_stops_the_job_before_any_rank(slurm_cluster, image_with_its_own_settings,
                                                                                 request, tmp_path, runtime):
    """NERSC's CUDA 12 build of the network plugin in a CUDA 13 image (Shifter's nccl-plugin module, podman-hpc's
    --nccl): it links libcudart.so.12, which the image lacks, and NCCL would stop at start-up on 2+ nodes. The
    preflight opens it in the image with the job's modules: one line with the loader's reason and the module to
    use, exit 2, no rank started. slurm/preflight.sh says the same on the login node, without a job."""
    image = image_with_its_own_settings
    if runtime == "shifter":
        shifter_pull(image)
        user = request.getfixturevalue("cluster_user")
        options, env, use = ["--module=gpu,nccl-plugin"], {}, "submit with '#SBATCH --module=gpu,nccl-cu13-plugin'"
    else:
        user = request.getfixturevalue("squashed_images")(image)
        options, env, use = [], {"HPCML_NCCL_MODULE": "nccl"}, "set HPCML_NCCL_MODULE=nccl-cu13 (podman-hpc --nccl-cu13)"
    work = user.work_dir(tmp_path)
    code, state, log = sbatch_recipe(slurm_cluster, work, "ddp", "-N", "2", "--ntasks-per-node", "1", *options, user=user,
                                     recipe_args=RECIPE_ARGS, CONTAINER_RUNTIME=runtime,
                                     CONTAINER_IMAGE=f"hpcml/{image}:cpu", **env)
    assert (code, state) == (2, "FAILED"), log
    errors = [line for line in log.splitlines() if "error:" in line]
    module = "Shifter's nccl-plugin module" if runtime == "shifter" else "podman-hpc's --nccl"
    assert errors == [f"[ddp] error: NCCL_NET='AWS Libfabric' but the network plugin of {module} does not load in this "
                      f"CUDA 13 image: libcudart.so.12: cannot open shared object file: No such file or directory; {use}"], log
    assert not re.search(r"^ *\d+: ", log, re.M) and "Traceback" not in log, log  # no rank said a word
    if runtime == "shifter":
        checked = user.run(["bash", "slurm/preflight.sh", "-m", "gpu,nccl-plugin", "-i", f"docker:hpcml/{image}:cpu",
                            "slurm/ddp.sh", *RECIPE_ARGS], env={"CONTAINER_RUNTIME": "shifter"}, timeout=300)
        assert checked.returncode == 2, checked.stdout + checked.stderr
        assert checked.stderr.strip().splitlines()[-1] == errors[0], checked.stderr


def unattributable_lines(log: str, world_size: int) -> list[str]:
    """The lines of a job log that do not say which rank wrote them, or that hold more than one rank's line.
    The batch script's own lines (launch: ..., the recipe's preflight) and srun's are not a rank's."""
    bad = []
    for line in log.splitlines():
        if line.startswith(("launch: ", "srun: ", "[ddp] preflight: ")):
            continue
        match = re.fullmatch(r" *(\d+): (.*)", line)
        if not match or int(match[1]) >= world_size:
            bad.append(line)
            continue
        rank, text = int(match[1]), match[2]
        run_together = text.count("[launch] ") + text.count("[ddp] ") > 1
        if run_together or (text.startswith("[launch] rank ") and not text.startswith(f"[launch] rank {rank} ")):
            bad.append(line)
    return bad


def test_every_line_of_an_8_rank_job_is_whole_and_names_its_rank(slurm_cluster, tmp_path):
    """srun --label (slurm/lib/runtime.sh): each rank's line reaches the log whole and starts with its rank
    (' 5: [launch] rank 5 ...'). Under srun -u a line's text and its newline were separate writes, and ranks'
    lines ran together; the control is such a line, from a 16-rank job's log, which the check must flag."""
    code, state, log = sbatch(slurm_cluster, tmp_path, "-N", "4", "--ntasks-per-node", "2", "-t", "5")
    assert (code, state) == (0, "COMPLETED"), log[-3000:]
    assert unattributable_lines(log, 8) == [], log[-3000:]
    started = {int(m[1]) for m in re.finditer(r"^ *(\d+): \[launch\] rank \1 \(local rank [01]\) on ", log, re.M)}
    assert started == set(range(8)), log[-3000:]
    assert re.search(r"^ *0: \[ddp\] done: step 4/4", log, re.M), log[-3000:]
    control = ("[launch] rank 9 (local rank 0) on nid000010: cpus 0-1, device cpu[launch] rank 14 (local rank 0) on "
               "nid000015: cpus 0-1, device cpu")
    assert unattributable_lines(control, 16) == [control]
    assert unattributable_lines(f" 9: {control}", 16) == [f" 9: {control}"]


def cpu_ids(cpus: str) -> set[int]:
    """'0-3,8' (harness.launch.cpu_list) as {0, 1, 2, 3, 8}."""
    ids = set()
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        ids.update(range(int(first), int(last or first) + 1))
    return ids


def binding_problems(log: str, cpus_per_task: int) -> list[str]:
    """What is wrong with the CPUs the ranks report ('[launch] rank R (local rank L) on NODE: cpus C'): a rank
    holding other than --cpus-per-task CPUs, or two ranks of one node sharing one."""
    problems, on_node = [], {}
    for rank, node, cpus in re.findall(r"\[launch\] rank (\d+) \(local rank \d+\) on (\S+): cpus ([\d,-]+),", log):
        ids = cpu_ids(cpus)
        if len(ids) != cpus_per_task:
            problems.append(f"rank {rank} on {node}: {len(ids)} cpus ({cpus}), not --cpus-per-task={cpus_per_task}")
        problems += [f"ranks {other} and {rank} on {node} share cpus {sorted(ids & theirs)}"
                     for other, theirs in on_node.get(node, {}).items() if ids & theirs]
        on_node.setdefault(node, {})[rank] = ids
    return problems


@pytest.mark.parametrize("runtime", ["none", pytest.param("podman", marks=pytest.mark.containers)])
def test_each_rank_of_a_node_is_bound_to_its_own_cores(runtime, host_shaped_cluster, request, tmp_path):
    """--cpus-per-task and --cpu-bind=cores (slurm/lib/runtime.sh) where Slurm binds (task/affinity, on the
    cluster whose node declares this machine's sockets and cores): two ranks of one node report disjoint CPUs,
    --cpus-per-task each, bare and inside the image (the container keeps its task's binding). The control is
    what the Perlmutter-shaped cluster's ranks report (it cannot bind 32 CPUs per task on a small machine, so
    every rank holds all of them), which the check must flag."""
    image = {"CONTAINER_IMAGE": "hpcml/ddp:cpu"} if runtime != "none" else {}
    if image:
        request.getfixturevalue("ddp_image")
    code, job = submit_recipe(host_shaped_cluster, tmp_path, "ddp", "--wait", "-N", "1", "--ntasks-per-node", "2",
                              "--cpus-per-task", "1", recipe_args=RECIPE_ARGS, CONTAINER_RUNTIME=runtime, **image)
    log = (tmp_path / f"ddp-{job}.out").read_text()
    assert code == 0, log[-3000:]
    assert f"launch: srun --label --kill-on-bad-exit=1 --cpus-per-task=1 --cpu-bind=cores {runtime if image else 'python'}" in log, \
        log[-3000:]
    reports = re.findall(r"^ *(\d+): \[launch\] rank \1 \(local rank \1\) on cpu000001: cpus ", log, re.M)
    assert sorted(reports) == ["0", "1"], log[-3000:]
    assert binding_problems(log, 1) == [], log[-3000:]
    assert re.search(r"^ *0: \[ddp\] world_size=2 backend=gloo ", log, re.M) and " done: step 4/4" in log, log[-3000:]
    unbound = ("0: [launch] rank 0 (local rank 0) on nid000001: cpus 0-1, device cpu\n"
               "1: [launch] rank 1 (local rank 1) on nid000001: cpus 0-1, device cpu\n")
    assert binding_problems(unbound, 1) == ["rank 0 on nid000001: 2 cpus (0-1), not --cpus-per-task=1",
                                            "rank 1 on nid000001: 2 cpus (0-1), not --cpus-per-task=1",
                                            "ranks 0 and 1 on nid000001 share cpus [0, 1]"]
    assert binding_problems(unbound.replace("0-1", "0"), 1) == ["ranks 0 and 1 on nid000001 share cpus [0]"]


# A step bound to one CPU (as a rank is) that widens its own affinity to every CPU of the machine (as a
# library may): under a cgroup cpuset the kernel keeps it on its own CPU; without one it gets them all.
WIDEN_AFFINITY = """import os
own = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {own[0]})
os.sched_setaffinity(0, range(os.cpu_count()))
print("cpus", own, "then", sorted(os.sched_getaffinity(0)))
"""


def test_a_job_step_cannot_leave_its_cores_where_the_cluster_confines_them(host_shaped_cluster, slurm_cluster):
    """task/cgroup (ConstrainCores), which the host-shaped cluster adds where this machine's cgroup v1 cpuset
    hierarchy is writable: a one-CPU step that widens its affinity to every CPU stays on its CPU, as on
    Perlmutter, where a library that sets its own affinity cannot take another rank's cores. The control: on
    the Perlmutter-shaped cluster (no cgroup) the same step, narrowed to one CPU, widens to all of them."""
    config = run(["scontrol", "show", "config"], env=recipe_env(**host_shaped_cluster)).stdout
    if "task/cgroup" not in re.search(r"^TaskPlugin\s*=\s*(\S+)", config, re.M)[1]:
        pytest.skip("this machine's cgroup v1 cpuset hierarchy is not writable: the host-shaped cluster binds "
                    "(task/affinity) without confining (tests/cluster/local_slurm.sh)")
    step = ["srun", "-N", "1", "-n", "1", "-c", "1", "-t", "1", sys.executable, "-c", WIDEN_AFFINITY]
    confined = run(step, env=recipe_env(**host_shaped_cluster), timeout=120)
    assert confined.returncode == 0 and re.fullmatch(r"cpus \[(\d+)\] then \[\1\]\n", confined.stdout), confined
    widened = run(step, env=recipe_env(**slurm_cluster), timeout=120)
    every_cpu = sorted(range(os.cpu_count()))
    assert widened.returncode == 0 and widened.stdout.endswith(f" then {every_cpu}\n") and len(every_cpu) > 1, widened
