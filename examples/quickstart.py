"""Quickstart: compile a small MLP with eclat for the CPU and compare it with PyTorch.

    python examples/quickstart.py
"""

import time

import torch

import eclat


def make():
    """(model, example_inputs): the factory form `eclat compile examples/quickstart.py:make` takes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(),
        torch.nn.Linear(1024, 256), torch.nn.SiLU(),
        torch.nn.Linear(256, 10),
    ).eval()
    return model, (torch.randn(8, 256),)


def median_ms(fn, repeats: int = 50) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    model, (x,) = make()
    t0 = time.perf_counter()
    fast = eclat.compile(model, (x,), target="cpu")
    print(f"compiled in {time.perf_counter() - t0:.1f} s")

    with torch.inference_mode():
        want = model(x)
        got = fast(x)
        err = (got - want).abs().max().item()
        print(f"max |eclat - torch| = {err:.2e}")
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-4), "eclat disagrees with PyTorch"

        torch.set_num_threads(1)
        eager_ms, eclat_ms = median_ms(lambda: model(x)), median_ms(lambda: fast(x))
        print(f"torch eager: {eager_ms:.3f} ms   eclat: {eclat_ms:.3f} ms (1 thread)")
    kernels = fast.report()["kernels"]
    print(f"{len(kernels)} kernels:", ", ".join(k["name"] for k in kernels))


if __name__ == "__main__":
    main()
