"""Generate text with a GPT-2-shaped model (random weights: no download) and an eclat-owned KV cache.

    python examples/generate.py            # 2 layers, a quick look (about a minute on 2 cores)
    python examples/generate.py --layers 12  # GPT-2 small's shape, 124M parameters

Prints the greedy tokens (checked against transformers' own generate) and the speed.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import eclat


def make(layers: int = 2) -> transformers.GPT2LMHeadModel:
    """A GPT-2-shaped causal LM with random weights (d=768, 12 heads, vocabulary 50257)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, bos_token_id=50256, eos_token_id=50256)
    return transformers.GPT2LMHeadModel(config).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--new", type=int, default=32, help="tokens to generate")
    args = ap.parse_args()
    model = make(args.layers)
    start = time.perf_counter()
    lm = eclat.compile_lm(model, max_len=128, chunk=16, autotune="none")
    print(f"compiled in {time.perf_counter() - start:.1f} s")
    prompt = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290]
    tokens = lm.generate(prompt, args.new)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                             min_new_tokens=args.new, do_sample=False)[0, len(prompt):].tolist()
    print("tokens:", tokens)
    assert tokens == ref, f"transformers' generate gives {ref}"
    print("the same tokens as transformers' generate")
    first, rate = lm.tokens_per_second(prompt, args.new)
    print(f"first token after {first * 1e3:.1f} ms, then {rate:.1f} tokens/s (1 thread)")


if __name__ == "__main__":
    main()
