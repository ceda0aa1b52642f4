"""A bounded schedule. egglog 13.2 has no timeout, so rule sets run in chunks of one
iteration and the loop stops on saturation, on the e-node limit or on the deadline.
Associativity and commutativity run under the back-off scheduler, whose match limit is
what bounds a single explosive iteration."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import egglog.bindings as eb

from .lang import CTORS, RuleSet, declarations


@dataclass
class Saturation:
    egraph: eb.EGraph
    deadline: float
    node_limit: int
    iterations: int = 0
    matches: dict[str, dict[str, int]] = field(default_factory=dict)
    stopped: str = "saturated"

    @staticmethod
    def start(rulesets: list[RuleSet], time_limit: float, node_limit: int) -> Saturation:
        egraph = eb.EGraph()
        egraph.run_program(*egraph.parse_program(declarations() + "\n".join(r.egglog() for r in rulesets)))
        return Saturation(egraph, time.perf_counter() + time_limit, node_limit)

    def enodes(self) -> int:
        (out,) = self.egraph.run_program(*self.egraph.parse_program("(print-size)"))
        return sum(n for name, n in out.sizes if name in CTORS)

    def out_of_budget(self) -> str | None:
        if time.perf_counter() > self.deadline:
            return "time limit"
        if self.enodes() > self.node_limit:
            return "e-node limit"
        return None

    def _chunk(self, text: str, rulesets: list[RuleSet]) -> bool:
        """Run one chunk; True when some rule changed the e-graph."""
        (out,) = self.egraph.run_program(*self.egraph.parse_program(text))
        report = out.report
        self.iterations += len(report.iterations)
        by_rule = {r.name: s.name for s in rulesets for r in s.rules}
        for rule, n in report.num_matches_per_rule.items():
            rs = by_rule.get(rule, "types" if rule.startswith("shape-") else "other")
            self.matches.setdefault(rs, {})
            self.matches[rs][rule] = self.matches[rs].get(rule, 0) + n
        return report.updated

    def run(self, rulesets: list[RuleSet], max_chunks: int = 50, match_limit: int = 1000) -> None:
        """Run the rule sets together until nothing changes, max_chunks runs or a limit."""
        if not rulesets:
            return
        if any(r.explosive for r in rulesets):
            runs = " ".join(f"(run-with bo {r.name})" for r in rulesets)
            text = (f"(run-schedule (seq (let-scheduler bo (back-off :match-limit {match_limit} "
                    f":ban-length 2)) (repeat 2 {runs})))")
        else:
            # shapes first: rules that build a constant of an operand's shape read them
            runs = " ".join(f"(run {r.name})" for r in rulesets)
            text = f"(run-schedule (seq (saturate types) {runs}))"
        for _ in range(max_chunks):
            stop = self.out_of_budget()
            if stop:
                self.stopped = stop
                return
            if not self._chunk(text, rulesets):
                return
