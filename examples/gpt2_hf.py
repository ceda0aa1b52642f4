"""HuggingFace GPT-2 from a tiny random config (nothing is downloaded), compiled with eclat
for the CPU and checked against PyTorch, then used for a few greedy tokens.

    python examples/gpt2_hf.py
    eclat compile examples/gpt2_hf.py:make --target cpu -o gpt2.eclat
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import eclat  # noqa: E402
from tests.zoo import make_hf_gpt2  # noqa: E402


def make():
    """(model, example_inputs): 2 layers, 32 wide, 128-token vocabulary, 8 token ids."""
    return make_hf_gpt2()


def logits_of(out):
    """GPT2LMHeadModel returns a ModelOutput (a dict-like); eclat returns the same structure."""
    return out["logits"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]


def main() -> None:
    model, (ids,) = make()
    t0 = time.perf_counter()
    # k=1: only the e-graph's best program is compiled, so the example takes seconds, not minutes
    fast = eclat.compile(model, (ids,), target="cpu", autotune="none", k=1)
    print(f"compiled in {time.perf_counter() - t0:.1f} s, {len(fast.report()['kernels'])} kernels")
    with torch.inference_mode():
        want = logits_of(model(ids))
        got = logits_of(fast(ids))
    err = (got - want).abs().max().item()
    print(f"logits {list(got.shape)}, max |eclat - torch| = {err:.2e}")
    assert err < 1e-3, "eclat disagrees with PyTorch"

    window = ids.clone()  # greedy tokens over a sliding window of the compiled length
    tokens = []
    for _ in range(8):
        with torch.inference_mode():
            nxt = logits_of(fast(window))[0, -1].argmax().item()
        tokens.append(nxt)
        window = torch.cat([window[:, 1:], torch.tensor([[nxt]])], dim=1)
    print("greedy tokens:", tokens)


if __name__ == "__main__":
    main()
