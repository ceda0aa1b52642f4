"""The rule sets and oracle fillers, in the order the schedule runs them."""

from __future__ import annotations

from . import affine, algebra, contraction, fusion, layout, merge, onehot, online, recognition, winograd
from .lang import RuleSet

# stages run in order, each to saturation or to the limits; targets join after the first
STAGES: tuple[RuleSet, ...] = (algebra.RULES, recognition.RULES, online.RULES, layout.RULES)
EXPLOSIVE: tuple[RuleSet, ...] = (algebra.EXPLOSIVE, contraction.RULES, affine.RULES)
FUSION: tuple[RuleSet, ...] = (fusion.RULES,)
# multi-patterns, run once after recognition (as Tensat does: they grow the e-graph by pairs);
# () turns horizontal merges off
MERGE: tuple[RuleSet, ...] = (merge.RULES,)
# after the merges: a merged product's shared operand still carries its norm's scale
AFTER_MERGE: tuple[RuleSet, ...] = (affine.RULES,)

# recognition before layout: layout lays out the operand views the matmul plans create; merge
# after the matmul plans (it adds its own) and before the fillers that cover every view (the
# broadcasts filler reads fill_late's too); affine after the merges (it reads their plans); shapes
# last: they cover the views and leaves the others create
ORACLE_FILLERS = (recognition.fill_matmul, recognition.fill_late, online.fill_online, winograd.fill_winograd,
                  merge.fill_merge, contraction.fill_contraction, affine.fill_affine,
                  recognition.fill_broadcasts, onehot.fill_gather, layout.fill_layout, algebra.fill_sums,
                  fusion.fill_rereads, algebra.fill_shapes)


def backend_rules(target: str) -> tuple[RuleSet, ...]:
    """The rule sets that join the e-graph for target only: its Target's rules()."""
    from ..backends import get_target

    try:
        return tuple(get_target(target).rules())
    except Exception as e:  # an unknown target, or one whose package does not import
        raise ValueError(f"unknown target {target!r}: {e}") from None


def all_rulesets() -> list[RuleSet]:
    """Every rule set that exists, every registered target's included (each once)."""
    from ..backends import target_names

    out = [*STAGES, *EXPLOSIVE, *FUSION, merge.RULES]
    for name in target_names():
        out += [s for s in backend_rules(name) if s not in out]
    return out


__all__ = ["STAGES", "EXPLOSIVE", "FUSION", "MERGE", "AFTER_MERGE", "ORACLE_FILLERS", "all_rulesets",
           "backend_rules"]
