"""Side-by-side benchmark: eclat against torch eager, torch.compile and onnxruntime.

    python benchmarks/run.py --threads 1 [--only mlp_b1,chain] [--autotune fast] [--out table.md]

All runners execute in this one process on the same inputs, taking turns in rounds (drift of a
shared machine falls on all alike); each is reported as the median over its calls after warm-up.
Ratios are peer time / eclat time (> 1 means eclat is faster). Matmul rows are also given in
GFLOP/s. OMP_WAIT_POLICY=PASSIVE is set for the peers because spinning OpenMP pools are
pathological on these VMs with 2 threads.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads its OpenMP runtime

import argparse
import io
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# --- workloads ------------------------------------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self, d: int = 512, hidden: int = 2048, layers: int = 3):
        super().__init__()
        dims = [d] + [hidden] * (layers - 1) + [d]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.nn.functional.gelu(x)
        return x


class NormChain(torch.nn.Module):
    """The memory-bound chain: LayerNorm, GELU, softmax."""

    def __init__(self, d: int = 1024):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        return torch.softmax(torch.nn.functional.gelu(self.norm(x)), dim=-1)


class MatMul(torch.nn.Module):
    def forward(self, a, b):
        return a @ b


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        c = torch.nn
        self.body = c.Sequential(
            c.Conv2d(3, 32, 3, padding=1), c.BatchNorm2d(32), c.ReLU(), c.MaxPool2d(2),
            c.Conv2d(32, 64, 3, padding=1), c.BatchNorm2d(64), c.ReLU(), c.MaxPool2d(2),
            c.Conv2d(64, 64, 3, padding=1, groups=4), c.ReLU(), c.AdaptiveAvgPool2d(1), c.Flatten(),
            c.Linear(64, 10))

    def forward(self, x):
        return self.body(x)


def _llama(seq: int, layers: int = 4, vocab: int = 4096):
    from tests.zoo import make_llama

    model, _ = make_llama(layers=layers, d=256, heads=8, ffn=688, vocab=vocab, seq=seq)
    return model, (torch.randint(0, vocab, (1, seq)),)


@dataclass
class Workload:
    name: str
    make: Callable[[], tuple[torch.nn.Module, tuple]]
    flops: float | None = None  # for GFLOP/s rows


def _rand(*shape):
    return torch.randn(*shape)


WORKLOADS = [
    Workload("mlp_b1", lambda: (MLP(), (_rand(1, 512),))),
    Workload("mlp_b64", lambda: (MLP(), (_rand(64, 512),))),
    Workload("chain_64x1024", lambda: (NormChain(), (_rand(64, 1024),))),
    Workload("llama_prefill128", lambda: _llama(128)),
    Workload("llama_prefill512", lambda: _llama(512)),
    Workload("llama_step1", lambda: _llama(1)),
    # one decoder block's token step: a 256-token vocabulary leaves the embedding and head small
    Workload("llama_block_step1", lambda: _llama(1, layers=1, vocab=256)),
    Workload("cnn_b8", lambda: (SmallCNN(), (_rand(8, 3, 32, 32),))),
    Workload("matmul_512", lambda: (MatMul(), (_rand(512, 512), _rand(512, 512))), 2 * 512**3),
    Workload("matmul_1024", lambda: (MatMul(), (_rand(1024, 1024), _rand(1024, 1024))), 2 * 1024**3),
]


# --- runners --------------------------------------------------------------------------------

def run_eager(model, inputs, threads):
    return lambda: model(*inputs)


def run_torch_compile(model, inputs, threads):
    compiled = torch.compile(model)
    return lambda: compiled(*inputs)


def run_onnxruntime(model, inputs, threads):
    import onnxruntime as ort

    buf = io.BytesIO()
    torch.onnx.export(model, inputs, buf, dynamo=False)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(buf.getvalue(), opts, providers=["CPUExecutionProvider"])
    feed = {i.name: x.numpy() for i, x in zip(sess.get_inputs(), inputs)}
    return lambda: sess.run(None, feed)


def make_eclat_runner(autotune: str):
    def run_eclat(model, inputs, threads):
        import eclat

        compiled = eclat.compile(model, inputs, target="cpu", threads=threads, autotune=autotune,
                                 quiet=True)
        arrays = [x.numpy() for x in inputs]

        def call():
            return compiled(*arrays)
        call.compiled = compiled  # what the search chose, for the table's notes
        return call
    return run_eclat


def time_interleaved(fns: dict[str, Callable[[], object]], rounds: int = 10, slice_s: float = 0.3,
                     min_calls: int = 3) -> dict[str, float]:
    """Median seconds per call of each fn. The runners take turns, a slice each per round, so
    that drift in the machine's speed (a shared VM's neighbours, clock changes) falls on all of
    them alike instead of on whichever ran during the slow minute."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            calls = 0
            while calls < min_calls or time.perf_counter() - start < slice_s:
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
                calls += 1
    return {n: statistics.median(v) for n, v in samples.items()}


def main(argv: list[str] | None = None, workloads: list[Workload] | None = None,
         peers: dict[str, Callable] | None = None, default_peers: str = "eager,torch.compile,onnxruntime"
         ) -> None:
    """peers: runners beside run.py's own (name -> (model, inputs, threads) -> callable)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--peers", default=default_peers)
    ap.add_argument("--autotune", default="fast", choices=["none", "fast", "full"])
    ap.add_argument("--out", help="also write the markdown table to this file")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    runners = {"eclat": make_eclat_runner(args.autotune), "eager": run_eager,
               "torch.compile": run_torch_compile, "onnxruntime": run_onnxruntime, **(peers or {})}
    names = ["eclat"] + [p for p in args.peers.split(",") if p]
    chosen = [w for w in workloads or WORKLOADS if not args.only or w.name in args.only.split(",")]

    from eclat.backends.cpu import host

    about = host.description()
    machine = (f"host: {about['cpu']} ({about['vector_unit']}, {about['lanes']} float32 lanes), "
               f"{os.cpu_count()} cores")
    header = "| workload | " + " | ".join(f"{n} ms" for n in names) + " | " + \
        " | ".join(f"{n}/eclat" for n in names[1:]) + " |"
    lines = [machine, "", header, "|" + "---|" * (1 + 2 * len(names) - 1)]
    print(machine + "\n\n" + header, flush=True)
    for w in chosen:
        torch.manual_seed(0)
        model, inputs = w.make()
        model.eval()
        fns: dict[str, Callable[[], object]] = {}
        notes = []
        with torch.inference_mode():
            for n in names:
                try:
                    t0 = time.perf_counter()
                    fns[n] = runners[n](model, inputs, args.threads)
                    fns[n]()
                    if n == "eclat":
                        notes.append(f"eclat compile {time.perf_counter() - t0:.1f}s")
                        chosen_layout = fns[n].compiled.compile_report.candidates.channels_last
                        notes += [f"channels-last to {chosen_layout} pixels"] if chosen_layout else []
                except Exception as e:  # a peer failing is reported, not fatal
                    fns.pop(n, None)
                    notes.append(f"{n} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            timed = time_interleaved(fns)
        medians: dict[str, float | None] = {n: timed.get(n) for n in names}
        cells = [f"{medians[n] * 1e3:.3f}" if medians[n] else "—" for n in names]
        base = medians["eclat"]
        ratios = [f"{medians[n] / base:.2f}" if base and medians[n] else "—" for n in names[1:]]
        row = f"| {w.name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |"
        if w.flops:
            row += " " + ", ".join(f"{n} {w.flops / medians[n] / 1e9:.1f} GFLOP/s"
                                   for n in names if medians[n])
        if notes:
            row += " " + "; ".join(notes)
        lines.append(row)
        print(row, flush=True)
    footer = (f"\nthreads={args.threads}, autotune={args.autotune}, OMP_WAIT_POLICY="
              f"{os.environ['OMP_WAIT_POLICY']}, torch {torch.__version__}, numpy {np.__version__}")
    print(footer)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n" + footer + "\n")


if __name__ == "__main__":
    main()
