"""Horizontal merges (eclat.rewrites.merge): products of one input against several constant
weights become one product over the joined weights, each original a slice of it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import eclat
from eclat.compiler.group import group
from eclat.frontend.lower import lower
from eclat.ir import graph as g
from eclat.ir.dtypes import DType
from eclat.ir.graph import Graph, Node
from eclat.ir.interpreter import read_view, run
from eclat.ir.symbolic import Var
from eclat.ir.view import View, compose
from eclat.rewrites import composites, merge, optimize, registry
from eclat.rewrites.check import check_merges, check_rule
from eclat.rewrites.encode import Encoding
from tests.zoo import make_llama

RNG = np.random.default_rng(0)


def linear(x: Node, name: str, n: int, weights: dict[str, np.ndarray]) -> Node:
    """x @ w.T for a new weight w [n, K] in torch's layout, in primitives."""
    weights[name] = RNG.standard_normal((n, x.shape[-1])).astype(np.float32)
    return product(x, g.weight(name, weights[name], DType.float32))


def product(x: Node, w: Node) -> Node:
    wt = g.movement(w, lambda v: v.permute([1, 0]))
    return g.decompose_composites(Graph([], [composites.matmul(x, wt)], {})).outputs[0]


def projections(m: int, sizes: tuple[int, ...], k: int = 8) -> Graph:
    """x [m, k] through one linear per size, each product an output."""
    x, weights = g.input_("x", (m, k)), {}
    outs = [linear(x, f"w{i}", n, weights) for i, n in enumerate(sizes)]
    return Graph([x], outs, weights)


def joined(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes() if n.op == "weight" and ".cat" in n.arg]


def reductions(graph: Graph) -> int:
    """Products in the program: matmuls and sums of products."""
    return sum(n.op == "matmul" or (n.op == "sum" and n.srcs[0].op == "mul") for n in graph.nodes())


# --- soundness ----------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 3])  # one token (a product with no M axis) and a matmul
@pytest.mark.parametrize("sizes", [(5, 6), (8, 4, 4), (6, 6, 6)])  # pairs, QKV with GQA widths
def test_merged_program_equals_interpreter(m: int, sizes: tuple[int, ...]):
    program, taken, worst = check_merges(projections(m, sizes))
    assert taken == 1 and worst < 1e-5
    (w,) = joined(program)  # every product of the group in one, however many members
    assert math.prod(w.shape) == 8 * sum(sizes)
    assert reductions(program) == 1


class Branches(nn.Module):
    """Inception-style: two convolutions of one input with one kernel size."""
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 5, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), torch.relu(self.b(x))


def test_convolutions_of_one_input_merge():
    torch.manual_seed(0)
    program, taken, worst = check_merges(lower(Branches().eval(), (torch.randn(1, 3, 6, 6),)))
    assert taken == 1 and worst < 1e-4 and reductions(program) == 1  # sums of 27 in another order


def test_every_rule_checked_on_its_example():
    assert merge.RULES in registry.all_rulesets()  # so tests/test_rewrites.py checks it too
    for rule in merge.RULES.rules:
        res = check_rule(rule)
        assert res.matches > 0 and res.rewritten >= 1 and res.worst < 1e-5, res


def test_check_catches_a_wrong_slice():
    """Two products of one width, each unioned with the other's slice."""
    def example() -> Graph:
        p = projections(3, (5, 5))
        out = g.binary("add", p.outputs[0], g.binary("mul", p.outputs[1], p.outputs[1]))
        return Graph(p.inputs, [out], p.weights)

    rule = merge.RULES.rules[0]
    swapped = (rule.actions[0], "(union e1 (View m s2))", "(union e2 (View m s1))")
    assert check_rule(merge.MultiRule("swapped", rule.facts, swapped, example)).worst > 1e-2
    assert check_rule(merge.MultiRule("right", rule.facts, rule.actions, example)).worst < 1e-5


# --- where no merge may happen ------------------------------------------------------------------

def _no_merge(graph: Graph) -> None:
    enc = Encoding.of(graph)
    assert not [o for o in enc.oracles if o[0] == "cat"]
    program, taken, worst = check_merges(graph)
    assert taken == 0 and not joined(program) and worst < 1e-5


def test_no_merge_of_different_inputs():
    x1, x2, weights = g.input_("x1", (3, 8)), g.input_("x2", (3, 8)), {}
    _no_merge(Graph([x1, x2], [linear(x1, "w1", 5, weights), linear(x2, "w2", 5, weights)], weights))


def test_no_merge_of_other_contractions():
    """x @ w1.T and x.T @ w2.T share x but contract different axes."""
    x, weights = g.input_("x", (3, 8)), {}
    xt = g.movement(x, lambda v: v.permute([1, 0]))
    _no_merge(Graph([x], [linear(x, "w1", 5, weights), linear(xt, "w2", 5, weights)], weights))


def test_no_merge_with_a_weight_that_is_an_input():
    x, w2, weights = g.input_("x", (3, 8)), g.input_("w2", (5, 8)), {}
    _no_merge(Graph([x, w2], [linear(x, "w1", 5, weights), product(x, w2)], weights))


def test_no_merge_with_a_symbolic_size():
    """Readers' views of the slices would not compose (copies the cost does not see)."""
    x, weights = g.input_("x", (Var("s", 1, 16), 8)), {}
    graph = Graph([x], [linear(x, "w1", 5, weights), linear(x, "w2", 6, weights)], weights)
    assert not [o for o in Encoding.of(graph).oracles if o[0] == "cat"]
    sized = Graph([g.input_("x", (4, 8))], [], weights)
    sized.outputs = [linear(sized.inputs[0], n, 5, weights) for n in ("w1", "w2")]
    assert [o for o in Encoding.of(sized).oracles if o[0] == "cat"]  # the same with a size merges


# --- views of slices ------------------------------------------------------------------------------

def _views() -> list[tuple[View, View]]:
    """(inner, outer) pairs: a slice read by a head reshape and permute, by rotate_half's masked
    halves, by a broadcast, by a flip; a transposed inner read row-major (needs a copy)."""
    s = View.contiguous((2, 24)).shrink(((0, 2), (8, 16)))
    return [
        (s, View.contiguous((2, 8)).reshape((2, 2, 4)).permute([1, 0, 2])),
        (s, View.contiguous((2, 8)).reshape((2, 2, 4)).shrink(((0, 2), (0, 2), (2, 4)))
         .pad(((0, 0), (0, 0), (0, 2)))),
        (s, View.contiguous((2, 8)).reshape((2, 1, 8)).expand((2, 3, 8))),
        (s, View.contiguous((2, 8)).flip([1])),
        (View.contiguous((4, 6)).permute([1, 0]), View.contiguous((6, 4)).reshape((24,))),
    ]


@pytest.mark.parametrize("inner,outer", _views())
def test_compose_reads_what_two_views_read(inner: View, outer: View):
    source = np.arange(100, dtype=np.float32)
    through = read_view(read_view(source, inner).reshape(-1), outer)
    one = compose(inner, outer)
    if one is None:
        assert inner.permute([1, 0]).is_contiguous  # only the transposed case needs a copy
        return
    np.testing.assert_array_equal(read_view(source, one), through)


def _movement(v: View, rng: np.random.Generator, pad: bool = True) -> View:
    """v after a random permute, slice, flip, expand of a new axis, merge of two axes (where v
    allows it) or (where pad) pad."""
    kind = rng.integers(6)
    if kind == 3 and not pad:
        kind = 0
    if kind == 5 and v.ndim > 1:
        axis = int(rng.integers(v.ndim - 1))
        merged = v.reshape((*v.shape[:axis], v.shape[axis] * v.shape[axis + 1], *v.shape[axis + 2:]))
        return v if merged is None else merged
    if kind == 0:
        return v.permute(list(rng.permutation(v.ndim)))
    axis = int(rng.integers(v.ndim))
    n = int(v.shape[axis])
    if kind == 1 and n > 1:
        start = int(rng.integers(n - 1))
        return v.slice(axis, start, int(rng.integers(start + 1, n + 1)), int(rng.integers(1, 3)))
    if kind == 2:
        return v.flip([axis])
    if kind == 3:
        return v.pad([tuple(rng.integers(3, size=2)) if k == axis else (0, 0) for k in range(v.ndim)])
    return v.reshape((*v.shape[:axis], 1, *v.shape[axis:])).expand((*v.shape[:axis], 3, *v.shape[axis:]))


def test_compose_agrees_with_reading_twice():
    rng = np.random.default_rng(1)
    source = np.arange(1, 121, dtype=np.float32)
    composed = 0
    for _ in range(300):
        inner = View.contiguous((4, 5, 6))
        for _ in range(int(rng.integers(1, 3))):
            inner = _movement(inner, rng, pad=False)
        outer = View.contiguous(inner.shape)
        for _ in range(int(rng.integers(1, 4))):
            outer = _movement(outer, rng)
        one = compose(inner, outer)
        if one is not None:
            composed += 1
            np.testing.assert_array_equal(read_view(source, one),
                                          read_view(read_view(source, inner).reshape(-1), outer))
    assert 100 < composed < 300  # some need a copy (a merge of axes inner does not store together)


# --- whole programs ------------------------------------------------------------------------------

class SiluMLP(nn.Module):
    def __init__(self, d: int = 32, f: int = 64):
        super().__init__()
        self.gate, self.up = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _optimized(graph: Graph, on: bool, monkeypatch) -> tuple[Graph, dict]:
    monkeypatch.setattr(registry, "MERGE", (merge.RULES,) if on else ())
    opt = optimize(graph, "cpu", k=4)
    return opt.candidates[0], opt.stats


@pytest.mark.parametrize("seq", [1, 4])
def test_silu_mlp_gate_and_up_in_one_kernel(seq: int, monkeypatch):
    torch.manual_seed(0)
    model, x = SiluMLP().eval(), torch.randn(seq, 32)
    graph = lower(model, (x,))
    merged, stats = _optimized(graph, True, monkeypatch)
    plain, _ = _optimized(graph, False, monkeypatch)
    assert stats["merged"] == 1 and reductions(merged) == 2 and reductions(plain) == 3
    assert len(group(merged).kernels) == len(group(plain).kernels) - 1
    (got,) = run(merged, [x.numpy()])
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_llama_blocks_merge_with_their_own_weights(monkeypatch):
    """Two layers optimised as one block: each layer's joined weights are its own (layer 1's
    values come out right only then); Q/K/V one product and gate/up one per layer."""
    model, (ids,) = make_llama(layers=2, seq=1)
    graph = lower(model, (ids,))
    merged, stats = _optimized(graph, True, monkeypatch)
    plain, _ = _optimized(graph, False, monkeypatch)
    assert stats["blocks"] < stats["segments"] and stats["merged"] == 4
    assert len({n.arg for n in joined(merged)}) == 4
    assert reductions(plain) - reductions(merged) == 2 * 3  # per layer: 3 -> 1 and 2 -> 1
    assert len(group(merged).kernels) == len(group(plain).kernels) - 2 * 3
    (got,) = run(merged, [ids.numpy()])
    np.testing.assert_allclose(got, model(ids).detach().numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seq", [1, 3])
def test_compiled_model_equals_torch(seq: int, tmp_path):
    """The merged program compiled (k=1: the search has nothing else to time)."""
    torch.manual_seed(0)
    model, x = SiluMLP().eval(), torch.randn(seq, 32)
    fast = eclat.compile(model, (x,), autotune="none", cache_dir=tmp_path, k=1)
    names = [k["name"] for k in fast.report()["kernels"]]
    assert len(names) == 3, names  # gate and up, silu(gate) * up, down
    y = torch.randn(seq, 32)
    np.testing.assert_allclose(fast(y).numpy(), model(y).detach().numpy(), rtol=1e-4, atol=1e-5)

