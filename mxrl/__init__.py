"""mxrl: low-precision RL for mixture-of-experts LMs with one precision contract."""

import os

__version__ = "0.1.0"

# Batch invariance on the CPU (docs/engine.md, "Batch invariance by construction"): the engine's
# fixed-shape GEMMs need each output row computed from its own input row, wherever it sits in
# the tile. MKL's AVX2 sgemm kernels on Intel processors break that (a row's bytes moved when the
# rows were rolled by one; measured on a Xeon with MKL_ENABLE_INSTRUCTIONS=AVX2, so on every
# AVX2-only Intel CPU); MKL's strict conditional numerical reproducibility mode keeps its own
# code path and rules it out, at ~10% of CPU GEMM time. MKL reads the variable at its first
# call, so this holds where mxrl is imported before the process's first CPU GEMM; a setting of
# the user's own is kept (the golden run pins COMPATIBLE, also row-independent).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
