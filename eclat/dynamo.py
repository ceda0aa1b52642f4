"""`torch.compile(model, backend="eclat")`.

Installed eclat registers the backend through the `torch_dynamo_backends` entry point
(pyproject.toml), so torch finds it by name. From a source checkout without installing,
`import eclat.dynamo` (or `eclat.dynamo.register()`) registers it.

Dynamo hands over each captured FX graph with example inputs; eclat compiles it
(default: CPU, no schedule search, so that the first call stays quick). A graph eclat
cannot compile runs in PyTorch, with a warning naming why.

When a size changes, dynamo recompiles the graph with that size symbolic (its inputs then include
the size itself): eclat compiles it once for every size up to `max_size` (default MAX_SIZE; buffers
are sized for it), and a call beyond that runs in PyTorch.

    torch.compile(model, backend="eclat", options={"target": "cpu", "autotune": "fast"})
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

NAME = "eclat"
OPTIONS = ("target", "autotune", "threads", "k", "max_size")
MAX_SIZE = 4096  # the default bound of a size dynamo made symbolic


def eclat_backend(gm: Any, example_inputs: list[Any], options: dict[str, Any] | None = None,
                  mode: str | None = None) -> Callable[..., Any]:
    """A dynamo backend: FX graph + example inputs -> a callable returning the graph's outputs.
    torch.compile passes its `options` dict through; `mode` is not used."""
    import torch

    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"eclat backend: unknown options {unknown}; expected some of {list(OPTIONS)}")
    max_size = int(options.pop("max_size", MAX_SIZE))
    sized = _symbolic(gm, example_inputs, max_size)
    if sized is None and not all(isinstance(x, torch.Tensor) for x in example_inputs):
        kinds = sorted({type(x).__name__ for x in example_inputs if not isinstance(x, torch.Tensor)})
        warnings.warn(f"eclat: graph has non-tensor inputs ({', '.join(kinds)}); running it in PyTorch",
                      stacklevel=2)
        return gm.forward
    settings = {"target": "cpu", "autotune": "none", **options}
    if sized is not None:
        return _sized_runner(gm, example_inputs, sized, settings)
    tensors, made = list(example_inputs), []

    def run(*args: Any) -> Any:
        if not made:  # at the first call: torch.export cannot run while dynamo builds a frame's guards
            made.append(_compiled(gm, tensors, None, settings))
        if made[0] is None:
            return gm.forward(*args)
        out = made[0](*args)
        return out if isinstance(out, (tuple, list)) else (out,)  # dynamo expects a sequence

    return run


def _compiled(model: Any, tensors: list[Any], dynamic: Any, settings: dict[str, Any]) -> Any:
    """eclat's compile of model, or None (with a warning naming why: it then runs in PyTorch)."""
    from . import compile as eclat_compile

    try:
        return eclat_compile(model, tuple(tensors), quiet=True, dynamic_shapes=dynamic, **settings)
    except Exception as e:  # any graph eclat cannot take must still run: in PyTorch, with a reason
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        warnings.warn(f"eclat: falling back to PyTorch for this graph: {type(e).__name__}: {reason}",
                      stacklevel=3)
        return None


def _sized_runner(gm: Any, example_inputs: list[Any], sized: tuple[Any, list[Any], Any],
                  settings: dict[str, Any]) -> Callable[..., Any]:
    """The graph with symbolic sizes, compiled at its first call (torch.export cannot run while
    dynamo is still building the frame's guards) and called with its tensors alone; a call with a
    size beyond the bound runs in PyTorch."""
    import torch

    model, tensors, dynamic = sized
    taken = [k for k, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
    made: list[Any] = []

    def run(*args: Any) -> Any:
        if not made:
            made.append(_compiled(model, tensors, dynamic, settings))
        if made[0] is None:
            return gm.forward(*args)
        try:
            out = made[0](*(args[k] for k in taken))
        except ValueError:  # a size beyond the bound eclat compiled for
            return gm.forward(*args)
        return out if isinstance(out, (tuple, list)) else (out,)

    return run


def _symbolic(gm: Any, example_inputs: list[Any], max_size: int) -> tuple[Any, list[Any], Any] | None:
    """For a graph whose inputs include sizes (dynamo's symbolic shapes): (a module taking only its
    tensors, which reads each size off the tensor dimension it is, the tensors, and
    torch.export's dynamic_shapes for them, each size bounded by max_size); None for another
    graph, or where a size is not a tensor's dimension."""
    import torch
    from torch.export import Dim

    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if all(isinstance(x, torch.Tensor) for x in example_inputs) or len(places) != len(example_inputs) or \
            not all(isinstance(x, (torch.Tensor, torch.SymInt)) for x in example_inputs):
        return None
    tensor_of = {k: j for j, k in enumerate([k for k, x in enumerate(example_inputs)
                                             if isinstance(x, torch.Tensor)])}
    where: dict[str, tuple[int, int]] = {}  # a size's name -> (tensor, dimension) it is
    for k, j in tensor_of.items():
        for d, n in enumerate(getattr(places[k].meta.get("example_value"), "shape", ())):
            if isinstance(n, torch.SymInt):
                where.setdefault(str(n), (j, d))
    reads = {k: where.get(str(x)) for k, x in enumerate(example_inputs) if k not in tensor_of}
    if None in reads.values():
        return None
    tensors = [example_inputs[k] for k in tensor_of]
    # AUTO: a size dynamo made symbolic that the graph pins (a Linear's features) becomes static
    dims = {name: Dim.AUTO(min=2, max=max(max_size, int(tensors[j].shape[d])))
            for name, (j, d) in where.items()}
    dynamic = tuple({d: dims[name] for name, (jj, d) in where.items() if jj == j} or None
                    for j in range(len(tensors)))

    class Sized(torch.nn.Module):
        """gm with its size inputs read off its tensors."""

        def __init__(self) -> None:
            super().__init__()
            self.gm = gm

        def forward(self, *ts: Any) -> Any:
            return self.gm(*(ts[tensor_of[k]] if k in tensor_of else ts[reads[k][0]].shape[reads[k][1]]
                             for k in range(len(example_inputs))))
    return Sized(), tensors, (dynamic,)  # forward(*ts): export sees one argument, a tuple


def register() -> None:
    """Register the backend with torch._dynamo unless torch already knows it (entry point)."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    if NAME not in list_backends(exclude_tags=()):
        register_backend(eclat_backend, name=NAME)


register()
