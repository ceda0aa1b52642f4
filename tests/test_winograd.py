"""Winograd F(2x2, 3x3) convolutions (eclat.rewrites.winograd): the transforms against their
numpy definitions and the direct convolution, compiled for the CPU, and chosen by a compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import eclat
from eclat.backends.cpu.runtime import CpuExecutable
from eclat.compiler.group import group
from eclat.frontend import lower
from eclat.ir import graph as G
from eclat.ir.dtypes import DType
from eclat.ir.interpreter import run
from eclat.ir.view import View
from eclat.rewrites import optimize, winograd
from eclat.rewrites.composites import matmul
from eclat.rewrites.extract import Roofline
from eclat.rewrites.winograd import Conv, winograd_in, winograd_out

RNG = np.random.default_rng(0)


def _winograd_graph(n: int, c: int, o: int, h: int, w: int) -> tuple[G.Graph, Conv]:
    """A padded input [n, c, h+2, w+2] and a filter [o, c, 3, 3] (as graph inputs) convolved by
    Winograd's transforms around a batched product, as the rule writes it."""
    k = Conv(n, c, o, h, w, h + 2, w + 2)
    xp, f = G.input_("xp", (n, c, h + 2, w + 2)), G.input_("f", (16, o, c))
    m = matmul(f, winograd_in(xp, k))
    y = G.view(winograd_out(m, k), View.contiguous(k.y_shape).slice(2, 0, h).slice(3, 0, w))
    return G.Graph([xp, f], [y], {}), k


def _direct(xp: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The 3x3 convolution of an already padded input, in float64."""
    n, c, hp, wp = xp.shape
    out = np.zeros((n, g.shape[0], hp - 2, wp - 2))
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i:i + hp - 2, j:j + wp - 2], g[:, :, i, j])
    return out


@pytest.mark.parametrize("n,c,o,h,w", [(1, 8, 8, 6, 6), (2, 8, 9, 5, 7), (1, 16, 12, 7, 7)])
def test_transforms_compute_the_convolution_compiled_and_interpreted(n, c, o, h, w):
    graph, _ = _winograd_graph(n, c, o, h, w)
    xp = np.zeros((n, c, h + 2, w + 2), np.float32)
    xp[:, :, 1:-1, 1:-1] = RNG.standard_normal((n, c, h, w))
    g = RNG.standard_normal((o, c, 3, 3)).astype(np.float32)
    u = np.einsum("ai,oci->aoc", np.kron(winograd.G, winograd.G), g.reshape(o, c, 9)).astype(np.float32)
    want = _direct(xp.astype(np.float64), g.astype(np.float64))
    scale = np.abs(want).max()
    (interpreted,) = run(graph, [xp, u])
    decomposed = G.decompose_composites(graph)
    assert not any(x.kind == "composite" and x.op.startswith("winograd") for x in decomposed.nodes())
    (prims,) = run(decomposed, [xp, u])
    (compiled,) = CpuExecutable(group(graph), 1).run([xp, u])
    for got in (interpreted, prims, compiled):
        assert got.shape == want.shape
        # a few float32 ulps of the output's magnitude, as the direct form's error is
        assert np.abs(got - want).max() < 2e-6 * scale


def test_transforms_group_alone_as_kernels_of_their_own():
    graph, k = _winograd_graph(1, 8, 8, 12, 12)
    program = group(graph)
    names = [kern.name for kern in program.kernels]
    assert any("winograd_in" in name for name in names) and any("winograd_out" in name for name in names)
    # the output transform's innermost axis is a tile's two columns, unrolled by the emitter
    out = next(kern for kern in program.kernels if "winograd_out" in kern.name)
    assert out.shape[-1] == 2


class _ConvBlock(torch.nn.Module):
    def __init__(self, c: int, o: int, bias: bool = False):
        super().__init__()
        self.conv = torch.nn.Conv2d(c, o, 3, padding=1, bias=bias)
        self.bn = torch.nn.BatchNorm2d(o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("bias", [False, True], ids=["batchnorm", "bias-and-batchnorm"])
def test_a_compile_offers_winograd_and_stays_correct(bias):
    torch.manual_seed(0)
    model = _ConvBlock(32, 32, bias).eval()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(1, 32, 15, 15)
    compiled = eclat.compile(model, (x,), autotune="none", threads=1, quiet=True)
    report = compiled.report()
    assert sum(report["egraph"]["rules"]["winograd"].values()) >= 1
    with torch.no_grad():
        want = model(x).double().numpy()
    got = compiled(x.numpy())
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


def test_a_plain_convolution_with_a_bias_takes_winograd_too():
    """No BatchNorm after it: the rule matches the frontend's product as it is read (squeezenet's)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 24, 3, padding=1).eval()
    x = torch.randn(1, 16, 9, 9)
    compiled = eclat.compile(conv, (x,), autotune="none", threads=1, quiet=True)
    assert compiled.report()["egraph"]["rules"]["winograd"]["winograd-f2x2-3x3"] >= 1
    with torch.no_grad():
        np.testing.assert_allclose(compiled(x.numpy()), conv(x).numpy(), rtol=1e-4, atol=1e-4)


# an AVX-512 Xeon's measured roofline (autotune.device): 243 GFLOP/s, 16.4 GB/s
XEON = Roofline(flops=2.43e11, bandwidth=1.64e10, launch=1e-7, windows_in_place=True)


@pytest.mark.parametrize("c,o,side,wanted", [(32, 64, 147, False), (80, 192, 71, True), (96, 96, 35, True)])
def test_winograd_is_extracted_where_its_products_stay_in_cache(c, o, side, wanted):
    """Few input channels over a large image: Winograd's products are shallow and their output (16
    per 2x2 block, 22 MB for inception_v3's second convolution) goes to memory; on that Xeon its
    three kernels took 7.1-10.6 ms where the direct convolution took 6.4. Deeper, it saves time."""
    torch.manual_seed(0)
    graph = lower(_ConvBlock(c, o).eval(), (torch.randn(1, c, side, side),))
    first = optimize(graph, "cpu", k=1, roof=XEON).candidates[0]
    assert any(n.op == "winograd_in" for n in first.nodes()) == wanted


def test_the_rule_leaves_strided_grouped_and_narrow_convolutions_alone():
    torch.manual_seed(0)
    convs = (torch.nn.Conv2d(16, 16, 3, stride=2, padding=1), torch.nn.Conv2d(16, 16, 3, padding=1, groups=2),
             torch.nn.Conv2d(16, 16, 3, padding=2, dilation=2), torch.nn.Conv2d(3, 16, 3, padding=1))
    for conv in convs:
        x = torch.randn(1, conv.in_channels, 10, 10)
        compiled = eclat.compile(conv.eval(), (x,), autotune="none", threads=1, quiet=True)
        assert not sum(compiled.report()["egraph"]["rules"].get("winograd", {}).values()), conv
        with torch.no_grad():
            np.testing.assert_allclose(compiled(x.numpy()), conv(x).numpy(), rtol=1e-4, atol=1e-4)


def test_a_weight_per_batch_index_is_packed_at_compile_time():
    """A batched product whose right operand is a constant per batch index (Winograd's 16 filters,
    transposed): packed once, each batch's panels in turn, and read right at every column count."""
    for b, o, c, t in ((3, 40, 24, 5), (2, 33, 17, 37)):
        f = RNG.standard_normal((b, o, c)).astype(np.float32)
        w = G.weight("f", f, DType.float32)
        v = G.input_("v", (b, t, c))
        graph = G.Graph([v], [matmul(v, G.view(w, View.contiguous((b, o, c)).permute([0, 2, 1])))], {"f": f})
        x = RNG.standard_normal((b, t, c)).astype(np.float32)
        program = group(graph)
        exe = CpuExecutable(program, 1)
        (got,) = exe.run([x])
        np.testing.assert_allclose(got, np.matmul(x, f.transpose(0, 2, 1)), rtol=1e-4, atol=1e-4)
        assert any(name.startswith("pack:") for name in exe.module.packed), "the weight was not packed"


def test_an_artifact_of_a_winograd_program_loads_and_runs(tmp_path):
    from eclat.compiler.artifact import save_artifact

    torch.manual_seed(0)
    model = _ConvBlock(64, 64).eval()  # channels enough that Winograd is the cheaper form
    x = torch.randn(1, 64, 28, 28)
    compiled = eclat.compile(model, (x,), autotune="none", threads=1, quiet=True)
    assert any("winograd" in k.name for k in compiled.executable.program.kernels)
    path = str(tmp_path / "model.eclat")
    save_artifact(compiled, path)
    loaded = eclat.load(path)
    with torch.no_grad():
        np.testing.assert_allclose(loaded(x.numpy()), model(x).numpy(), rtol=1e-4, atol=1e-4)


def test_a_winograd_program_on_two_threads():
    torch.manual_seed(0)
    model = _ConvBlock(64, 64, bias=True).eval()  # channels enough that Winograd is the cheaper form
    x = torch.randn(2, 64, 29, 27)
    compiled = eclat.compile(model, (x,), autotune="none", threads=2, quiet=True)
    assert any("winograd" in k.name for k in compiled.executable.program.kernels)
    with torch.no_grad():
        np.testing.assert_allclose(compiled(x.numpy()), model(x).numpy(), rtol=1e-4, atol=1e-4)


def test_candidates_that_run_the_same_kernels_are_one_substance_and_come_last(monkeypatch):
    """The e-graph's candidates are its cheapest programs of distinct substance first. Programs that
    differ only in elementwise expressions (a BatchNorm's scale as Fma or as Mul and Add) or in what
    is computed at compile time run the same kernels: one substance (before, such programs filled
    the list and the search timed one program several times). Products merged or not are two."""
    from eclat import rewrites
    from eclat.frontend.lower import lower
    from eclat.rewrites import extract
    from tests.test_merge import SiluMLP

    seen: list[list[frozenset]] = []
    ids: dict = {}

    def recording(data, cost, k, **options):
        out = extract.candidates(data, cost, k, **options)
        seen.append([extract._substance(data, c, ids) for c in out])
        return out
    monkeypatch.setattr(rewrites, "candidates", recording)
    torch.manual_seed(0)
    model = _ConvBlock(32, 32).eval()
    model.bn.running_var.uniform_(0.5, 2)
    conv = rewrites.optimize(lower(model, (torch.randn(1, 32, 28, 28),)), "cpu", k=4)
    mlp = rewrites.optimize(lower(SiluMLP().eval(), (torch.randn(1, 32),)), "cpu", k=4)
    (conv_subs, mlp_subs) = seen
    assert any("Fma" in d for d in conv.stats["differs"]) and len(set(conv_subs)) == 1
    assert mlp_subs[0] != mlp_subs[1], mlp.stats["differs"]  # merged, then not
    firsts = [j for j, s in enumerate(mlp_subs) if s not in mlp_subs[:j]]
    assert firsts == list(range(len(firsts)))  # the distinct ones lead
