"""What the CPU's attention kernel (attention.py) runs and how it cuts the work: the operands of
the scores it reads, the axis of its query rows, and the parts a decode's keys are split into
(flash-decoding). The schedules decide the parts (`default_key_depth`), the layout sizes their
scratch and the kernel reads them (`key_parts`); kept apart from attention.py, which imports
the schedules' neighbours."""

from __future__ import annotations

import math
from dataclasses import replace

from ...compiler.kernel import (
    Attention,
    Buffer,
    Kernel,
    KExpr,
    Load,
    Op,
    Program,
    as_attention,
    axis_vars,
    free_vars,
)
from ...ir.dtypes import DType
from ...ir.symbolic import Num, Var, terms, upper

# Fewer query rows than this (decode: one per head) read keys and values in place, not in panels
DIRECT_BELOW = 6
MIN_PART_KEYS = 256  # fewest keys a part of a split decode takes (its combine costs a row's worth)


def attention_parts(att: Attention | None, kernel: Kernel, lanes: int) -> tuple[Load, Load] | None:
    """(query factor, key factor) of att's score contraction when the CPU kernel runs it: float32,
    values read as whole vectors along the last axis, a contraction of a query row (no key variable)
    against a key row (no query-row variable); None otherwise (the generic loops run it)."""
    if att is None or att.score is None or kernel.body.dtype is not DType.float32:
        return None
    rows = len(kernel.shape) - 2  # the query rows and the keys may be run-time sizes; the rest not
    if not all(isinstance(n, int) for a, n in enumerate(kernel.shape) if a != rows) or \
            not isinstance(att.score.size, int):
        return None
    last = f"i{len(kernel.shape) - 1}"
    v = att.v
    if not (isinstance(v, Load) and v.valid == Num(1) and kernel.shape[-1] % lanes == 0
            and sum(c for c, a in terms(v.index) if isinstance(a, Var) and a.name == last) == 1):
        return None
    body = att.score.body
    if not (isinstance(body, Op) and body.op == "mul" and all(isinstance(s, Load) and s.valid == Num(1)
                                                              for s in body.srcs)):
        return None
    q, k = body.srcs if att.var.name not in free_vars(body.srcs[0]) else body.srcs[::-1]
    if att.var.name in free_vars(q) or att.var.name not in free_vars(k) or last in free_vars(k):
        return None
    return q, k



def rows_axis(kernel: Kernel, k_row: Load, v: KExpr) -> int | None:
    """The axis of the query rows: the kernel's last outer axis when it has more than one position
    and neither the keys nor the values read it (prefill); None (each outer position one row)."""
    last = len(kernel.shape) - 2
    reads = free_vars(k_row) | free_vars(v)
    if last >= 0 and upper(kernel.shape[last]) > 1 and axis_vars(kernel.shape)[last].name not in reads:
        return last
    return None


def _decode_slices(kernel: Kernel) -> int | None:
    """The slices a decode attention's heads make (the first head axis's length): one the CPU runs
    with fewer than DIRECT_BELOW query rows a head, a known number; None for any other kernel."""
    att = as_attention(kernel)
    parts = attention_parts(att, kernel, 1)  # the vector width does not matter here
    if parts is None:
        return None
    rows = rows_axis(kernel, parts[1], att.v)
    if rows is not None and not (isinstance(kernel.shape[rows], int) and kernel.shape[rows] < DIRECT_BELOW):
        return None
    heads = [a for a in range(len(kernel.shape) - 1) if a != rows]
    return kernel.shape[heads[0]] if heads else 1


def default_key_depth(kernel: Kernel, threads: int) -> int:
    """Keys a part of a decode attention takes by default (`Schedule.depth`; 0: one part): parts
    where the heads alone would load the threads unevenly or leave one idle, the fewest that give
    every thread as many slices and each at least two (1 head on 2 threads: 4 parts; 3 heads: 2),
    each MIN_PART_KEYS keys or more."""
    slices = _decode_slices(kernel)
    if slices is None or threads <= 1:
        return 0
    split = next(p for p in range(1, 2 * threads + 1)
                 if slices * p % threads == 0 and slices * p >= 2 * threads)
    keys = upper(as_attention(kernel).size)
    parts = min(split, keys // MIN_PART_KEYS)
    return -(-keys // parts) if parts > 1 else 0


def key_parts(kernel: Kernel) -> int:
    """Parts a decode attention's keys are split into (flash-decoding): its schedule's depth keys
    each at the largest number of keys, as many parts of equal share at any number; 1: not split.
    Depends on the kernel and its schedule alone (the memory plan an artifact derives at load
    follows it), not on the host's vector width."""
    depth = getattr(kernel.schedule, "depth", 0)
    if depth <= 0 or _decode_slices(kernel) is None:
        return 1
    return max(1, -(-upper(as_attention(kernel).size) // depth))


def counters_at(kernel: Kernel, parts: int) -> int:
    """Where the counters start in a split attention's scratch: after a row of dv + 2 (its output,
    max and sum) per head, part and query row."""
    return math.prod(kernel.shape[:-1]) * parts * (kernel.shape[-1] + 2)


def split_keys(program: Program) -> Program:
    """program with a scratch buffer for each attention whose keys `key_parts` splits: per head
    (every outer position but the rows), part and row, the row's unnormalised output, its max and
    its sum; then an int32 counter per slice of the first head axis."""
    kernels = list(program.kernels)
    for j, k in enumerate(kernels):
        parts = key_parts(k)
        if parts == 1:
            continue
        name = f"keyparts{j}_{k.out}"
        outer = math.prod(k.shape[:-1])  # heads x rows; as many counters (slices are fewer or as many)
        program.buffers[name] = Buffer(name, counters_at(k, parts) + outer, DType.float32, "temp")
        kernels[j] = replace(k, scratch=name)
    return replace(program, kernels=kernels)
