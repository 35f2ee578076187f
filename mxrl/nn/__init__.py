"""Quantized training ops: QLinear and grouped experts with the three backward modes."""

from mxrl.nn.experts import GroupedExperts

__all__ = ["GroupedExperts"]
