"""Verification: no executable leaves the compiler without its outputs checked against a reference
(the lowered graph run by the numpy interpreter, or the model run by torch)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import EclatError
from ..ir.dtypes import DType
from ..ir.graph import Graph
from .kernel import Program, numel_bound
from .phases import phase

RTOL, ATOL = 1e-3, 1e-4
HALF_RTOL = {DType.float16: 4e-3, DType.bfloat16: 3e-2}  # a few units in the last place of a half type
REFERENCE_BUDGET = 20_000_000  # elements the reference interpreter may touch on the lowered graph


def to_numpy(x: Any) -> np.ndarray:
    """A tensor or array as numpy (bfloat16 widened to float32: numpy has no bfloat16)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        return x.float().numpy() if str(x.dtype) == "torch.bfloat16" else x.numpy()
    return np.asarray(x)


def reference_graph(graph: Graph, candidates: list[Graph]) -> Graph:
    """The graph whose interpretation is the reference: the model as lowered, unless
    interpreting it would materialise huge broadcast products (a matmul as sum(mul(expand,
    expand)) costs M*K*N memory in numpy); then the e-graph's first candidate, which keeps
    recognised contractions as composites that numpy runs directly. Rewrites are
    checked for soundness on their own, so either is a faithful reference."""
    work = sum(numel_bound(n.shape) for n in graph.nodes())  # a run-time size at its bound
    return graph if work <= REFERENCE_BUDGET or not candidates else candidates[0]


def verified_build(program: Program, target: Any, threads: int, arrays: list[np.ndarray],
                   reference: list[np.ndarray] | None) -> Any:
    """program compiled for target, run once on arrays and its outputs checked against reference
    (raises when wrong)."""
    with phase("build"):
        exe = target.compile(program, threads)
    with phase("verify"):
        outs = exe.run([np.ascontiguousarray(a) for a in arrays])
        if reference is not None:
            verify(outs, reference, [program.buffers[name].dtype for name in program.outputs])
    return exe


def verify(outs: list[np.ndarray], reference: list[np.ndarray], dtypes: list[DType] | None = None) -> None:
    """Raise unless each output agrees with the reference's (`agrees`)."""
    for j, (o, r) in enumerate(zip(outs, reference)):
        r = np.asarray(r)
        if o.shape != r.shape:
            raise EclatError(f"output {j}: shape {o.shape}, reference {r.shape}")
        if not agrees(o, r, dtypes[j] if dtypes else None):
            err = np.max(np.abs(o.astype(np.float64) - r.astype(np.float64)), initial=0.0)
            raise EclatError(f"output {j} differs from the reference (max abs error {err:.3g})")


def agrees(o: np.ndarray, r: np.ndarray, dtype: DType | None = None, rtol: float = RTOL,
           atol: float = ATOL) -> bool:
    """o is r: equal for integers, else within rtol (and atol of the largest finite value); within
    HALF_RTOL, also of the largest value, for a value the program stores in a half type (the
    reference rounds after each op, a kernel only where it stores, so they differ by a few units in
    the last place of the values they passed through, which can be larger than the output)."""
    if r.dtype.kind in "biu":
        return bool(np.array_equal(o, r))
    if dtype in HALF_RTOL:
        rtol = atol = HALF_RTOL[dtype]
    scale = max(1.0, float(np.max(np.abs(r[np.isfinite(r)]), initial=0.0)))
    return bool(np.allclose(o, r, rtol=rtol, atol=atol * scale, equal_nan=True))
