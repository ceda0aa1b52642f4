"""Channels-last programs (compiler/layout.py): the same values as the channels-first graph, the
depthwise convolutions they make run several pixels at a time (Schedule.jam), and the search
offered them beside the channels-first program."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import eclat
from eclat.backends.cpu.runtime import CpuExecutable
from eclat.backends.cpu.schedules import default_schedule
from eclat.compiler import pipeline
from eclat.compiler.group import group
from eclat.compiler.kernel import Load, loads
from eclat.compiler.layout import channels_last, feature_maps
from eclat.frontend import lower
from eclat.ir.interpreter import run


class MobileBlocks(torch.nn.Module):
    """What mobile networks are made of, at a size a test runs: a strided stem, depthwise 3x3 and
    strided 5x5 convolutions, squeeze-excitation, a residual, a channel shuffle, a concatenation,
    pooling and a classifier."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, groups=16), nn.BatchNorm2d(16), nn.ReLU())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(16, 8, 1), nn.ReLU(), nn.Conv2d(8, 16, 1),
                                nn.Hardsigmoid())
        self.expand = nn.Conv2d(16, 48, 1)
        self.dw5 = nn.Conv2d(48, 48, 5, 2, 2, groups=48)
        self.project = nn.Conv2d(48, 32, 1)
        self.side = nn.Conv2d(16, 32, 3, 2, 1)
        self.head = nn.Linear(64, 10)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.dw(x)
        x = x * self.se(x)
        y = self.project(torch.relu(self.dw5(self.expand(x))))
        y = y + self.side(x)
        n, c, h, w = y.shape
        y = y.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)  # a channel shuffle
        y = torch.cat([y, torch.nn.functional.max_pool2d(y, 3, 1, 1)], 1)
        return self.head(y.mean((2, 3)))


def _model():
    torch.manual_seed(0)
    return MobileBlocks().eval(), torch.randn(1, 3, 32, 32)


@pytest.mark.parametrize("pixels", [64, 10**6])
def test_a_channels_last_graph_computes_what_the_channels_first_one_does(pixels):
    model, x = _model()
    graph = lower(model, (x,))
    cl = channels_last(graph, pixels)
    assert cl is not None
    # the maps of 8x8 pixels are computed channels-last, those of 16x16 only with the larger bound
    shapes = {tuple(n.shape) for n in cl.nodes() if n.kind not in ("leaf", "view")}
    assert (1, 8, 8, 48) in shapes and (1, 48, 8, 8) not in shapes
    assert ((1, 48, 16, 16) in shapes) == (pixels == 64)
    want = run(graph, [x.numpy()])[0]
    np.testing.assert_allclose(run(cl, [x.numpy()])[0], want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        np.testing.assert_allclose(want, model(x).numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_channels_last_program_matches_torch_and_jams_its_depthwise_rows(threads):
    model, x = _model()
    graph = lower(model, (x,))
    program = group(graph, frozenset({"windows"}), channels_last_pixels=10**6)
    for k in program.kernels:
        k.schedule = default_schedule(k, threads, weights=program.weights)
    jammed = [k for k in program.kernels if k.schedule.jam > 1]
    # the stride-1 depthwise 3x3 over 16x16 pixels: [rows, pixels, channels], each tap's filter read
    # along the channels alike for every pixel
    assert any(k.shape[-1] == 16 and len(k.shape) == 3 for k in jammed)
    for k in jammed:
        assert all(isinstance(x, Load) for x in loads(k.body))
    got = CpuExecutable(program, threads).run([x.numpy()])[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-4, atol=1e-5)


def test_channels_first_depthwise_kernels_are_not_jammed():
    model, x = _model()
    program = group(lower(model, (x,)))
    assert all(default_schedule(k, weights=program.weights).jam == 1 for k in program.kernels)


def test_graphs_without_feature_maps_or_with_run_time_sizes_are_not_laid_out():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    graph = lower(mlp, (torch.randn(2, 8),))
    assert not feature_maps(graph, 10**6) and channels_last(graph, 10**6) is None
    model, x = _model()
    sized = lower(model, (x,), dynamic_shapes={"x": {2: torch.export.Dim("h", min=16, max=64),
                                                     3: torch.export.Dim("w", min=16, max=64)}})
    assert channels_last(sized, 10**6) is None


def test_the_search_times_the_channels_last_program_and_remembers_its_choice(monkeypatch):
    model, x = _model()
    offered = []
    original = pipeline._programs

    def spy(*args, **kw):
        programs = original(*args, **kw)
        offered.extend(p[4] for p in programs)
        return programs

    monkeypatch.setattr(pipeline, "_programs", spy)
    compiled = eclat.compile(model, (x,), autotune="fast", k=1)
    assert 0 in offered and 196 in offered and 784 not in offered  # the larger bound: "full" only
    with torch.no_grad():
        np.testing.assert_allclose(compiled(x).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
    chosen = compiled.compile_report.candidates.channels_last
    assert eclat.compile(model, (x,), autotune="fast", k=1).compile_report.candidates.channels_last == chosen
    offered.clear()  # without the program cache: the tuning database's choice, grouped alone
    again = eclat.compile(model, (x,), autotune="fast", k=1, program_cache_used=False)
    assert offered == [chosen] and again.compile_report.candidates.channels_last == chosen


def test_a_channels_last_program_saves_and_loads(tmp_path, monkeypatch):
    """The laid-out weights and the jammed schedules travel in an artifact."""
    model, x = _model()
    original = pipeline._programs
    monkeypatch.setattr(pipeline, "_programs", lambda *args, **kw: original(
        *args[:5], fused=True, shapes=kw.get("shapes"), layout=196))
    compiled = eclat.compile(model, (x,), autotune="none")
    assert compiled.compile_report.candidates.channels_last == 196
    assert any(k.schedule.jam > 1 for k in compiled.executable.program.kernels)
    compiled.save(str(tmp_path / "model.eclat"))
    loaded = eclat.load(str(tmp_path / "model.eclat"))
    with torch.no_grad():
        np.testing.assert_allclose(np.asarray(loaded(x.numpy())), model(x).numpy(), rtol=1e-4, atol=1e-5)


class _ReadTwoWays(torch.nn.Module):
    """Found by fuzzing: the copy of a 3x3 filter's middle row that a convolution over maps one
    pixel high reads (its other taps read padding) is itself a small rank-4 value, asked for
    channels-last, and read by a view that cannot be composed with that order; the copy made for
    that view held the values transposed (an error of 0.08 on outputs of 0.3)."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem, self.side = nn.Conv2d(1, 2, 5, 2), nn.Conv2d(2, 8, 1)
        self.grouped = nn.Conv2d(10, 4, 1, 2, dilation=2, groups=2)
        self.res = nn.Conv2d(4, 4, 3, 1, 1)

    def forward(self, x):
        x = self.stem(x)
        x = self.grouped(torch.cat([x, self.side(x)], 1))
        return x + self.res(x)


def test_a_view_that_cannot_compose_with_its_sources_order_reads_a_copy_in_the_sources_order():
    torch.manual_seed(0)
    model, x = _ReadTwoWays().eval(), torch.randn(2, 1, 8, 14)
    graph = lower(model, (x,))
    want = run(graph, [x.numpy()])[0]
    with torch.no_grad():
        np.testing.assert_allclose(want, model(x).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run(channels_last(graph, 10**6), [x.numpy()])[0], want, rtol=1e-5, atol=1e-6)
