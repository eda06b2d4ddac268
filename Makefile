# Developer entry points. Everything runs inside the repository's own .venv.
#
# torch is pinned to exactly 2.13.0 and installed first: this machine keeps a
# CPU build of that release on disk, which pip picks for `torch==2.13.0`. An
# open-ended `torch` requirement would pull a multi-GB CUDA build instead.

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
PYTHON := $(shell command -v python3.11 2>/dev/null || command -v python3)

.PHONY: install test zoo lint demo bench scale clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install '$(TORCH)'
	$(PIP) install -e '.[test,hf]'
	touch $@

zoo: install
	$(PY) -m pytest -m zoo

lint: install
	$(VENV)/bin/ruff check .

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

demo: install
	$(VENV)/bin/autoshard show examples/mlp.py:mlp --mesh 2x2x2 --budget 32KiB
	$(VENV)/bin/torchrun --standalone --nproc-per-node 8 examples/train.py --steps 5

bench: install
	$(PY) benchmarks/run.py

# Plans for LLaMA-3 8B/70B/405B and GPT-3 175B on 64-4096 devices (long; SCALE="--quick"
# for LLaMA-3 70B on 8x8x8 only).
scale: install
	$(PY) benchmarks/scale.py $(SCALE)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
