"""eclat: an equality-saturation compiler for PyTorch inference.

    import eclat
    fast = eclat.compile(model, example_inputs, target="cpu")
    y = fast(x)

Heavy parts (torch, egglog, llvmlite) are imported only when they are needed, so
that `eclat.load` runs a saved artifact without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import EclatError, ExportError, UnsupportedOpError

if TYPE_CHECKING:
    from .compiler.model import CompiledModel

__all__ = ["CompiledModel", "EclatError", "ExportError", "UnsupportedOpError", "compile", "load"]


def compile(model: Any, example_inputs: Any, target: str = "cpu", **options: Any) -> CompiledModel:
    """Compile model's forward pass for target ("cpu", "cuda", "metal", "opencl")."""
    from .compiler.pipeline import compile_model

    return compile_model(model, example_inputs, target=target, **options)


def load(path: str) -> CompiledModel:
    """Load an artifact written by `CompiledModel.save` or `eclat compile`."""
    from .compiler.model import load as load_model

    return load_model(path)


def __getattr__(name: str) -> Any:
    if name == "CompiledModel":
        from .compiler.model import CompiledModel

        return CompiledModel
    raise AttributeError(name)
