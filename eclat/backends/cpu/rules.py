"""What the CPU does natively, as rewrite rules joining the e-graph for this target only."""

from __future__ import annotations

from ...rewrites.lang import Rule, RuleSet

FMA = Rule("fma", "(Add (Mul x y) z)", "(Fma x y z)")
FMA_NEG = Rule("fma-neg", "(Add (Neg (Mul x y)) z)", "(Fma (Neg x) y z)")  # z - x * y, the frontend's sub

RULES = RuleSet("target_cpu", (FMA, FMA_NEG))
