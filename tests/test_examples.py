"""The examples: each stands alone (a user copies it), every factory gives (model, example_inputs)
the CLI can take, and (slow) each script runs end to end, asserting its own agreement with PyTorch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

from eclat.cli import load_factory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ["quickstart.py", "tiny_llama.py", "cnn.py", "gpt2_hf.py", "dynamic.py"]
SCRIPTS = [*EXAMPLES, "generate.py"]  # generate.py's factory gives a language model alone (compile --lm)
LIBRARIES = {"eclat", "torch", "numpy", "transformers"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_stands_alone(name):
    """Its model is its own: it imports eclat and libraries, never the tests or another example,
    and does not reach into the checkout through sys.path."""
    with open(os.path.join(ROOT, "examples", name)) as f:
        source = f.read()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." if node.level else node.module.split(".")[0])
    assert imported <= LIBRARIES | sys.stdlib_module_names, imported - LIBRARIES - sys.stdlib_module_names
    assert "sys.path" not in source


@pytest.mark.parametrize("name", EXAMPLES)
def test_factory_gives_a_model_and_inputs_that_run(name):
    model, inputs, _ = load_factory(os.path.join(ROOT, "examples", name))
    assert isinstance(model, torch.nn.Module) and isinstance(inputs, tuple) and inputs
    assert not model.training
    with torch.no_grad():
        out = model(*inputs)
    assert out is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_example_runs_end_to_end(name):
    env = {**os.environ, "PYTHONPATH": ROOT}  # this checkout's eclat, whichever one is installed
    r = subprocess.run([sys.executable, os.path.join("examples", name)], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
