"""What each backend can do natively, as rewrite rules joining the e-graph only for it.
A new backend adds a module here and a row to TARGETS; it does not fork the optimiser."""

from __future__ import annotations

from ..lang import RuleSet
from . import cpu, gpu

TARGETS: dict[str, tuple[RuleSet, ...]] = {
    "cpu": (cpu.RULES,),
    "cuda": (gpu.RULES,),
    "opencl": (gpu.RULES,),
    "metal": (gpu.RULES,),
}


def backend_rules(target: str) -> tuple[RuleSet, ...]:
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; known: {', '.join(sorted(TARGETS))}")
    return TARGETS[target]
