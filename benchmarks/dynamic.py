"""One compile for every size: eclat compiled once with dynamic_shapes, called at several sizes,
side by side with eclat compiled for each size alone, torch eager, torch.compile(dynamic=True) and
onnxruntime (exported with dynamic axes), all in one process; compile times beside.

    python benchmarks/dynamic.py --threads 1 [--autotune fast] [--only encoder] [--sizes 1,7,32,128,256]

With a search (`--autotune fast`), the one compile also searches at its sizes' ends and keeps the
programs that win there (compiler/buckets.py); what it found is printed after each model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.export import Dim

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from run import time_interleaved  # noqa: E402

MAX = 512


def _encoder():
    layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    return model, lambda n: (torch.randn(1, n, 128),), 1


def _gpt2():
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=MAX,
                                     bos_token_id=0, eos_token_id=0)
    lm = transformers.GPT2LMHeadModel(config)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids, use_cache=False).logits
    return Logits(), lambda n: (torch.randint(0, 4096, (1, n)),), 1


def _mlp():
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    return model, lambda n: (torch.randn(n, 256),), 0


MODELS = {"encoder": _encoder, "gpt2_4x256": _gpt2, "mlp_batch": _mlp}


def _onnxruntime(model, example, axis, threads):
    """An onnxruntime session of model exported with the length axis dynamic (torch's dynamo
    exporter: the TorchScript one bakes traced lengths into reshapes)."""
    import onnxruntime as ort

    program = torch.onnx.export(model, example, dynamo=True, input_names=["x"],
                                dynamic_shapes=({axis: Dim("n", min=1, max=MAX)},))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(program.model_proto.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    return lambda *xs: sess.run(None, {"x": xs[0].numpy()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="")
    ap.add_argument("--sizes", default="1,7,32,128,512")
    ap.add_argument("--no-static", action="store_true", help="skip eclat compiled per size")
    ap.add_argument("--autotune", default="none", help="eclat's search, for every eclat compile")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import eclat
    from eclat.backends.cpu import host
    from eclat.compiler.model import CompiledModel

    about = host.description()
    print(f"host: {about['cpu']} ({about['vector_unit']}, {about['lanes']} float32 lanes), "
          f"{os.cpu_count()} cores; threads={args.threads}, autotune={args.autotune}\n")
    sizes = [int(s) for s in args.sizes.split(",")]
    names = ["eclat (one compile)", "eclat (per size)", "eager", "torch.compile dynamic", "onnxruntime",
             "eclat (example's program only)"]
    print("| model | size | " + " | ".join(f"{n} ms" for n in names) + " | " +
          " | ".join(f"{n}/eclat" for n in names[1:]) + " |")
    print("|" + "---|" * (2 + 2 * len(names) - 1))
    for name, make in MODELS.items():
        if args.only and name not in args.only.split(","):
            continue
        torch.manual_seed(0)
        model, inputs, axis = make()
        model.eval()
        compiles = {}
        try:  # outside inference mode: there an encoder layer exports as its fused fast-path op
            ort = _onnxruntime(model, inputs(16), axis, args.threads)
        except Exception as e:  # a peer failing is reported, not fatal
            print(f"onnxruntime failed on {name}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            ort = None
        with torch.inference_mode():
            t0 = time.perf_counter()
            dynamic = eclat.compile(model, inputs(16), dynamic_shapes=({axis: Dim("n", min=1, max=MAX)},),
                                    autotune=args.autotune, threads=args.threads, quiet=True)
            compiles["eclat one"] = time.perf_counter() - t0
            buckets = getattr(dynamic.executable, "buckets", None)
            example_only = buckets and CompiledModel(buckets[0].executable, dynamic.program_inputs,
                                                     dynamic.out_spec, dynamic.compile_report)
            tc = torch.compile(model, dynamic=True)
            t0 = time.perf_counter()
            tc(*inputs(16))
            compiles["torch.compile"] = time.perf_counter() - t0
            compiles["eclat per size"] = 0.0
            for n in sizes:
                xs = inputs(n)
                arrays = [x.numpy() for x in xs]
                fns = {names[0]: partial(dynamic, *arrays), names[2]: partial(model, *xs),
                       names[3]: partial(tc, *xs)}
                if example_only is not None:  # the one compile without its programs for other sizes
                    fns[names[5]] = partial(example_only, *arrays)
                if ort is not None:
                    fns[names[4]] = partial(ort, *xs)
                if not args.no_static:
                    t0 = time.perf_counter()
                    static = eclat.compile(model, xs, autotune=args.autotune, threads=args.threads,
                                           quiet=True)
                    compiles["eclat per size"] += time.perf_counter() - t0
                    fns[names[1]] = partial(static, *arrays)
                want = model(*xs).numpy()
                assert np.allclose(dynamic(*arrays), want, rtol=1e-3, atol=1e-3), (name, n)
                for peer in [k for k in fns if k != names[0]]:
                    try:
                        fns[peer]()
                    except Exception as e:  # a peer failing at this size is reported, not fatal
                        print(f"{peer} failed on {name} at {n}: {type(e).__name__}: {str(e)[:80]}")
                        del fns[peer]
                timed = time_interleaved(fns, rounds=5, slice_s=0.2)
                ms = [timed.get(k) for k in names]
                cells = [f"{t * 1e3:.3f}" if t else "—" for t in ms]
                ratios = [f"{t / ms[0]:.2f}" if t else "—" for t in ms[1:]]
                print(f"| {name} | {n} | " + " | ".join(cells + ratios) + " |", flush=True)
        print(f"| {name} | compile s | " + ", ".join(f"{k} {v:.1f}" for k, v in compiles.items()) + " |")
        for row in dynamic.report().get("buckets", ()):
            print(f"|   | searched at {row['sizes']} | kept: {row['kept']}, candidate {row['candidate']}, "
                  f"{row['us']} us against the example's program's {row['example_us']} us |")


if __name__ == "__main__":
    main()
