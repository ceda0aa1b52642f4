"""Metal runtime through PyObjC on macOS (marked metal: `pytest -m metal`): every kernel case and
the schedule space against the interpreter."""

from __future__ import annotations

import sys

import pytest

from eclat.ir.interpreter import run
from tests.gpu_cases import CASES, check_schedule_space, compare, lowered

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(sys.platform != "darwin", reason="Metal runs only on macOS")]


def _exe(program, schedules=None):
    pytest.importorskip("Metal")
    from eclat.backends.metal.runtime import MetalExecutable

    return MetalExecutable(program, schedules)


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_matches_interpreter(case: str) -> None:
    graph, inputs = CASES[case]()
    compare(_exe(lowered(graph)).run(inputs), run(graph, inputs))


@pytest.mark.parametrize("case", ["matmuls", "reductions", "elementwise"])
def test_whole_schedule_space(case: str) -> None:
    check_schedule_space(_exe, case, full=True)
