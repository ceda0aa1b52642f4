"""Simplification that terminates: adversarial arithmetic and every zoo model saturate their
simplifying stages (not stopped by a budget), with small e-graphs and values torch agrees with."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch

import eclat
from eclat import rewrites
from eclat.frontend import lower
from eclat.ir.interpreter import run
from eclat.rewrites import optimize
from eclat.rewrites.algebra import RULES as SIMPLIFY
from eclat.rewrites.schedule import Saturation
from tests.zoo import ZOO


@pytest.fixture
def sats(monkeypatch) -> list[Saturation]:
    """Every e-graph built while the test runs: optimize saturates one per block, each fresh here
    (not the thread's reused one, which is emptied after each block) so that a test can read it."""
    made: list[Saturation] = []
    start = Saturation.start
    monkeypatch.setattr(rewrites, "declared", lambda rulesets: contextlib.nullcontext())

    def recording(*args, **kwargs) -> Saturation:
        made.append(start(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(Saturation, "start", staticmethod(recording))
    return made


def stages(sats: list[Saturation]) -> list[dict]:
    return [s for sat in sats for s in sat.stages]


def assert_terminated(sats: list[Saturation]) -> None:
    """The simplifying stages saturate; nothing stops at the e-node or time limit (exploring stages
    may stop at their chunk budget)."""
    assert stages(sats)
    for s in stages(sats):
        assert s["stopped"] in ("saturated", "chunk limit"), s
        if SIMPLIFY.name in s["rulesets"]:
            assert s["stopped"] == "saturated", s


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# name -> (function, the best program's ops other than input/const/view, its constant values)
ADVERSARIAL = {
    "(x*2)/2": (lambda x: (x * 2) / 2, {}, set()),
    "(x*2)*0.5": (lambda x: (x * 2) * 0.5, {}, set()),
    "((x*3)*0.5)*2": (lambda x: ((x * 3) * 0.5) * 2, {"mul": 1}, {3.0}),
    "x*2*3*4*5": (lambda x: x * 2 * 3 * 4 * 5, {"mul": 1}, {120.0}),
    # a true division rounds as torch's does, so ((x / 7) * 7) is not x: nothing folds, and it saturates
    "((x/7)*7)/3*3": (lambda x: ((x / 7) * 7) / 3 * 3, {"div": 2, "mul": 2}, {7.0, 3.0}),
    "x*0.5*0.0": (lambda x: x * 0.5 * 0.0, {"mul": 1}, {0.0}),  # x * 0 stays: NaN and inf times 0
    "(x/3)*0.0": (lambda x: (x / 3) * 0.0, {"div": 1, "mul": 1}, {3.0, 0.0}),
    "(x+1)+2-3": (lambda x: (x + 1) + 2 - 3, {}, set()),
    "relu((x*2)/2)+1": (lambda x: torch.relu((x * 2) / 2) + 1, {"max": 1, "add": 1}, {0.0, 1.0}),
    "relu(relu(x))": (lambda x: torch.relu(torch.relu(x)), {"max": 1}, {0.0}),
    "clamp chain": (lambda x: torch.clamp_min(torch.clamp_min(x, 0.5), 1.5), {"max": 1}, {1.5}),
    "-(-x)": (lambda x: torch.neg(-x), {}, set()),
    "exp(log(x))": (lambda x: torch.exp(torch.log(x)), {"lt": 1, "where": 1}, {0.0, math.nan}),
    "sum of a broadcast": (lambda x: x[:, None, :].expand(4, 5, 8).sum(1), {"mul": 1}, {5.0}),
    # both operands' scales leave the product (recognition's product-scales): 2 * 0.5 * 4 / 4 is 1
    "scale chain in a product": (lambda x: ((x * 2) @ (x.T * 0.5)) * 4 / 4, {"matmul": 1}, set()),
}


def _values(graph) -> set[float]:
    return {float(n.arg[0]) for n in graph.nodes() if n.op == "const"}


def _same(a: set[float], b: set[float]) -> bool:
    return len(a) == len(b) and all(any(x == y or (math.isnan(x) and math.isnan(y)) for y in b) for x in a)


@pytest.mark.parametrize("target", ["cpu", "opencl"])
@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_arithmetic_saturates(name: str, target: str, sats):
    fn, ops, consts = ADVERSARIAL[name]
    x = torch.rand(4, 8) + 0.5
    graph = lower(Fn(fn), (x,))
    res = optimize(graph, target, k=4)
    assert_terminated(sats)
    assert all(s["enodes"] < 2000 for s in stages(sats)), [s["enodes"] for s in stages(sats)]
    best = res.candidates[0]
    assert {op: n for op, n in best.op_counts().items() if op not in ("input", "const", "view")} == ops
    assert _same(_values(best), consts), _values(best)
    for cand in res.candidates:
        for want, got in zip(run(graph, [x.numpy()]), run(cand, [x.numpy()])):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_arithmetic_compiles_right(name: str):
    fn = ADVERSARIAL[name][0]
    x = torch.rand(4, 8) + 0.5
    fast = eclat.compile(Fn(fn), (x,), target="cpu", autotune="none", k=2, quiet=True)
    for inp in (x, torch.rand(4, 8) * 3):
        torch.testing.assert_close(fast(inp), fn(inp), rtol=1e-5, atol=1e-6)


def test_exp_log_keeps_torch_nans():
    """exp(log(x)) is x only where log is defined: a negative x still gives NaN, as in torch."""
    fn = ADVERSARIAL["exp(log(x))"][0]
    x = torch.tensor([[0.5, 2.0, 0.0, -1.0], [3.0, -0.25, 1e-30, 7.0]])
    fast = eclat.compile(Fn(fn), (x,), target="cpu", autotune="none", k=1, quiet=True)
    got, want = fast(x), fn(x)
    assert torch.isnan(want).sum() == 2
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0, equal_nan=True)


def test_folding_makes_no_family_of_constants(sats):
    """The old loop: 0 = 0.5 * 0 put 0 * 0.5 in the class of 0, and folding around it made 0.25,
    0.0625, ... down to the smallest double. Now the e-graph holds the two constants it started with."""
    optimize(lower(Fn(lambda x: x * 0.5 * 0.0), (torch.rand(4, 8),)), "cpu", k=2)
    assert_terminated(sats)
    (sat,) = sats
    rows = sat.egraph.freeze().functions["Fill"].rows
    assert sorted({sat.egraph.value_to_f64(r.inputs[0]) for r in rows}) == [0.0, 0.5]


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_models_saturate_and_match_torch(name: str, sats):
    """Every test model (the examples' CNN and decoder among them): the simplifying stages saturate,
    the e-graphs stay small, and the compiled model matches torch."""
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    model, inputs = ZOO[name]()
    fast = eclat.compile(model, inputs, target="cpu", autotune="none", k=1, quiet=True)
    assert_terminated(sats)
    assert max(s["enodes"] for s in stages(sats)) < 5000
    with torch.no_grad():
        want = torch.utils._pytree.tree_leaves(model(*inputs))
    got = torch.utils._pytree.tree_leaves(fast(*inputs))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


# --- the stage report ------------------------------------------------------------------------

def test_stages_say_why_they_stopped():
    from eclat.rewrites.algebra import EXPLOSIVE
    from eclat.rewrites.encode import Encoding

    graph = lower(Fn(lambda x: ((x + 1) * (x + 2) + x) * (x + 3) + (x + 4)), (torch.rand(4, 8),))
    enc = Encoding.of(graph)
    sat = Saturation.start([SIMPLIFY, EXPLOSIVE], 10.0, 30000)
    enc.insert(sat.egraph)
    first = sat.run([SIMPLIFY])
    explore = sat.run([EXPLOSIVE], max_chunks=1)
    sat.node_limit = 0
    capped = sat.run([SIMPLIFY])
    assert sat.stages == [first, explore, capped]
    assert first["stopped"] == "saturated" and first["rulesets"] == ["algebra"] and first["iterations"] >= 1
    assert explore["stopped"] == "chunk limit" and explore["chunks"] == 1
    assert explore["enodes"] > first["enodes"]
    assert capped["stopped"] == "e-node limit" and capped["chunks"] == 0
    assert sat.stopped == "chunk limit (assoc); e-node limit (algebra)"


def test_a_saturated_run_says_so():
    from eclat.rewrites.encode import Encoding

    graph = lower(Fn(lambda x: torch.neg(-x) * 1.0), (torch.rand(4, 8),))
    enc = Encoding.of(graph)
    sat = Saturation.start([SIMPLIFY], 10.0, 30000)
    enc.insert(sat.egraph)
    stage = sat.run([SIMPLIFY])
    assert stage["stopped"] == "saturated" and sat.stopped == "saturated"
    assert 1 <= stage["chunks"] <= stage["iterations"] and stage["enodes"] == sat.enodes()
    assert {r for r, n in sat.matches["algebra"].items() if n} == {"neg-neg", "mul-one", "neg-mul"}
