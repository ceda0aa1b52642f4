"""HuggingFace GPT-2 from a tiny random config (nothing is downloaded), compiled with eclat
for the CPU and checked against PyTorch, then used for a few greedy tokens, which must be
PyTorch's own token for token.

    python examples/gpt2_hf.py
    eclat compile examples/gpt2_hf.py:make --target cpu -o gpt2.eclat
"""

import time

import torch

import eclat


def make():
    """(model, example_inputs): 2 layers, 32 wide, 128-token vocabulary, 8 token ids. The random
    weights are drawn wider than GPT-2's own (0.5, not 0.02), so that greedy decoding does not
    repeat one token and comparing the tokens means something."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                     bos_token_id=0, eos_token_id=0, initializer_range=0.5, attn_implementation="eager")
    return GPT2LMHeadModel(cfg).eval(), (torch.randint(0, 128, (1, 8)),)


def logits_of(out):
    """GPT2LMHeadModel returns a ModelOutput (a dict-like); eclat returns the same structure."""
    return out["logits"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]


def main() -> None:
    model, (ids,) = make()
    t0 = time.perf_counter()
    # k=1: only the e-graph's best program is compiled, so the example takes seconds, not minutes
    fast = eclat.compile(model, (ids,), target="cpu", autotune="none", k=1)
    print(f"compiled in {time.perf_counter() - t0:.1f} s, {len(fast.report()['kernels'])} kernels")
    with torch.inference_mode():
        want = logits_of(model(ids))
        got = logits_of(fast(ids))
    err = (got - want).abs().max().item()
    print(f"logits {list(got.shape)}, max |eclat - torch| = {err:.2e}")
    assert err < 1e-3, "eclat disagrees with PyTorch"

    tokens = {name: greedy(run, ids) for name, run in (("eclat", fast), ("torch", model))}
    print("greedy tokens:", tokens["eclat"])
    assert tokens["eclat"] == tokens["torch"], f"torch's greedy tokens are {tokens['torch']}"


def greedy(run, ids: torch.Tensor, steps: int = 8) -> list[int]:
    """Greedy tokens over a sliding window of the compiled length."""
    window, tokens = ids.clone(), []
    for _ in range(steps):
        with torch.inference_mode():
            nxt = logits_of(run(window))[0, -1].argmax().item()
        tokens.append(nxt)
        window = torch.cat([window[:, 1:], torch.tensor([[nxt]])], dim=1)
    return tokens


if __name__ == "__main__":
    main()
