"""The GPU lowering executed on OpenCL (PoCL's CPU device here) against the numpy interpreter:
elementwise, reductions (row and flat), masked and negative-stride views, gather, matmul tiles
with ragged edges, integer semantics, and every schedule of the GPU schedule space."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from eclat.compiler.group import group
from eclat.compiler.kernel import Buffer, Program
from eclat.ir.interpreter import run
from tests.gpu_cases import CASES, compare

cl = pytest.importorskip("pyopencl")
from eclat.backends.gpu_c import GpuSchedule, gpu_schedule_space  # noqa: E402
from eclat.backends.opencl.runtime import OpenCLExecutable, context  # noqa: E402

try:
    context()
except Exception as e:  # no platform: say how to get one
    pytest.skip(f"no OpenCL device ({e}); apt-get install -y pocl-opencl-icd ocl-icd-libopencl1",
                allow_module_level=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_matches_interpreter(case: str) -> None:
    graph, inputs = CASES[case]()
    exe = OpenCLExecutable(group(graph))
    compare(exe.run(inputs), run(graph, inputs))


def sample(space: list[GpuSchedule]) -> list[GpuSchedule]:
    """The default and the first schedule of every other (strategy, vector) pair: every
    code path of the space, at a fraction of the PoCL build time."""
    out = space[:1]
    for s in space[1:]:
        if all((s.strategy, s.vector) != (o.strategy, o.vector) for o in out[1:]):
            out.append(s)
    return out


Variant = tuple[str, str, GpuSchedule]


def with_variants(program: Program, full: bool = True
                  ) -> tuple[Program, dict[str, GpuSchedule], list[Variant]]:
    """program plus one copy of each kernel per schedule of its space, each copy writing an
    output of its own, so that one OpenCL build checks them all. Returns the variants as
    (output of the default schedule, output of this schedule, schedule)."""
    buffers, kernels = dict(program.buffers), list(program.kernels)
    outputs, shapes = list(program.outputs), list(program.output_shapes)
    chosen, variants = {}, []
    for k in program.kernels:
        space = gpu_schedule_space(k)
        for j, s in enumerate(space if full else sample(space)):
            out, name = f"{k.out}_v{j}", f"{k.name}_v{j}"
            buffers[out] = Buffer(out, k.numel, program.buffers[k.out].dtype, "output")
            kernels.append(replace(k, name=name, out=out))
            chosen[name] = s
            outputs.append(out)
            shapes.append(k.shape)
            variants.append((f"{k.out}_v0", out, s))
    return replace(program, buffers=buffers, kernels=kernels, outputs=outputs, output_shapes=shapes), \
        chosen, variants


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sample", "full"])
@pytest.mark.parametrize("case", ["matmuls", "reductions", "elementwise"])
def test_schedule_space(case: str, full: bool) -> None:
    graph, inputs = CASES[case]()
    program = group(graph)
    prog, chosen, variants = with_variants(program, full)
    assert len(variants) >= 2 * len(program.kernels)
    outs = dict(zip(prog.outputs, OpenCLExecutable(prog, chosen).run(inputs)))
    compare([outs[o] for o in program.outputs], run(graph, inputs))  # the default schedules
    for default, out, s in variants:
        np.testing.assert_allclose(outs[out], outs[default], rtol=1e-4, atol=1e-5, err_msg=f"{out} with {s}")
    tried = {s.strategy for _, _, s in variants}
    assert "flat" in tried and (case == "elementwise" or "row" in tried)
    assert case != "matmuls" or "tile" in tried
    assert case != "elementwise" or any(s.vector == 4 for _, _, s in variants)


def test_strategies_are_the_expected_ones() -> None:
    graph, inputs = CASES["reductions"]()
    strategies = [k.schedule.strategy for k in OpenCLExecutable(group(graph)).rendered.kernels]
    assert "row" in strategies  # the 300-long rows get a work-group each
    graph, inputs = CASES["matmuls"]()
    assert {k.schedule.strategy for k in OpenCLExecutable(group(graph)).rendered.kernels} == {"tile"}


def test_runs_twice_with_new_inputs() -> None:
    graph, inputs = CASES["matmuls"]()
    exe = OpenCLExecutable(group(graph))
    exe.run(inputs)
    other = [np.ascontiguousarray(a[::-1]) for a in inputs]
    compare(exe.run(other), run(graph, other))
