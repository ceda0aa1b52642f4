"""eclat.compile end to end on the CPU: every zoo model matches torch; calls are validated."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import eclat
from eclat.compiler import pipeline
from eclat.compiler.kernel import Load, loads
from eclat.ir.symbolic import Num
from tests.zoo import ZOO, StackedOutputs


def _compile(name: str):
    model, inputs = ZOO[name]()
    return model, inputs, eclat.compile(model, inputs, target="cpu", autotune="none", k=1, quiet=True)


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_matches_torch(name):
    model, inputs, fast = _compile(name)
    with torch.no_grad():
        want = torch.utils._pytree.tree_leaves(model(*inputs))
    got = torch.utils._pytree.tree_leaves(fast(*inputs))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


@pytest.fixture(scope="module")
def mlp():
    return _compile("mlp")


def test_numpy_in_numpy_out(mlp):
    model, (x,), fast = mlp
    out = fast(x.numpy())
    assert isinstance(out, np.ndarray)
    with torch.no_grad():
        np.testing.assert_allclose(out, model(x).numpy(), rtol=1e-3, atol=1e-4)


def test_repeated_calls_are_independent(mlp):
    model, (x,), fast = mlp
    a, b = fast(x), fast(x * 2)
    with torch.no_grad():
        torch.testing.assert_close(a, model(x), rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(b, model(x * 2), rtol=1e-3, atol=1e-4)


def test_torch_inputs_of_every_kind_match(mlp):
    """The plain torch call (contiguous CPU float32, no grad) and the ones that need the general
    path (grad, a transposed view, a subclass) give the same tensors."""
    model, (x,), fast = mlp
    with torch.no_grad():
        want = model(x)
    plain = fast(x)
    assert type(plain) is torch.Tensor and not plain.requires_grad
    torch.testing.assert_close(plain, want, rtol=1e-3, atol=1e-4)
    grad = x.clone().requires_grad_(True)
    strided = x.t().contiguous().t()  # same values, column-major
    assert not strided.is_contiguous()
    param = torch.nn.Parameter(x.clone())
    for other in (grad, strided, param):
        torch.testing.assert_close(fast(other), plain, rtol=0, atol=0)


@pytest.mark.parametrize("args,message", [
    ((), "expected 1 arguments, given 0"),
    ((torch.zeros(4, 16), torch.zeros(4, 16)), "given 2"),
    ((torch.zeros(3, 16),), "expected shape [4, 16], given [3, 16]"),
    ((torch.zeros(4, 16, dtype=torch.float64),), "expected dtype float32, given float64"),
    ((np.zeros((4, 16), np.int32),), "expected dtype float32, given int32"),
    (("hello",), "expected a torch.Tensor or numpy.ndarray, given str"),
])
def test_bad_calls_raise_value_error(mlp, args, message):
    _, _, fast = mlp
    with pytest.raises(ValueError) as err:
        fast(*args)
    assert message in str(err.value)


def test_report_is_json_and_complete(mlp):
    _, _, fast = mlp
    report = json.loads(json.dumps(fast.report()))
    for key in ("target", "device", "egraph", "candidates", "kernels", "compile_seconds", "tuning_cache"):
        assert key in report
    assert set(report["device"]) >= {"name", "fingerprint", "peak_gflops", "peak_gbps"}
    assert set(report["egraph"]) >= {"enodes", "eclasses", "iterations", "seconds", "rules"}
    assert set(report["candidates"]) >= {"extracted", "pruned", "timed"}
    kern = report["kernels"][0]
    assert set(kern) >= {"name", "ops", "flops", "bytes", "estimated_us", "measured_us"}
    assert sum(k["flops"] for k in report["kernels"]) > 2 * 4 * 16 * 32  # at least the first layer
    # where the compile's time went: the phases it passed through, adding up to no more than it took
    assert set(report["phases"]) >= {"lower", "e-graph", "group", "reference", "build", "verify", "timing"}
    assert all(s >= 0 for s in report["phases"].values())
    assert sum(report["phases"].values()) <= report["compile_seconds"] + 0.01


def test_bad_options():
    model, inputs = ZOO["mlp"]()
    with pytest.raises(ValueError, match="autotune"):
        eclat.compile(model, inputs, autotune="sometimes")
    with pytest.raises(ValueError, match="threads"):
        eclat.compile(model, inputs, threads=0)
    with pytest.raises(eclat.EclatError, match="no backend"):
        eclat.compile(model, inputs, target="tpu", autotune="none")


def test_autotune_fills_the_tuning_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "_faster_first", lambda *a: True)  # tuned schedules kept: read back below
    model, inputs = ZOO["mlp"](batch=8)
    first = eclat.compile(model, inputs, autotune="fast", k=1, cache_dir=str(tmp_path), quiet=True)
    second = eclat.compile(model, inputs, autotune="fast", k=1, cache_dir=str(tmp_path), quiet=True)
    one, two = first.report()["tuning_cache"], second.report()["tuning_cache"]
    assert one["misses"] >= 2  # the chosen candidate and at least one kernel
    assert two == {"hits": one["hits"] + one["misses"], "misses": 0}
    assert second.report()["candidates"]["chosen"] == first.report()["candidates"]["chosen"]
    assert all(k["measured_us"] is not None for k in second.report()["kernels"])
    with torch.no_grad():
        torch.testing.assert_close(second(*inputs), model(*inputs), rtol=1e-3, atol=1e-4)


def test_a_compiled_model_does_not_see_later_changes_to_the_weights():
    """The compile reads the model's tensors in place (it holds no second copy while it works), so
    what the code reads directly (an embedding, a bias) must be copied when it is built."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 8), nn.LayerNorm(8)).eval()
    x = torch.randint(0, 100, (4,))
    compiled = eclat.compile(model, (x,), autotune="none", quiet=True)
    with torch.no_grad():
        want = model(x).clone()
        for p in model.parameters():
            p.mul_(2).add_(1)
    torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(model(x), want)


def test_threads_give_the_same_answer():
    model, inputs = ZOO["mlp"](batch=64)
    fast = eclat.compile(model, inputs, autotune="none", k=1, threads=2, quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(fast(*inputs), model(*inputs), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("side", [11, 12])
def test_windows_strided_along_rows_match_torch_with_special_values(side):
    """Max and average pools and a depthwise convolution strided along rows, compiled, match torch
    on odd and even sizes, in ceil mode, with NaN and infinities in the input (a window that only
    reads padding, a tap past a window's end: nothing may read them as a value)."""
    torch.manual_seed(0)

    class Strided(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dw = torch.nn.Conv2d(4, 4, 5, 2, 2, groups=4)

        def forward(self, x):
            f = torch.nn.functional
            return (f.max_pool2d(x, 3, 2, 1), f.max_pool2d(x, 2, 2, ceil_mode=True),
                    f.avg_pool2d(x, 3, 2, 1, ceil_mode=True), self.dw(x))

    model = Strided().eval()
    x = torch.randn(1, 4, side, side)
    x[0, 0, 3, 4], x[0, 1, 0, 0], x[0, 2, 5, 5], x[0, 3, side - 1, side - 1] = float("nan"), float("inf"), \
        -float("inf"), float("nan")
    fast = eclat.compile(model, (x,), autotune="none", k=1, quiet=True)
    with torch.no_grad():
        for got, want in zip(fast(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("groups, batch", [(4, 1), (8, 2)])
def test_a_grouped_convolution_is_one_register_blocked_product_per_group(groups, batch):
    """A ResNeXt-style grouped 3x3 convolution with BatchNorm and ReLU (its channels in groups of
    32 // groups) matches torch, and its product is a contraction with rows: the group's output
    channels (kernel.split_groups), not a matrix-vector product per output channel that rereads
    the group's patches for each (resnext50 ran 0.9x torch eager that way)."""
    from eclat.compiler.kernel import as_contraction
    from eclat.ir.symbolic import upper

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(32, 32, 3, padding=1, groups=groups, bias=False),
                                torch.nn.BatchNorm2d(32), torch.nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(batch, 32, 9, 9)
    fast = eclat.compile(model, (x,), autotune="none", k=1, quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    products = [c for k in fast.executable.program.kernels for c in [as_contraction(k)]
                if c is not None and upper(c.reduce.size) == 32 // groups * 9]
    assert products and all(c.m_axis is not None for c in products), fast.executable.program.kernels


def test_a_value_two_convolutions_read_is_computed_once_by_its_producer():
    """A ReLU that a 1x1 convolution and a strided 1x1 convolution both read (a ResNet or RegNet
    downsampling block after its stem) is computed once, in the epilogue of the product that
    makes its input: each convolution's copy of its operand computed it again (regnet_y_400mf's
    stem: two copies of 1.6 and 0.4 MB computing BatchNorm and ReLU, the product's raw sums
    written besides)."""
    from eclat.compiler.kernel import as_contraction

    class Fork(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, 2, 1), torch.nn.BatchNorm2d(16),
                                            torch.nn.ReLU())
            self.a, self.b = torch.nn.Conv2d(16, 24, 1), torch.nn.Conv2d(16, 24, 1, 2)

        def forward(self, x):
            y = self.stem(x)
            return self.a(y)[:, :, ::2, ::2] + self.b(y)

    torch.manual_seed(0)
    model = Fork().eval()
    with torch.no_grad():
        model.stem[1].running_mean.uniform_(-0.5, 0.5)
        model.stem[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(1, 3, 32, 32)
    fast = eclat.compile(model, (x,), autotune="none", k=1, quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    relu = [k for k in fast.executable.program.kernels if "max" in k.ops]
    assert len(relu) == 1 and as_contraction(relu[0]) is not None, fast.executable.program.kernels


@pytest.mark.parametrize("batch,padded", [(1, False), (2, False), (1, True)])
def test_a_groupnorms_statistics_run_once_per_group(batch, padded):
    """GroupNorm (8 groups of 4 channels) then ReLU matches torch, and the kernel that normalises
    every channel computes its group's statistics once per group: its channel axis is split into
    (group, channel) and no reduction reads the channel within the group (kernel.split_groups),
    where unsplit the statistics ran once per channel (BiT's ResNet-v2 7x slower than eager).
    Written padded (the copy a max pool reads), the padding's mask does not guard the statistics'
    loads, which then ran once per position (timm's resnet50_gn 0.07x eager)."""
    from eclat.compiler.kernel import free_vars, reduces

    torch.manual_seed(0)
    layers = [torch.nn.GroupNorm(8, 32), torch.nn.ReLU(), *[torch.nn.ZeroPad2d(1)] * padded]
    model = torch.nn.Sequential(*layers).eval()
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
        model[0].bias.uniform_(-0.5, 0.5)
    x = torch.randn(batch, 32, 9, 9) * 3 + 1
    fast = eclat.compile(model, (x,), autotune="none", k=1, quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    normalising = [k for k in fast.executable.program.kernels if reduces(k.body) and 4 in k.shape]
    assert normalising, fast.executable.program.kernels
    for k in normalising:
        within = {f"i{a}" for a in range(k.shape.index(4), len(k.shape))}  # channel in group, pixels
        assert all(not within & free_vars(r) for r in reduces(k.body)), k


@pytest.mark.parametrize("dilation, stride, groups",
                         [(36, 1, 1), (12, 1, 1), (6, 2, 1), (9, 1, 8), (5, 3, 2)])
def test_taps_that_read_only_padding_are_left_out(dilation, stride, groups):
    """An atrous convolution whose dilation passes the input's size (DeepLab's pyramid over 16x16
    positions): the filter taps that read only zero padding at every position are dropped (at 36,
    a 3x3 filter is its centre tap), the input cropped where the first tap kept starts inside it;
    strided, grouped and depthwise ones alike match torch, and at 36 no padded copy of the input is
    made."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(8, 8, 3, stride=stride, padding=dilation, dilation=dilation, groups=groups).eval()
    x = torch.randn(1, 8, 16, 11)
    fast = eclat.compile(model, (x,), autotune="none", k=1, quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    if dilation == 36:  # one tap: a 1x1 convolution, no kernel writes a padded input
        assert all(k.shape[-2:] != (16 + 72, 11 + 72) for k in fast.executable.program.kernels)
        assert sum(k.flops for k in fast.compile_report.kernels) <= 2 * 8 * 8 * 16 * 11 + 8 * 16 * 11


@pytest.mark.parametrize("conv, shape, regions", [
    (torch.nn.Conv2d(8, 6, 3, padding=12, dilation=12), (1, 8, 16, 16), True),  # DeepLab's rate 12
    (torch.nn.Conv2d(8, 6, 3, padding=8, dilation=8, stride=2, groups=2), (2, 8, 12, 10), True),
    (torch.nn.Conv1d(16, 12, 3, padding=7, dilation=7), (1, 16, 8), True),
    (torch.nn.Conv3d(3, 4, 3, padding=5, dilation=5), (1, 3, 6, 6, 7), False),  # 27 regions: padded
])
def test_windows_that_read_mostly_padding_run_by_regions(conv, shape, regions):
    """A convolution whose windows read padding at most taps runs as one convolution per region of
    outputs that read the same taps, without padding: its products do at most half the work of the
    padded one's. Split or not (too many regions), it matches torch."""
    torch.manual_seed(0)
    model, x = conv.eval(), torch.randn(*shape)
    fast = eclat.compile(model, (x,), autotune="none", k=1, quiet=True)
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(fast(x), want, rtol=1e-4, atol=1e-4)
    padded = 2 * want.numel() * conv.weight[0].numel()
    assert (sum(k.flops for k in fast.compile_report.kernels) <= 0.5 * padded) == regions


def test_fold_is_a_sum_of_placed_taps_not_a_scatter():
    """F.fold (VOLO's outlook attention writes its windows back with it) lowers to the sum over
    its filter's taps of strided placements: a few operations per output element. torch's own
    decomposition, an index_put accumulating, ran as a one-hot product (VOLO 11x slower than
    torch eager). F.unfold with it; both match torch."""
    torch.manual_seed(0)
    f = torch.nn.functional

    class Outlook(torch.nn.Module):
        def forward(self, x):
            cols = f.unfold(x, kernel_size=3, padding=1, stride=2)
            return f.fold(cols * cols, output_size=x.shape[-2:], kernel_size=3, padding=1, stride=2)

    x = torch.randn(1, 16, 28, 28)
    fast = eclat.compile(Outlook(), (x,), autotune="none", k=1, quiet=True)
    torch.testing.assert_close(fast(x), Outlook()(x), rtol=1e-5, atol=1e-5)
    assert sum(k.flops for k in fast.compile_report.kernels) <= 40 * x.numel()


def test_a_pool_over_a_concatenation_reads_it_from_one_buffer():
    """An Inception block's pool branch: a 3x3 max pool at stride 1 over a concatenation of branch
    outputs, padded with -inf. The concatenation is written once and the pool's passes (each a
    maximum of shifted views, masked at the edges) read that buffer; inlined, each of its taps loaded
    every branch under masks and unravelled the concatenation's flat index (googlenet's pools: 44.8
    ms of loops, 3.8 with a copy)."""
    from eclat.compiler.kernel import Load, walk

    torch.manual_seed(0)

    class Inception(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Conv2d(3, 8, 1), torch.nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            joined = torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)
            return torch.nn.functional.max_pool2d(joined, 3, 1, 1, ceil_mode=True)

    model, x = Inception().eval(), torch.randn(1, 3, 10, 10)
    x[0, 1, 2, 3] = float("nan")
    fast = eclat.compile(model, (x,), autotune="none", k=1, quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5, equal_nan=True)
    kernels = fast.executable.program.kernels
    branches = {k.out for k in kernels if "sum" in k.ops}  # the two convolutions' outputs
    pool = [k for k in kernels if "where" in k.ops]
    assert len(pool) == 2 and not any(isinstance(e, Load) and e.buffer in branches
                                       for k in pool for e in walk(k.body))


class Branches(torch.nn.Module):
    """Two 1x1 convolutions concatenated, then read by a third (a squeezenet fire module's end)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(8, 16, 1), torch.nn.Conv2d(8, 16, 1)
        self.c = torch.nn.Conv2d(32, 8, 1)

    def forward(self, x):
        return self.c(torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1))


def test_a_concatenation_is_written_in_place_by_the_writers_of_its_parts():
    """The kernel that only copies two buffers into their concatenation runs no loop: the kernels
    writing the parts write them where they lie in it (memplan.elided_concatenations). A part that
    another kernel also reads keeps its own buffer, and the copy."""
    from eclat.backends.cpu.runtime import layout
    from eclat.compiler.kernel import Op
    from eclat.compiler.memplan import elided_concatenations

    torch.manual_seed(0)
    model, x = Branches().eval(), torch.randn(1, 8, 12, 12)
    compiled = eclat.compile(model, (x,), autotune="none", k=1, quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    program = compiled.executable.program
    code, plan = layout(program)
    (elided,) = [k for k in code.kernels if 0 in k.shape]
    parts = sorted({x.buffer for x in loads(elided.body)}, key=plan.offsets.get)
    start = plan.offsets[elided.out]
    assert [plan.offsets[p] - start for p in parts] == [0, 16 * 144 * 4]
    # the last kernel also reading the first part: the concatenation is copied
    last = program.kernels[-1]
    more = replace(last, body=Op("add", (last.body, Load(parts[0], Num(0), Num(1), last.body.dtype)),
                                  last.body.dtype))
    kept, aliases = elided_concatenations(replace(program, kernels=[*program.kernels[:-1], more]))
    assert not aliases and all(0 not in k.shape for k in kept.kernels)


def test_an_output_stacking_one_row_per_step_is_written_in_place():
    """A GRU's output stacks each step's h, one row each (a part whose index does not name the
    row): the parts' writers write the caller's array where each row lies, and no kernel copies them
    (100 steps: 1070 -> 874 us)."""
    from eclat.backends.cpu.runtime import layout

    torch.manual_seed(0)
    gru = StackedOutputs(torch.nn.GRU(4, 8)).eval()
    x = torch.randn(6, 1, 4)
    compiled = eclat.compile(gru, (x,), autotune="none", quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), gru(x), rtol=1e-4, atol=1e-5)
    program = compiled.executable.program
    code, plan = layout(program)
    (elided,) = [k for k in code.kernels if 0 in k.shape]
    assert elided.out in program.outputs
    assert sorted(at for _, at in plan.within.values()) == [8 * 4 * j for j in range(6)]
