"""CompiledModel: validated calls into a compiled program, and its report."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..ir.dtypes import DType
from ..ir.graph import Returned, State
from ..ir.symbolic import bind_sizes, describe_shape
from .report import CompileReport
from .specs import InputSpec, in_gpu_memory, is_array, is_torch, leaves


class CompiledModel:
    """Call with torch tensors or numpy arrays nested as the example inputs were (dicts matched by
    key), or with the flat list of `inputs` as positional arrays; get the same kind back: torch
    outputs in the model's own structure, numpy outputs as one array or a list. A GPU program also
    takes tensors in GPU memory (torch CUDA tensors, or anything with __cuda_array_interface__) and
    returns its outputs there, with no host copy. Calls from several threads at once are safe: a CPU
    program gives each call its own memory, others take turns."""

    def __init__(self, executable: Any, inputs: list[InputSpec], out_spec: Any,
                 report: CompileReport | dict[str, Any], in_structure: Any = None,
                 states: list[State] | None = None):
        self.executable = executable
        self.state_specs = list(states or [])
        self.program_inputs = inputs  # the states are the program's last inputs, not arguments
        inputs = inputs[:len(inputs) - len(self.state_specs)]
        self.inputs = inputs
        self.out_spec = out_spec
        self.in_structure = [None] * len(inputs) if in_structure is None else in_structure
        self.compile_report = report if isinstance(report, CompileReport) else CompileReport.from_dict(report)
        self._expected = [(s.shape, np.dtype(s.dtype.np)) for s in inputs]
        self._sized = any(not isinstance(n, int) for s in inputs for n in s.shape)  # run-time sizes
        self._names = [f"input {k} ({s.name})" for k, s in enumerate(inputs)]
        self._torch_dtypes: list[Any] | None = None  # each input's torch dtype, once torch is seen
        # GPU programs keep their buffers on the device: their calls take turns
        reentrant, turns = getattr(executable, "reentrant", False), threading.Lock()
        self._execute = executable.run if reentrant else _one_at_a_time(executable.run, turns)
        run_device = getattr(executable, "run_device", None)  # a GPU program: tensors in its memory
        self._execute_device = None if run_device is None else _one_at_a_time(run_device, turns)
        if self.state_specs:
            self.states = {s.name: s.initial.copy() for s in self.state_specs}
            self._execute = self._stateful(self._execute)
        if any(s.index_range or s.divisor for s in inputs):  # kernels clamp an index, torch raises
            self._execute = _values_checked(inputs, self._execute)
            if self._execute_device is not None:
                self._execute_device = _values_checked(inputs, self._execute_device)

    def reset_states(self) -> None:
        """Give every state (a buffer the model updates, such as a KV cache) its initial value."""
        for s in self.state_specs:
            self.states[s.name][...] = s.initial

    def _stateful(self, run: Callable[[list[np.ndarray]], list[np.ndarray]]) -> Callable:
        """run with the states as its last inputs, whose updates (the last outputs) are then written
        into them in place; calls take turns, since each sees the state the last one left."""
        lock = threading.Lock()
        taken = sum(s.outputs for s in self.state_specs)
        program = getattr(self.executable, "program", None)
        total = len(program.outputs) if program is not None else None

        def stateful(args: list[np.ndarray], states_only: bool = False) -> list[np.ndarray]:
            """states_only: the model's own outputs are not needed (their kernels may be skipped)."""
            wanted = range(total - taken, total) if states_only and total is not None else None
            with lock:  # self.states may be replaced: two programs of one model share theirs
                arrays = [self.states[s.name] for s in self.state_specs]
                outs = run(list(args) + arrays) if wanted is None else run(list(args) + arrays, wanted)
                updates = iter(outs[len(outs) - taken:])
                for s, state in zip(self.state_specs, arrays):
                    if s.axis is None:
                        state[...] = next(updates)
                    else:
                        index, values = next(updates), next(updates)
                        state[(slice(None),) * s.axis + (index,)] = values
            return outs[:len(outs) - taken]
        return stateful

    def update_states(self, *args: Any) -> None:
        """Run for the states' updates alone (arguments as for a call): the kernels that only the
        model's outputs need are skipped, as a prompt's chunks before its last need no logits."""
        if not self.state_specs:
            raise ValueError("this model has no states (buffers it updates) to update")
        flat = list(args) if self._plain(args) else \
            [self._array(k, spec, x) for k, (spec, x) in enumerate(zip(self.inputs, self._flat(args)))]
        if self._sized:
            self._check_sizes(flat)
        self._execute(flat, states_only=True)

    def __call__(self, *args: Any) -> Any:
        if self._plain(args):  # the common call, checked in one pass: a tenth of a small model's time
            if self._sized:
                self._check_sizes(args)
            outs = self._execute(list(args))
            return outs[0] if len(outs) == 1 else outs
        arrays = self._plain_torch(args)
        if arrays is not None:  # the common torch call: 8 us where the general path below takes 25
            return self._as_torch(self._execute(arrays))
        flat = self._flat(args)
        if self._execute_device is not None and any(in_gpu_memory(x) for x in flat):
            return self._device_call(flat)
        use_torch = any(is_torch(x) for x in flat)
        arrays = [self._array(k, spec, x) for k, (spec, x) in enumerate(zip(self.inputs, flat))]
        if self._sized:
            self._check_sizes(arrays)
        outs = self._execute(arrays)
        if not use_torch:
            return outs[0] if len(outs) == 1 else outs
        return self._as_torch(outs)

    def _flat(self, args: tuple) -> list[Any]:
        """The call's tensors in the order of self.inputs: nested as the example inputs were, or flat."""
        if len(args) == len(self.inputs) and all(is_array(a) for a in args):
            return list(args)
        if len(args) != len(self.in_structure):
            raise ValueError(f"expected {len(self.in_structure)} arguments, given {len(args)}; the inputs "
                             f"are {', '.join(_describe(s) for s in self.inputs)}")
        flat = leaves(args, self.in_structure, "arguments")
        if len(flat) != len(self.inputs):  # a structure that disagrees with the program: never run it
            raise ValueError(f"the arguments hold {len(flat)} tensors, not the program's {len(self.inputs)}")
        return flat

    def _device_call(self, flat: list[Any]) -> Any:
        """A call with tensors in GPU memory: checked, run with no host copy, outputs left there."""
        if self.state_specs:
            raise ValueError("a model with states (such as a KV cache) takes host tensors, not GPU ones")
        tensors = [self._device_tensor(k, spec, x) for k, (spec, x) in enumerate(zip(self.inputs, flat))]
        outs = self._execute_device(tensors)
        if tensors and is_torch(tensors[0]):
            return self._structured(outs)
        return outs[0] if len(outs) == 1 else outs

    @staticmethod
    def _device_tensor(k: int, spec: InputSpec, x: Any) -> Any:
        """x, a contiguous tensor of spec's dtype and shape in GPU memory (0), or a ValueError."""
        where = f"input {k} ({spec.name})"
        if not in_gpu_memory(x):
            raise ValueError(f"{where}: expected a tensor in GPU memory as the other inputs are, given "
                             f"{type(x).__name__} on the host")
        if is_torch(x):
            got, shape = str(x.dtype).removeprefix("torch."), tuple(x.shape)
            if x.device.index not in (None, 0):
                raise ValueError(f"{where}: expected a tensor on cuda:0 (the program's), given {x.device}")
            x = x.detach().contiguous()
        else:
            cai = x.__cuda_array_interface__
            got, shape = str(np.dtype(cai["typestr"])), tuple(cai["shape"])
            strides = cai.get("strides")
            if strides is not None and tuple(strides) != tuple(np.empty(shape, got).strides):
                raise ValueError(f"{where}: expected a contiguous array, given strides {list(strides)}")
        want = spec.dtype.name if is_torch(x) else str(np.dtype(spec.dtype.np))
        if got != want:
            raise ValueError(f"{where}: expected dtype {want}, given {got}")
        if shape != spec.shape:
            raise ValueError(f"{where}: expected shape {list(spec.shape)}, given {list(shape)}")
        return x

    def _as_torch(self, outs: list[np.ndarray]) -> Any:
        """outs as tensors, in the model's own output structure."""
        import torch

        tensors = [torch.from_numpy(o) for o in outs]
        program = getattr(self.executable, "program", None)
        if program is not None:  # bfloat16 outputs are computed widened (numpy has no bfloat16)
            wide = [program.buffers[n].dtype is DType.bfloat16 for n in program.outputs]
            tensors = [t.to(torch.bfloat16) if w else t for t, w in zip(tensors, wide)]
        return self._structured(tensors)

    def _structured(self, tensors: list[Any]) -> Any:
        """tensors in the model's own output structure (with the outputs it returns as constants)."""
        import torch

        if isinstance(self.out_spec, str):  # as an artifact stores it: torch's pytree JSON
            self.out_spec = _read_out_spec(self.out_spec)
        spec = self.out_spec
        if isinstance(spec, Returned):
            tensors, spec = spec.merged(tensors), spec.tree
        if hasattr(spec, "num_leaves") and not spec.is_leaf():
            return torch.utils._pytree.tree_unflatten(tensors, spec)
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def _check_sizes(self, arrays: Any) -> None:
        """Sizes that vary: each within its bounds, and the inputs agreeing on them (ValueError)."""
        bind_sizes([s.shape for s in self.inputs], [a.shape for a in arrays], self._names)

    def _plain(self, args: tuple) -> bool:
        """Whether args are exactly the expected contiguous numpy arrays, their run-time sizes aside
        (a plain loop: a generator under all() costs a microsecond more, a tenth of a small model's
        call)."""
        if len(args) != len(self._expected):
            return False
        for a, (shape, dtype) in zip(args, self._expected):
            if type(a) is not np.ndarray or a.dtype != dtype or not a.flags.c_contiguous:
                return False
            if a.shape != shape and not (self._sized and len(a.shape) == len(shape) and all(
                    m == n for m, n in zip(a.shape, shape) if type(n) is int)):
                return False
        return True

    def _plain_torch(self, args: tuple) -> list[np.ndarray] | None:
        """args as arrays when they are exactly the expected contiguous CPU tensors, needing no
        grad, conversion or copy; else None."""
        torch = sys.modules.get("torch")
        if torch is None or len(args) != len(self._expected):
            return None
        if self._torch_dtypes is None:  # bfloat16 is converted, so never plain
            self._torch_dtypes = [None if s.dtype is DType.bfloat16 else getattr(torch, s.dtype.name, None)
                                  for s in self.inputs]
        arrays = []
        for a, (shape, _), dtype in zip(args, self._expected, self._torch_dtypes):
            if type(a) is not torch.Tensor or a.dtype is not dtype or a.shape != shape or \
                    a.requires_grad or not a.is_cpu or not a.is_contiguous():
                return None
            arrays.append(a.numpy())
        return arrays

    @staticmethod
    def _array(k: int, spec: InputSpec, x: Any) -> np.ndarray:
        where = f"input {k} ({spec.name})"
        if is_torch(x):
            got = str(x.dtype).removeprefix("torch.")
            if got != spec.dtype.name:
                raise ValueError(f"{where}: expected dtype {spec.dtype.name}, given {got}")
            if x.device.type != "cpu":
                raise ValueError(f"{where}: expected a CPU tensor, given one on {x.device}")
            x = x.detach()
            a = x.float().numpy() if spec.dtype is DType.bfloat16 else x.numpy()
        elif isinstance(x, np.ndarray):
            a = x
            if a.dtype != spec.dtype.np:
                raise ValueError(f"{where}: expected dtype {spec.dtype.np}, given {a.dtype}")
        else:
            raise ValueError(f"{where}: expected a torch.Tensor or numpy.ndarray, given {type(x).__name__}")
        if tuple(a.shape) != spec.shape and not any(not isinstance(n, int) for n in spec.shape):
            raise ValueError(f"{where}: expected shape {list(spec.shape)}, given {list(a.shape)}")
        return np.ascontiguousarray(a)

    def save(self, path: str, beside: CompiledModel | None = None) -> None:
        """Write an artifact that `eclat.load` runs without torch, egglog or a new search. beside:
        another program of the model, saved with it: the weights they share are stored there only
        (`load(path, beside=...)` takes them from it)."""
        from .artifact import save_artifact

        save_artifact(self, path, _weights_of(beside))

    @property
    def weights(self) -> dict[str, np.ndarray]:
        """The program's weights by name, as its executable holds them (none where it keeps no program)."""
        program = getattr(self.executable, "program", None)
        held = program.weights if program is not None else {}
        return {name: b.data for name, b in held.items() if b.data is not None}

    def report(self) -> dict:
        """What was chosen and why, as JSON data (`compile_report` is the typed record)."""
        return self.compile_report.to_dict()


def load(path: str, beside: CompiledModel | None = None) -> CompiledModel:
    """The CompiledModel an artifact holds; outputs are numpy arrays unless called with torch.
    beside: the program it was saved beside (CompiledModel.save), whose weights it shares."""
    from .artifact import load_artifact

    loaded = load_artifact(path, _weights_of(beside))
    return CompiledModel(loaded.executable, loaded.inputs, loaded.out_spec, loaded.report,
                         loaded.in_structure, loaded.states)


def _weights_of(model: CompiledModel | None) -> dict[str, np.ndarray] | None:
    return None if model is None else model.weights


def _describe(spec: InputSpec) -> str:
    return f"{spec.name}: {spec.dtype.name}{describe_shape(spec.shape)}"


def _values_checked(specs: list[InputSpec], run: Callable[[list[Any]], list[Any]]) -> Callable:
    """run, after checking what torch would raise on: an index out of its range, an integer divisor 0.
    The arrays are numpy arrays or torch tensors (on any device); other GPU arrays go unchecked."""
    ranges = [(k, s, *s.index_range) for k, s in enumerate(specs) if s.index_range]
    divisors = [(k, s) for k, s in enumerate(specs) if s.divisor]

    def checked(arrays: list[Any], *rest: Any, **options: Any) -> list[Any]:
        comparable = [isinstance(a, np.ndarray) or is_torch(a) for a in arrays]
        for k, spec, low, high in ranges:
            a = arrays[k]
            outside = (a < low) | (a >= high) if comparable[k] else None
            if outside is not None and outside.any():
                bad = int(a[outside].reshape(-1)[0])
                raise IndexError(f"input {k} ({spec.name}): index {bad} is out of range: this input indexes "
                                 f"a dimension of size {high}, valid indices are {low} to {high - 1}")
        for k, spec in divisors:
            if comparable[k] and not arrays[k].all():
                raise ZeroDivisionError(f"input {k} ({spec.name}) divides integers and holds a zero")
        return run(arrays, *rest, **options)
    return checked


def _one_at_a_time(run: Callable[[list[Any]], list[Any]], lock: threading.Lock) -> Callable:
    def locked(arrays: list[Any], wanted: Any = None) -> list[Any]:
        with lock:  # the whole program runs: `wanted` (some outputs only) is the CPU's
            return run(arrays)
    return locked


def _read_out_spec(text: str) -> Any:
    """An output structure as an artifact stores it: torch's pytree JSON, or {"tree": that JSON,
    "constants": [[flat position, value], ...]} when some outputs are constants."""
    import json

    import torch

    try:
        stored = json.loads(text)
        if isinstance(stored, dict) and "constants" in stored:
            tree = torch.utils._pytree.treespec_loads(stored["tree"])
            return Returned(tree, {int(k): v for k, v in stored["constants"]})
        return torch.utils._pytree.treespec_loads(text)
    except Exception as e:  # torch's own errors for a spec it cannot read
        raise ValueError(f"the stored output structure cannot be read: {type(e).__name__}: {e}") from None
