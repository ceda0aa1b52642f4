"""The examples: every factory gives (model, example_inputs) the CLI can take, and (slow) each
script runs end to end, asserting its own agreement with PyTorch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from eclat.cli import load_factory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ["quickstart.py", "tiny_llama.py", "cnn.py", "gpt2_hf.py"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_factory_gives_a_model_and_inputs_that_run(name):
    model, inputs = load_factory(os.path.join(ROOT, "examples", name))
    assert isinstance(model, torch.nn.Module) and isinstance(inputs, tuple) and inputs
    assert not model.training
    with torch.no_grad():
        out = model(*inputs)
    assert out is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_end_to_end(name):
    r = subprocess.run([sys.executable, os.path.join("examples", name)], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
