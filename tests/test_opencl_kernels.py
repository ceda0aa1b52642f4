"""The GPU lowering executed on OpenCL (PoCL's CPU device here) against the numpy interpreter:
elementwise, reductions (row and flat), masked and negative-stride views, gather, matmul tiles
with ragged edges, integer semantics, and every schedule of the GPU schedule space."""

from __future__ import annotations

import numpy as np
import pytest

from eclat.compiler.group import group
from eclat.ir.interpreter import run
from tests.gpu_cases import CASES, check_schedule_space, compare, lowered, opencl_or_skip

opencl_or_skip()
from eclat.backends.opencl.runtime import OpenCLExecutable  # noqa: E402


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_matches_interpreter(case: str) -> None:
    graph, inputs = CASES[case]()
    exe = OpenCLExecutable(lowered(graph))
    compare(exe.run(inputs), run(graph, inputs))


def test_floats_round_to_half_exactly() -> None:
    """OpenCL has no half arithmetic: the rounding by bits gives numpy's (nearest, ties to even)
    through subnormals, the largest half, overflow, infinities and NaN."""
    graph, inputs = CASES["halves"]()
    cast, want = OpenCLExecutable(lowered(graph)).run(inputs)[4], inputs[2].astype(np.float16)
    number = ~np.isnan(want)
    assert not np.any(np.isnan(cast[number])) and np.all(np.isnan(cast[~number]))
    np.testing.assert_array_equal(cast.view(np.uint16)[number], want.view(np.uint16)[number])


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sample", "full"])
@pytest.mark.parametrize("case", ["matmuls", "reductions", "elementwise", "packed", "attention"])
def test_schedule_space(case: str, full: bool) -> None:
    check_schedule_space(OpenCLExecutable, case, full)


def test_strategies_are_the_expected_ones() -> None:
    graph, inputs = CASES["reductions"]()
    strategies = [k.schedule.strategy for k in OpenCLExecutable(group(graph)).rendered.kernels]
    assert "row" in strategies  # the 300-long rows get a work-group each
    graph, inputs = CASES["matmuls"]()
    strategies = [k.schedule.strategy for k in OpenCLExecutable(group(graph)).rendered.kernels]
    assert strategies == ["tile", "tile", "tile", "row"]  # the last: 2 rows, k = 300


def test_runs_twice_with_new_inputs() -> None:
    graph, inputs = CASES["matmuls"]()
    exe = OpenCLExecutable(group(graph))
    exe.run(inputs)
    other = [np.ascontiguousarray(a[::-1]) for a in inputs]
    compare(exe.run(other), run(graph, other))


def test_tuning_picks_a_verified_schedule_and_reuses_the_database(tmp_path) -> None:
    from types import SimpleNamespace

    from eclat.autotune.db import TuningDB
    from eclat.backends import get_target
    from eclat.backends.gpu import gpu_schedule_space
    from eclat.compiler.tune import tune

    graph, inputs = CASES["matmuls"]()
    program = group(graph)
    backend = get_target("opencl")
    device = SimpleNamespace(fingerprint="pocl-test")
    db = TuningDB(tmp_path / "tuning.db")
    tune(program, backend, device, db, "full", 1, inputs)
    chosen = {k.name: k.schedule for k in program.kernels}
    assert set(chosen) == {k.name for k in program.kernels}
    for k in program.kernels:
        assert chosen[k.name] in gpu_schedule_space(k)
    compare(backend.compile(program).run(inputs), run(graph, inputs))
    tune(program, backend, device, db, "fast", 1, inputs)
    again = {k.name: k.schedule for k in program.kernels}
    assert again == chosen and db.hits >= len(program.kernels)


def test_every_tile_schedule_on_ragged_contractions() -> None:
    """Each tile schedule of the space against the interpreter, on products whose m, n and k are
    no multiples of the tiles: a bias + relu epilogue, a batch axis, a transposed weight (both
    operands unit-stride in k) and a transposed a (neither), so every way a slice is read."""
    from eclat.backends.gpu import gpu_schedule_space, with_variants
    from eclat.ir import graph as g
    from eclat.ir.graph import Graph
    from tests.gpu_cases import matmul

    def t(x):
        return g.movement(x, lambda v: v.permute((1, 0)))

    def bias_relu(y, bias):
        y = g.binary("add", y, g.expand_to(bias, y.shape))
        return g.binary("max", y, g.expand_to(g.const(0.0), y.shape))

    rng = np.random.default_rng(7)
    shapes = {"a": (70, 45), "b": (45, 75), "bias": (75,), "ba": (3, 19, 40), "bb": (3, 40, 33),
              "x": (21, 50), "w": (35, 50), "at": (37, 130), "c": (37, 9)}
    n = {name: g.input_(name, s) for name, s in shapes.items()}
    outs = [bias_relu(matmul(n["a"], n["b"]), n["bias"]), matmul(n["ba"], n["bb"]),
            bias_relu(matmul(n["x"], t(n["w"])), g.movement(n["bias"], lambda v: v.slice(0, 0, 35, 1))),
            matmul(t(n["at"]), n["c"])]
    graph = Graph(list(n.values()), outs, {})
    inputs = [rng.standard_normal(s).astype(np.float32) for s in shapes.values()]
    program = lowered(graph)
    spaces = {k.name: [s for s in gpu_schedule_space(k) if s.strategy == "tile"] for k in program.kernels}
    assert len(spaces) == 4 and all(len(s) >= 5 for s in spaces.values())  # fewer where tiles clamp
    prog, chosen, variants = with_variants(program, spaces)
    got = dict(zip(prog.outputs, OpenCLExecutable(prog, chosen).run(inputs)))
    want = dict(zip(program.outputs, run(graph, inputs)))
    out_of = {k.name: k.out for k in program.kernels}
    for v in variants:
        np.testing.assert_allclose(got[v.out], want[out_of[v.kernel]], rtol=1e-4, atol=1e-5,
                                   err_msg=f"{v.kernel} with {v.schedule}")
