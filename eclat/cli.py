"""The `eclat` command: compile, run, inspect, autotune, bench, tuning databases, devices.

    eclat compile examples/quickstart.py:make --target cpu -o mlp.eclat
    eclat run mlp.eclat --inputs x.npy -o out.npz
    eclat compile examples/generate.py:make --lm --max-len 256 -o gpt2-lm
    eclat generate gpt2-lm --tokens 464,2068,318 --max-new-tokens 32 [--sample --seed 0]
    eclat inspect mlp.eclat [--json] [--html roofline.html] [--measure]
    eclat autotune examples/quickstart.py examples/cnn.py --target cpu --db tuning.db
    eclat db merge tuning-cpu.db tuning-opencl.db -o tuning.db
    eclat bench examples/quickstart.py:make --target cpu
    eclat devices

A model is named FILE.py:FACTORY (FACTORY defaults to `make`), a function returning
(model, example_inputs). Exit status: 0 success, 1 a compile or run failure (one line on
stderr), 2 a usage error.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from eclat.compiler.quantize import MODES as QUANT_MODES

MODES = ("none", "fast", "full")


class Failure(Exception):
    """A failure the command reports on one line and exits 1 for."""


# --- models named on the command line --------------------------------------------------------

def load_factory(spec: str) -> tuple[Any, tuple, Any]:
    """FILE.py[:FACTORY] -> FACTORY() as (model, example_inputs, dynamic_shapes): a factory returns
    (model, example_inputs) or, for sizes known only at run time, (model, example_inputs,
    dynamic_shapes) in torch.export's convention."""
    made = call_factory(spec)
    if not (isinstance(made, tuple) and len(made) in (2, 3)):
        raise Failure(f"{spec}: the factory must return (model, example_inputs[, dynamic_shapes]), "
                      f"it returned {type(made).__name__}")
    model, inputs, dynamic = (*made, None)[:3]
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    elif not isinstance(inputs, tuple):
        inputs = (inputs,)
    return model, inputs, dynamic


def call_factory(spec: str) -> Any:
    """FILE.py[:FACTORY] -> what FACTORY() returns."""
    path, _, name = spec.partition(":")
    name = name or "make"
    if not os.path.isfile(path):
        raise Failure(f"{path}: no such file (expected FILE.py[:FACTORY])")
    for folder in (os.getcwd(), os.path.dirname(os.path.abspath(path))):
        if folder not in sys.path:  # so that a factory may import its neighbours or tests.zoo
            sys.path.insert(0, folder)
    module_name = "_eclat_model_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise Failure(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise Failure(f"{path} has no function {name}() (expected FILE.py[:FACTORY])")
    return factory()


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """eclat.compile's options from the command's."""
    options: dict[str, Any] = {"autotune": args.autotune, "quiet": args.quiet}
    if getattr(args, "threads", None):
        options["threads"] = args.threads
    if getattr(args, "candidates", None):
        options["k"] = args.candidates
    if getattr(args, "db", None):
        options["db"] = args.db
    if getattr(args, "weights", "fp32") != "fp32":
        options["weights"] = args.weights
    if getattr(args, "max_error", None) is not None:
        options["max_error"] = args.max_error
    return options


def _compile(spec: str, args: argparse.Namespace) -> tuple[Any, Any, tuple]:
    """Compile the model named by spec with the command's options: (compiled, model, inputs)."""
    import eclat

    model, inputs, dynamic = load_factory(spec)
    options = _options(args)
    if dynamic is not None:
        options["dynamic_shapes"] = dynamic
    return eclat.compile(model, inputs, target=args.target, **options), model, inputs


def _median_s(fn: Callable[[], Any], budget_s: float = 1.0, least: int = 5, most: int = 1000) -> float:
    fn()  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < least or (time.perf_counter() - start < budget_s and len(times) < most):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# --- commands -----------------------------------------------------------------------------------

def cmd_compile(args: argparse.Namespace) -> None:
    t = time.perf_counter()
    from eclat.compiler.artifact import save_artifact

    if args.lm:
        return _compile_lm(args, t)
    compiled, _, _ = _compile(args.model, args)
    save_artifact(compiled, args.output)
    for note in compiled.report().get("notes", []):  # e.g. kept untuned: the device is absent here
        print(f"eclat: {note}", file=sys.stderr)
    kernels = compiled.report().get("kernels", [])
    print(f"{args.output}: {len(kernels)} kernels, {os.path.getsize(args.output)} bytes, "
          f"compiled for {args.target} in {time.perf_counter() - t:.1f} s")


def _compile_lm(args: argparse.Namespace, start: float) -> None:
    """A causal LM (the factory returns a transformers model, or (model, anything)) compiled for
    generation and saved as a folder."""
    import eclat

    made = call_factory(args.model)
    model = made[0] if isinstance(made, tuple) else made
    lm = eclat.compile_lm(model, max_len=args.max_len, chunk=args.chunk, target=args.target,
                          **_options(args))
    lm.save(args.output)
    print(f"{args.output}: prefill of {args.chunk} tokens and decode step, cache of {args.max_len} "
          f"positions, compiled for {args.target} in {time.perf_counter() - start:.1f} s")


def cmd_generate(args: argparse.Namespace) -> None:
    import eclat

    lm = eclat.load(args.artifact)
    if not isinstance(lm, eclat.CausalLM):
        raise Failure(f"{args.artifact}: not a language model (compile one with `eclat compile --lm`)")
    try:
        prompt = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        raise Failure(f"--tokens must be comma-separated integers, given {args.tokens!r}") from None
    t = time.perf_counter()
    new = lm.generate(prompt, args.max_new_tokens, do_sample=args.sample, temperature=args.temperature,
                      top_k=args.top_k, seed=args.seed, eos_token_id=args.eos)
    seconds = time.perf_counter() - t
    print(",".join(str(t) for t in new))
    print(f"{len(new)} tokens in {seconds:.3f} s ({len(new) / seconds:.1f} tokens/s, "
          f"prompt of {len(prompt)})", file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> None:
    import eclat

    model = eclat.load(args.artifact)
    arrays = []
    for p in args.inputs:
        try:
            arrays.append(np.load(p, allow_pickle=False))
        except (OSError, ValueError) as e:
            raise Failure(f"{p}: not a readable .npy file ({e})") from None
    t = time.perf_counter()
    outs = model(*arrays)
    seconds = time.perf_counter() - t
    outs = outs if isinstance(outs, list) else [outs]
    for j, o in enumerate(outs):
        summary = (f"min {o.min():.4g} max {o.max():.4g} mean {o.astype(np.float64).mean():.4g}"
                   if o.size and o.dtype.kind in "biuf" else "")
        print(f"output {j}: {o.dtype}{list(o.shape)} {summary}")
    print(f"ran in {seconds * 1e3:.3f} ms")
    if args.output:
        np.savez(args.output, **{f"output{j}": o for j, o in enumerate(outs)})
        print(f"wrote {args.output}")


def inspect_data(path: str) -> dict[str, Any]:
    """What `eclat inspect --json` prints: manifest summary, kernels, times, e-graph statistics. Only
    the manifest is read: no code is loaded, so any artifact can be inspected anywhere."""
    from eclat.compiler.artifact import Artifact

    with Artifact(path) as art:
        manifest, files = art.manifest, art.sizes()
    try:
        return _summary(path, manifest, files)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise Failure(f"{path} has a malformed manifest ({type(e).__name__}: {e})") from None


def _summary(path: str, manifest: dict[str, Any], files: dict[str, int]) -> dict[str, Any]:
    report = manifest.get("report") or {}
    kernels = {k["name"]: k for k in manifest["program"]["kernels"]}
    rows = []
    for k in report.get("kernels", []):
        rows.append({**k, "shape": kernels.get(k["name"], {}).get("shape"),
                     "schedule": kernels.get(k["name"], {}).get("schedule")})
    estimates = [k["estimated_us"] for k in rows if k.get("estimated_us") is not None]
    return {
        "path": path, "format_version": manifest["format_version"],
        "eclat_version": manifest["eclat_version"],
        "target": manifest["target"], "device": report.get("device") or {}, "built_on": manifest["device"],
        "inputs": manifest["inputs"],
        "outputs": [{"name": n, "shape": s} for n, s in zip(manifest["program"]["outputs"],
                                                             manifest["program"]["output_shapes"])],
        "kernels": rows, "estimated_us": round(sum(estimates), 3) if estimates else None,
        "egraph": report.get("egraph"), "candidates": report.get("candidates"),
        "memory": report.get("memory"), "compile_seconds": report.get("compile_seconds"),
        "phases": report.get("phases") or {}, "quantization": report.get("quantization"),
        "files": files, "measured_us": None,
    }


def _measure_artifact(path: str) -> float:
    """Median microseconds of one call of the artifact on zero inputs."""
    import eclat
    from eclat.ir.symbolic import upper

    model = eclat.load(path)  # a size known at run time at its largest
    arrays = [np.zeros([upper(n) for n in s.shape], dtype=s.dtype.np) for s in model.inputs]
    return _median_s(lambda: model(*arrays), budget_s=0.5) * 1e6


def cmd_inspect(args: argparse.Namespace) -> None:
    data = inspect_data(args.artifact)
    if args.measure:
        data["measured_us"] = round(_measure_artifact(args.artifact), 3)
    _fill_estimates(data)
    if args.json:
        print(json.dumps(data, indent=1, default=str))
    else:
        print(_inspect_text(data))
    if args.html:
        with open(args.html, "w") as f:
            f.write(roofline_html(data))
        print(f"wrote {args.html}")


def _shape_text(shape: list[Any], bounds: bool = True) -> str:
    """A stored shape as a user reads it: [1, s27 in 2..256, 64] (bounds) or [1, s27, 64]."""
    from eclat.ir.symbolic import describe_shape, size_from_json

    sizes = tuple(size_from_json(n) for n in shape)
    return describe_shape(sizes) if bounds else "[" + ", ".join(str(n) for n in sizes) + "]"


def _inspect_text(d: dict[str, Any]) -> str:
    dev = d["device"]
    built = d["built_on"]
    where = (f"{built.get('cpu', '?')} ({built.get('triple', '?')})" if built.get("kind") == "cpu" else
             built.get("name") or f"no {built.get('kind', 'such')} device (unmeasured)")
    lines = [f"{d['path']}: eclat artifact v{d['format_version']} (eclat {d['eclat_version']}), "
             f"target {d['target']}, built on {where}",
             "inputs:  " + ", ".join(f"{i['name']} {i['dtype']}{_shape_text(i['shape'])}"
                                     for i in d["inputs"]),
             "outputs: " + ", ".join(f"{o['name']} {_shape_text(o['shape'], bounds=False)}"
                                     for o in d["outputs"])]
    if dev.get("name"):
        lines.append(f"device:  {dev['name']} ({_num(dev.get('peak_gflops'))} GFLOP/s, "
                     f"{_num(dev.get('peak_gbps'))} GB/s)")
    lines.append(f"{'kernel':<22} {'shape':<16} {'schedule':<34} {'MFLOP':>8} {'KB':>8} "
                 f"{'est us':>8} {'meas us':>8}")
    for k in d["kernels"]:
        s = k.get("schedule") or {}
        sched = f"tile={s.get('tile')} vec={s.get('vector')} thr={s.get('threads')}" if s else "-"
        shape = _shape_text(k["shape"], bounds=False) if k.get("shape") is not None else "-"
        lines.append(f"{k['name'][:22]:<22} {shape[:16]:<16} {sched[:34]:<34} "
                     f"{k['flops'] / 1e6:>8.3f} {k['bytes'] / 1e3:>8.1f} {_num(k.get('estimated_us')):>8} "
                     f"{_num(k.get('measured_us')):>8}")
    measured = f"measured {_num(d['measured_us'])} us (median, this machine)" if d["measured_us"] else \
        "not measured (--measure runs it here)"
    lines.append(f"whole model: estimated {_num(d['estimated_us'])} us, {measured}")
    if d.get("compile_seconds") is not None:
        spent = ", ".join(f"{name} {s:.2f}" for name, s in sorted(d["phases"].items(), key=lambda kv: -kv[1]))
        lines.append(f"compiled in {d['compile_seconds']:.2f} s" + (f" ({spent})" if spent else ""))
    eg = d.get("egraph") or {}
    if eg.get("enodes") is not None:
        lines.append(f"e-graph: {eg['enodes']} e-nodes, {eg['eclasses']} e-classes, "
                     f"{eg['iterations']} iterations, {eg['seconds']} s"
                     + (f", {eg['stopped']}" if eg.get("stopped") else ""))
    c = d.get("candidates") or {}
    if c:
        lines.append(f"candidates: {c.get('extracted')} extracted, {c.get('pruned')} pruned, "
                     f"{c.get('timed')} timed, {len(c.get('failed') or [])} failed, chose {c.get('chosen')}")
        lines += [f"  {n}: {what}" for n, what in enumerate(c.get("differences") or [])]
    q = d.get("quantization")
    if q:
        worst = max(q["layers"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        lines.append(f"weights: {q['weights']} ({', '.join(f'{n} {f}' for f, n in q['formats'].items())}), "
                     f"{q['stored_bytes']} of {q['float32_bytes']} float32 bytes; relative error of the "
                     f"outputs {', '.join(_num(e) for e in q['outputs'][:4])}; worst layer {worst[0]} "
                     f"{_num(worst[1])}")
    if d.get("memory"):
        lines.append(f"memory: arena {d['memory']['arena_bytes']} bytes "
                     f"(without reuse {d['memory']['without_reuse_bytes']})")
    lines.append("files: " + ", ".join(f"{n} {b} B" for n, b in d["files"].items()))
    return "\n".join(lines)


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def _fill_estimates(data: dict[str, Any]) -> None:
    """Device peaks and per-kernel roofline estimates where the report has none (a compile
    with --autotune none measures no device): from the device model, measured once and cached."""
    dev = data["device"]
    if dev.get("peak_gflops") and all(k.get("estimated_us") is not None for k in data["kernels"]):
        return
    try:
        from eclat.autotune import estimate_us, get_device

        device = get_device(data["target"])
    except Exception as e:  # no device model here: the table and chart go without estimates
        print(f"eclat: no device model for {data['target']} ({type(e).__name__}: {e})", file=sys.stderr)
        return
    if not dev.get("peak_gflops"):
        dev.update(name=device.name, fingerprint=device.fingerprint, peak_gflops=device.gflops("float32"),
                   peak_gbps=device.peak_gbps)
    for k in data["kernels"]:
        if k.get("estimated_us") is None:
            k["estimated_us"] = round(estimate_us(k["flops"], k["bytes"], device), 3)
    data["estimated_us"] = round(sum(k["estimated_us"] for k in data["kernels"]), 3)


def roofline_points(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per kernel: arithmetic intensity (FLOP/byte) and GFLOP/s, from the measured time if there
    is one, else from the roofline estimate (marked)."""
    points = []
    for k in data["kernels"]:
        us = k.get("measured_us") or k.get("estimated_us")
        if not us or not k["flops"] or not k["bytes"]:
            continue
        points.append({"name": k["name"], "intensity": k["flops"] / k["bytes"],
                       "gflops": k["flops"] / (us * 1e3), "measured": bool(k.get("measured_us"))})
    return points


def _decades(values: list[float]) -> tuple[float, float]:
    """Axis range in whole decades around values, at least two decades wide."""
    lo = 10 ** math.floor(math.log10(min(values, default=0.01)))
    hi = 10 ** math.ceil(math.log10(max(values, default=100)))
    return lo, max(hi, lo * 100)


def roofline_html(data: dict[str, Any]) -> str:
    """A self-contained HTML page with an inline SVG roofline chart (log-log) and the kernel table."""
    w, h, pad = 640, 420, 60
    dev = data["device"]
    points = roofline_points(data)
    peak, bw = dev.get("peak_gflops"), dev.get("peak_gbps")
    xs = [p["intensity"] for p in points] + ([peak / bw] if peak and bw else [])
    ys = [p["gflops"] for p in points] + ([peak] if peak else [])
    x0, x1 = _decades(xs)
    y0, y1 = _decades(ys)

    def px(x: float) -> float:
        return pad + (w - 2 * pad) * (math.log10(x) - math.log10(x0)) / (math.log10(x1) - math.log10(x0))

    def py(y: float) -> float:
        return h - pad - (h - 2 * pad) * (math.log10(y) - math.log10(y0)) / (math.log10(y1) - math.log10(y0))

    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="11"><rect width="{w}" height="{h}" fill="white"/>',
           f'<rect x="{pad}" y="{pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" fill="none" '
           'stroke="#888"/>']
    for e in range(round(math.log10(x0)), round(math.log10(x1)) + 1):
        svg.append(f'<text x="{px(10 ** e):.1f}" y="{h - pad + 15}" text-anchor="middle">1e{e}</text>')
    for e in range(round(math.log10(y0)), round(math.log10(y1)) + 1):
        svg.append(f'<text x="{pad - 5}" y="{py(10 ** e) + 4:.1f}" text-anchor="end">1e{e}</text>')
    svg.append(f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">arithmetic intensity (FLOP/byte)</text>')
    svg.append(f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" text-anchor="middle">'
               f'GFLOP/s</text>')
    if peak and bw:
        ridge = peak / bw
        xa = max(x0, y0 / bw)
        svg.append(f'<polyline fill="none" stroke="#c33" stroke-width="2" points="{px(xa):.1f},'
                   f'{py(xa * bw):.1f} {px(ridge):.1f},{py(peak):.1f} {px(x1):.1f},{py(peak):.1f}"/>')
        svg.append(f'<text x="{px(x1) - 4:.1f}" y="{py(peak) - 5:.1f}" text-anchor="end" fill="#c33">'
                   f'{peak:.1f} GFLOP/s</text>')
        svg.append(f'<text x="{px(xa) + 4:.1f}" y="{py(xa * bw) - 5:.1f}" fill="#c33">{bw:.1f} GB/s</text>')
    for p in points:
        fill = "#36c" if p["measured"] else "none"
        svg.append(f'<circle cx="{px(p["intensity"]):.1f}" cy="{py(p["gflops"]):.1f}" r="5" fill="{fill}" '
                   f'stroke="#36c"><title>{html.escape(p["name"])}: {p["gflops"]:.3g} GFLOP/s at '
                   f'{p["intensity"]:.3g} FLOP/B</title></circle>')
        svg.append(f'<text x="{px(p["intensity"]) + 7:.1f}" y="{py(p["gflops"]) + 4:.1f}">'
                   f'{html.escape(p["name"])}</text>')
    svg.append("</svg>")
    rows = "".join(f"<tr><td>{html.escape(k['name'])}</td><td>{k['flops']}</td><td>{k['bytes']}</td>"
                   f"<td>{_num(k.get('estimated_us'))}</td><td>{_num(k.get('measured_us'))}</td></tr>"
                   for k in data["kernels"])
    where = dev.get("name") or data["target"]
    title = html.escape(f"eclat roofline: {os.path.basename(data['path'])} on {where}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
            f"<h1>{title}</h1>{''.join(svg)}<p>Filled: measured time; hollow: roofline estimate. "
            f"Whole model: estimated {_num(data['estimated_us'])} us, "
            f"measured {_num(data.get('measured_us'))} us."
            f"</p><table border='1' cellpadding='3'><tr><th>kernel</th><th>FLOPs</th><th>bytes</th>"
            f"<th>estimated us</th><th>measured us</th></tr>{rows}</table></body></html>\n")


def cmd_autotune(args: argparse.Namespace) -> None:
    for spec in args.models:
        t = time.perf_counter()
        compiled, _, _ = _compile(spec, args)
        cache = compiled.report().get("tuning_cache") or {}
        print(f"{spec}: tuned for {args.target} in {time.perf_counter() - t:.1f} s "
              f"({cache.get('hits', 0)} DB hits, {cache.get('misses', 0)} misses) -> {args.db}")


def cmd_db_merge(args: argparse.Namespace) -> None:
    from eclat.autotune.db import merge

    counts = merge(args.inputs, args.output)
    print(f"{args.output}: merged {counts['inputs']} files, {counts['read']} entries read, "
          f"{counts['entries']} entries")


def cmd_bench(args: argparse.Namespace) -> None:
    import torch

    compiled, model, inputs = _compile(args.model, args)
    torch.set_num_threads(args.threads or 1)
    arrays = [x.detach().numpy() if hasattr(x, "detach") else x for x in inputs]
    rows: dict[str, float | str] = {}
    with torch.inference_mode():
        rows["eclat"] = _median_s(lambda: compiled(*arrays), args.budget)
        rows["torch eager"] = _median_s(lambda: model(*inputs), args.budget)
        if not args.no_torch_compile:
            try:
                fast = torch.compile(model)
                rows["torch.compile"] = _median_s(lambda: fast(*inputs), args.budget)
            except Exception as e:  # torch.compile failing is a row of the table, not a failure
                rows["torch.compile"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    base = rows["eclat"]
    print(f"{args.model} on {args.target}, {args.threads or 1} thread(s), median of repeats "
          f"(vs eclat: time / eclat's time, above 1 means eclat is faster)")
    print(f"{'runner':<15} {'median ms':>10} {'vs eclat':>9}")
    for name, v in rows.items():
        if isinstance(v, str):
            print(f"{name:<15} {v}")
        else:
            print(f"{name:<15} {v * 1e3:>10.4f} {v / base:>8.2f}x")


def cmd_devices(args: argparse.Namespace) -> None:
    from eclat.autotune.device import describe_devices

    rows = describe_devices(measure=not args.no_measure)
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
        return
    for r in rows:
        peaks = (f"{r['peak_gflops'].get('float32', 0):.1f} GFLOP/s, {r['peak_gbps']:.1f} GB/s, "
                 f"launch {r['launch_overhead_us']:.2f} us" if "peak_gflops" in r else r.get("error", ""))
        print(f"{r['target']:<10} {r['name']:<40} {peaks}")


# --- the parser --------------------------------------------------------------------------------

def _model_options(p: argparse.ArgumentParser, tune_default: str = "fast",
                   modes: Sequence[str] = MODES) -> None:
    from eclat.backends import target_names

    targets = target_names()
    p.add_argument("--target", default="cpu", choices=targets, help=f"{', '.join(targets)} (default cpu)")
    p.add_argument("--autotune", choices=modes, default=tune_default,
                   help=f"schedule search: {', '.join(modes)} (default {tune_default})")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per kernel (default 1)")
    p.add_argument("--candidates", type=int, default=None, metavar="K",
                   help="candidate programs extracted from the e-graph (default 8)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--weights", choices=QUANT_MODES, default="fp32",
                   help="store the weights of products in a low-precision format: "
                        f"{', '.join(QUANT_MODES)} (default fp32; the error is in the report)")
    p.add_argument("--max-error", type=float, default=None, metavar="E",
                   help="--weights: refuse a quantization whose relative error on an output exceeds E")


def _version() -> str:
    from eclat.compiler.artifact import eclat_version

    return eclat_version()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eclat", description="eclat: an equality-saturation compiler for "
                                 "PyTorch inference.", epilog="A MODEL is FILE.py[:FACTORY]; FACTORY() "
                                 "returns (model, example_inputs) and defaults to make.")
    ap.add_argument("--version", action="version", version=f"eclat {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compile", help="compile a model to an artifact",
                       description="Compile a model and write one self-contained artifact file.")
    p.add_argument("model", metavar="MODEL", help="FILE.py[:FACTORY]")
    p.add_argument("-o", "--output", required=True, help="artifact to write (e.g. model.eclat)")
    p.add_argument("--db", help="tuning database to read and update")
    p.add_argument("--lm", action="store_true", help="a transformers causal LM (the factory may return "
                   "the model alone): a prefill and a decode program with a KV cache, written as a folder")
    p.add_argument("--max-len", type=int, default=256, help="--lm: the cache's positions (default 256)")
    p.add_argument("--chunk", type=int, default=32, help="--lm: prompt tokens per prefill call (default 32)")
    _model_options(p)
    p.set_defaults(run=cmd_compile)

    p = sub.add_parser("generate", help="generate tokens with a language model compiled with --lm",
                       description="Greedy (or sampled) continuation of token ids; no tokenizer needed.")
    p.add_argument("artifact", help="a folder written by `eclat compile --lm`")
    p.add_argument("--tokens", required=True, help="the prompt's token ids, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--sample", action="store_true", help="sample instead of taking the most likely token")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--eos", type=int, default=None, help="stop after this token id")
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("run", help="run an artifact on .npy inputs",
                       description="Load an artifact (no torch needed) and run it on .npy inputs.")
    p.add_argument("artifact", help="an artifact written by `eclat compile`")
    p.add_argument("--inputs", nargs="+", default=[], metavar="NPY", help="one .npy file per model input")
    p.add_argument("-o", "--output", help="write the outputs to this .npz (output0, output1, ...)")
    p.set_defaults(run=cmd_run)

    p = sub.add_parser("inspect", help="show an artifact's kernels, schedules and times",
                       description="Kernels, schedules, estimated (and with --measure, measured) time, "
                       "e-graph statistics. Reads the manifest only: works anywhere, for any target.")
    p.add_argument("artifact")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--html", metavar="PATH", help="write a roofline chart as HTML with inline SVG")
    p.add_argument("--measure", action="store_true",
                   help="also load and time the model here (needs the artifact's device)")
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("autotune", help="tune models and record the schedules in a database",
                       description="Compile each model with schedule search and record the winners in DB.")
    p.add_argument("models", nargs="+", metavar="MODEL", help="FILE.py[:FACTORY] ...")
    p.add_argument("--db", required=True, help="tuning database to create or update")
    _model_options(p, "full", ("fast", "full"))
    p.set_defaults(run=cmd_autotune)

    p = sub.add_parser("db", help="tuning database tools", description="Tuning database tools.")
    dbs = p.add_subparsers(dest="db_command", required=True, metavar="DBCOMMAND")
    m = dbs.add_parser("merge", help="merge databases, keeping the faster entry per key",
                       description="Merge tuning databases; the faster entry per key wins.")
    m.add_argument("inputs", nargs="+", metavar="DB")
    m.add_argument("-o", "--output", required=True, help="database to write (created or added to)")
    m.set_defaults(run=cmd_db_merge)

    p = sub.add_parser("bench", help="time a model against torch eager and torch.compile",
                       description="Side by side: eclat, torch eager and torch.compile (medians, ratios).")
    p.add_argument("model", metavar="MODEL", help="FILE.py[:FACTORY]")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timing per runner (default 1)")
    p.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile (slow to build)")
    p.add_argument("--db", help="tuning database to read and update")
    _model_options(p, "none")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("devices", help="list the devices and their measured peaks",
                       description="Devices eclat can target here, with measured peaks.")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-measure", action="store_true", help="list only; measure nothing")
    p.set_defaults(run=cmd_devices)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error
    for written in ("output", "html"):  # before any work: a compile may take minutes
        path = getattr(args, written, None)
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            parser.error(f"cannot write {path}: there is no folder {folder}")
    try:
        args.run(args)
    except KeyboardInterrupt:
        print("eclat: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader stopped early (`eclat inspect --json | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except Exception as e:  # one line for scripts and people; the traceback is for ECLAT_DEBUG=1
        if os.environ.get("ECLAT_DEBUG"):
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        kind = "" if isinstance(e, Failure) else f"{type(e).__name__}: "
        print(f"eclat: error: {kind}{message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
