"""Recurrent networks nobody here wrote (torch.nn's LSTM and GRU, random weights, batch 1), timed
as run.py times its workloads, side by side with torch eager, torch.compile and onnxruntime. A
recurrence lowers to one step after another: its compile is the test of a long graph whose steps
each hand several values to the next.

    python benchmarks/recurrent.py --threads 1 --autotune none [--only lstm_t100]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from run import Workload, main  # noqa: E402


class Outputs(torch.nn.Module):
    """A recurrent layer's outputs at every step (not its final states)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)[0]


def _recurrent(kind: str, steps: int, inputs: int, hidden: int, **options):
    def make():
        layer = getattr(torch.nn, kind)(inputs, hidden, batch_first=True, **options)
        return Outputs(layer), (torch.randn(1, steps, inputs),)
    return make


RECURRENT = [
    Workload("lstm_t100", _recurrent("LSTM", 100, 128, 256)),
    Workload("gru_t100", _recurrent("GRU", 100, 128, 256)),
    Workload("lstm2_bi_t50", _recurrent("LSTM", 50, 64, 128, num_layers=2, bidirectional=True)),
]

if __name__ == "__main__":
    main(workloads=RECURRENT)
