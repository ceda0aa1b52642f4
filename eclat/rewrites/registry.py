"""The rule sets and oracle fillers, in the order the schedule runs them."""

from __future__ import annotations

from . import algebra, fusion, layout, onehot, recognition
from .lang import RuleSet
from .targets import TARGETS, backend_rules

# stages run in order, each to saturation or to the limits; targets join after the first
STAGES: tuple[RuleSet, ...] = (algebra.RULES, recognition.RULES, layout.RULES)
EXPLOSIVE: tuple[RuleSet, ...] = (algebra.EXPLOSIVE,)
FUSION: tuple[RuleSet, ...] = (fusion.RULES,)

# recognition before layout: layout lays out the operand views the matmul plans create
# shapes last: they cover the views and leaves the others create
ORACLE_FILLERS = (recognition.fill_matmul, recognition.fill_broadcasts, onehot.fill_gather,
                  layout.fill_layout, algebra.fill_shapes)


def all_rulesets() -> list[RuleSet]:
    """Every rule set that exists, target ones included (each once)."""
    out = [*STAGES, *EXPLOSIVE, *FUSION]
    for sets in TARGETS.values():
        out += [s for s in sets if s not in out]
    return out


__all__ = ["STAGES", "EXPLOSIVE", "FUSION", "ORACLE_FILLERS", "all_rulesets", "backend_rules"]
