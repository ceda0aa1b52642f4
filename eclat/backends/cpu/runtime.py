"""The CPU executable: one JIT-compiled entry point called through ctypes."""

from __future__ import annotations

import contextlib
import ctypes
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ...compiler.derived import content, derived
from ...compiler.kernel import Program, Schedule, loads
from ...compiler.memplan import ALIGN, MemoryPlan, elided_concatenations, plan_memory
from ...errors import EclatError
from ...ir.symbolic import bind_sizes, evaluate
from .attention_plan import split_keys
from .codegen import build_module, packed_copies
from .emitter import SIZES
from .jit import Jitted, one_thread_warning
from .schedules import default_schedule
from .sides import fold_row_reductions


def _data(a: np.ndarray) -> int:
    """a's data pointer. ndarray.ctypes and __array_interface__ build objects (3 us each
    here); a ctypes view of the buffer is 1 us. Read-only or empty arrays take the slow way."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):
        return a.ctypes.data


def _owned(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """a as contiguous dtype: a itself when it is so and the compile's own, else one copy shared by
    the executables that read it (a read-only a views the model's own tensor, frontend.lower, and
    the compiled code must not see the model change; or lays a weight out, rewrites.layout)."""
    if a.flags.writeable and a.flags.c_contiguous and a.dtype == dtype:
        return a
    return derived(a, ("own copy", np.dtype(dtype).str), lambda: np.array(a, dtype=dtype, order="C"))


def layout(program: Program) -> tuple[Program, MemoryPlan]:
    """What runs and its memory plan: program with its row sums folded into their writers (the side
    buffers join program's buffers), its concatenations written in place by the kernels that write
    their parts, and a scratch for each attention split along its keys. An artifact's loader
    derives the same from the stored program."""
    code, aliases = elided_concatenations(split_keys(fold_row_reductions(program)))
    return code, plan_memory(code, aliases)


class NativeRun:
    """Calls a compiled `eclat_run(slots)`: slots ordered as slot_names, the arena last. Weights
    are bound once; `run(inputs)` binds contiguous inputs of the right shapes and dtypes (the
    caller validates) and fresh outputs, and returns the outputs.

    Calls may come from several Python threads at once (ctypes releases the GIL while the code
    runs), so the slots and arena a call writes are its own: each call takes a free pair from a
    pool and returns it, making one only when every pair is in use. Memory grows with the
    callers that actually overlap, and a lone caller pays a list pop and append (0.1 us)."""

    reentrant = True  # CompiledModel need not make calls take turns

    def __init__(self, program: Program, plan: MemoryPlan, slot_names: list[str], address: int,
                 owner: object = None, address_of: Callable[[str], int] | None = None):
        """address: of eclat_run; address_of(name): of another entry point (eclat_kernel_<j>)."""
        self.program, self.plan = program, plan
        self._owner = owner  # what holds the machine code at address (an execution engine), kept alive
        self._fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(address)
        self._address_of = address_of
        self._subsets: dict[tuple[int, ...], list] = {}  # outputs wanted -> the kernels that compute them
        self._index = {name: j for j, name in enumerate(slot_names)}
        self._weights: dict[int, np.ndarray] = {}  # slot -> data, bound in every call's slots
        self._no_data: list[int] = []  # slots nothing reads: pointed at the arena, a valid address
        for name, j in self._index.items():
            buf = program.buffers.get(name)
            if name == "<arena>" or (buf is not None and buf.role == "weight" and
                                     (buf.numel == 0 or buf.data is None)):
                self._no_data.append(j)
            elif buf is not None and buf.role == "weight":
                self._weights[j] = _owned(np.asarray(buf.data), buf.dtype.np)
        self._free: list[_CallState] = [self._state()]

        # per call work precomputed: a model step is a few microseconds of Python, not tens
        self._in_slots = [self._index[name] for name in program.inputs]
        self._out_specs = [(self._index[name], tuple(shape), program.buffers[name].dtype.np)
                           for name, shape in zip(program.outputs, program.output_shapes)]
        self._size_names = [v.name for v in program.sizes]

    def share_weights(self, other: NativeRun) -> int:
        """Bind each weight whose bytes equal one of other's to other's array, so that two programs
        of one model (a prefill and a decode step) hold their weights once. Returns the bytes this
        executable no longer holds. Not while calls run."""
        theirs = {_digest(a): a for a in other._weights.values()}
        names = {j: name for name, j in self._index.items()}
        freed = 0
        for j, a in list(self._weights.items()):
            b = theirs.get(_digest(a))
            if b is None or b is a or not np.array_equal(a, b):
                continue
            self._weights[j], name = b, names[j]
            self.program.buffers[name] = replace(self.program.buffers[name], data=b)
            packed = getattr(getattr(self, "module", None), "packed", {})
            if name in packed:
                packed[name] = b
            freed += a.nbytes
        self._free = [self._state()]
        return freed

    @contextlib.contextmanager
    def _call_state(self) -> Iterator[_CallState]:
        """A free state of the pool, returned to it after the call."""
        try:
            state = self._free.pop()  # atomic under the GIL, as is append
        except IndexError:  # every state is in use by another thread's call
            state = self._state()
        try:
            yield state
        finally:
            self._free.append(state)

    def _state(self) -> _CallState:
        """Slots with the weights bound and an arena of the plan's size, 64-byte aligned."""
        arena = _aligned_empty((max(self.plan.arena_bytes, 1),), np.uint8)
        arena[:] = 0
        slots = (ctypes.c_void_p * len(self._index))()
        for j in self._no_data:
            slots[j] = arena.ctypes.data
        for j, data in self._weights.items():
            slots[j] = data.ctypes.data
        sizes = np.zeros(len(self.program.sizes), np.int64)
        if self.program.sizes:
            slots[self._index[SIZES]] = sizes.ctypes.data
        return _CallState(slots, arena, ctypes.addressof(slots), sizes)

    def _bind(self, state: _CallState, inputs: list[np.ndarray]) -> list[np.ndarray]:
        slots = state.slots
        for j, a in zip(self._in_slots, inputs):
            slots[j] = _data(a)
        env = None
        if self._size_names:  # each call's sizes, read off its inputs (checked: buffers hold the bounds)
            env = bind_sizes(self.program.input_shapes, [a.shape for a in inputs], self.program.inputs)
            state.sizes[:] = [env[name] for name in self._size_names]
        outs = []
        for j, shape, dtype in self._out_specs:
            o = _aligned_empty(shape if env is None else tuple(evaluate(n, env) for n in shape), dtype)
            slots[j] = _data(o)
            outs.append(o)
        return outs

    def run(self, inputs: list[np.ndarray], wanted: Sequence[int] | None = None) -> list[np.ndarray | None]:
        """The outputs; with `wanted` (output numbers), only the kernels those outputs depend on
        run (one call each), and the other outputs are None."""
        kernels = None if wanted is None else self._kernels_for(tuple(sorted(wanted)))
        with self._call_state() as state:
            outs = self._bind(state, inputs)
            if kernels is None:
                self._fn(state.address)
            else:
                for fn in kernels:
                    fn(state.address)
        return outs if wanted is None else [o if j in wanted else None for j, o in enumerate(outs)]

    def _kernels_for(self, wanted: tuple[int, ...]) -> list:
        """The entry points of the kernels the outputs `wanted` depend on, in program order."""
        if wanted not in self._subsets:
            if self._address_of is None:
                raise ValueError("this executable runs whole programs only")
            needed = {self.program.outputs[j] for j in wanted}
            order = []
            for j in range(len(self.program.kernels) - 1, -1, -1):
                k = self.program.kernels[j]
                if k.out in needed or any(side.out in needed for side in k.sides):
                    order.append(j)
                    bodies = (k.body, *(side.body for side in k.sides))
                    needed |= {x.buffer for body in bodies for x in loads(body)}
            self._subsets[wanted] = [self._kernel_entry(j) for j in reversed(order)]
        return self._subsets[wanted]

    def _kernel_entry(self, j: int) -> ctypes._CFuncPtr:
        """The entry point that runs kernel j alone (eclat_kernel_<j>)."""
        return ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._address_of(f"eclat_kernel_{j}"))


def _digest(a: np.ndarray) -> tuple:
    return a.dtype.str, a.shape, content(a)


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a cache line: the arena (so its buffers start on
    lines too) and every output. numpy's start 16 bytes into one about as often as not; then threads
    that split the columns of a product write a line of every row in common, and at 2 threads a
    512 x 224 product's output took 65 us against 31 on a line (44 on one thread)."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize  # math.prod and _data: 1.4 us a call, numpy's ways 4.9
    raw = np.empty(size + ALIGN, np.uint8)
    start = -_data(raw) % ALIGN
    return raw[start:start + size].view(dtype).reshape(shape)


@dataclass(frozen=True)
class _CallState:
    slots: ctypes.Array  # eclat_run's argument: one pointer per slot
    arena: np.ndarray  # owns the temporaries' memory the arena slot points into
    address: int  # of slots
    sizes: np.ndarray  # the run-time sizes of the call (int64, in program.sizes' order)


def scheduled(program: Program, threads: int = 1, lanes: int | None = None) -> Program:
    """A copy of program (its buffers and kernels) in which every kernel has a CPU schedule: those not
    scheduled yet (grouped, not searched, or scheduled for another target) take the default."""
    return replace(program, buffers=dict(program.buffers),
                   kernels=[replace(k, schedule=k.schedule if isinstance(k.schedule, Schedule)
                                    else default_schedule(k, threads, lanes, weights=program.weights))
                            for k in program.kernels])


class CpuExecutable(NativeRun):
    """Program -> native code: the module built and JIT-compiled here, run by NativeRun."""

    def __init__(self, program: Program, threads: int = 1, lanes: int | None = None):
        """lanes: the float32 lanes code is generated for (None: the host's vector unit; more than
        the host has is legal, LLVM splits the wide vectors)."""
        # the executable's own copy: codegen adds packed weights and folded sums to the buffers and
        # tuning sets schedules in place, so a shared program would drift from what was built here
        program = scheduled(program, threads, lanes)
        one_thread_warning(threads)
        code, plan = layout(program)  # what runs; program is what reports and artifacts see
        self.module = build_module(code, plan, threads, lanes)
        unheld = sorted(n for n in self.module.used if (b := program.buffers.get(n)) is not None
                        and b.role == "weight" and b.numel and b.data is None)
        if unheld:  # its slot would point at the arena: a wrong answer, not an error
            raise EclatError(f"the code reads weights {unheld} that the program holds no data of (a built "
                             f"program keeps only what its own schedules read)")
        # a weight read only through its packed copy is not held (the model's weights once, not twice)
        for name in packed_copies(program) - self.module.used:
            program.buffers[name] = replace(program.buffers[name], data=None)
        self.jit = Jitted(self.module.ir, self.module.kernels)
        super().__init__(program, plan, self.module.slot_names, self.jit.address("eclat_run"),
                         address_of=self.jit.address)

    def profile(self, inputs: list[np.ndarray], repeats: int = 5) -> list[float]:
        """Median microseconds of each kernel alone, in program order (inputs as for run)."""
        if len(inputs) != len(self._in_slots):  # a missing pointer would crash the native code
            raise ValueError(f"profile takes the program's {len(self._in_slots)} inputs (states included), "
                             f"given {len(inputs)}")
        # on the arena calls use: a fresh one (pages new to the caches and the TLB) slowed some
        # kernels by up to a sixth
        with self._call_state() as state:
            keep = self._bind(state, inputs)
            self._fn(state.address)  # every temporary holds real values
            times = []
            for j in range(len(self.program.kernels)):
                fn = self._kernel_entry(j)
                samples = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    fn(state.address)
                    samples.append(time.perf_counter() - t)
                times.append(sorted(samples)[len(samples) // 2] * 1e6)
            del keep
        return times
