"""CUDA, OpenCL and Metal: fused multiply-add and the native reciprocal square root."""

from __future__ import annotations

from ..lang import Rule, RuleSet
from .cpu import FMA, FMA_NEG

RULES = RuleSet("target_gpu", (
    FMA, FMA_NEG,
    Rule("rsqrt", "(Recip (Sqrt x))", "(Rsqrt x)"),
))
