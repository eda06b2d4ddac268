# Developer entry points. Everything runs inside the repository's own .venv.
#
# torch is pinned to exactly 2.13.0 and installed first: this machine keeps a
# CPU build of that release on disk, which pip picks for `torch==2.13.0`. An
# open-ended `torch` requirement would pull a multi-GB CUDA build instead.
# pip byte-compiles one file at a time; compileall does it on every core.

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
	$(PIP) install --no-compile '$(TORCH)'
	$(PIP) install --no-compile -e '.[test,hf]'
	$(PY) -c "import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"
	touch $@

zoo: install
	$(PY) -m pytest -m zoo

lint: install
	$(VENV)/bin/ruff check .

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

# train 4 steps on 2x2x2, checkpoint, resume on 1x2x4 for 4 more, beside a serial run
DEMO     := runs/demo
TRAIN    := examples/train.py --steps 8 --dim 32 --hidden 64 --layers 2 --seq 16 --batch 8
TORCHRUN := $(VENV)/bin/torchrun --standalone --nproc-per-node 8

demo: install
	$(VENV)/bin/autoshard show examples/mlp.py:mlp --mesh 2x2x2 --budget 32KiB
	rm -rf $(DEMO)
	$(PY) $(TRAIN) --curve $(DEMO)/serial.json
	$(TORCHRUN) $(TRAIN) --mesh 2x2x2 --steps 4 --total-steps 8 --save-every 4 \
		--ckpt-dir $(DEMO)/ckpt --curve $(DEMO)/first.json
	$(TORCHRUN) $(TRAIN) --mesh 1x2x4 --resume $(DEMO)/ckpt/step-4 --curve $(DEMO)/resumed.json
	$(PY) examples/curves.py $(DEMO)/serial.json $(DEMO)/first.json $(DEMO)/resumed.json

bench: install
	$(PY) benchmarks/run.py

# Plans for LLaMA-3 8B/70B/405B and GPT-3 175B on 64-4096 devices (long; SCALE="--quick"
# for LLaMA-3 70B on 8x8x8 only).
scale: install
	$(PY) benchmarks/scale.py $(SCALE)

clean:
	rm -rf $(VENV) build dist runs *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
