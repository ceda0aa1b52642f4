"""Row sums computed by the kernel that writes the rows.

A kernel that sums a row of another kernel's output (softmax's sum over the exponentials, a
norm's sum of squares over a residual) reads that row once more. When the writer is a generic
kernel over the same rows, it can accumulate the sum while it stores each value and write one
number per row to a small side buffer, which the reader loads instead: one pass over the rows
less per sum.

A row max is not folded. Beside the writer's own work it costs two operations per element (the
max and the running sum that makes it NaN-propagating) and registers the writer needs: on the
LayerNorm+GELU+softmax benchmark it cost the writer 8.6 us and saved softmax's own max pass
4.1 us, and whole runs were no faster (0.98-1.00 of the time with it).

The folded program shares its buffers with the original (the side buffers join them), and only
the CPU code generator sees its kernels: tuning, reports and artifacts keep the original ones.
"""

from __future__ import annotations

from dataclasses import replace

from ...compiler.group import ravel, unravel
from ...compiler.kernel import (
    Buffer,
    Index,
    Kernel,
    KExpr,
    Load,
    Op,
    Program,
    Reduce,
    Side,
    as_contraction,
    axis_vars,
    loads,
    reduces,
    rewrite,
    split_last,
)
from ...ir.dtypes import DType
from ...ir.symbolic import Expr, Num, prod, upper, variables


def fold_row_reductions(program: Program) -> Program:
    """program with each foldable row sum computed by the writer of the rows it reads."""
    writers = {k.out: j for j, k in enumerate(program.kernels)}
    kernels = list(program.kernels)
    made: dict[tuple, str] = {}  # (writer, body) -> side buffer
    for j, k in enumerate(program.kernels):
        mapping = {}
        for r in reduces(k.body):
            found = _foldable(r, writers, kernels, j)
            if found is None:
                continue
            writer, row, body = found
            w = writers[writer.out]
            kernels[w] = writer
            key = (w, body)
            if key not in made:
                name = f"side{len(made)}_{kernels[w].out}"
                rows = program.buffers[kernels[w].out].numel // kernels[w].shape[-1]
                program.buffers[name] = Buffer(name, rows, DType.float32, "temp")
                made[key] = name
                kernels[w] = replace(kernels[w], sides=(*kernels[w].sides, Side(name, body)))
            mapping[r] = Load(made[key], row, Num(1), DType.float32)
        if mapping:
            kernels[j] = replace(kernels[j], body=rewrite(kernels[j].body, mapping))
    return replace(program, kernels=kernels) if made else program


def _foldable(r: Reduce, writers: dict[str, int], kernels: list[Kernel],
              reader: int) -> tuple[Kernel, Expr, KExpr] | None:
    """(the writer, over the rows, the row index in the reader, the body in the writer's variables)
    when r reduces rows of an earlier generic kernel's output elementwise, else None."""
    if r.op != "sum" or r.dtype is not DType.float32 or reduces(r.body):
        return None
    reads = loads(r.body)
    if not reads or any(not isinstance(x, Load) or x != reads[0] for x in reads):
        return None
    x = reads[0]
    w = writers.get(x.buffer)
    if w is None or w >= reader or x.valid != Num(1):
        return None
    kw = kernels[w]
    if not (kw.shape and isinstance(kw.shape[-1], int) and isinstance(r.size, int)):
        return None  # rows of a run-time length
    if not kw.sides and kw.shape[-1] > r.size and kw.shape[-1] % r.size == 0:
        kw = split_last(kw, r.size)  # its rows were merged (kernel.coalesce)
    shape = kw.shape
    lead = next((d for d, n in enumerate(shape) if upper(n) > 1), len(shape))
    if len(shape) < 2 or lead >= len(shape) - 1 or shape[-1] != r.size or as_contraction(kw) is not None \
            or kw.body.dtype is not DType.float32 or _padded(kw):
        return None
    row, col = unravel(x.index, [prod(shape[:-1]), r.size])
    if col != r.var or r.var.name in variables(row):
        return None
    own = Load(x.buffer, ravel(axis_vars(shape), shape), Num(1), x.dtype)
    return kw, row, rewrite(r.body, {x: own})


def _padded(k: Kernel) -> bool:
    """A padding kernel (where(mask, x, 0) at the top) writes its rows in pieces: not folded."""
    return isinstance(k.body, Op) and k.body.op == "where" and isinstance(k.body.srcs[0], Index)
