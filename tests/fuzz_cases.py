"""The cases of tests/test_fuzz.py and the worker process that runs them.

A case is JSON data: which model, how each input is spoiled (values, dtype, shape, memory layout,
what kind of object it is), how the call's arguments are arranged; or a damaged artifact or cache
folder to load or compile from. The worker (`python -m tests.fuzz_cases`) compiles the models once,
then reads one request a line on stdin, runs it and judges the result against torch:

    right        the answer torch gives (values, shapes, dtypes, NaN where torch has NaN)
    refused      an EclatError, ValueError, TypeError, IndexError or ZeroDivisionError with a message,
                 where refusing is allowed (torch refuses too, or the input is not what the model was
                 compiled for)
    wrong        an answer that is not torch's, or an answer to a call that must be refused
    bad_refusal  a refusal where an answer is required, of the wrong type, or without a message
    raw          any other exception (KeyError, AttributeError, RecursionError, MemoryError, ...)

and writes one JSON answer a line. A segfault, abort or hang kills only the worker: the test
(WorkerClient) reports it as "crash" or "hang" and starts another worker for the next case.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import inspect
import io
import json
import os
import queue
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
import traceback
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GOOD = ("right", "refused")

# --- the models ---------------------------------------------------------------------------------

VALUES = ["normal", "nan", "inf", "special", "zero", "negative", "high", "extreme"]
DTYPES = ["same", "float32", "float64", "float16", "bfloat16", "int64", "int32", "bool", "uint8",
          "complex64"]
SHAPES = ["same", "bigger", "smaller", "extra_dim", "drop_dim", "empty", "scalar"]
LAYOUTS = ["contiguous", "transposed", "strided", "expanded", "offset", "requires_grad", "channels_last",
           "reversed"]
KINDS = ["tensor", "numpy", "parameter", "list", "int", "float", "none", "str", "meta", "numpy_scalar"]
# how a call's arguments are arranged; the first three must be answered (when the inputs are right)
STRUCTURES = ["nested", "flat", "shuffled", "swap_seq", "kwargs", "missing_key", "unknown_key",
              "renamed_key", "dict_as_list", "extra_arg", "missing_arg", "no_args", "wrapped"]
ANSWERED = ("nested", "flat", "shuffled")
VALUE_ERROR = ("missing_key", "unknown_key", "renamed_key")  # refused with a ValueError
REFUSED = ("dict_as_list", "extra_arg", "missing_arg", "no_args", "wrapped")  # refused, any clean error
CALL_MODELS = ["mlp", "conv", "embed", "index", "intdiv", "ranks", "nested"]
ARTIFACT_MODELS = ["mlp", "conv", "embed", "intdiv", "nested"]


def _models() -> dict[str, Any]:
    import torch
    from torch import nn

    class Index(nn.Module):
        def forward(self, x, i, j):
            return x[i], x.gather(1, j)

    class IntDiv(nn.Module):
        def forward(self, a, b):
            return a // b, a % b, torch.div(a, b, rounding_mode="trunc")

    class Ranks(nn.Module):
        def forward(self, x):
            values, indices = torch.sort(x, -1)
            return x.argmax(-1), values, indices, torch.topk(x, 2, -1).values, x.amax(-1)

    class Nested(nn.Module):
        def forward(self, d, pair):
            x, rest = pair
            return {"sum": d["a"] * 2 - d["b"] + x.sum(0), "prod": x * rest[0]}

    def seeded(make):
        def made():
            torch.manual_seed(0)
            return make()
        return made

    # name -> (model, example arguments, the value role of each input in flattened order)
    return {
        "mlp": seeded(lambda: (nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                               (torch.randn(3, 8),), ["float"])),
        # the same model and weights, compiled with an all-zero example: its first layer's weights do not
        # show in the example's output (what checking a cached program against the example cannot see)
        "mlp_zero": seeded(lambda: (nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                                    (torch.zeros(3, 8),), ["float"])),
        "conv": seeded(lambda: (nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU()),
                                (torch.randn(1, 2, 5, 5),), ["float"])),
        "embed": seeded(lambda: (nn.Embedding(10, 4), (torch.tensor([[1, 2, 3], [9, 0, 4]]),), ["index:10"])),
        "index": seeded(lambda: (Index(), (torch.randn(5, 3), torch.tensor([0, 4, -1, 2]),
                                           torch.tensor([[0, 1]] * 5)), ["float", "index_neg:5", "index:3"])),
        "intdiv": seeded(lambda: (IntDiv(), (torch.tensor([7, -7, 9, 3, -4, 0]),
                                             torch.tensor([2, 2, -4, 5, 3, 1])), ["int", "divisor"])),
        "ranks": seeded(lambda: (Ranks(), (torch.randn(3, 5),), ["float"])),
        "nested": seeded(lambda: (Nested(), ({"a": torch.randn(3), "b": torch.randn(3)},
                                             (torch.randn(2, 3), [torch.randn(3)])),
                                  ["float"] * 4)),
    }


# functions of one tensor, compiled with odd example inputs
BODIES = ["ew", "relu", "sum", "amax", "argmax", "sort", "softmax", "cumsum", "where", "matmul", "linear",
          "div", "floordiv"]
EXAMPLE_SHAPES = {"vec": (5,), "mat": (3, 4), "4d": (1, 2, 3, 3), "empty_lead": (0, 4),
                  "empty_last": (3, 0), "scalar": (), "one": (1, 1)}
EXAMPLE_DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "bool"]


def _body(name: str, shape: tuple[int, ...]) -> Any:
    import torch
    from torch import nn

    fns = {"ew": lambda x: x * 2 + 1, "relu": torch.relu, "sum": lambda x: x.sum(-1),
           "amax": lambda x: x.amax(-1), "argmax": lambda x: x.argmax(-1),
           "sort": lambda x: torch.sort(x, -1).values, "softmax": lambda x: torch.softmax(x, -1),
           "cumsum": lambda x: x.cumsum(-1), "where": lambda x: torch.where(x > 0, x, -x),
           "matmul": lambda x: x @ x.transpose(-1, -2), "div": lambda x: x / 3,
           "floordiv": lambda x: x // 3}

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.linear = nn.Linear(shape[-1] if shape else 1, 3) if name == "linear" else None

        def forward(self, x):
            return self.linear(x) if self.linear is not None else fns[name](x)

    return Body().eval()


# --- building spoiled inputs ------------------------------------------------------------------------

def _values(role: str, kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Values for an input of role "float", "int", "divisor", "index:N" (valid 0..N-1) or "index_neg:N"
    (valid -N..N-1), spoiled as kind says (float64 or int64)."""
    n = int(np.prod(shape)) if shape else 1

    def sprinkle(base: np.ndarray, choices: list) -> np.ndarray:
        flat = base.reshape(-1).copy()
        if n:
            hit = rng.random(n) < 0.4
            hit[rng.integers(n)] = True
            flat[hit] = rng.choice(np.array(choices, dtype=base.dtype), int(hit.sum()))
        return flat.reshape(shape)

    if role == "float":
        base = rng.standard_normal(n).reshape(shape)
        return {"normal": lambda: base,
                "nan": lambda: sprinkle(base, [np.nan]),
                "inf": lambda: sprinkle(base, [np.inf, -np.inf]),
                "special": lambda: sprinkle(base, [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-40, 1.0]),
                "zero": lambda: np.zeros(shape),
                "negative": lambda: -np.abs(base),
                "high": lambda: base * 1e4,
                "extreme": lambda: sprinkle(base, [1e30, -1e30, 3e30])}[kind]()
    if role.startswith("index"):
        size = int(role.partition(":")[2])
        low = -size if role.startswith("index_neg") else 0
        base = rng.integers(low, size, n).reshape(shape)
        return {"high": lambda: sprinkle(base, [size, size + 1, 12, 2**31, 2**33]),
                "negative": lambda: sprinkle(base, [low - 1, low - 5, -(2**31) - 1]),
                "extreme": lambda: sprinkle(base, [2**62, -(2**62)]),
                "zero": lambda: np.zeros(shape, np.int64),
                "special": lambda: sprinkle(base, [size - 1, 0, low]),
                }.get(kind, lambda: base)()
    nonzero = rng.integers(1, 10, n).reshape(shape) * rng.choice([-1, 1], n).reshape(shape)
    base = nonzero if role == "divisor" else rng.integers(-9, 10, n).reshape(shape)
    return {"zero": lambda: sprinkle(base, [0]) if role == "divisor" else np.zeros(shape, np.int64),
            "negative": lambda: -np.abs(base) - (role == "divisor"),
            "high": lambda: sprinkle(base, [2**31 - 1, 2**31, 2**40]),
            "extreme": lambda: sprinkle(base, [2**62, -(2**62), 2**63 - 1]),
            "special": lambda: sprinkle(base, [1, -1, 2**31 - 1, -(2**31)]),
            }.get(kind, lambda: base)()


def _shape(shape: tuple[int, ...], how: str) -> tuple[int, ...]:
    if how == "bigger":
        return (shape[0] + 1, *shape[1:]) if shape else (2,)
    if how == "smaller":
        return (shape[0] - 1, *shape[1:]) if shape and shape[0] > 1 else (*shape, 2)
    if how == "extra_dim":
        return (1, *shape)
    if how == "drop_dim":
        return shape[1:] if shape else (1,)
    if how == "empty":
        return (*shape[:-1], 0) if shape else (0,)
    if how == "scalar":
        return ()
    return shape


def make_leaf(example: Any, role: str, spoil: dict[str, str], rng: np.random.Generator) -> tuple[Any, Any]:
    """(the input as given to the call, the same data as a torch tensor or None where torch cannot
    take it as a tensor)."""
    import torch

    shape = _shape(tuple(example.shape), spoil.get("shape", "same"))
    values = _values(role, spoil.get("values", "normal"), shape, rng)
    dtype = example.dtype if spoil.get("dtype", "same") == "same" else getattr(torch, spoil["dtype"])
    t = torch.from_numpy(np.asarray(values))
    if dtype == torch.bool:
        t = t != 0
    elif not dtype.is_floating_point and not dtype.is_complex and t.dtype.is_floating_point:
        t = torch.nan_to_num(t, nan=0.0, posinf=2**31 - 1, neginf=-(2**31)).to(dtype)
    else:
        t = t.to(dtype)
    layout = spoil.get("layout", "contiguous")
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout in ("strided", "transposed") and t.dim() >= 1:
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        t = wide[..., ::2]
    elif layout == "expanded" and t.numel():
        t = t.reshape(-1)[:1].reshape([1] * t.dim()).expand(t.shape)
    elif layout == "offset":
        store = torch.zeros(t.numel() + 3, dtype=t.dtype)
        store[3:] = t.reshape(-1)
        t = store[3:].view(t.shape)
    elif layout == "requires_grad" and (t.dtype.is_floating_point or t.dtype.is_complex):
        t = t.clone().requires_grad_(True)
    elif layout == "channels_last" and t.dim() == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    kind = spoil.get("kind", "tensor")
    tensor = t.detach()
    if kind == "tensor" or (kind == "numpy" and t.dtype == torch.bfloat16):
        return t, tensor
    if kind == "numpy":
        a = t.detach().numpy()
        if layout == "reversed" and a.ndim:
            a = a[::-1].copy()[::-1]  # a negative stride
        elif layout == "reversed":
            a = np.asfortranarray(a)
        return a, torch.from_numpy(np.array(a))
    if kind == "parameter":
        return (torch.nn.Parameter(t.detach().clone(), requires_grad=t.dtype.is_floating_point), tensor)
    if kind == "list":
        return t.tolist(), None
    if kind == "meta":
        return torch.empty(t.shape, dtype=t.dtype, device="meta"), None
    return {"int": 3, "float": 1.5, "none": None, "str": "x", "numpy_scalar": np.float32(1.0)}[kind], None


def flatten(x: Any) -> list[Any]:
    """The leaves of nested tuples, lists and dicts, in order (as eclat orders a call's inputs)."""
    if isinstance(x, (list, tuple)):
        return [leaf for a in x for leaf in flatten(a)]
    if isinstance(x, dict):
        return [leaf for a in x.values() for leaf in flatten(a)]
    return [x]


def rebuild(example: Any, leaves: list[Any], how: str = "nested", rng: random.Random | None = None) -> Any:
    """example's nesting with leaves in place of its tensors; how="shuffled" puts each dict's keys in
    another order, "swap_seq" makes tuples lists and lists tuples."""
    it = iter(leaves)

    def go(x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            kids = [go(a) for a in x]
            if how == "swap_seq":
                return tuple(kids) if isinstance(x, list) else kids
            return type(x)(kids)
        if isinstance(x, dict):
            items = [(k, go(v)) for k, v in x.items()]
            if how == "shuffled" and len(items) > 1:
                first = items[:]
                while items == first:
                    (rng or random.Random(0)).shuffle(items)
            return dict(items)
        return next(it)
    return go(example)


def _first_dict(args: Any) -> dict | None:
    if isinstance(args, dict):
        return args
    if isinstance(args, (list, tuple)):
        for a in args:
            d = _first_dict(a)
            if d is not None:
                return d
    return None


def arrange(example: tuple, leaves: list[Any], how: str, rng: random.Random,
            names: list[str]) -> tuple[tuple, dict]:
    """The call's positional and keyword arguments for a STRUCTURES entry (names: the forward's
    parameters, for "kwargs")."""
    if how == "flat":
        return tuple(leaves), {}
    if how in ("shuffled", "swap_seq"):
        return tuple(rebuild(example, leaves, how, rng)), {}
    args = list(rebuild(example, leaves))
    if how in ("missing_key", "unknown_key", "renamed_key", "dict_as_list"):
        d = _first_dict(args)
        if d is None:  # no dict in this model's inputs: an argument too few or too many
            how = "missing_arg" if how != "unknown_key" else "extra_arg"
        else:
            key = next(iter(d))
            if how == "missing_key":
                del d[key]
            elif how == "unknown_key":
                d["zz"] = leaves[0]
            elif how == "renamed_key":
                d[key + "_"] = d.pop(key)
            else:
                return tuple([list(d.values()) if a is d else a for a in args]), {}
    if how == "extra_arg":
        return (*args, leaves[0]), {}
    if how == "missing_arg":
        return tuple(args[:-1]), {}
    if how == "no_args":
        return (), {}
    if how == "wrapped":
        return (tuple(args),), {}
    if how == "kwargs":
        return (), dict(zip(names, args))
    return tuple(args), {}


# --- judging ---------------------------------------------------------------------------------------

def allowed() -> tuple[type, ...]:
    import eclat

    return (eclat.EclatError, ValueError, TypeError, IndexError, ZeroDivisionError)


def _tb(e: BaseException) -> str:
    return "".join(traceback.format_exception(e)[-6:])[-3000:]


def _leaves_of(x: Any) -> list[Any]:
    import torch

    if isinstance(x, (np.ndarray, torch.Tensor)):
        return [x]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in _leaves_of(v)]
    if isinstance(x, (list, tuple)):
        return [leaf for v in x for leaf in _leaves_of(v)]
    return [x]


def _structure(x: Any) -> Any:
    import torch

    if isinstance(x, (np.ndarray, torch.Tensor)):
        return "*"
    if isinstance(x, dict):
        return {k: _structure(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_structure(v) for v in x])
    return repr(x)


def mismatch(got: Any, want: Any, scale: float, as_torch: bool) -> str | None:
    """Why got is not torch's answer want (None when it is): count, structure (for a torch call),
    shape, dtype, values (NaN and inf where torch has them; finite values within a tolerance
    that grows with the inputs' magnitude `scale`)."""
    import torch

    gl, wl = _leaves_of(got), _leaves_of(want)
    if len(gl) != len(wl):
        return f"{len(gl)} outputs, torch gives {len(wl)}"
    if as_torch and len(wl) > 1 and _structure(got) != _structure(want):
        return f"outputs nested as {_structure(got)}, torch nests them as {_structure(want)}"
    for k, (g, w) in enumerate(zip(gl, wl)):
        if not isinstance(g, (np.ndarray, torch.Tensor)):
            return f"output {k} is a {type(g).__name__}"
        if as_torch and not isinstance(g, torch.Tensor):
            return f"output {k} is a {type(g).__name__} for a call with tensors"
        if tuple(g.shape) != tuple(w.shape):
            return f"output {k} has shape {list(g.shape)}, torch gives {list(w.shape)}"
        wdt = str(w.dtype).removeprefix("torch.")
        gdt = str(g.dtype).removeprefix("torch.")
        if gdt != wdt and not (wdt == "bfloat16" and not as_torch):
            return f"output {k} has dtype {gdt}, torch gives {wdt}"
        ga = (g.detach().float().numpy() if gdt == "bfloat16" else g.detach().numpy()) \
            if isinstance(g, torch.Tensor) else np.asarray(g)
        wa = w.detach().float().numpy() if wdt == "bfloat16" else w.detach().numpy()
        if wa.dtype.kind in "fc":
            wide = np.complex128 if wa.dtype.kind == "c" else np.float64
            ga64, wa64 = ga.astype(wide), wa.astype(wide)
            low = wdt in ("float16", "bfloat16")
            rtol, atol = (2e-2, 2e-2 * scale) if low else (1e-4, 1e-4 * scale)
            nan_g, nan_w = np.isnan(ga64), np.isnan(wa64)
            fin = np.isfinite(wa64)
            for bad in (nan_g != nan_w, (ga64 != wa64) & ~fin & ~nan_w):
                if bad.any():
                    at = tuple(np.argwhere(bad)[0])
                    return f"output {k}[{', '.join(map(str, at))}] is {ga[at]}, torch gives {wa[at]}"
            bad = fin & ~(np.abs(ga64 - wa64) <= atol + rtol * np.abs(wa64))
        else:
            bad = ga != wa
        if bad.any():
            at = np.argwhere(bad)[0] if bad.ndim else ()
            where = f"[{', '.join(map(str, at))}]" if len(at) else ""
            return (f"output {k}{where} is {ga[tuple(at)]}, torch gives {wa[tuple(at)]} "
                    f"({int(bad.sum())} of {bad.size} differ)")
    return None


def _refused(e: BaseException, expect: str, want: Any) -> dict[str, Any]:
    """Judge an exception: a clean refusal, a refusal of the wrong kind, or a raw internal error."""
    import eclat

    if isinstance(e, KeyboardInterrupt):
        raise e
    text = f"{type(e).__name__}: {e}"[:500]
    if not isinstance(e, allowed()):
        return {"outcome": "raw", "detail": text, "tb": _tb(e)}
    if not str(e).strip():
        return {"outcome": "bad_refusal", "detail": f"{type(e).__name__} with an empty message", "tb": _tb(e)}
    if expect == "answer" and not isinstance(want, BaseException):
        return {"outcome": "bad_refusal", "detail": f"refused a call torch answers: {text}", "tb": _tb(e)}
    if expect == "value_error" and not isinstance(e, ValueError):
        return {"outcome": "bad_refusal", "detail": f"expected a ValueError, given {text}", "tb": _tb(e)}
    if expect == "eclat_error" and not isinstance(e, eclat.EclatError):
        return {"outcome": "bad_refusal", "detail": f"expected an EclatError, given {text}", "tb": _tb(e)}
    return {"outcome": "refused", "detail": text}


def attempt(fn: Any, expect: str = "either") -> tuple[Any, dict[str, Any] | None]:
    """(fn(), None), or (None, the judged exception) when it raises."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(), None
    except BaseException as e:  # noqa: BLE001 - what this test is for: any exception is judged
        return None, _refused(e, expect, None)


def judge(call: Any, expect: str, want: Any, scale: float, as_torch: bool) -> dict[str, Any]:
    """Run call() and judge it. expect: "answer" (torch's answer required), "refuse" (a clean refusal
    required), "value_error" (a ValueError required), "either". want: torch's answer, or the exception
    torch raises (then eclat must refuse too), or None when there is nothing to compare with (then
    eclat must refuse)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = call()
    except BaseException as e:  # noqa: BLE001 - what this test is for: any exception is judged
        return _refused(e, expect, want)
    if expect in ("refuse", "value_error"):
        return {"outcome": "wrong", "detail": "answered a call that must be refused"}
    if isinstance(want, NotImplementedError):  # torch has no kernel for this dtype: nothing to compare
        return {"outcome": "right", "detail": f"unverified: torch raises {type(want).__name__}: {want}"}
    if isinstance(want, BaseException):
        return {"outcome": "wrong",
                "detail": f"answered where torch raises {type(want).__name__}: {str(want)[:300]}"}
    if want is None:
        return {"outcome": "wrong", "detail": "answered a call with inputs that are not arrays"}
    why = mismatch(got, want, scale, as_torch)
    return {"outcome": "wrong", "detail": why} if why else {"outcome": "right"}


def worst(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The first answer that is not good, else the first."""
    return next((a for a in answers if a["outcome"] not in GOOD), answers[0])


def _scale(tensors: list[Any]) -> float:
    """The largest finite magnitude among the inputs (at least 1): the tolerance grows with it."""
    import torch

    scale = 1.0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel():
            finite = t.detach().float()[torch.isfinite(t.detach().float())]
            if finite.numel():
                scale = max(scale, float(finite.abs().max()))
    return scale


def _torch_answer(model: Any, args: tuple) -> Any:
    """What torch gives for args, or the exception it raises."""
    import torch

    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model(*args)
    except Exception as e:  # noqa: BLE001 - torch refusing is an answer too
        return e


# --- the worker ------------------------------------------------------------------------------------

class Worker:
    """Runs requests (op_<name> for {"op": name}): the models made and compiled once, on first use."""

    def __init__(self) -> None:
        self.models = _models()
        self.compiled: dict[str, Any] = {}
        self.made: dict[str, tuple] = {}

    def model(self, name: str) -> tuple[Any, tuple, list[str]]:
        if name not in self.made:
            model, example, roles = self.models[name]()
            self.made[name] = (model.eval(), example, roles)
        return self.made[name]

    def compiled_model(self, name: str) -> Any:
        import eclat

        if name not in self.compiled:
            model, example, _ = self.model(name)
            self.compiled[name] = eclat.compile(model, example, autotune="none", quiet=True)
        return self.compiled[name]

    def fresh(self, name: str, seed: int = 7) -> tuple[list[Any], tuple]:
        """Valid inputs for model name (flat leaves, and nested as the example)."""
        _, example, roles = self.model(name)
        rng = np.random.default_rng(seed)
        leaves = [make_leaf(ex, role, {}, rng)[0] for ex, role in zip(flatten(example), roles)]
        return leaves, tuple(rebuild(example, leaves))

    # requests -----------------------------------------------------------------------------------------

    def op_ping(self, req: dict) -> dict:
        for name in req.get("compile", []):
            self.compiled_model(name)
        return {"outcome": "right"}

    def op_call(self, req: dict) -> dict:
        """A compiled model called with spoiled inputs arranged as case["structure"] says."""
        case = req["case"]
        model, example, roles = self.model(case["model"])
        fast = self.compiled_model(case["model"])
        spoils = case["leaves"]
        given, tensors = [], []
        for k, (ex, role) in enumerate(zip(flatten(example), roles)):
            g, t = make_leaf(ex, role, spoils[k % len(spoils)], np.random.default_rng(case["seed"] + k))
            given.append(g)
            tensors.append(t)
        how = case.get("structure", "nested")
        names = list(inspect.signature(model.forward).parameters)
        args, kwargs = arrange(example, given, how, random.Random(case["seed"]), names)
        shapes_ok = all(t is not None and t.shape == ex.shape and t.dtype == ex.dtype
                        for t, ex in zip(tensors, flatten(example)))
        kinds_ok = all(s.get("kind", "tensor") in ("tensor", "numpy", "parameter")
                       for s in (spoils[k % len(spoils)] for k in range(len(given))))
        want = None
        if all(t is not None for t in tensors):
            want = _torch_answer(model, tuple(rebuild(example, tensors)))
        if how in VALUE_ERROR and _first_dict(example) is not None:
            expect = "value_error"
        elif how in REFUSED or how in VALUE_ERROR:
            expect = "refuse"
        elif how in ANSWERED and shapes_ok and kinds_ok:
            expect = "answer"
        else:
            expect = "either"
        import torch

        as_torch = any(isinstance(g, torch.Tensor) for g in given)
        return judge(lambda: fast(*args, **kwargs), expect, want, _scale(tensors), as_torch)

    def op_compile(self, req: dict) -> dict:
        """A model compiled with an odd example input, then called with it and with fresh inputs."""
        import torch

        import eclat

        case = req["case"]
        shape = EXAMPLE_SHAPES[case["shape"]]
        dtype = getattr(torch, case["dtype"])
        model = _body(case["body"], shape)
        role = "float" if dtype.is_floating_point else "int"
        spoil = {**case["leaf"], "dtype": case["dtype"], "kind": "tensor"}
        example = torch.zeros(shape, dtype=dtype)
        x, xt = make_leaf(example, role, spoil, np.random.default_rng(case["seed"]))
        fast, refused = attempt(lambda: eclat.compile(model, (x,), autotune="none", quiet=True))
        if refused is not None:
            return refused
        rng = np.random.default_rng(case["seed"] + 1)
        fresh, ft = make_leaf(example, role, {"dtype": case["dtype"]}, rng)
        answers = [judge(lambda: fast(x), "answer", _torch_answer(model, (xt,)), _scale([xt]), True),
                   judge(lambda: fast(fresh), "answer", _torch_answer(model, (ft,)), _scale([ft]), True)]
        if dtype != torch.bfloat16:
            answers.append(judge(lambda: fast(ft.numpy()), "answer", _torch_answer(model, (ft,)),
                                 _scale([ft]), False))
        return worst(answers)

    def op_save(self, req: dict) -> dict:
        fast = self.compiled_model(req["model"])
        fast.save(req["path"])
        leaves, _ = self.fresh(req["model"])
        np.savez(req["path"] + ".inputs.npz", *[np.asarray(x) for x in leaves])
        return {"outcome": "right"}

    def op_load(self, req: dict) -> dict:
        """A (damaged) artifact: an EclatError at load, or right answers (or a clean refusal) when run
        with the model's own inputs, and with inputs shaped as the artifact now says."""
        import torch

        import eclat

        name = req["model"]
        model, example, _ = self.model(name)
        intact = req.get("intact", False)  # an intact artifact must load and answer
        expect = "answer" if intact else "either"
        fast, refused = attempt(lambda: eclat.load(req["path"]), "answer" if intact else "eclat_error")
        if refused is not None:
            return refused
        leaves, args = self.fresh(name)
        want = _torch_answer(model, args)
        scale = _scale(leaves)
        answers = [judge(lambda: fast(*[t.numpy() for t in leaves]), expect, want, scale, False),
                   judge(lambda: fast(*leaves), expect, want, scale, True),
                   judge(lambda: fast(*args), expect, want, scale, True)]  # nested as the example
        try:  # inputs as the artifact describes them, where that differs from the model's own
            specs = [(tuple(int(n) for n in s.shape), np.dtype(s.dtype.np)) for s in fast.inputs]
            own = [(tuple(t.shape), t.numpy().dtype) for t in leaves]
        except Exception as e:  # noqa: BLE001
            return worst([*answers, {"outcome": "raw", "detail": f"reading .inputs: {type(e).__name__}: {e}",
                                     "tb": _tb(e)}])
        if specs != own and len(specs) == len(own) and all(0 <= np.prod(s) < 1e7 for s, _ in specs):
            rng = np.random.default_rng(3)
            theirs = [(rng.standard_normal(s) if d.kind == "f" else rng.integers(0, 3, s)).astype(d)
                      for s, d in specs]
            tensors = [torch.from_numpy(a) for a in theirs]
            want2 = _torch_answer(model, tuple(rebuild(example, tensors)))
            answers.append(judge(lambda: fast(*theirs), "either", want2, _scale(tensors), False))
        return worst(answers)

    def op_warm_cache(self, req: dict) -> dict:
        """Fill a cache folder (device, tuning database, program cache) with one compile."""
        import eclat

        model, example, _ = self.model(req["model"])
        with _cache_dir(req["cache"]):
            eclat.compile(model, example, autotune="fast", k=2, quiet=True)
        return {"outcome": "right",
                "files": sorted(str(p.relative_to(req["cache"])) for p in Path(req["cache"]).rglob("*")
                                if p.is_file())}

    def op_cache(self, req: dict) -> dict:
        """A compile with a (damaged) cache folder must still give the right answer."""
        import eclat

        name = req["model"]
        model, example, _ = self.model(name)
        with _cache_dir(req["cache"]):
            fast, refused = attempt(lambda: eclat.compile(model, example, autotune="fast", k=2, quiet=True))
        if refused is not None:
            return refused if refused["outcome"] != "refused" else {
                "outcome": "bad_refusal", "detail": "refused to compile: " + refused["detail"]}
        leaves, args = self.fresh(name, seed=11)
        return judge(lambda: fast(*args), "answer", _torch_answer(model, args), _scale(leaves), True)


@contextlib.contextmanager
def _cache_dir(folder: str) -> Any:
    """ECLAT_CACHE_DIR set to folder for a while (the way a user points eclat at a cache)."""
    before = os.environ.get("ECLAT_CACHE_DIR")
    os.environ["ECLAT_CACHE_DIR"] = folder
    try:
        yield
    finally:
        if before is None:
            del os.environ["ECLAT_CACHE_DIR"]
        else:
            os.environ["ECLAT_CACHE_DIR"] = before


def main() -> None:
    faulthandler.enable()  # a crash prints the Python stack to stderr, which the test reads back
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed (by eclat, LLVM, a C library) goes to stderr, not the answers
    sys.stdout = sys.stderr
    worker = Worker()
    for line in sys.stdin:
        req = json.loads(line)
        print(f"=== {line.strip()[:2000]}", file=sys.stderr, flush=True)
        try:
            answer = getattr(worker, "op_" + req["op"])(req)
        except Exception as e:  # noqa: BLE001 - a fault of the test's own code, not of eclat
            answer = {"outcome": "harness", "detail": f"{type(e).__name__}: {e}",
                      "tb": traceback.format_exc()[-3000:]}
        proto.write(json.dumps(answer, default=str) + "\n")


# --- the test's side: a worker that may die ---------------------------------------------------------

class WorkerClient:
    """Sends requests to a worker process, starting one when there is none (the first, or after a
    crash or hang). Every request and answer is kept in .log."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None):
        self.folder = folder
        self.stderr = folder / "worker.stderr"
        self.env = {**os.environ, "ECLAT_CACHE_DIR": str(folder / "cache"), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()
        self.log: list[tuple[dict, dict]] = []
        self.starts = 0

    def _start(self) -> None:
        self.starts += 1
        err = open(self.stderr, "ab")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fuzz_cases"], cwd=ROOT, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        err.close()
        self.lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()

    @staticmethod
    def _read(proc: subprocess.Popen, lines: queue.Queue) -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def request(self, req: dict, timeout: float = 120) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        start = self.stderr.stat().st_size if self.stderr.exists() else 0
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=timeout)
        except (BrokenPipeError, OSError):
            line = None
        except queue.Empty:
            self.proc.kill()
            self.proc.wait()
            answer = {"outcome": "hang", "detail": f"no answer in {timeout} s", "tb": self._err(start)}
            self.log.append((req, answer))
            return answer
        if line is None:
            rc = self.proc.wait()
            answer = {"outcome": "crash", "detail": f"the worker died (exit status {rc})",
                      "tb": self._err(start)}
        else:
            answer = json.loads(line)
        self.log.append((req, answer))
        return answer

    def _err(self, start: int) -> str:
        with open(self.stderr, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def explain(req: dict, answer: dict) -> str:
    """A failed case, for an assertion message."""
    return (f"{answer['outcome']}: {answer.get('detail')}\nrequest: {json.dumps(req)}\n"
            f"{answer.get('tb', '')}")


# --- damaging files --------------------------------------------------------------------------------

JSON_VALUES = [None, True, 0, 1, -1, 7, 2**31, 2**63, -(2**63), 1.5, 1e308, "", "x", "float32", [], {},
               [1, 2], {"a": 1}, "__DEEP__"]
DEEP = 100_000


def dump_json(obj: Any) -> bytes:
    """obj as JSON, "__DEEP__" strings replaced by lists nested DEEP levels (json.dumps cannot write them)."""
    return json.dumps(obj).replace('"__DEEP__"', "[" * DEEP + "]" * DEEP).encode()


def edit_json(obj: Any, edit: dict[str, Any]) -> Any:
    """A copy of obj with one edit: start at edit["root"] (a dotted path of keys), walk down choosing
    children by edit["path"] (indices taken modulo the number of children), then edit["op"] the
    node reached: "set" it to edit["value"], "delete" it, "scale" a number, "dup" or "swap" list items.
    A root that does not exist leaves obj as it is."""
    obj = copy.deepcopy(obj)
    parent, key, node = None, None, obj
    for part in [p for p in edit.get("root", "").split(".") if p]:
        if isinstance(node, dict) and part in node:
            parent, key, node = node, part, node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            parent, key, node = node, int(part), node[int(part)]
        else:  # no such node: nothing to edit
            return obj
    for choice in edit.get("path", []):
        if isinstance(node, dict) and node:
            k = sorted(node)[choice % len(node)]
        elif isinstance(node, list) and node:
            k = choice % len(node)
        else:
            break
        parent, key, node = node, k, node[k]
    op, value = edit.get("op", "set"), edit.get("value")
    if op == "scale" and isinstance(node, (int, float)) and not isinstance(node, bool):
        value = {0: node * 2, 1: node // 2, 2: node + 1, 3: node - 1, 4: -node, 5: node * 2**20}[
            edit.get("factor", 0) % 6]
    elif op == "dup" and isinstance(node, list) and node:
        value = node + node[:1]
    elif op == "swap" and isinstance(node, list) and len(node) > 1:
        value = node[::-1]
    elif op == "delete":
        if parent is None:
            return {}
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
        return obj
    elif op != "set":
        value = node  # an op that does not apply here leaves the node as it was
    if parent is None:
        return value
    parent[key] = value
    return obj


def zip_members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n: z.read(n) for n in z.namelist()}


def write_zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def damage_zip(data: bytes, damage: dict[str, Any], json_member: str) -> bytes:
    """data (a zip file) damaged: "truncate" at a fraction, "flip" a byte of the file or of one
    member's stored bytes (zip's CRC may catch it), or, written again as a valid zip: "member_flip",
    "member_garbage", "member_truncate", "member_drop" of one member, "member_weights" (the tensors of
    a safetensors member whose names start with damage["prefix"] scaled by damage["factor"]),
    "json_edit" of json_member (see edit_json)."""
    kind = damage["kind"]
    if kind == "truncate":
        return data[:int(len(data) * damage["at"])]
    if not data:
        return data
    if kind != "flip" or damage.get("member"):
        try:
            members = zip_members(data)
        except (zipfile.BadZipFile, zlib.error, KeyError, EOFError, ValueError, OSError, NotImplementedError):
            return data  # damaged already past reading: a second damage changes nothing
    if kind == "flip":  # anywhere in the file, or (given "member") in that member's stored bytes
        start, size = 0, len(data)
        if damage.get("member"):
            if damage["member"] not in members:
                return data
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                info = z.getinfo(damage["member"])
            head = info.header_offset  # the local header: 30 bytes, then the name and the extra field
            name_len = int.from_bytes(data[head + 26:head + 28], "little")
            extra_len = int.from_bytes(data[head + 28:head + 30], "little")
            start, size = head + 30 + name_len + extra_len, max(info.compress_size, 1)
        at = (start + int(size * damage["at"])) % len(data)
        return data[:at] + bytes([data[at] ^ damage.get("mask", 0xFF)]) + data[at + 1:]
    if kind == "json_edit":
        try:
            manifest = json.loads(members[json_member])
        except (KeyError, ValueError, RecursionError):  # damaged already (or nested too deep to edit)
            return data
        members[json_member] = dump_json(edit_json(manifest, damage["edit"]))
        return write_zip(members)
    names = sorted(members)
    if not names:
        return data
    name = damage["member"] if damage.get("member") in members else names[damage.get("index", 0) % len(names)]
    body = members[name]
    if kind == "member_weights" and name.endswith(".safetensors"):  # tensors named prefix... scaled
        from safetensors.numpy import load, save

        try:
            weights = load(body)
        except Exception:  # noqa: BLE001 - damaged already: a second damage changes nothing
            return data
        for key, w in weights.items():
            if key.startswith(damage.get("prefix", "")):
                weights[key] = (w * damage.get("factor", -3)).astype(w.dtype)
        members[name] = save(weights) if weights else b""
    elif kind == "member_flip" and body:
        at = int(len(body) * damage["at"]) % len(body)
        members[name] = body[:at] + bytes([body[at] ^ damage.get("mask", 0xFF)]) + body[at + 1:]
    elif kind == "member_garbage":
        members[name] = random.Random(damage.get("seed", 0)).randbytes(damage.get("size", 64))
    elif kind == "member_truncate":
        members[name] = body[:int(len(body) * damage["at"])]
    elif kind == "member_drop":
        del members[name]
    return write_zip(members)


def damage_file(path: Path, damage: dict[str, Any]) -> None:
    """A cache file damaged in place: "garbage", "truncate", "empty", "flip", "directory" (a folder in
    its place), "json_edit" (a JSON file), "db_edit" (every schedule in a tuning database edited),
    or a zip damage (damage_zip) for a program cache entry."""
    kind = damage["kind"]
    data = path.read_bytes()
    if kind == "garbage":
        path.write_bytes(random.Random(damage.get("seed", 0)).randbytes(damage.get("size", 64)))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "directory":
        path.unlink()
        (path / "inside").mkdir(parents=True)
    elif kind == "json_edit" and path.suffix == ".json":
        try:
            path.write_bytes(dump_json(edit_json(json.loads(data), damage["edit"])))
        except (ValueError, RecursionError):  # damaged already: a second damage changes nothing
            pass
    elif kind == "db_edit" and path.suffix == ".db":
        conn = sqlite3.connect(path)
        try:
            rows = conn.execute("SELECT rowid, schedule FROM tuning").fetchall()
        except sqlite3.Error:  # not a tuning database any more: a second damage changes nothing
            rows = []
        for rowid, schedule in rows:
            try:
                edited = edit_json(json.loads(schedule), damage["edit"])
            except (ValueError, RecursionError):
                continue
            conn.execute("UPDATE tuning SET schedule = ? WHERE rowid = ?",
                         (dump_json(edited).decode(), rowid))
        conn.commit()
        conn.close()
    elif path.suffix == ".zip" and kind in ("truncate", "flip", "json_edit", "member_flip", "member_garbage",
                                            "member_truncate", "member_drop", "member_weights"):
        path.write_bytes(damage_zip(data, damage, "program.json"))
    elif kind == "truncate":
        path.write_bytes(data[:int(len(data) * damage.get("at", 0.5))])
    elif kind == "flip" and data:
        at = int(len(data) * damage.get("at", 0.5)) % len(data)
        path.write_bytes(data[:at] + bytes([data[at] ^ damage.get("mask", 0xFF)]) + data[at + 1:])


def copy_cache(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("lib"))


if __name__ == "__main__":
    main()
