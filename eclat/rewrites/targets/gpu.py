"""CUDA, OpenCL and Metal: fused multiply-add and the native reciprocal square root."""

from __future__ import annotations

from ..lang import Rule, RuleSet
from .cpu import FMA

RULES = RuleSet("target_gpu", (
    FMA,
    Rule("rsqrt", "(Recip (Sqrt x))", "(Rsqrt x)"),
))
