"""Attention as one kernel: prefill in four score variants and a decode step, timed as run.py times
its workloads, side by side with torch eager, torch.compile and F.scaled_dot_product_attention
(where the variant is expressible), then the bytes the chosen program moves against the program
without the fused kernel (the same compile with the CPU target's `fused` emptied).

    python benchmarks/attention.py --threads 1 --autotune none [--only causal_T2048,alibi_T2048]
    python benchmarks/attention.py --bytes [--only causal_T2048]
    python benchmarks/attention.py --scaling [--only decode_4096,decode3h_16384]

--scaling compiles each decode workload for 1 and for 2 threads and calls the two in turns.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from run import Workload, main  # noqa: E402

T, HEADS, DIM, CACHE, WINDOW, CAP = 2048, 8, 64, 4096, 256, 30.0


class Attention(torch.nn.Module):
    """softmax(f(q k^T / sqrt(d))) v over one [1, heads, t, d] block, f the variant's, written as
    people write it; `sdpa()` is the same computation through F.scaled_dot_product_attention."""

    def __init__(self, variant: str, t: int, s: int, heads: int = HEADS):
        super().__init__()
        self.variant = variant
        i, j = torch.arange(t)[:, None] + (s - t), torch.arange(s)[None, :]
        causal = torch.where(j <= i, 0.0, -math.inf)
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)])
        masks = {"plain": torch.zeros(t, s), "causal": causal, "softcap": causal, "alibi": causal,
                 "window": torch.where((j <= i) & (i - j < WINDOW), 0.0, -math.inf)}
        self.register_buffer("mask", masks[variant])
        # ALiBi's bias is computed from the positions as models do, not stored as heads x t x s
        self.register_buffer("slopes", slopes[:, None, None])
        self.register_buffer("distance", (i - j).abs().float())

    def scores(self, q, k):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if self.variant == "softcap":
            s = torch.tanh(s / CAP) * CAP
        if self.variant == "alibi":
            s = s - self.slopes * self.distance
        return s + self.mask

    def forward(self, q, k, v):
        return torch.softmax(self.scores(q, k), -1) @ v

    def sdpa(self):
        if self.variant == "softcap":
            raise NotImplementedError("soft-capping is not expressible")
        if self.variant in ("plain", "causal"):
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=self.variant == "causal")
        if self.variant == "alibi":
            return lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, attn_mask=self.mask - self.slopes * self.distance)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


def _workload(variant: str, t: int, s: int, heads: int = HEADS) -> Workload:
    def make():
        return Attention(variant, t, s, heads), tuple(torch.randn(1, heads, n, DIM) for n in (t, s, s))
    name = f"{variant}_T{t}" if t > 1 else f"decode{'' if heads == HEADS else f'{heads}h'}_{s}"
    return Workload(name, make, 4 * heads * t * s * DIM)


def run_sdpa(model, inputs, threads):
    fn = model.sdpa()
    return lambda: fn(*inputs)


def moved_bytes(variants: list[str]) -> None:
    """MB the chosen program moves (kernel.bytes_moved), fused and not."""
    import eclat
    from eclat.backends.cpu import CpuTarget
    from eclat.compiler.kernel import bytes_moved

    print("\n| workload | eclat MB moved | without the fused kernel | ratio |\n|---|---|---|---|")
    for w in WORKLOADS:
        if variants and w.name.split("_")[0] not in variants:
            continue
        model, inputs = w.make()
        moved = []
        for fused in (CpuTarget.fused, frozenset()):
            saved, CpuTarget.fused = CpuTarget.fused, fused
            try:
                program = eclat.compile(model, inputs, autotune="none", quiet=True, k=1).executable.program
            finally:
                CpuTarget.fused = saved
            moved.append(sum(bytes_moved(k, program.buffers) for k in program.kernels) / 1e6)
        print(f"| {w.name} | {moved[0]:.1f} | {moved[1]:.1f} | {moved[0] / moved[1]:.3f} |", flush=True)


def thread_scaling(names: list[str]) -> None:
    """Each decode workload compiled for 1 and for 2 threads, the two called in turns in rounds:
    medians and their ratio (3 heads share 2 threads unevenly unless the keys are split)."""
    from run import time_interleaved

    import eclat

    print("\n| workload | 1 thread ms | 2 threads ms | 1 / 2 threads |\n|---|---|---|---|")
    for w in WORKLOADS:
        if not w.name.startswith("decode") or names and w.name not in names:
            continue
        torch.manual_seed(0)
        model, inputs = w.make()
        fns = {}
        for threads in (1, 2):
            compiled = eclat.compile(model.eval(), inputs, threads=threads, autotune="none", quiet=True)
            fns[threads] = lambda c=compiled, x=inputs: c(*x)
        with torch.inference_mode():
            timed = time_interleaved(fns)
        one, two = timed[1], timed[2]
        print(f"| {w.name} | {one * 1e3:.3f} | {two * 1e3:.3f} | {one / two:.2f} |", flush=True)


WORKLOADS = [*(_workload(v, T, T) for v in ("causal", "alibi", "softcap", "window")),
             _workload("plain", 1, CACHE), _workload("plain", 1, CACHE, heads=3),
             _workload("plain", 1, 4 * CACHE, heads=3)]

if __name__ == "__main__":
    argv = sys.argv[1:]
    only = argv[argv.index("--only") + 1] if "--only" in argv else ""
    if "--bytes" in argv:  # the bytes table alone
        moved_bytes([v.split("_")[0] for v in only.split(",") if v])
    elif "--scaling" in argv:
        thread_scaling([v for v in only.split(",") if v])
    else:
        main(argv, WORKLOADS, {"sdpa": run_sdpa}, default_peers="eager,torch.compile,sdpa")
