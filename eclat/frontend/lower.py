"""torch.nn.Module -> primitive Graph: torch.export, core ATen decompositions, then one
walk over the FX graph that applies the lowering table in `ops.py` node by node."""

from __future__ import annotations

import functools
import inspect
import operator
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch
from torch.export.graph_signature import InputKind, OutputKind

from eclat.errors import ExportError, UnsupportedOpError
from eclat.ir import graph as g
from eclat.ir.dtypes import DType
from eclat.ir.graph import Graph, Node, Returned, State, numel
from eclat.ir.symbolic import Var, as_int

from .context import INT_MAX, Ctx, Unavailable, ir_dtype


def source_line(node: torch.fx.Node) -> str | None:
    """'file.py:LINE in fn: code' for the innermost frame outside torch itself."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return None
    user = [f for f in frames if f"{os.sep}torch{os.sep}" not in f[0]] or frames
    path, line, fn, code = user[-1]
    return f"{os.path.basename(path)}:{line} in {fn}: {code.strip()}"


# ops eclat lowers better than torch's decomposition of them: F.unfold and F.fold (im2col, col2im)
# decompose into index_put(accumulate=True), a scatter-add eclat can only run as a one-hot product
KEPT = ("im2col", "col2im")


@functools.cache
def _decompositions() -> Any:
    """torch.export's core ATen decompositions, less those of KEPT."""
    table = torch.export.default_decompositions()
    for name in KEPT:
        table.pop(getattr(torch.ops.aten, name).default, None)
    return table


def export(model: torch.nn.Module | torch.export.ExportedProgram, example_inputs: tuple,
           dynamic_shapes: Any = None) -> torch.export.ExportedProgram:
    """model's forward in core ATen; a program exported already (transformers' cached decoders
    export themselves) is only decomposed."""
    name = type(model).__name__
    try:
        with warnings.catch_warnings():
            # torch.export trips over its own deprecated pytree API; not the user's concern
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
            if not isinstance(model, torch.export.ExportedProgram):
                with _without_returned_cache(model):
                    model = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic_shapes)
            return model.run_decompositions(_decompositions())
    except Exception as e:  # torch raises many types; all mean "could not export"
        raise ExportError(f"torch.export failed for {name}: {type(e).__name__}: {e}") from e


def _user_frame() -> int:
    """The stacklevel, for a warning raised by its caller, of the first frame outside eclat (and
    contextlib): the user's line that compiled the model."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(package)
                                 or frame.f_code.co_filename.endswith("contextlib.py")):
        frame, level = frame.f_back, level + 1
    return level


@contextmanager
def _without_returned_cache(model: torch.nn.Module) -> Iterator[None]:
    """A transformers decoder returns a fresh key/value cache (DynamicCache) with its outputs by
    default, which torch.export cannot export. Compiled for one forward pass, it is exported with
    use_cache off in every config its modules hold (an encoder-decoder's decoder keeps a copy; the
    cache output is None), and the user told so: eclat.compile_lm keeps a cache across steps."""
    configs = {id(c): c for m in model.modules() for c in [getattr(m, "config", None)]
               if type(m).__module__.startswith("transformers.") and getattr(c, "use_cache", False)}
    if not configs:
        yield
        return
    warnings.warn(f"{type(model).__name__} returns its key/value cache by default; eclat compiles it with "
                  "config.use_cache=False (past_key_values is None). eclat.compile_lm keeps a cache "
                  "for generation.", stacklevel=_user_frame())
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def _dim_names(model: Any, example_inputs: tuple, dynamic_shapes: Any, ep: torch.export.ExportedProgram,
               specs: dict) -> dict[str, str]:
    """torch's symbol -> the user's name for it (a Dim's name), so that a size error names the Dim
    the user wrote, not s27. For tensors passed as flat arguments, with dynamic_shapes a tuple (or a
    dict by argument name) of {axis: Dim} or [Dim, ...]; anything else keeps torch's names, as does
    a name eclat's kernels could confuse with an index (i0, r3)."""
    if dynamic_shapes is None or not all(isinstance(t, torch.Tensor) for t in example_inputs):
        return {}
    if isinstance(dynamic_shapes, dict):
        try:
            arguments = list(inspect.signature(model.forward).parameters)[:len(example_inputs)]
        except (TypeError, ValueError, AttributeError):
            return {}
        dynamic_shapes = [dynamic_shapes.get(a) for a in arguments]
    user = [n for n in ep.graph.nodes if n.op == "placeholder" and specs[n.name].kind == InputKind.USER_INPUT]
    if not isinstance(dynamic_shapes, (tuple, list)) or len(dynamic_shapes) != len(user):
        return {}
    out: dict[str, str] = {}
    for node, dims in zip(user, dynamic_shapes):
        for axis, dim in (dims.items() if isinstance(dims, dict) else enumerate(dims or ())):
            name, size = getattr(dim, "__name__", None), node.meta["val"].shape[axis]
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol and isinstance(name, str) and \
                    name.isidentifier() and not re.fullmatch(r"[a-z]\d+", name):
                out.setdefault(str(size.node.expr), name)
    return out if len(set(out.values())) == len(out) else {}


def _bound(end: Any, unbounded: int) -> int:
    """An export range's end as an int within int32, `unbounded` where it has none. torch spells
    "no bound" as sympy's oo or its own int_oo, which int() does not take (int_oo raises
    AttributeError from sympy), so only a true integer is converted."""
    if isinstance(end, int) or getattr(end, "is_Integer", False):
        return max(-INT_MAX - 1, min(int(end), INT_MAX))
    return unbounded


def lower(model: torch.nn.Module | torch.export.ExportedProgram, example_inputs: tuple, *,
          dynamic_shapes: Any = None) -> Graph:
    """Lower model's forward pass on example_inputs (or a program torch.export made) to a primitive
    Graph. Buffers the forward updates in place become the graph's states (ir.graph.State)."""
    from .ops import LOWERINGS, LOWERINGS_BY_NAME, NO_BOOL_INPUTS, convert_output

    if not isinstance(example_inputs, tuple):
        raise TypeError(f"example_inputs must be a tuple, got {type(example_inputs).__name__}")
    ep = export(model, example_inputs, dynamic_shapes)
    weights: dict[str, np.ndarray] = {}
    ctx = Ctx(weights)
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    named = _dim_names(model, example_inputs, dynamic_shapes, ep, specs)
    for name, r in ep.range_constraints.items():
        ctx.symbols[str(name)] = Var(named.get(str(name), str(name)), _bound(r.lower, -INT_MAX - 1),
                                     _bound(r.upper, INT_MAX))
    mutated = {s.target for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    env: dict[torch.fx.Node, Any] = {}
    inputs: list[Node] = []
    states: dict[str, Node] = {}
    outputs: list[Node] = []
    tied: dict[tuple, Node] = {}
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            spec = specs[node.name]
            if spec.kind == InputKind.BUFFER and spec.target in mutated:
                shape = tuple(ctx.sym(d) for d in val.shape)
                env[node] = states[spec.target] = g.input_(spec.target, shape,
                                                           _dtype_or_raise(val.dtype, spec.target))
            else:
                env[node] = _placeholder(ep, ctx, node, spec, val, inputs, tied)
        elif node.op == "call_function":
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            fn = LOWERINGS.get(node.target) or LOWERINGS_BY_NAME.get(_op_name(node.target))
            if fn is None:
                raise UnsupportedOpError(_op_name(node.target), source_line(node))
            try:
                leaves = torch.utils._pytree.tree_leaves((args, kwargs))
                for a in leaves:
                    if isinstance(a, Unavailable) and node.target is not operator.getitem:
                        raise NotImplementedError(f"uses {a.what}, which eclat does not compute")
                if getattr(node.target, "overloadpacket", None) in NO_BOOL_INPUTS and \
                        any(isinstance(a, Node) and a.dtype is DType.bool for a in leaves):
                    raise NotImplementedError("torch runs it on no bool tensor (it has no bool kernel); "
                                              "cast the input to a number type first")
                ctx.arg_vals = tuple(a.meta.get("val") if isinstance(a, torch.fx.Node) else None
                                     for a in node.args)
                first = val[0] if isinstance(val, (tuple, list)) and val else val
                if isinstance(first, torch.Tensor):
                    ctx.out_shape = tuple(ctx.sym(d) for d in first.shape)
                    ctx.out_dtype = ir_dtype(first.dtype, f"the result of {_op_name(node.target)}")
                env[node] = _empty_as_constant(fn(ctx, *args, **kwargs))
            except (ValueError, TypeError, NotImplementedError) as e:
                raise UnsupportedOpError(_op_name(node.target), source_line(node), str(e)) from e
            except UnsupportedOpError as e:  # a part of the op (a size of its result): named with the op
                if e.source is not None:
                    raise
                detail = f"{e.op}: {e.detail}"
                raise UnsupportedOpError(_op_name(node.target), source_line(node), detail) from e
            if isinstance(val, torch.Tensor) and not isinstance(env[node], Unavailable):
                _check(node, env[node], ctx)
        elif node.op == "output":
            out_specs = ep.graph_signature.output_specs
            returned = [env[o] if isinstance(o, torch.fx.Node) else o
                        for o, spec in zip(node.args[0], out_specs) if _user_output(spec)]
            constants = {k: v for k, v in enumerate(returned) if v is None or type(v) in (bool, int, float)}
            outputs = [convert_output(ctx, v) for k, v in enumerate(returned) if k not in constants]
            if not outputs:
                raise UnsupportedOpError("a model that returns no tensor", source_line(node),
                                         f"it returns only {[returned[k] for k in sorted(constants)]}")
            updates = {spec.target: o for o, spec in zip(node.args[0], ep.graph_signature.output_specs)
                       if spec.kind == OutputKind.BUFFER_MUTATION}
    state_list = []
    for name, x in states.items():
        state, outs = _state_update(name, x, updates[name], env, ep)
        state_list.append(state)
        outputs += outs
    out_spec = Returned(ep.call_spec.out_spec, constants) if constants else ep.call_spec.out_spec
    return Graph(inputs + list(states.values()), outputs, weights, out_spec, ctx.index_ranges, ctx.divisors,
                 state_list)


def _empty_as_constant(value: Any) -> Any:
    """value, where it is a computed tensor with no elements, as a broadcast constant: it holds
    nothing to compute, and kernels over an empty axis (a short clip's window padding that
    slices nothing) would divide by its size."""
    if isinstance(value, (tuple, list)):
        return type(value)(_empty_as_constant(v) for v in value)
    if isinstance(value, Node) and value.kind != "leaf" and numel(value.shape) == 0:
        return g.expand_to(g.const(0, value.dtype), value.shape)
    return value


def _state_update(name: str, x: Node, new: torch.fx.Node, env: dict, ep) -> tuple[State, list[Node]]:
    """How the buffer `name` (input x) is updated: rows written along one axis (a KV cache's
    index_copy_, which the program returns as index and values, so that the runtime writes only
    those rows), or a new whole value."""
    t = ep.state_dict.get(name, ep.constants.get(name))
    initial = np.zeros([int(d) for d in x.shape], x.dtype.np) if t is None else _array(t, x.dtype)
    if new.target is torch.ops.aten.index_put.default and env.get(new.args[0]) is x and \
            not (len(new.args) > 3 and new.args[3]):
        given = [(axis, i) for axis, i in enumerate(new.args[1]) if i is not None]
        if len(given) == 1 and len(env[given[0][1]].shape) == 1 and env[given[0][1]].dtype is not DType.bool:
            axis, index = given[0][0], env[given[0][1]]
            rows = tuple(index.shape[0] if k == axis else n for k, n in enumerate(x.shape))
            return State(name, initial, axis), [index, g.expand_to(g.cast(env[new.args[2]], x.dtype), rows)]
    value = env[new]
    return State(name, initial), [value if value.dtype is x.dtype else g.cast(value, x.dtype)]


def _placeholder(ep, ctx: Ctx, node: torch.fx.Node, spec, val: Any, inputs: list[Node],
                 tied: dict[tuple, Node]) -> Any:
    if spec.kind == InputKind.USER_INPUT:
        if not isinstance(val, torch.Tensor):
            return val  # a non-tensor input is specialised to its example value by torch.export
        shape = tuple(ctx.sym(d) for d in val.shape)
        x = g.input_(node.name, shape, _dtype_or_raise(val.dtype, f"input {node.name!r}"))
        inputs.append(x)
        return x
    if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
        tensor = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
        # tied parameters (an LM head sharing the embedding) are one weight under its first name
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype)
        if key in tied:
            return tied[key]
        dtype = _dtype_or_raise(tensor.dtype, f"weight {spec.target!r}")
        shared = _SHARED_WEIGHTS.get()
        if shared is None or key not in shared:
            array = _weight_view(tensor, dtype)
            if shared is not None:
                shared[key] = (tensor, array)  # the tensor held, so that its address stays its own
        else:
            array = shared[key][1]
        ctx.weights[spec.target] = array
        tied[key] = g.weight(spec.target, array, dtype)
        return tied[key]
    for user in node.users:  # a token threads an op with side effects (linalg's error checks)
        if user.target is torch.ops.higher_order.with_effects and len(user.args) > 1:
            names = [a for a in user.args[2:] if isinstance(a, str)]  # linalg's checks name their op
            raise UnsupportedOpError(_op_name(user.args[1]), source_line(user),
                                     f"an op with side effects{''.join(f' (of {n})' for n in names)}: "
                                     "torch.export threads it with a token")
    raise UnsupportedOpError(f"graph input of kind {spec.kind.name}", detail=node.name)


_SHARED_WEIGHTS: ContextVar[dict | None] = ContextVar("eclat_shared_weights", default=None)


@contextmanager
def sharing_weights() -> Iterator[None]:
    """Within it, lowerings of programs that read the same tensors (a language model's prefill and
    decode) share one copy of each weight: the compile then holds the weights once."""
    token = _SHARED_WEIGHTS.set({})
    try:
        yield
    finally:
        _SHARED_WEIGHTS.reset(token)


def _array(t: torch.Tensor, dtype: DType) -> np.ndarray:
    """A state's initial value: its own copy (bfloat16 widened: numpy has none)."""
    return _weight_view(t, dtype).copy()


def _weight_view(t: torch.Tensor, dtype: DType) -> np.ndarray:
    """A weight as numpy, read-only: the tensor's own memory where it is float32 and contiguous, so
    that a compile does not hold the model's weights a second time. What a compiled program reads
    of it directly is copied when the program is built (a later change to the model is not seen)."""
    view = (t.float() if dtype is DType.bfloat16 else t).detach().contiguous().numpy()
    view.flags.writeable = False
    return view


def _user_output(spec) -> bool:
    if spec.kind == OutputKind.BUFFER_MUTATION:
        return False
    if spec.kind != OutputKind.USER_OUTPUT:
        what = spec.kind.name.lower().replace("_", " ") + (f" of {spec.target!r}" if spec.target else "")
        raise UnsupportedOpError("state mutation", detail=f"the model's forward performs a {what}; eclat "
                                 "compiles pure inference (keep state such as caches outside the model)")
    return True


def _dtype_or_raise(dtype: torch.dtype, what: str) -> DType:
    try:
        return ir_dtype(dtype, what)
    except TypeError as e:
        raise UnsupportedOpError(f"dtype {dtype}", detail=str(e)) from None


def _check(node: torch.fx.Node, out: Any, ctx: Ctx) -> None:
    """A lowering must produce exactly torch's shape and dtype: catching it here names the op."""
    if not isinstance(out, Node):
        raise AssertionError(f"lowering of {_op_name(node.target)} returned {type(out).__name__}")
    # symbolic sizes may be spelled differently; constant ones must agree
    same = len(out.shape) == len(ctx.out_shape) and all(
        as_int(a) == as_int(b) for a, b in zip(out.shape, ctx.out_shape))
    if not same or out.dtype is not ctx.out_dtype:
        raise AssertionError(f"lowering of {_op_name(node.target)} gave {out.dtype.short}{list(out.shape)}, "
                             f"torch says {ctx.out_dtype.short}{list(ctx.out_shape)}")


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))
