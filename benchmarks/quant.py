"""Weight-only int8 (and bf16/int4) against the peers' int8: time and error, side by side.

    python benchmarks/quant.py [--threads 1] [--only mlp_b1,bert_b1] [--weights int8,int4] [--out table.md]

For an MLP and a BERT-style encoder (random weights) at batch 1 and 64: eclat float32 and eclat with
`weights=` each mode; torch eager float32 and `torch.ao.quantization.quantize_dynamic` (int8
weights, activations quantized per call); onnxruntime float32 and its dynamic int8 quantization
(`onnxruntime.quantization.quantize_dynamic`, QInt8 weights). Times are medians of interleaved
calls in this one process (benchmarks/run.py's time_interleaved); the error is the relative L2
error of the output against torch's float32 output on the same input.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads its OpenMP runtime

import argparse
import io
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import MLP, time_interleaved  # noqa: E402

import eclat  # noqa: E402


def _bert(batch: int, seq: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                     intermediate_size=1536, vocab_size=8192)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()

    class Encoder(torch.nn.Module):  # last hidden state only: one output for every runner
        def __init__(self):
            super().__init__()
            self.bert = model

        def forward(self, ids):
            return self.bert(input_ids=ids).last_hidden_state

    return Encoder().eval(), (torch.randint(0, config.vocab_size, (batch, seq)),)


def _mlp(batch: int):
    torch.manual_seed(0)
    return MLP(), (torch.randn(batch, 512),)


WORKLOADS = {"mlp_b1": lambda: _mlp(1), "mlp_b64": lambda: _mlp(64),
             "bert_b1": lambda: _bert(1, 128), "bert_b64": lambda: _bert(64, 16)}


def _onnx(model, inputs, threads: int, int8: bool):
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    buf = io.BytesIO()
    torch.onnx.export(model, inputs, buf, dynamo=False)
    data = buf.getvalue()
    if int8:
        with tempfile.TemporaryDirectory() as d:
            src, dst = os.path.join(d, "m.onnx"), os.path.join(d, "q.onnx")
            Path(src).write_bytes(data)
            quantize_dynamic(src, dst, weight_type=QuantType.QInt8)
            data = Path(dst).read_bytes()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    feed = {i.name: x.numpy() for i, x in zip(sess.get_inputs(), inputs)}
    return lambda: sess.run(None, feed)[0]


def _error(got, want: np.ndarray) -> float:
    got = np.asarray(got.detach() if hasattr(got, "detach") else got, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--weights", default="int8", help="eclat's modes besides fp32, comma-separated")
    ap.add_argument("--autotune", default="none")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from eclat.backends.cpu import host

    about = host.description()
    modes = ["fp32"] + [m for m in args.weights.split(",") if m and m != "fp32"]
    lines = [f"host: {about['cpu']} ({about['vector_unit']}, {about['lanes']} float32 lanes), "
             f"{args.threads} thread(s), eclat autotune={args.autotune}; ms (median) and relative error "
             f"against torch float32",
             "", "| workload | runner | ms | error | vs eclat fp32 |", "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name in args.only.split(","):
        model, inputs = WORKLOADS[name]()
        with torch.inference_mode():
            want = np.asarray(model(*inputs), np.float64)
        runners = {}
        for mode in modes:
            compiled = eclat.compile(model, inputs, threads=args.threads, autotune=args.autotune,
                                     weights=mode, quiet=True)
            arrays = [x.numpy() for x in inputs]
            runners[f"eclat {mode}"] = lambda c=compiled, a=arrays: c(*a)
        qmodel = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        runners["torch eager fp32"] = lambda m=model, x=inputs: m(*x)
        runners["torch quantize_dynamic int8"] = lambda m=qmodel, x=inputs: m(*x)
        runners["onnxruntime fp32"] = _onnx(model, inputs, args.threads, int8=False)
        runners["onnxruntime dynamic int8"] = _onnx(model, inputs, args.threads, int8=True)
        with torch.inference_mode():
            errors = {r: _error(fn(), want) for r, fn in runners.items()}
            times = time_interleaved(runners, rounds=5)
        base = times["eclat fp32"]
        for r, t in times.items():
            line = f"| {name} | {r} | {t * 1e3:.3f} | {errors[r]:.2e} | {base / t:.2f}x |"
            lines.append(line)
            print(line, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
