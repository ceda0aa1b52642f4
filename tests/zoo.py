"""The shared model zoo: small models with fixed random weights, each factory returning
(model.eval(), example_inputs). Nothing is downloaded; HuggingFace models come from tiny
configs. `ZOO` maps a name to its factory; `make_llama` is parametric for benchmarks. The CNN
and the Llama-style decoder are the examples' own (examples/cnn.py, examples/tiny_llama.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from examples.cnn import make as make_cnn
from examples.tiny_llama import Llama

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


def make_llama(layers: int = 2, d: int = 64, heads: int = 4, ffn: int | None = None, vocab: int = 128,
               seq: int = 8, tied: bool = True, batch: int = 1) -> tuple[nn.Module, tuple]:
    """examples/tiny_llama.py's decoder (RMSNorm, RoPE, causal softmax attention, SiLU-gated MLP),
    of any size; tied: the output head shares the embedding's weight."""
    torch.manual_seed(0)
    model = Llama(layers, d, heads, ffn or 4 * d, vocab, max(seq, 64))
    if tied:
        model.head.weight = model.embed.weight
    return model.eval(), (torch.randint(0, vocab, (batch, seq)),)


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


class InvertedResidual(nn.Module):
    """MobileNetV2/V3 and EfficientNet's block: expand 1x1, depthwise kxk, squeeze-excitation,
    project 1x1, with a residual where the shape allows."""

    def __init__(self, c_in: int, c_out: int, expand: int, k: int, stride: int, act: type[nn.Module]):
        super().__init__()
        hidden = c_in * expand
        self.block = nn.Sequential(
            nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), act(),
            nn.Conv2d(hidden, hidden, k, stride, k // 2, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            act())
        self.squeeze = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(hidden, hidden // 4, 1), nn.ReLU(),
                                     nn.Conv2d(hidden // 4, hidden, 1), nn.Hardsigmoid())
        self.project = nn.Sequential(nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        y = self.project(h * self.squeeze(h))
        return x + y if self.residual else y


def make_mobile(side: int = 32) -> tuple[nn.Module, tuple]:
    """A small MobileNetV3-style network (random weights, BatchNorm statistics drawn away from the
    identity): depthwise convolutions at strides 1 and 2, 3x3 and 5x5, 7x7 pixels at the end."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(),
        InvertedResidual(16, 16, 3, 3, 1, nn.ReLU6), InvertedResidual(16, 24, 4, 5, 2, nn.SiLU),
        InvertedResidual(24, 24, 3, 5, 1, nn.Hardswish), InvertedResidual(24, 32, 3, 3, 2, nn.SiLU),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model.eval(), (torch.randn(1, 3, side, side),)


class StackedOutputs(nn.Module):
    """A recurrent layer (torch.nn.LSTM, GRU) returning its steps' outputs alone."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


ZOO: dict[str, Factory] = {
    "mlp": make_mlp,
    "cnn": make_cnn,
    "mobile": make_mobile,
    "llama": make_llama,
    "hf_gpt2": make_hf_gpt2,
    "hf_bert": make_hf_bert,
    "hf_llama": make_hf_llama,
}
