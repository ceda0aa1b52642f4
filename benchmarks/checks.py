"""What the call's safety costs: each check timed against the same call without it, in turns.

    python benchmarks/checks.py

- index check: llama_step1 (the 1-token Llama step of run.py) called with its token id checked
  against the embedding's range, and the same compiled program with the check left out;
- call state: a tiny Linear-ReLU called through CompiledModel (each call takes its slots and arena
  from the pool) against eclat_run called on one fixed set of slots, as before the pool.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import eclat  # noqa: E402
from benchmarks.run import _llama  # noqa: E402
from eclat.compiler.model import CompiledModel  # noqa: E402


def mean_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def in_turns(fns: dict[str, Callable[[], object]], calls: int, rounds: int = 15) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(mean_us(fn, calls))
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    torch.set_num_threads(1)
    from eclat.backends.cpu import host

    about = host.description()
    print(f"host: {about['cpu']} ({about['vector_unit']}, {about['lanes']} float32 lanes), "
          f"{os.cpu_count()} cores; 1 thread")

    model, (ids,) = _llama(1)
    checked = eclat.compile(model, (ids,), autotune="fast", quiet=True)
    unchecked = CompiledModel(checked.executable, [replace(s, index_range=None) for s in checked.inputs],
                              checked.out_spec, checked.report())
    assert checked.inputs[0].index_range is not None
    t = in_turns({"checked": lambda: checked(ids), "unchecked": lambda: unchecked(ids)}, calls=50)
    print(f"llama_step1: {t['checked']:.1f} us checked, {t['unchecked']:.1f} us unchecked "
          f"({(t['checked'] / t['unchecked'] - 1) * 100:+.1f}%)")

    tiny = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    fast = eclat.compile(tiny, (torch.from_numpy(x),), autotune="none", quiet=True)
    exe = fast.executable
    state = exe._state()  # one fixed set of slots: what every call shared before the pool

    def fixed() -> list[np.ndarray]:
        outs = exe._bind(state.slots, [x])
        exe._fn(state.address)
        return outs

    fns = {"pooled": lambda: exe.run([x]), "fixed": fixed, "CompiledModel": lambda: fast(x)}
    t = in_turns(fns, calls=2000)
    print(f"tiny model: run {t['pooled']:.2f} us with the state pool, {t['fixed']:.2f} us on fixed slots "
          f"({t['pooled'] - t['fixed']:+.2f} us); a whole CompiledModel call {t['CompiledModel']:.2f} us")


if __name__ == "__main__":
    main()
