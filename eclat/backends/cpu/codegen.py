"""Kernel IR -> LLVM modules: one per distinct kernel function, and one with the entry points.

    void eclat_run(ptr slots)   slots[j] = pointer to buffer `slot_names[j]`, the arena last

The entry calls every kernel in order with its buffers (temporaries are offsets into
the arena chosen by the memory planner), so a model call is one native call.

A kernel function is `void k(ptr args, i64 lo, i64 hi)`: it runs the slice [lo, hi)
of its outermost loop, which is how the thread pool splits it. The code is generated for a
vector unit of `lanes` float32 lanes, the host's unless told (host.vector_lanes()).

    codegen      this module: the module, its entry points and the calls into the kernels
    emitter      a generic kernel: loop nests, hoisted reductions, ops from a table
    contraction  a contraction kernel: register-blocked micro-kernel, packed weights
    attention    a softmax contracted with values: one pass over the keys, online softmax
    scalar       types, constants, casts and binary ops of single values
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llvmlite.ir as ir
import numpy as np

from ...autotune.cache import source_version
from ...compiler.kernel import (
    Buffer,
    Gather,
    Kernel,
    Load,
    Program,
    as_attention,
    bytes_moved,
    flops,
    loads,
    rewrite,
)
from ...compiler.memplan import MemoryPlan
from ...ir.symbolic import Expr, Num, Var, add, mul, sint, size_from_json, size_to_json, terms, upper
from . import code_store, host
from .attention import AttentionEmitter
from .attention_plan import attention_parts
from .contraction import PACKED, ContractionEmitter, contraction_of
from .emitter import INDEX_OPS, KERNEL_TYPE, SIZES, KernelEmitter
from .jit import code_environment, prepared_text
from .scalar import I8, I32, I64, PTR, i64

# below both, handing a kernel to the pool costs more than it saves; a copy above the bytes
# threshold is split too, so that each core reads what it wrote (the neighbour's L2 is far)
PARALLEL_MIN_FLOPS = 200_000
PARALLEL_MIN_BYTES = 256 * 1024
EMITTED_FUNCTIONS = 4096  # kernel functions kept emitted in this process, least recently used out
_emitted: OrderedDict[str, tuple[sint, str]] = OrderedDict()  # function name -> (outer, IR text)
_emitted_lock = threading.Lock()


@dataclass
class Module:
    """What codegen hands the JIT and the runtime."""

    ir: ir.Module  # the entry points, calling the kernel functions
    kernels: dict[str, str]  # kernel function name -> the IR text of the module defining it alone
    functions: dict[str, str]  # kernel name -> the name of the function that runs it
    slot_names: list[str]  # buffers passed to eclat_run, in order (arena last, as "<arena>")
    packed: dict[str, np.ndarray]  # constant buffers made at compile time (packed weights)
    parallel: list[str]  # kernels split across threads
    used: set[str]  # buffers some kernel reads or writes (a weight read only packed is not)
    lanes: int  # float32 lanes of the vector unit the code was generated for

    def text(self) -> str:
        """The whole program as one module of LLVM IR: the kernels linked with the entry points."""
        from .jit import linked

        return str(linked(self))


def slots_of(program: Program) -> list[str]:
    """The buffers passed to eclat_run, in order: every one but the temporaries, then the run-time
    sizes (int64, in program.sizes' order) if there are any, the arena last."""
    names = [n for n, b in program.buffers.items() if b.role != "temp"]
    return names + ([SIZES] if program.sizes else []) + ["<arena>"]


def packed_copies(program: Program) -> set[str]:
    """Weights the program also holds packed (a matmul's constant operand in panels): code may read
    only the packed copy, so their own data need not be held (nor saved in an artifact)."""
    sources = {n.removeprefix(PACKED).rsplit("_", 2)[0] for n, b in program.buffers.items()
               if n.startswith(PACKED) and b.role == "weight"}
    return sources & set(program.buffers)  # an attention's table of live blocks is packed from none


def emitter(mod: ir.Module, kernel: Kernel, buffers: dict[str, Buffer], packed: dict[str, np.ndarray],
            lanes: int, sizes: Sequence[Var] = ()) -> KernelEmitter:
    """The emitter for kernel: the attention or contraction micro-kernels where they apply, else
    loops. sizes: the program's run-time sizes."""
    att = as_attention(kernel)
    parts = attention_parts(att, kernel, lanes)
    c = contraction_of(kernel, buffers) if parts is None else None
    if parts is not None:
        em: KernelEmitter = AttentionEmitter(mod, kernel, buffers, packed, lanes, att, parts)
    elif c is not None:
        em = ContractionEmitter(mod, kernel, buffers, packed, lanes, c)
    else:
        em = KernelEmitter(mod, kernel, buffers, packed, lanes)
    em.read_sizes(sizes)
    return em


def build_module(program: Program, plan: MemoryPlan, threads: int = 1, lanes: int | None = None) -> Module:
    """Emit program for a vector unit of `lanes` float32 lanes (None: the host's). Packed weights
    join program.buffers (role weight, names starting with PACKED); a rebuild drops the previous
    build's. Kernels equal up to buffer names share one function (the layers of a model differ
    only in their weights)."""
    lanes = host.vector_lanes() if lanes is None else int(lanes)
    if lanes < 1:
        raise ValueError(f"lanes must be positive, given {lanes}")
    for name in [n for n in program.buffers if n.startswith(PACKED)]:
        del program.buffers[name]
    mod = ir.Module(name="eclat")
    packed: dict[str, np.ndarray] = {}
    calls: list[Call] = []
    used: set[str] = set()
    parallel: list[str] = []
    functions: dict[str, tuple[str, sint]] = {}
    kernels: dict[str, str] = {}
    for k in program.kernels:
        moved, shifts = _shifted(k, program.buffers)
        em = emitter(ir.Module(name=k.name), moved, program.buffers, packed, lanes, program.sizes)
        key = em.key()
        if key not in functions:
            fn_name, outer, kernels[fn_name] = _function(em, key, lanes)
            functions[key] = (fn_name, outer)
            ir.Function(mod, KERNEL_TYPE, fn_name)  # declared here, defined in its own module
        fn_name, outer = functions[key]
        calls.append((fn_name, em.arg_names, outer, shifts))
        used |= em.used
        if k.schedule.threads > 1 and threads > 1 and upper(outer) > 1 and (
                flops(k) >= PARALLEL_MIN_FLOPS or bytes_moved(k, program.buffers) >= PARALLEL_MIN_BYTES):
            parallel.append(k.name)
    slot_names = slots_of(program)
    _entry(mod, program, plan, slot_names, calls, set(parallel), threads)
    return Module(mod, kernels, {k.name: fn for k, (fn, *_) in zip(program.kernels, calls)}, slot_names,
                  packed, parallel, used, lanes)


def _shifted(k: Kernel, buffers: dict[str, Buffer]) -> tuple[Kernel, dict[str, int]]:
    """(k, its shifts): k reading each buffer past the least constant element offset of its loads
    there, from a pointer the caller moves by that many elements. Kernels equal but for where they
    read a buffer (a recurrence's steps, each reading its slice of the input's projection) are then
    one function, compiled once (a 50-step bidirectional LSTM's 403 kernels were 113 functions).
    Read where they lie: weights (a product packs them by name), gathered tables, the output, and
    every buffer of an attention kernel."""
    if k.scratch is not None or as_attention(k) is not None:
        return k, {}
    found: dict[str, list[Load]] = {}
    in_place = {k.out}
    for x in loads(k.body):
        if isinstance(x, Gather):
            in_place.add(x.buffer)
        else:
            found.setdefault(x.buffer, []).append(x)
    shifts: dict[str, int] = {}
    moved: dict = {}
    for name, reads in found.items():
        if name in in_place or buffers[name].role == "weight":
            continue
        parts = [terms(x.index) for x in reads]
        offsets = [sum(c for c, atom in t if atom is None) for t in parts]
        if min(offsets) <= 0:
            continue
        shifts[name] = min(offsets)
        for x, t, offset in zip(reads, parts, offsets):
            index: Expr = Num(0)
            for c, atom in t:
                if atom is not None:
                    index = add(index, atom if c == 1 else mul(atom, c))
            moved[x] = Load(x.buffer, add(index, offset - shifts[name]), x.valid, x.dtype)
    if not shifts:
        return k, {}
    return dataclasses.replace(k, body=rewrite(k.body, moved)), shifts


def _function(em: KernelEmitter, key: str, lanes: int) -> tuple[str, sint, str]:
    """(name, outer loop length, IR text) of em's kernel function. Named by its code: equal kernels
    of any program are one function, emitted once per process (the candidates of a compile and the
    schedules a tuner tries share most of them) and kept on disk for the next (code_store), and
    compiled once (jit)."""
    fn_name = f"eclat_{hashlib.sha256(f'{lanes}|{key}'.encode()).hexdigest()[:24]}"
    with _emitted_lock:
        if fn_name in _emitted:
            _emitted.move_to_end(fn_name)
            return (fn_name, *_emitted[fn_name])
    stored_key = f"{fn_name}|{source_version()}|{code_environment()}"
    made = _stored_function(stored_key)
    if made is None:
        outer = em.function(fn_name)
        em.mod.name = fn_name  # its text, and so its cached code, depends on nothing else
        made = outer, prepared_text(em.mod)
        code_store.write("function", stored_key, size_to_json(outer), [made[1].encode()])
    with _emitted_lock:
        _emitted[fn_name] = made
        while len(_emitted) > EMITTED_FUNCTIONS:
            _emitted.popitem(last=False)
    return (fn_name, *made)


def _stored_function(key: str) -> tuple[sint, str] | None:
    kept = code_store.read("function", key, parts=1)
    try:
        return None if kept is None else (size_from_json(kept[0]), kept[1][0].decode())
    except (ValueError, UnicodeDecodeError):  # a foreign header or text: emitted afresh
        return None


Call = tuple[str, list[str], sint, dict[str, int]]  # a kernel's function, its buffers, outer loop, shifts


def _entry(mod: ir.Module, program: Program, plan: MemoryPlan, slot_names: list[str],
           calls: list[Call], parallel: set[str], threads: int) -> None:
    """eclat_run calls every kernel in order; eclat_kernel_<j> calls kernel j alone (profiling)."""
    steps = [(k, *call) for k, call in zip(program.kernels, calls)]
    _caller(mod, "eclat_run", steps, program, plan, slot_names, parallel, threads)
    for j, step in enumerate(steps):
        _caller(mod, f"eclat_kernel_{j}", [step], program, plan, slot_names, parallel, threads)


def _caller(mod: ir.Module, name: str, steps: list[tuple[Kernel, *Call]], program: Program,
            plan: MemoryPlan, slot_names: list[str], parallel: set[str], threads: int) -> None:
    sizes = program.sizes
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [PTR]), name)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    slot = {name: j for j, name in enumerate(slot_names)}
    pool = mod.globals.get("eclat_parallel")
    if parallel and pool is None:
        pool = ir.Function(mod, ir.FunctionType(ir.VoidType(), [PTR, PTR, I64, I32]), "eclat_parallel")
    ptrs: dict[str, ir.Value] = {}

    def pointer(name: str) -> ir.Value:
        if name not in ptrs:
            if name in slot:
                ptrs[name] = b.load(b.gep(fn.args[0], [i64(slot[name])], source_etype=PTR), typ=PTR)
            elif name in plan.within:  # a part of an output, written where it lies in the caller's array
                holder, at = plan.within[name]
                ptrs[name] = b.gep(pointer(holder), [i64(at)], source_etype=I8)
            else:
                arena = pointer("<arena>")
                ptrs[name] = b.gep(arena, [i64(plan.offsets[name])], source_etype=I8)
        return ptrs[name]

    def size(e: sint) -> ir.Value:
        """A run-time size's value (the length of a kernel's outer loop)."""
        if isinstance(e, int):
            return i64(e)
        if isinstance(e, Num):
            return i64(e.v)
        if isinstance(e, Var):
            at = b.gep(pointer(SIZES), [i64([v.name for v in sizes].index(e.name))], source_etype=I64)
            return b.load(at, typ=I64)
        return INDEX_OPS[e.op](b, size(e.a), size(e.b))

    for k, fn_name, names, n, shifts in steps:
        if n == 0:
            continue
        n = size(n)
        args = b.alloca(PTR, size=max(len(names), 1))
        for j, name in enumerate(names):
            at = pointer(name)
            if name in shifts:  # the kernel reads past this many elements (_shifted)
                at = b.gep(at, [i64(shifts[name] * program.buffers[name].dtype.np.itemsize)], source_etype=I8)
            b.store(at, b.gep(args, [i64(j)], source_etype=PTR))
        kfn = mod.globals[fn_name]
        if k.scratch is not None:
            memset = mod.declare_intrinsic("llvm.memset", [PTR, I64])
            b.call(memset, [pointer(k.scratch), ir.Constant(I8, 0), i64(program.buffers[k.scratch].nbytes),
                            ir.Constant(ir.IntType(1), 0)])
        if k.name in parallel:
            b.call(pool, [kfn, args, n, ir.Constant(I32, min(threads, k.schedule.threads))])
        else:
            b.call(kfn, [args, i64(0), n])
    b.ret_void()


__all__ = ["PACKED", "Module", "build_module", "emitter", "packed_copies", "slots_of"]
