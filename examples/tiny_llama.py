"""A tiny Llama-style decoder (RMSNorm, RoPE, causal attention, SiLU-gated MLP; random
weights) generating tokens greedily with an eclat-compiled step, checked against PyTorch.

    python examples/tiny_llama.py
    eclat compile examples/tiny_llama.py:make --target cpu -o tiny_llama.eclat

The step is compiled once for a fixed window of WINDOW tokens: each new token is the
argmax of the last position's logits, and the window slides by one.
"""

import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import eclat  # noqa: E402
from tests.zoo import make_llama  # noqa: E402

WINDOW, NEW_TOKENS = 8, 16


def make():
    """(model, example_inputs): a 2-layer, 64-wide decoder over a 128-token vocabulary."""
    return make_llama(layers=2, d=64, heads=4, vocab=128, seq=WINDOW, tied=False)


def generate(step, prompt: np.ndarray, steps: int) -> list[int]:
    """Greedy decoding with a fixed-size window; step maps ids [1, WINDOW] to logits [1, WINDOW, vocab]."""
    ids = list(prompt)
    for _ in range(steps):
        window = np.asarray(ids[-WINDOW:], dtype=np.int64)[None, :]
        ids.append(int(np.argmax(step(window)[0, -1])))
    return ids[len(prompt):]


def main() -> None:
    model, (prompt,) = make()
    t0 = time.perf_counter()
    # k=1: only the e-graph's best program is compiled, so the example takes seconds, not minutes
    fast = eclat.compile(model, (prompt,), target="cpu", autotune="none", k=1)
    print(f"compiled in {time.perf_counter() - t0:.1f} s, {len(fast.report()['kernels'])} kernels")

    def torch_step(ids: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(ids)).numpy()

    start = prompt[0].numpy()
    torch.set_num_threads(1)  # eclat runs one thread by default: compare like with like
    generate(torch_step, start, 1)  # warm-up
    t0 = time.perf_counter()
    ours = generate(fast, start, NEW_TOKENS)
    eclat_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = generate(torch_step, start, NEW_TOKENS)
    torch_s = time.perf_counter() - t0
    print("prompt:   ", start.tolist())
    print("eclat:    ", ours)
    print("pytorch:  ", theirs)
    assert ours == theirs, "eclat's greedy tokens differ from PyTorch's"
    print(f"{NEW_TOKENS} tokens: eclat {eclat_s * 1e3 / NEW_TOKENS:.2f} ms/token, "
          f"torch eager {torch_s * 1e3 / NEW_TOKENS:.2f} ms/token")


if __name__ == "__main__":
    main()
