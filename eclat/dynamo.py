"""`torch.compile(model, backend="eclat")`.

Installed eclat registers the backend through the `torch_dynamo_backends` entry point
(pyproject.toml), so torch finds it by name. From a source checkout without installing,
`import eclat.dynamo` (or `eclat.dynamo.register()`) registers it.

Dynamo hands over each captured FX graph with example inputs; eclat compiles it
(default: CPU, no schedule search, so that the first call stays quick). A graph eclat
cannot compile runs in PyTorch, with a warning naming why.

    torch.compile(model, backend="eclat", options={"target": "cpu", "autotune": "fast"})
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

NAME = "eclat"
OPTIONS = ("target", "autotune", "threads", "k")


def eclat_backend(gm: Any, example_inputs: list[Any], options: dict[str, Any] | None = None,
                  mode: str | None = None) -> Callable[..., Any]:
    """A dynamo backend: FX graph + example inputs -> a callable returning the graph's outputs.
    torch.compile passes its `options` dict through; `mode` is not used."""
    import torch

    from . import compile as eclat_compile

    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"eclat backend: unknown options {unknown}; expected some of {list(OPTIONS)}")
    if not all(isinstance(x, torch.Tensor) for x in example_inputs):
        kinds = sorted({type(x).__name__ for x in example_inputs if not isinstance(x, torch.Tensor)})
        warnings.warn(f"eclat: graph has non-tensor inputs ({', '.join(kinds)}, e.g. dynamic shapes); "
                      "running it in PyTorch", stacklevel=2)
        return gm.forward
    settings = {"target": "cpu", "autotune": "none", **options}
    try:
        compiled = eclat_compile(gm, tuple(example_inputs), quiet=True, **settings)
    except Exception as e:  # any graph eclat cannot take must still run: in PyTorch, with a reason
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        warnings.warn(f"eclat: falling back to PyTorch for this graph: {type(e).__name__}: {reason}",
                      stacklevel=2)
        return gm.forward

    def run(*args: Any) -> Any:
        out = compiled(*args)
        return out if isinstance(out, (tuple, list)) else (out,)  # dynamo expects a sequence

    return run


def register() -> None:
    """Register the backend with torch._dynamo unless torch already knows it (entry point)."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    if NAME not in list_backends(exclude_tags=()):
        register_backend(eclat_backend, name=NAME)


register()
