"""CPU (LLVM): fused multiply-add."""

from __future__ import annotations

from ..lang import Rule, RuleSet

FMA = Rule("fma", "(Add (Mul x y) z)", "(Fma x y z)")

RULES = RuleSet("target_cpu", (FMA,))
