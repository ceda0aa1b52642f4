"""What every GPU dialect does natively, as rewrite rules joining the e-graph for GPU targets only."""

from __future__ import annotations

from ...rewrites.lang import Rule, RuleSet
from ..cpu.rules import FMA, FMA_NEG

RULES = RuleSet("target_gpu", (
    FMA, FMA_NEG,
    Rule("rsqrt", "(Recip (Sqrt x))", "(Rsqrt x)"),
))
