"""One compile for every sequence length: a transformer encoder compiled with torch.export's
dynamic_shapes, called with lengths it was never shown.

    python examples/dynamic.py
    eclat compile examples/dynamic.py -o encoder.eclat   # the factory's third item: dynamic_shapes
"""

import statistics
import time
import timeit

import torch
from torch.export import Dim

import eclat


def make():
    """(model, example_inputs, dynamic_shapes): any length from 1 to 256 tokens, one program."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    return model, (torch.randn(1, 32, 128),), ({1: Dim("tokens", min=1, max=256)},)


def median_ms(fn) -> float:
    return statistics.median(timeit.repeat(fn, number=1, repeat=20)) * 1e3


def main() -> None:
    model, example, dynamic = make()
    t0 = time.perf_counter()
    fast = eclat.compile(model, example, dynamic_shapes=dynamic, autotune="none")
    print(f"compiled once in {time.perf_counter() - t0:.1f} s")
    torch.set_num_threads(1)
    with torch.inference_mode():
        for tokens in (1, 7, 32, 100, 256):
            x = torch.randn(1, tokens, 128)
            want, got = model(x), fast(x)
            assert torch.allclose(got, want, rtol=1e-3, atol=1e-4), f"eclat disagrees at {tokens} tokens"
            eager_ms, eclat_ms = median_ms(lambda: model(x)), median_ms(lambda: fast(x))  # noqa: B023
            print(f"{tokens:4d} tokens: torch eager {eager_ms:7.3f} ms   eclat {eclat_ms:7.3f} ms (1 thread)")


if __name__ == "__main__":
    main()
