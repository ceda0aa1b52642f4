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
    from .generate import CausalLM

__all__ = ["CausalLM", "CompiledModel", "EclatError", "ExportError", "UnsupportedOpError", "compile",
           "compile_lm", "load"]


def compile(model: Any, example_inputs: Any, target: str = "cpu", **options: Any) -> CompiledModel:
    """Compile model's forward pass for target ("cpu", "cuda", "metal", "opencl")."""
    from .compiler.pipeline import compile_model

    return compile_model(model, example_inputs, target=target, **options)


def compile_lm(model: Any, max_len: int = 256, chunk: int = 32, target: str = "cpu",
               **options: Any) -> CausalLM:
    """Compile a transformers causal LM for generation with an eclat-owned KV cache (eclat.generate)."""
    from .generate import compile_lm as compile_causal_lm

    return compile_causal_lm(model, max_len, chunk, target, **options)


def load(path: str) -> CompiledModel | CausalLM:
    """Load an artifact written by `CompiledModel.save` or `eclat compile`; a folder written by
    `CausalLM.save` (`eclat compile --lm`) loads as a CausalLM."""
    import os

    if os.path.isdir(path):
        from .generate import load_lm

        return load_lm(path)
    from .compiler.model import load as load_model

    return load_model(path)


def __getattr__(name: str) -> Any:
    if name == "CompiledModel":
        from .compiler.model import CompiledModel

        return CompiledModel
    if name == "CausalLM":
        from .generate import CausalLM

        return CausalLM
    raise AttributeError(name)
