"""The GEMM paths a quantized module runs (docs/design.md §4.5): `reference` (fp32 emulated
GEMMs, `QMatmul`), `tensor_core` (bf16 tensor cores with fp32 accumulation, block FP8 on
`torch._scaled_mm`), `grouped` (grouped expert GEMMs with autograd) and `rollout` (the engine's
fixed-shape tiles, packed low-bit and block-FP8 GEMMs, no autograd).
"""
