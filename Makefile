# hpcml: containers, recipes and Slurm files for training on one GPU to many (Perlmutter first).
#   make run    train the DDP recipe on 2 CPU processes here (creates .venv on first use)
#   make test   the default test suite (unit, parity, resume, bad input, launcher, local Slurm cluster; root)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2
# Optional: a PyTorch wheel index, e.g. https://download.pytorch.org/whl/cpu for the small CPU build.
TORCH_INDEX ?=

.PHONY: help venv run test test-unit test-slurm shellcheck cluster-start cluster-stop cluster-status clean

help:
	@sed -n 's/^#   //p' Makefile
	@echo "other targets: venv test-unit test-slurm shellcheck cluster-start cluster-stop cluster-status clean"

venv: $(VENV)/.installed

$(VENV)/.installed: requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements/cpu.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	touch $@

run: venv
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) \
		recipes/ddp/train.py --out-dir runs/ddp-local --no-resume

# The local Slurm cluster is started by the tests themselves (and left up for the next run).
test: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest

test-unit: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -m "not slurm"

test-slurm: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -m slurm

shellcheck:
	shellcheck -x slurm/*.sh slurm/lib/*.sh tests/cluster/*.sh .ci/run

cluster-start:
	bash tests/cluster/local_slurm.sh start

cluster-stop:
	bash tests/cluster/local_slurm.sh stop

cluster-status:
	bash tests/cluster/local_slurm.sh status

clean:
	rm -rf runs .pytest_cache
