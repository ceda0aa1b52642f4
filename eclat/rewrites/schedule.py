"""A bounded schedule. egglog 13.2 has no timeout, so rule sets run in chunks of one
iteration and the loop stops on saturation, on the e-node limit, on the deadline or after
max_chunks. Associativity and commutativity run under the back-off scheduler, whose match
limit is what bounds a single explosive iteration.

Every `run` is one stage; `stages` records, per stage, the rule sets it ran, its chunks and
iterations, the e-nodes after it (subsumed ones included), its seconds and why it stopped
("saturated", "e-node limit", "time limit" or "chunk limit"). A stage meant to saturate (the
simplifying sets) should say "saturated"; an exploring stage run under a chunk budget may stop
at it. `stopped` sums them up."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import egglog.bindings as eb

from .lang import CTORS, RuleSet, declarations

SATURATED = "saturated"
# a fact true until the first explosive stage: rules that compute a new constant from old ones
# require it (algebra.FRESH), so they never run on classes that exploration has reassociated
UNEXPLORED = "unexplored 0"


@dataclass
class Saturation:
    egraph: eb.EGraph
    deadline: float
    node_limit: int
    iterations: int = 0
    matches: dict[str, dict[str, int]] = field(default_factory=dict)
    stages: list[dict] = field(default_factory=list)

    @staticmethod
    def start(rulesets: list[RuleSet], time_limit: float, node_limit: int,
              egraph: eb.EGraph | None = None) -> Saturation:
        """A saturation of a fresh e-graph declaring rulesets, or of egraph (one `declared` gave)."""
        if egraph is None:
            egraph = _declaring(rulesets)
        egraph.run_program(*egraph.parse_program(f"(set ({UNEXPLORED}) 1)"))
        return Saturation(egraph, time.perf_counter() + time_limit, node_limit)

    @property
    def stopped(self) -> str:
        """"saturated" when every stage saturated; else each reason with the stages it stopped,
        e.g. "chunk limit (assoc+contraction)"."""
        by: dict[str, list[str]] = {}
        for s in self.stages:
            if s["stopped"] != SATURATED:
                by.setdefault(s["stopped"], []).append("+".join(s["rulesets"]))
        return "; ".join(f"{why} ({', '.join(names)})" for why, names in by.items()) or SATURATED

    def enodes(self) -> int:
        (out,) = self.egraph.run_program(*self.egraph.parse_program("(print-size)"))
        return sum(n for name, n in out.sizes if name in CTORS)

    def out_of_budget(self) -> str | None:
        if time.perf_counter() > self.deadline:
            return "time limit"
        if self.enodes() > self.node_limit:
            return "e-node limit"
        return None

    def _chunk(self, text: str, rulesets: list[RuleSet]) -> tuple[bool, int]:
        """Run one chunk; (whether some rule changed the e-graph, iterations run)."""
        (out,) = self.egraph.run_program(*self.egraph.parse_program(text))
        report = out.report
        self.iterations += len(report.iterations)
        by_rule = {r.name: s.name for s in rulesets for r in s.rules}
        for rule, n in report.num_matches_per_rule.items():
            rs = by_rule.get(rule, "types" if rule.startswith("shape-") else "other")
            self.matches.setdefault(rs, {})
            self.matches[rs][rule] = self.matches[rs].get(rule, 0) + n
        # under back-off, a banned rule with matches left also reads as updated
        return report.updated, len(report.iterations)

    def run(self, rulesets: list[RuleSet], max_chunks: int = 50, match_limit: int = 1000) -> dict:
        """Run the rule sets together until nothing changes, max_chunks runs or a limit; the
        stage's record (also appended to `stages`)."""
        stage = {"rulesets": [r.name for r in rulesets], "chunks": 0, "iterations": 0, "stopped": SATURATED}
        if not rulesets:
            return stage
        start = time.perf_counter()
        # shapes first: rules that build a constant of an operand's shape read them
        if any(r.explosive for r in rulesets):
            self.egraph.run_program(*self.egraph.parse_program(f"(delete ({UNEXPLORED}))"))
            runs = " ".join(f"(run-with bo {r.name})" for r in rulesets)
            text = (f"(run-schedule (seq (let-scheduler bo (back-off :match-limit {match_limit} "
                    f":ban-length 2)) (repeat 2 (saturate types) {runs})))")
        else:
            runs = " ".join(f"(run {r.name})" for r in rulesets)
            text = f"(run-schedule (seq (saturate types) {runs}))"
        while True:
            stop = self.out_of_budget()
            if stop is None and stage["chunks"] == max_chunks:
                stop = "chunk limit"
            if stop:
                stage["stopped"] = stop
                break
            updated, n = self._chunk(text, rulesets)
            stage["chunks"] += 1
            stage["iterations"] += n
            if not updated:
                break
        stage["enodes"] = self.enodes()
        stage["seconds"] = round(time.perf_counter() - start, 3)
        self.stages.append(stage)
        return stage


def _program(rulesets: list[RuleSet]) -> str:
    return declarations() + "\n".join(r.egglog() for r in rulesets)


def _declaring(rulesets: list[RuleSet]) -> eb.EGraph:
    """A fresh e-graph declaring rulesets, each parsed on its own: egglog's parser takes memory
    quadratic in a text's length (the whole program at once, 39 KB: 0.5 GB while a model's e-graph
    runs, stacked on a language model's built prefill; one ruleset at a time: 0.06 GB)."""
    egraph = eb.EGraph()
    for text in (declarations(), *(r.egglog() for r in rulesets)):
        egraph.run_program(*egraph.parse_program(text))
    return egraph


_declared = threading.local()  # per thread: the e-graphs the open `keeping` block keeps, by program


@contextmanager
def keeping() -> Iterator[None]:
    """Within it, `declared` keeps its e-graphs for the next use; they go at its end: a kept e-graph
    holds the memory of the largest saturation it ran (GPT-2's block: 155 MB after its pop)."""
    if getattr(_declared, "egraphs", None) is not None:
        yield
        return
    _declared.egraphs = {}
    try:
        yield
    finally:
        _declared.egraphs = None


@contextmanager
def declared(rulesets: list[RuleSet]) -> Iterator[eb.EGraph]:
    """An e-graph declaring rulesets, reused within a `keeping` block: pushed on entry and popped on
    exit, so it holds nothing of the last use. Declaring and compiling the rules takes longer than
    saturating a model's block, and a model has dozens of blocks."""
    program = _program(rulesets)
    kept = getattr(_declared, "egraphs", None)
    egraph = kept.pop(program, None) if kept is not None else None  # absent while in use
    if egraph is None:
        egraph = _declaring(rulesets)
    egraph.run_program(*egraph.parse_program("(push)"))
    yield egraph  # a use that raises leaves it half-changed: it is not kept
    egraph.run_program(*egraph.parse_program("(pop)"))
    if kept is not None:
        kept[program] = egraph
