"""Does roofline pruning lose? The pruned search ("fast") against the exhaustive one ("full").

For each workload both modes compile from a fresh, empty tuning cache (the device's measured
peaks are measured once and shared, so neither pays for them); the table gives the winner's
median run time in each mode (the two winners timed in turn over ROUNDS rounds), their ratio
(fast / full: above 1.10 means pruning lost more than 10%) and each mode's compile seconds
(search and tuning included).

    python benchmarks/tuning.py [--only mlp_b1,cnn_b8] [--threads 1] [--budget 1.0]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.run import WORKLOADS, time_interleaved  # noqa: E402

DEFAULT = "mlp_b1,mlp_b64,chain_64x1024,llama_step1,cnn_b8,matmul_512"
MODES = ("fast", "full")
ROUNDS = 3


def compile_fresh(model, inputs, mode: str, threads: int, devices: Path) -> tuple[object, float, dict]:
    """Compile in a new cache folder holding only the measured device peaks."""
    import eclat

    with tempfile.TemporaryDirectory(prefix=f"eclat-{mode}-") as cache:
        shutil.copytree(devices, Path(cache) / "devices")
        start = time.perf_counter()
        compiled = eclat.compile(model, inputs, target="cpu", threads=threads, autotune=mode, cache_dir=cache,
                                 quiet=True)
        return compiled, time.perf_counter() - start, compiled.report()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=DEFAULT, help="comma-separated workload names")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per winner")
    args = ap.parse_args()
    from eclat.autotune import get_device

    names = args.only.split(",")
    unknown = sorted(set(names) - {w.name for w in WORKLOADS})
    if unknown:
        sys.exit(f"unknown workloads {unknown}: choose among {[w.name for w in WORKLOADS]}")
    shared = Path(tempfile.mkdtemp(prefix="eclat-devices-"))
    get_device("cpu", threads=args.threads, cache_dir=shared)  # measured once, copied into every cache
    header = ("| workload | fast ms | full ms | fast/full | fast compile s | full compile s | "
              "fast timed/pruned | full timed/pruned |")
    print(header + "\n|" + "---|" * 8, flush=True)
    for w in (w for w in WORKLOADS if w.name in names):
        torch.manual_seed(0)
        model, inputs = w.make()
        model.eval()
        secs, counts, winners = {}, {}, {}
        arrays = [x.numpy() for x in inputs]
        with torch.inference_mode():
            for mode in MODES:
                winners[mode], secs[mode], report = compile_fresh(model, inputs, mode, args.threads,
                                                                  shared / "devices")
                c = report["candidates"]
                counts[mode] = f"{c['timed']}/{c['pruned']}"
            fns = {mode: (lambda c=compiled, a=arrays: c(*a)) for mode, compiled in winners.items()}
            ms = {mode: t * 1e3 for mode, t in time_interleaved(fns, rounds=ROUNDS,
                                                                 slice_s=args.budget / ROUNDS / 2).items()}
        print(f"| {w.name} | {ms['fast']:.3f} | {ms['full']:.3f} | {ms['fast'] / ms['full']:.2f} | "
              f"{secs['fast']:.1f} | {secs['full']:.1f} | {counts['fast']} | {counts['full']} |", flush=True)
    shutil.rmtree(shared, ignore_errors=True)


if __name__ == "__main__":
    main()
