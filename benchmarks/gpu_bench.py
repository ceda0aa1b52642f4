"""CUDA benchmark: eclat target="cuda" against torch eager and torch.compile on the same GPU.

    python benchmarks/gpu_bench.py [--out DIR] [--only mlp_b64,matmul_1024] [--k 1] [--budget 400]
    python benchmarks/gpu_bench.py --compare opencl,cpu --only mlp_b64,chain_64x1024,matmul_512

Times are medians of CUDA-event timings on the device, without host copies: eclat's kernels
(CudaExecutable.time_kernels, one graph launch) against torch's forward on CUDA tensors. eclat's
whole call is timed too, with CUDA tensors in and out (call_ms, each call synchronised; overhead_us
is call_ms less the kernels' time) and with host arrays (host_call_ms, copies through pinned
memory). Every eclat result is checked against torch (rtol 1e-3; bf16 workloads 2e-2). TF32 is off
for torch and eclat (torch.backends.cuda.matmul.allow_tf32 = False) unless --tf32.
Writes gpu_bench.json and gpu_bench.md to --out (default $OUT, else ./gpu_results).
--compare T1,T2,... instead times eclat's full call (wall clock, median) on each target, no GPU
needed (e.g. OpenCL on PoCL against the CPU backend).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run import MLP, MatMul, NormChain  # noqa: E402  (the CPU benchmark's workloads)
from tests.zoo import make_llama  # noqa: E402


def _llama(seq: int = 64):
    model, _ = make_llama(layers=2, d=256, heads=8, ffn=688, vocab=4096, seq=seq)
    return model, (torch.randint(0, 4096, (1, seq)),)


def _decode(keys: int = 4096, heads: int = 8):
    """One query a head against a cache (benchmarks/attention.py's decode): the decode strategy."""
    from benchmarks.attention import Attention

    return Attention("plain", 1, keys, heads), tuple(torch.randn(1, heads, n, 64) for n in (1, keys, keys))


def _matmul(n: int, dtype: torch.dtype = torch.float32):
    return MatMul(), (torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype))


WORKLOADS = {  # name -> (factory, flops for a GFLOP/s column or None)
    "mlp_b64": (lambda: (MLP(), (torch.randn(64, 512),)), None),
    "chain_64x1024": (lambda: (NormChain(), (torch.randn(64, 1024),)), None),
    "matmul_512": (lambda: _matmul(512), 2 * 512**3),
    "matmul_1024": (lambda: _matmul(1024), 2 * 1024**3),
    "matmul_4096": (lambda: _matmul(4096), 2 * 4096**3),
    "matmul_4096_bf16": (lambda: _matmul(4096, torch.bfloat16), 2 * 4096**3),
    "llama_2x256_seq64": (_llama, None),
    "llama_2x256_prefill512": (lambda: _llama(512), None),
    "attention_decode_4096": (_decode, 4 * 8 * 4096 * 64),
}


def cuda_median_ms(fn, repeats: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def bench(name: str, args) -> dict:
    import eclat

    factory, flops = WORKLOADS[name]
    torch.manual_seed(0)
    model, inputs = factory()
    model.eval()
    row: dict = {"workload": name}
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(*inputs)
        t = time.perf_counter()
        fast = eclat.compile(model, inputs, target="cuda", autotune=args.autotune, k=args.k, quiet=True)
        row["eclat_compile_s"] = round(time.perf_counter() - t, 2)
        cuda_model = model.cuda()
        cuda_inputs = tuple(x.cuda() for x in inputs)
        got = fast(*cuda_inputs)
        assert got.is_cuda, "a call with CUDA tensors returns CUDA tensors"
        low = want.dtype == torch.bfloat16
        want, got, host = want.float(), got.float().cpu(), fast(*inputs).float()
        tol = 2e-2 if low else 1e-3
        row["eclat_matches_torch"] = bool(torch.allclose(got, want, rtol=tol, atol=tol * abs(want).max()) and
                                          torch.equal(got, host))
        row["eclat_max_abs_err"] = float((got - want).abs().max())
        row["eclat_kernels_ms"] = fast.executable.time_kernels(repeats=30) * 1e3

        def device_call():
            fast(*cuda_inputs)
            torch.cuda.synchronize()
        row["eclat_call_ms"] = wall_median_ms(device_call, repeats=50)
        row["eclat_overhead_us"] = (row["eclat_call_ms"] - row["eclat_kernels_ms"]) * 1e3
        row["eclat_host_call_ms"] = wall_median_ms(lambda: fast(*inputs))
        row["torch_eager_ms"] = cuda_median_ms(lambda: cuda_model(*cuda_inputs))
        try:
            t = time.perf_counter()
            compiled = torch.compile(cuda_model)
            compiled(*cuda_inputs)
            row["torch_compile_s"] = round(time.perf_counter() - t, 2)
            row["torch_compile_ms"] = cuda_median_ms(lambda: compiled(*cuda_inputs))
        except Exception as e:  # torch.compile needs triton; report instead of failing the run
            row["torch_compile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if flops:
        row["eclat_gflops"] = flops / row["eclat_kernels_ms"] / 1e6
        row["torch_eager_gflops"] = flops / row["torch_eager_ms"] / 1e6
    return row


def compare(name: str, targets: list[str], args) -> dict:
    """eclat's full call on each target: wall-clock median ms, checked against torch."""
    import eclat

    factory, _ = WORKLOADS[name]
    torch.manual_seed(0)
    model, inputs = factory()
    model.eval()
    row: dict = {"workload": name}
    arrays = [x.numpy() for x in inputs]
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(*inputs).numpy()
        for target in targets:
            fast = eclat.compile(model, inputs, target=target, autotune=args.autotune, k=args.k, quiet=True)
            ok = np.allclose(fast(*arrays), want, rtol=1e-3, atol=1e-3)
            row[f"{target}_ms"] = wall_median_ms(lambda f=fast: f(*arrays), repeats=args.repeats)
            row[f"{target}_matches_torch"] = bool(ok)
    return row


BENCH_COLUMNS = ["workload", "eclat_kernels_ms", "eclat_call_ms", "eclat_overhead_us",
                 "eclat_host_call_ms", "torch_eager_ms", "torch_compile_ms", "eclat_gflops",
                 "torch_eager_gflops", "eclat_compile_s", "eclat_matches_torch", "error"]


def table(rows: list[dict], cols: list[str] = BENCH_COLUMNS) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_results")
    ap.add_argument("--only", default="")
    ap.add_argument("--k", type=int, default=1, help="e-graph candidates to compile and time")
    ap.add_argument("--autotune", default="none", choices=["none", "fast", "full"])
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; later workloads are skipped")
    ap.add_argument("--compare", default="", help="targets to compare by eclat call time, e.g. opencl,cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tf32", action="store_true", help="let torch and eclat use TF32 for float32 products")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = args.tf32  # eclat reads it at compile time
    names = [n for n in WORKLOADS if not args.only or n in args.only.split(",")]
    if args.compare:
        targets = args.compare.split(",")
        rows = [compare(n, targets, args) for n in names]
        cols = ["workload"] + [f"{t}_ms" for t in targets] + [f"{t}_matches_torch" for t in targets]
        print(table(rows, cols))
        return 0 if all(r[c] for r in rows for c in cols if c.endswith("matches_torch")) else 1
    if not torch.cuda.is_available():
        print("gpu_bench: torch sees no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, rows = time.perf_counter(), []
    for name in names:
        if time.perf_counter() - start > args.budget:
            rows.append({"workload": name, "error": "skipped: time budget spent"})
            continue
        try:
            rows.append(bench(name, args))
        except Exception as e:
            traceback.print_exc()
            rows.append({"workload": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    (out / "gpu_bench.json").write_text(json.dumps(info, indent=2))
    (out / "gpu_bench.md").write_text(f"# eclat CUDA vs torch on {info['device']}\n\n{table(rows)}\n")
    print(table(rows))
    return 0 if all("error" not in r and r.get("eclat_matches_torch") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
