"""The shared model zoo: small models with fixed random weights, each factory returning
(model.eval(), example_inputs). Nothing is downloaded; HuggingFace models come from tiny
configs. `ZOO` maps a name to its factory; `make_llama` is parametric for benchmarks."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

Factory = Callable[[], tuple[nn.Module, tuple]]


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden)
        self.fc3, self.fc4 = nn.Linear(hidden, hidden), nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(x))
        x = F.gelu(self.fc2(x), approximate="tanh")
        x = F.silu(self.fc3(x))
        return self.fc4(x)


def make_mlp(batch: int = 4, d_in: int = 16, hidden: int = 32, d_out: int = 8) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return MLP(d_in, hidden, d_out).eval(), (torch.randn(batch, d_in),)


class CNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.avg = nn.AvgPool2d(2, stride=1)
        self.adapt = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16 * 2 * 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.pool(x)
        x = self.avg(F.relu(self.conv3(x)))
        x = torch.flatten(self.adapt(x), 1)
        return self.fc(x)


def make_cnn(batch: int = 2, size: int = 16) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = CNN()
    for bn in (model.bn1, model.bn2):  # non-trivial running statistics
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    return model.eval(), (torch.randn(batch, 3, size, size),)


# --- a hand-written Llama-style decoder -----------------------------------------------------

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
    def __init__(self, layers: int, d: int, heads: int, ffn: int, vocab: int, max_seq: int, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
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


def make_llama(layers: int = 2, d: int = 64, heads: int = 4, ffn: int | None = None, vocab: int = 128,
               seq: int = 8, tied: bool = True, batch: int = 1) -> tuple[nn.Module, tuple]:
    """Llama-style decoder (RMSNorm, RoPE, causal softmax attention, SiLU-gated MLP)."""
    torch.manual_seed(0)
    model = Llama(layers, d, heads, ffn or 4 * d, vocab, max(seq, 64), tied)
    return model.eval(), (torch.randint(0, vocab, (batch, seq)),)


def llama_block(layers: int = 2, d: int = 64, heads: int = 4, ffn: int | None = None, vocab: int = 128,
                seq: int = 8) -> tuple[nn.Module, tuple]:
    """Same as make_llama, named for benchmarks: e.g. llama_block(12, 512, 8) or (4, 256, 4)."""
    return make_llama(layers, d, heads, ffn, vocab, seq)


# --- HuggingFace transformers, tiny random configs --------------------------------------------

def _ids(vocab: int, seq: int = 8, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def make_hf_gpt2() -> tuple[nn.Module, tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                     bos_token_id=0, eos_token_id=0,
                     attn_implementation="eager")
    return GPT2LMHeadModel(cfg).eval(), (_ids(128),)


def make_hf_bert() -> tuple[nn.Module, tuple]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")
    return BertModel(cfg).eval(), (_ids(128),)


def make_hf_llama() -> tuple[nn.Module, tuple]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      use_cache=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval(), (_ids(128),)


ZOO: dict[str, Factory] = {
    "mlp": make_mlp,
    "cnn": make_cnn,
    "llama": make_llama,
    "hf_gpt2": make_hf_gpt2,
    "hf_bert": make_hf_bert,
    "hf_llama": make_hf_llama,
}
