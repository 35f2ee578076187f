# One command for newcomers and CI alike: `make test`. `make demo` runs the main job.
# Both create .venv and install everything from scratch.
#
# torch: if the interpreter you run make with already has torch (e.g. a CUDA build), the venv
# sees it (--system-site-packages) and keeps it; otherwise TORCH_SPEC (the CPU build that lies on
# this machine kind's disk) is installed first, so nothing pulls a multi-GB CUDA wheel.

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.6.0
# pytest-xdist workers for each part of `make test`: most tests hold one core (small tensors, Python,
# the Triton interpreter), so the parts run on two (the CI machine's cores); XDIST=-n0: one process
XDIST      ?= -n 2
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.mxrl-installed

.PHONY: install test test-main test-capabilities test-triton lint format demo test-gpu mutate clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "make: keeping the torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(PY) -m pip install --disable-pip-version-check -q "$(TORCH_SPEC)"; \
	fi
	$(PY) -m pip install --disable-pip-version-check -q -e ".[dev]"
	@if $(PY) -c "import triton" 2>/dev/null; then \
		echo "make: keeping the triton already installed: $$($(PY) -c 'import triton; print(triton.__version__)')"; \
	else \
		$(PY) -m pip install --disable-pip-version-check -q "$(TRITON_SPEC)"; \
	fi
	@touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# make test = lint, the main run, the capability matrix, the Triton tier (README, "Tests").
test: lint test-main test-capabilities test-triton

test-main: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --dist loadfile -m "not triton"

# The tests marked `capability` again under every other CPU capability this processor supports
# (ATen kernels and MKL code path of an AVX2-only / baseline x86-64 machine; tests/numeric_env.py).
test-capabilities: $(STAMP)
	@caps="$$($(PY) -m tests.numeric_env)" || exit 1; \
	for cap in $$caps; do \
		$(PY) -m tests.numeric_env $$cap -m pytest -q -p no:cacheprovider $(XDIST) \
			--dist loadfile -m "capability and not triton" || exit 1; \
	done

# Triton's kernels under its CPU interpreter, byte for byte against the reference, and the sm_90
# compile checks: a process of its own (TRITON_INTERPRET=1 before triton is imported), where a
# skipped test fails (MXRL_REQUIRE_TRITON=1). The interpreter runs tl.dot as numpy's matmul, i.e.
# OpenBLAS, which picks its sgemm kernel by processor; its Haswell kernel (AVX2 machines) sums a
# row differently by the number of rows, so the attention kernel's chunk invariance failed there
# and passed on AVX-512 ones. OPENBLAS_CORETYPE=Prescott: one SSE3 kernel on every x86-64 CPU.
test-triton: $(STAMP)
	OPENBLAS_CORETYPE=Prescott TRITON_INTERPRET=1 MXRL_REQUIRE_TRITON=1 \
		$(PY) -m pytest -q -p no:cacheprovider $(XDIST) --dist worksteal -m triton

# On a CUDA machine: the GPU tier (kernels, device invariance of the reference).
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

# Mutation testing of one module (not part of `make test`: every mutant reruns the module's
# tests): `make mutate MODULE=engine` writes docs/mutation/engine.md (docs/mutation/README.md).
mutate: $(STAMP)
	@test -n "$(MODULE)" || { echo "usage: make mutate MODULE=<$$($(PY) tools/mutate.py --list)>"; exit 2; }
	$(PY) tools/mutate.py $(MODULE) $(if $(JOBS),--max-children $(JOBS))

demo: $(STAMP)
	$(VENV)/bin/mxrl demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info
