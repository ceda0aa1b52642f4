"""A small CNN (strided, dilated and grouped convolutions, batch norm, max/avg/adaptive
pooling, a linear head; random weights) compiled for the CPU, saved as an artifact and
reloaded, checked against PyTorch.

    python examples/cnn.py
    eclat compile examples/cnn.py:make --target cpu -o cnn.eclat
"""

import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import eclat  # noqa: E402
from tests.zoo import make_cnn  # noqa: E402


def make():
    """(model, example_inputs): a batch of two 3x16x16 images."""
    return make_cnn(batch=2, size=16)


def main() -> None:
    model, (x,) = make()
    t0 = time.perf_counter()
    fast = eclat.compile(model, (x,), target="cpu", autotune="none", k=4)  # 4 candidate programs
    print(f"compiled in {time.perf_counter() - t0:.1f} s, {len(fast.report()['kernels'])} kernels")
    with torch.inference_mode():
        want = model(x)
    err = (fast(x) - want).abs().max().item()
    print(f"max |eclat - torch| = {err:.2e}")
    assert err < 1e-3, "eclat disagrees with PyTorch"

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cnn.eclat")
        fast.save(path)
        t0 = time.perf_counter()
        loaded = eclat.load(path)  # no search, no torch needed
        print(f"artifact: {os.path.getsize(path)} bytes, loaded in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        again = loaded(x.numpy())
    assert abs(again - want.numpy()).max() < 1e-3
    print("predicted classes:", want.argmax(-1).tolist())


if __name__ == "__main__":
    main()
