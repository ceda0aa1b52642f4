"""Affine maps moved into products (eclat.rewrites.affine): a BatchNorm into the convolution before
it, a LayerNorm's or RMSNorm's affine part into the Linear after it; then folded, so no run-time
kernel reads a norm's statistics or affine weights. Checked on the first candidate, on the
compiled program, and against torch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import eclat
from eclat.compiler import pipeline
from eclat.frontend import lower
from eclat.ir.view import View
from eclat.rewrites.affine import k_scale, operand_scale

BN_WEIGHTS = ("1.running_mean", "1.running_var", "1.weight", "1.bias")


def _bn(conv: nn.Conv2d) -> nn.Module:
    model = nn.Sequential(conv, nn.BatchNorm2d(conv.out_channels), nn.ReLU()).eval()
    with torch.no_grad():  # statistics that are not the identity
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-1, 1)
    return model


def _weights_read(compiled) -> set[str]:
    from eclat.compiler.kernel import loads

    program = compiled.executable.program
    names = {x.buffer for k in program.kernels for x in loads(k.body)}
    return {program.buffers[n].name for n in names if program.buffers[n].role == "weight"}


@pytest.mark.parametrize("conv", [
    nn.Conv2d(8, 16, 3, padding=1, bias=False),
    nn.Conv2d(8, 16, 3, padding=1, stride=2),
    nn.Conv2d(8, 16, 1),
    nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),  # depthwise: no product, BN stays an epilogue
], ids=["3x3", "3x3-bias-stride2", "1x1-bias", "depthwise"])
def test_batchnorm_folds_into_the_convolution(conv):
    torch.manual_seed(0)
    model, x = _bn(conv), torch.randn(1, 8, 12, 12)
    first = pipeline._candidates(lower(model, (x,)), "cpu", 4)[0][0]
    names = {n.arg for n in first.nodes() if n.op == "weight"}
    assert not set(BN_WEIGHTS) & names  # folded, never raw
    if conv.groups == 1:
        # the scale went into the convolution's weight (or into Winograd's transform of it, a 3x3's
        # first candidate on the CPU): a bias (one vector) is all that is left
        assert len(names) == 2 and any(n.split("(")[0] in ("mul", "matmul") and "0.weight" in n
                                       for n in names)
        assert not {"mul", "fma"} & set(first.op_counts())
    compiled = eclat.compile(model, (x,), target="cpu", autotune="none", k=1, quiet=True)
    assert not {n for n in _weights_read(compiled) if n.split("_", 1)[-1] in BN_WEIGHTS}
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


class NormLinear(nn.Module):
    def __init__(self, norm: nn.Module, d: int = 64, n: int = 32):
        super().__init__()
        self.norm, self.linear = norm, nn.Linear(d, n)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            if getattr(self.norm, "bias", None) is not None:
                self.norm.bias.uniform_(-1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


@pytest.mark.parametrize("norm", [nn.LayerNorm(64), nn.RMSNorm(64)], ids=["layernorm", "rmsnorm"])
def test_a_norms_affine_part_folds_into_the_linear_after_it(norm):
    torch.manual_seed(0)
    model, x = NormLinear(norm).eval(), torch.randn(2, 8, 64)
    first = pipeline._candidates(lower(model, (x,)), "cpu", 4)[0][0]
    names = {n.arg for n in first.nodes() if n.op == "weight"}
    assert not {"norm.weight", "norm.bias"} & names
    assert any(n.startswith("mul(") and "norm.weight" in n for n in names)  # the scale, in W
    if isinstance(norm, nn.LayerNorm):  # the shift, with the Linear's bias: beta @ W + b, one row
        assert any(n.startswith("add(") and "norm.bias" in n for n in names)
    compiled = eclat.compile(model, (x,), target="cpu", autotune="none", k=1, quiet=True)
    assert not {"norm.weight", "norm.bias"} & {n.split("_", 1)[-1] for n in _weights_read(compiled)}
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


def test_operand_scale_reads_s_only_along_the_scaled_axis():
    mm = [1, 16, 144]  # a convolution's product [1, Cout, H*W], read as [1, 16, 12, 12]
    ow = View.contiguous((1, 16, 144)).reshape((1, 16, 12, 12))
    per_channel = View.make((1, 16, 12, 12), (0, 1, 0, 0))
    rows = operand_scale(ow, per_channel, mm, 1, View.contiguous((1, 16, 72)))
    assert rows == View.make((1, 16, 72), (0, 1, 0))
    assert operand_scale(ow, per_channel, mm, 2, View.contiguous((1, 72, 144))) is None  # not along N
    per_pixel = View.make((1, 16, 12, 12), (0, 0, 12, 1))
    cols = View.contiguous((1, 72, 144))
    assert operand_scale(ow, per_pixel, mm, 2, cols) == View.make((1, 72, 144), (0, 0, 1))
    half = View.contiguous((1, 16, 144)).shrink([(0, 1), (0, 8), (0, 144)]).reshape((1, 8, 12, 12))
    # half the channels read: a scale over all 16 rows would read past s
    rows_of_8 = View.make((1, 8, 12, 12), (0, 1, 0, 0))
    assert operand_scale(half, rows_of_8, mm, 1, View.contiguous((1, 16, 72))) is None


def test_k_scale_moves_a_feature_scale_to_the_other_operand():
    gamma = View.make((2, 8, 64), (0, 0, 1))  # a [64] weight broadcast over [batch, tokens]
    a = View.contiguous((2, 8, 64)).reshape((16, 64))
    assert k_scale(gamma, a, View.contiguous((64, 32)), left=True) == View.make((64, 32), (1, 0))
    per_token = View.make((2, 8, 64), (0, 1, 0))
    assert k_scale(per_token, a, View.contiguous((64, 32)), left=True) is None


class SqueezeExcite(nn.Module):
    """EfficientNet's squeeze-excitation then the 1x1 projection after it."""

    def __init__(self, c: int = 32, out: int = 8):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, 4, 1), nn.Conv2d(4, c, 1)
        self.project = nn.Conv2d(c, out, 1, bias=False)

    def forward(self, x):
        scale = torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True)))))
        return self.project(x * scale)


def test_a_computed_channel_scale_moves_onto_the_weights_of_the_product_after_it():
    """x * s[c] then a 1x1 convolution over c: the rule `matmul-scale-k-copied-b` (`-twice`: x * s
    is a copy the frontend made for the convolutions that read it) scales the
    convolution's weights by s (out x c values) where x * s was a pass over every pixel, and the
    product reads x itself. The extraction's cost prefers it (the best candidate alone, k=1, so
    that no timing decides)."""
    torch.manual_seed(0)
    model, x = SqueezeExcite().eval(), torch.randn(1, 32, 20, 20)
    compiled = eclat.compile(model, (x,), target="cpu", autotune="none", k=1)
    rules = compiled.report()["egraph"]["rules"]["affine"]
    assert sum(n for name, n in rules.items() if name.startswith("matmul-scale-k-copied-b")) > 0
    program = compiled.executable.program
    sizes = {k.name: math.prod(k.shape) for k in program.kernels}
    assert max(sizes.values()) == 8 * 400  # the projection's output: no kernel writes x * s
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
