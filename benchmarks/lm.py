"""Language-model inference: time to first token and decode speed, eclat against transformers.

    python benchmarks/lm.py [--models gpt2,llama] [--threads 1] [--prompts 128,512] [--new 128]
                            [--autotune fast] [--torch-compile] [--weights fp32,int8] [--torch-int8]
                            [--onnxruntime] [--out table.md]

Models are random-weight configs (no download): GPT-2 small's shape (12 layers, d=768, 124M
parameters) and a Llama of about 300M parameters. For each: eclat's compile time; time to first
token for each prompt length (median of a few prefills); decode tokens/s over --new tokens after
the longest prompt; the same for transformers eager `generate` (its dynamic cache) and, with
--torch-compile, transformers with its static cache and a torch.compile'd forward. Decode is also
given as a fraction of the bandwidth roofline: bytes read per token (every weight once, the KV
cache eclat's static cache reads) over the triad bandwidth eclat's device probe measured.

--weights compiles eclat once per mode (`weights=`: fp32, bf16, int8, int4, int4-128), each with its
agreement with the model (mean KL divergence of the next-token distributions, top-1 agreement;
eclat.generate.agreement); --torch-int8 adds transformers eager with torch's dynamic int8
quantization of its nn.Linear layers (GPT-2's Conv1D layers are not nn.Linear: it leaves them);
--onnxruntime adds onnxruntime running the model exported to ONNX with its KV cache as inputs and
outputs, in float32 and after its dynamic int8 quantization (benchmarks/ort_decoder.py), the
compile column then being the export's seconds.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads its OpenMP runtime

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import eclat  # noqa: E402


def make(name: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, bos_token_id=0, eos_token_id=0)
    elif name == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=12, hidden_size=1024, intermediate_size=2816,
                                          num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                          max_position_embeddings=2048, bos_token_id=0, eos_token_id=0)
    elif name == "llama1b":  # the "1B" shape: 0.85B parameters, 3.4 GB of float32 weights
        config = transformers.LlamaConfig(num_hidden_layers=16, hidden_size=2048, intermediate_size=5632,
                                          num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                          max_position_embeddings=2048, bos_token_id=0, eos_token_id=0)
    else:
        raise SystemExit(f"unknown model {name!r}: gpt2, llama or llama1b")
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def median_s(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def hf_times(model, prompt: list[int], new: int, runs: int, **generate) -> tuple[float, float]:
    """transformers generate: (seconds to the first token, decode tokens/s after it)."""
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)

    def run(n: int) -> None:
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       **generate)

    run(2)  # warm-up (and torch.compile's compile)
    first = median_s(lambda: run(1), runs)
    total = median_s(lambda: run(new + 1), max(1, runs // 2))
    return first, new / max(total - first, 1e-9)


def peer_row(model, token_prompts: dict[int, list[int]], new: int, runs: int, roof: float,
             agreement: str = "0, 1.00", **generate) -> tuple:
    """A transformers runner's row: (compile s, first-token seconds per prompt, decode tokens/s, its
    roofline, agreement); decode after the longest prompt."""
    t = time.perf_counter()
    longest = max(token_prompts)
    times = [hf_times(model, tokens, new if p == longest else 1, runs, **generate)
             for p, tokens in token_prompts.items()]
    took = f"{time.perf_counter() - t:.0f}" if generate else ""  # torch.compile's compile is in it
    return took, [f for f, _ in times], times[-1][1], roof, agreement


def torch_agreement(qmodel, model, max_len: int, positions: int = 64) -> str:
    """eclat.generate.agreement's figures for a torch model against the float32 one."""
    from eclat.generate import next_token_agreement

    def logits_of(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            return qmodel(torch.tensor([tokens]), use_cache=False).logits[0].double().numpy()

    a = next_token_agreement(model, min(positions, max_len), logits_of)
    return f"{a['mean_kl']:.2g}, {a['top1']:.2f}"


def ort_row(model, threads: int, int8: bool, token_prompts: dict[int, list[int]], new: int, runs: int,
            roof: float, max_len: int) -> tuple:
    """onnxruntime's row (benchmarks/ort_decoder.py): export (and quantization) seconds, first token
    per prompt, decode tokens/s after the longest prompt (best of two), its roofline, agreement."""
    from ort_decoder import OrtDecoder

    from eclat.generate import next_token_agreement

    t = time.perf_counter()
    dec = OrtDecoder(model, threads, int8)
    took = f"{time.perf_counter() - t:.0f}"

    def prefill(tokens: list[int]) -> np.ndarray:
        dec.start()
        return dec.feed(tokens)

    firsts = [median_s(lambda t=tokens: prefill(t), runs) for tokens in token_prompts.values()]
    rates = []
    for _ in range(2):
        token = int(prefill(token_prompts[max(token_prompts)]).argmax())
        t = time.perf_counter()
        for _ in range(new):
            token = int(dec.feed([token]).argmax())
        rates.append(new / (time.perf_counter() - t))

    def logits_of(tokens: list[int]) -> np.ndarray:
        dec.start()
        return np.stack([dec.feed([tok]) for tok in tokens])

    a = next_token_agreement(model, min(64, max_len), logits_of)
    return took, firsts, max(rates), roof, f"{a['mean_kl']:.2g}, {a['top1']:.2f}"


def compile_times(name: str, max_len: int, chunk: int, autotune: str, threads: int) -> str:
    """The first compile of a model into an empty cache folder and the second from it, with what the
    first spent on the e-graph and how many candidates it timed, per program."""
    model = make(name)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())  # tied weights once
    with tempfile.TemporaryDirectory() as cache:
        times, peaks, lms = [], [], []
        for _ in range(2):
            t = time.perf_counter()
            with peak_memory() as peak:
                lms.append(eclat.compile_lm(model, max_len=max_len, chunk=chunk, autotune=autotune,
                                            threads=threads, quiet=True, cache_dir=cache))
            times.append(time.perf_counter() - t)
            peaks.append(f"{peak[0] / 1e9:.2f} GB ({peak[0] / weights:.1f}x the weights)")
    reports = [p.report() for p in (lms[0].prefill, lms[0].decode)]
    egraph = ", ".join(f"{r['egraph']['seconds']:.1f}" for r in reports)
    timed = ", ".join(str(r["candidates"]["timed"]) for r in reports)
    return (f"{name}: first compile {times[0]:.1f} s (e-graph {egraph} s, candidates timed {timed}; "
            f"prefill, decode), second from the cache {times[1]:.1f} s; peak memory over the process's "
            f"before the compile (the model and torch loaded): first {peaks[0]}, second {peaks[1]}")


def _rss() -> int:
    with open("/proc/self/statm") as f:  # Linux: resident pages
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_memory(every_s: float = 0.02) -> Iterator[list[int]]:
    """[the most resident bytes seen above the start] while the block runs, sampled by a thread."""
    start, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            peak[0] = max(peak[0], _rss() - start)
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        yield peak
    finally:
        done.set()
        watcher.join()
        peak[0] = max(peak[0], _rss() - start)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", default="128,512")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--autotune", default="fast")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--torch-compile", action="store_true")
    ap.add_argument("--weights", default="fp32", help="eclat's weight formats, comma-separated (fp32 first)")
    ap.add_argument("--torch-int8", action="store_true")
    ap.add_argument("--onnxruntime", action="store_true",
                    help="add onnxruntime float32 and dynamic int8 rows (benchmarks/ort_decoder.py)")
    ap.add_argument("--out")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile each model twice into an empty cache folder and report only the compiles")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = [int(p) for p in args.prompts.split(",")]
    max_len = max(prompts) + args.new + 1
    chunk = min(args.chunk, max_len)

    from eclat.autotune.device import get_device
    from eclat.backends.cpu import host

    about = host.description()
    gbps = get_device("cpu", threads=args.threads).peak_gbps
    lines = [f"host: {about['cpu']} ({about['vector_unit']}, {about['lanes']} float32 lanes), "
             f"{os.cpu_count()} cores; {args.threads} thread(s); triad {gbps:.1f} GB/s; eclat autotune="
             f"{args.autotune}, static cache of {max_len}, prefill chunk {chunk}", "",
             "| model | runner | compile s | " + " | ".join(f"first token @{p} ms" for p in prompts) +
             " | decode tok/s | of roofline | KL, top-1 | eclat speed-up |",
             "|---|---|---|" + "---|" * len(prompts) + "---|---|---|---|"]
    print("\n".join(lines), flush=True)
    if args.compile_only:
        for name in args.models.split(","):
            print(compile_times(name, max_len, chunk, args.autotune, args.threads), flush=True)
        return
    rng = np.random.default_rng(0)
    notes: list[str] = []
    for name in args.models.split(","):
        model = make(name)
        vocab = model.config.vocab_size
        token_prompts = {p: rng.integers(1, vocab, p).tolist() for p in prompts}
        params = sum(t.numel() for t in model.parameters())  # tied weights once
        cfg = model.config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        cache_bytes = 2 * cfg.num_hidden_layers * kv_heads * head_dim * max_len * 4
        roof = gbps * 1e9 / (params * 4 + cache_bytes)  # tokens/s if every byte moved at triad speed

        rows, same = {}, []
        longest = token_prompts[max(prompts)]
        check = torch.tensor([longest[:32]])
        check_new = min(16, max_len - check.shape[1])  # greedy tokens compared, within the cache
        want = model.generate(check, attention_mask=torch.ones_like(check), max_new_tokens=check_new,
                              min_new_tokens=check_new, do_sample=False)[0, check.shape[1]:].tolist()
        for mode in args.weights.split(","):
            t = time.perf_counter()
            lm = eclat.compile_lm(model, max_len=max_len, chunk=chunk, autotune=args.autotune,
                                  threads=args.threads, quiet=True, weights=mode)
            compile_s = time.perf_counter() - t
            firsts = [median_s(lambda t=token_prompts[p], lm=lm: lm.logits(t), args.runs) for p in prompts]
            rate = max(lm.tokens_per_second(longest, args.new)[1] for _ in range(2))
            q = lm.decode.report().get("quantization")
            mode_roof = gbps * 1e9 / ((q["stored_bytes"] if q else params * 4) + cache_bytes)
            ag = lm.agreement or {"mean_kl": 0.0, "top1": 1.0}
            rows[f"eclat {mode}"] = (f"{compile_s:.0f}", firsts, rate, mode_roof,
                                     f"{ag['mean_kl']:.2g}, {ag['top1']:.2f}")
            same.append(f"{mode} {lm.generate(longest[:32], check_new) == want}")
            del lm

        with torch.inference_mode():
            common = (token_prompts, args.new, args.runs, roof)
            rows["transformers eager"] = peer_row(model, *common)
            if args.torch_int8:
                qmodel = torch.ao.quantization.quantize_dynamic(make(name), {torch.nn.Linear},
                                                                dtype=torch.qint8)
                rows["transformers eager, torch dynamic int8"] = peer_row(
                    qmodel, *common, torch_agreement(qmodel, model, max_len))
            if args.onnxruntime:
                for int8 in (False, True):
                    rows[f"onnxruntime {'dynamic int8' if int8 else 'fp32'}"] = ort_row(
                        model, args.threads, int8, *common, max_len)
            if args.torch_compile:
                compiled = make(name)
                compiled.forward = torch.compile(compiled.forward)
                rows["transformers torch.compile (static cache)"] = peer_row(compiled, *common,
                                                                              cache_implementation="static")
        base = rows.get("eclat fp32", next(iter(rows.values())))[2]
        for runner, (cs, fs, r, rf, ag) in rows.items():
            speed = f"{r / base:.2f}x (vs eclat fp32)" if runner.startswith("eclat") else f"{base / r:.2f}x"
            firsts_ms = " | ".join(f"{f * 1e3:.0f}" for f in fs)
            line = (f"| {name} ({params / 1e6:.0f}M) | {runner} | {cs} | {firsts_ms} | {r:.1f} "
                    f"| {r / rf:.0%} | {ag} | {speed} |")
            lines.append(line)
            print(line, flush=True)
        notes.append(f"{name}: eclat's greedy tokens match transformers' generate: {', '.join(same)}")
        print(notes[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines + [""] + notes) + "\n")


if __name__ == "__main__":
    main()
