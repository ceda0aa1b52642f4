"""What the e-graph buys, workload by workload: each benchmark workload compiled with the rewrites
off (the lowered graph grouped into kernels directly) and on (the e-graph's candidates, searched),
both with the same autotuning, timed in turns in one process. With --without merges, "off" is the
e-graph without its horizontal merge rules (registry.MERGE) instead; with --without attention, the
CPU target without its one-kernel attention (Target.fused).

    python benchmarks/ablation.py --threads 1 [--only mlp_b1,llama_step1] [--without merges|attention]
        [--out x.md]

Reports each program's median time, its kernel count and the bytes its kernels move (the
roofline's count: every buffer a kernel reads or writes, once per kernel).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from run import WORKLOADS, time_interleaved  # noqa: E402

import eclat  # noqa: E402
from eclat.backends.cpu import CpuTarget, host  # noqa: E402
from eclat.compiler import pipeline  # noqa: E402
from eclat.rewrites import registry  # noqa: E402


def _compile(model: torch.nn.Module, inputs: tuple, target: str, threads: int, autotune: str,
             without: str | None) -> Any:
    """eclat.compile, with the e-graph's candidates replaced by the lowered graph when without is
    "rewrites", the merge rules left out when it is "merges", attention run as separate kernels when it
    is "attention" (a cache directory of its own: the
    program cache would hand back the other's program). Without rewrites the compiler's own check
    is off (interpreting the lowered graph materialises every broadcast product: 4 GB for
    matmul_1024); main compares its outputs with the other's."""
    original, merges, fused = pipeline._candidates, registry.MERGE, CpuTarget.fused
    if without == "rewrites":
        pipeline._candidates = lambda graph, target, k, device=None: ([graph], {})
    elif without == "merges":
        registry.MERGE = ()
    elif without == "attention":
        CpuTarget.fused = frozenset()
    try:
        with tempfile.TemporaryDirectory() as cache:
            return eclat.compile(model, inputs, target=target, threads=threads, autotune=autotune,
                                 cache_dir=cache, quiet=True, verify=without != "rewrites")
    finally:
        pipeline._candidates, registry.MERGE, CpuTarget.fused = original, merges, fused


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", default="")
    p.add_argument("--autotune", choices=("none", "fast", "full"), default="fast")
    p.add_argument("--without", choices=("rewrites", "merges", "attention"), default="rewrites")
    p.add_argument("--target", default="cpu")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    wanted = set(filter(None, args.only.split(",")))
    d = host.description()
    lines = [f"host: {d['cpu']} ({d['vector_unit']}, {d['lanes']} float32 lanes), threads={args.threads}, "
             f"autotune={args.autotune}, target={args.target}, off = without {args.without}", "",
             "| workload | off ms | off kernels | off MB moved | on ms | on kernels | on MB moved | off/on |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for w in WORKLOADS:
        if wanted and w.name not in wanted:
            continue
        torch.manual_seed(0)
        model, inputs = w.make()
        model.eval()
        arrays = [x.numpy() for x in inputs]
        runs = {side: _compile(model, inputs, args.target, args.threads, args.autotune, without)
                for side, without in (("off", args.without), ("on", None))}
        outs = {side: c(*arrays) for side, c in runs.items()}
        outs = {side: o if isinstance(o, list) else [o] for side, o in outs.items()}
        for got, want in zip(outs["off"], outs["on"]):
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)  # the unchecked one, checked here
        times = time_interleaved({side: (lambda c=c, a=arrays: c(*a)) for side, c in runs.items()})
        cells = []
        for side in ("off", "on"):
            kernels = runs[side].report()["kernels"]
            moved = sum(k["bytes"] for k in kernels) / 1e6
            cells += [f"{times[side] * 1e3:.3f}", str(len(kernels)), f"{moved:.2f}"]
        row = f"| {w.name} | {' | '.join(cells)} | {times['off'] / times['on']:.2f} |"
        lines.append(row)
        print(row, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
