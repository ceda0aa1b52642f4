"""A tiny Llama-style decoder (RMSNorm, RoPE, causal attention, SiLU-gated MLP; random
weights) generating tokens greedily with an eclat-compiled step, checked against PyTorch.

    python examples/tiny_llama.py
    eclat compile examples/tiny_llama.py:make --target cpu -o tiny_llama.eclat

The step is compiled once for a fixed window of WINDOW tokens: each new token is the
argmax of the last position's logits, and the window slides by one.
"""

import math
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import eclat

WINDOW, NEW_TOKENS = 8, 16


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(1 + 0.1 * torch.randn(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v, self.o = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        mask = torch.full((s, s), float("-inf"), dtype=scores.dtype, device=scores.device)
        mask = torch.triu(mask, diagonal=1)
        attn = torch.softmax(scores + mask, dim=-1)
        return self.o((attn @ v).transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.norm1, self.attn = RMSNorm(d), Attention(d, heads)
        self.norm2 = RMSNorm(d)
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """ids [batch, seq] -> logits [batch, seq, vocab], for seq up to max_seq."""

    def __init__(self, layers: int, d: int, heads: int, ffn: int, vocab: int, max_seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(max_seq).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def make():
    """(model, example_inputs): a 2-layer, 64-wide decoder over a 128-token vocabulary."""
    torch.manual_seed(0)
    model = Llama(layers=2, d=64, heads=4, ffn=256, vocab=128, max_seq=64)
    return model.eval(), (torch.randint(0, 128, (1, WINDOW)),)


def generate(step, prompt: np.ndarray, steps: int) -> list[int]:
    """Greedy decoding with a fixed-size window; step maps ids [1, WINDOW] to logits [1, WINDOW, vocab]."""
    ids = list(prompt)
    for _ in range(steps):
        window = np.asarray(ids[-WINDOW:], dtype=np.int64)[None, :]
        ids.append(int(np.argmax(step(window)[0, -1])))
    return ids[len(prompt):]


def main() -> None:
    model, (prompt,) = make()
    t0 = time.perf_counter()
    # k=1: only the e-graph's best program is compiled, so the example takes seconds, not minutes
    fast = eclat.compile(model, (prompt,), target="cpu", autotune="none", k=1)
    print(f"compiled in {time.perf_counter() - t0:.1f} s, {len(fast.report()['kernels'])} kernels")

    def torch_step(ids: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(ids)).numpy()

    start = prompt[0].numpy()
    torch.set_num_threads(1)  # eclat runs one thread by default: compare like with like
    generate(torch_step, start, 1)  # warm-up
    t0 = time.perf_counter()
    ours = generate(fast, start, NEW_TOKENS)
    eclat_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = generate(torch_step, start, NEW_TOKENS)
    torch_s = time.perf_counter() - t0
    print("prompt:   ", start.tolist())
    print("eclat:    ", ours)
    print("pytorch:  ", theirs)
    assert ours == theirs, "eclat's greedy tokens differ from PyTorch's"
    print(f"{NEW_TOKENS} tokens: eclat {eclat_s * 1e3 / NEW_TOKENS:.2f} ms/token, "
          f"torch eager {torch_s * 1e3 / NEW_TOKENS:.2f} ms/token")


if __name__ == "__main__":
    main()
