# One command for newcomers and CI alike: `make test`. `make demo` runs the main job.
# Both create .venv and install everything from scratch.
#
# torch: if the interpreter you run make with already has torch (e.g. a CUDA build), the venv
# sees it (--system-site-packages) and keeps it; otherwise TORCH_SPEC (the CPU build that lies on
# this machine kind's disk) is installed first, so nothing pulls a multi-GB CUDA wheel.

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.mxrl-installed

.PHONY: install test lint format demo test-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "make: keeping the torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(PY) -m pip install --disable-pip-version-check -q "$(TORCH_SPEC)"; \
	fi
	$(PY) -m pip install --disable-pip-version-check -q -e ".[dev]"
	@touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test: lint
	$(PY) -m pytest -q

# On a CUDA machine: the GPU tier (kernels, device invariance of the reference).
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

demo: $(STAMP)
	$(VENV)/bin/mxrl demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info
