# fedfeat — `make help` lists the targets.
.DEFAULT_GOAL := help
SHELL := /bin/bash

PYTHON ?= python3
VENV ?= .venv
PY ?= $(VENV)/bin/python
# torch first, pinned: on CPU machines `torch==2.13.0` is a local CPU build; without the pin open_clip pulls
# a CUDA build with ~3 GB of nvidia wheels. Set TORCH_PIN= (empty) to keep a torch you installed yourself.
TORCH_PIN ?= torch==2.13.0
export PIP_CONSTRAINT ?= $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1
STORE ?= cache/synth-cifar10.zarr
RUNS ?= runs

.PHONY: help install test test-all lint format synth demo bench bench-gpu identity clean

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sort -u | \
	  awk 'BEGIN {FS = ":.*## "}; {printf "  \033[1m%-16s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_PIN)" ]; then echo "installing $(TORCH_PIN) first"; $(PY) -m pip install -q "$(TORCH_PIN)"; fi
	$(PY) -m pip install -q -e '.[dev,hf,flower,tensorboard,wandb,slurm,ray]'
	HF_HUB_OFFLINE=1 $(PY) -m fedfeat compile   # the fused CPU kernels, now: a first run then starts at once
	$(PY) -m fedfeat.encoders.tvhook --install  # a plain `import open_clip` works in .venv too (README, environment)
	@touch $@

install: $(VENV)/.installed ## create .venv and install fedfeat (torch first, pinned) with its dev tools and the hf / flower / tensorboard / wandb / slurm / ray extras its tests use

TEST_WORKERS ?= 2

test: install ## run the test suite (fast, CPU, offline; TEST_WORKERS=2 processes, pytest-xdist; 0 runs in this process)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS)

test-all: install ## run every test, the slow ones too
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(TEST_WORKERS) -m ''

lint: install ## the import contracts (layers, independent method families; pyproject.toml), ruff lint and format check
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check fedfeat tests bench scripts
	$(VENV)/bin/ruff format --check fedfeat tests bench scripts

format: install ## ruff: fix lint and format in place
	$(VENV)/bin/ruff check --fix fedfeat tests bench scripts
	$(VENV)/bin/ruff format fedfeat tests bench scripts

synth: install ## build the synthetic CIFAR-10-shaped store at $(STORE) if missing
	$(PY) -m fedfeat synth --out $(STORE)

DEMO_RUNS ?= runs/demo

demo: synth ## the main job on the built-in default: synthetic store, FST-CBDG vs baselines x 5 seeds, mean ± std table
	@rm -rf $(DEMO_RUNS)
	$(PY) -m fedfeat sweep --grid configs/demo.toml --store $(STORE) --out $(DEMO_RUNS) --quiet > /dev/null
	$(PY) -m fedfeat report $(DEMO_RUNS) --seeds --plot $(DEMO_RUNS)/curves.png | tee $(DEMO_RUNS)/table.md

bench: install ## run bench/ and write BENCHMARKS.md
	$(PY) bench/run_all.py

.PHONY: bench-threads
bench-threads: install ## creff / clip2fl / fedclip s per round at the thread policy vs fixed counts, 1 / 2 / 4 jobs at once (~10 min on 2 idle cores) -> bench/results/threads.md
	$(PY) bench/bench_threads.py
	$(PY) bench/run_all.py --assemble

# On an offline GPU machine whose python3 has a CUDA torch: no install (no .venv there; fedfeat is pure Python, so
# PYTHONPATH=. runs it), the wheels `bash scripts/device_wheels.sh` downloaded into .devwheels/ on a machine with
# network (carried along), then the bench (~7-8 min on one H100, --budget 380). BENCH_GPU_FLAGS: more flags (e.g.
# --budget 200, or --parts ef for the encode and prompt parts only).
BENCH_GPU_FLAGS ?=
bench-gpu: ## on a GPU machine: make bench-gpu PY=python3 (batched vs loop, stacked runs, agreement, GPU memory, encode img/s RN50 / ViT-B-32 / ViT-L-14 PIL vs device feed, promptfl / fedcopl steps and rounds) -> bench/results/gpu.md
	PY=$(PY) bash scripts/device_wheels.sh install
	PYTHONPATH=.:.devwheels/site $(PY) bench/bench_gpu.py --out bench/results/gpu.md $(BENCH_GPU_FLAGS)

IDENTITY_BASE ?= db2511c  # issue 35-37: copl-linear lr 1e-4; promptfl / fedtpg gain the `optimizer` param (results unchanged)
identity: install ## the same commands and seeds give the same run directories as $(IDENTITY_BASE) (every method; ~5 min)
	$(PY) scripts/check_identity.py --base $(IDENTITY_BASE)

clean: ## remove runs/ and caches of tools (keeps cache/ stores and .venv)
	rm -rf $(RUNS) .pytest_cache .ruff_cache

-include mk/*.mk
