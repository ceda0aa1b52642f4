"""Attention as one kernel (compiler.group's `attend`, kernel.Attention, backends/cpu/attention.py):
a softmax contracted with values, whatever the scores are made of, run in one pass over the keys
with an online softmax and checked against torch; no buffer of heads x queries x keys is written."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import eclat
from eclat.backends.cpu.attention import AttentionEmitter
from eclat.backends.cpu.codegen import emitter
from eclat.backends.cpu.runtime import CpuExecutable
from eclat.compiler import pipeline
from eclat.compiler.group import group
from eclat.compiler.kernel import Const, Kernel, Load, Op, Reduce, as_attention, attention_body, reduces
from eclat.ir import graph as G
from eclat.ir.dtypes import DType
from eclat.ir.interpreter import run
from eclat.ir.symbolic import Num, Var
from eclat.ir.view import View
from eclat.rewrites.composites import attend, matmul
from tests.conftest import _PROGRAMS

H, D = 2, 16


def _masks(t: int, s: int) -> dict[str, torch.Tensor]:
    i, j = torch.arange(t)[:, None] + (s - t), torch.arange(s)[None, :]
    causal = torch.where(j <= i, 0.0, -math.inf)
    slopes = torch.tensor([2.0 ** (-4 * (h + 1)) for h in range(H)])
    return {"causal": causal, "alibi": causal - slopes[:, None, None] * (i - j).abs(),
            "window": torch.where((j <= i) & (i - j < 5), 0.0, -math.inf)}


class Scores(torch.nn.Module):
    """softmax(f(q k^T)) v for the score variants the issue names, as people write them."""

    def __init__(self, variant: str, t: int, s: int, heads: int = H):
        super().__init__()
        self.variant = variant
        for name, m in _masks(t, s).items():
            self.register_buffer(name, m)
        i, j = torch.arange(t)[:, None] + (s - t), torch.arange(s)[None, :]
        slopes = torch.tensor([2.0 ** (-4 * (h + 1)) for h in range(heads)])
        self.register_buffer("slopes", slopes[:, None, None])
        self.register_buffer("distance", (i - j).abs().float())

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if self.variant == "softcap":
            s = torch.tanh(s / 30) * 30 + self.causal
        elif self.variant == "bias":  # ALiBi's bias computed in the forward, as models do, then the mask
            s = s + (self.causal - self.slopes * self.distance)
        elif self.variant != "plain":
            s = s + getattr(self, self.variant)
        return torch.softmax(s, -1) @ v


@pytest.fixture(autouse=True)
def _one_kernel(one_grouping):
    """The search times each candidate with attention in one kernel and as separate kernels; these
    tests check the one-kernel program, so it is the only one."""


def _check(model: torch.nn.Module, args: tuple, atol: float = 2e-5) -> eclat.CompiledModel:
    compiled = eclat.compile(model, args, autotune="none", quiet=True, k=1)  # the e-graph's choice
    want = model(*args).detach().numpy()
    got = compiled(*args)
    got = got[0] if isinstance(got, (list, tuple)) else got
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=atol, equal_nan=True)
    return compiled


def _attention_kernels(compiled: eclat.CompiledModel) -> list:
    program = compiled.executable.program
    return [k for k in program.kernels if as_attention(k) is not None]


def _largest_temp(compiled: eclat.CompiledModel) -> int:
    return max((b.numel for b in compiled.executable.program.buffers.values() if b.role == "temp"), default=0)


@pytest.mark.parametrize("variant", ["plain", "causal", "alibi", "window", "softcap", "bias"])
@pytest.mark.parametrize("t", [1, 5, 300])
def test_score_variants_run_as_one_kernel(variant, t):
    s, heads = 300, 6 if variant == "bias" else H  # 6 heads of bias: too large to fold into one mask
    torch.manual_seed(t)
    q, k, v = torch.randn(1, heads, t, D), torch.randn(1, heads, s, D), torch.randn(1, heads, s, D)
    compiled = _check(Scores(variant, t, s, heads).eval(), (q, k, v))
    (kern,) = _attention_kernels(compiled)
    program = compiled.executable.program
    assert program.kernels == [kern]  # the output, a reshape of its result, is written in place
    em = emitter(None, kern, program.buffers, {}, compiled.executable.module.lanes)
    assert isinstance(em, AttentionEmitter)
    # blocks of keys the constant mask hides from blocks of query rows throughout are skipped
    assert (em.live is not None) == (variant != "plain" and t == s or variant == "window")
    assert _largest_temp(compiled) < H * t * s  # the scores are never written


def test_sdpa_with_boolean_mask_gives_zero_on_fully_masked_rows():
    """torch's scaled_dot_product_attention softmax is safe: a row that masks every key gives 0;
    torch.softmax of a row of -inf gives NaN, and so must the fused kernel."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, H, 6, D), torch.randn(1, H, 9, D), torch.randn(1, H, 9, D)
    keep = torch.rand(6, 9) > 0.4
    keep[2] = False

    class Sdpa(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    compiled = _check(Sdpa().eval(), (q, k, v))
    assert np.all(np.asarray(compiled(q, k, v))[0, :, 2] == 0)

    class Unsafe(torch.nn.Module):
        def forward(self, q, k, v):
            s = (q @ k.transpose(-1, -2)).masked_fill(~keep, -math.inf)
            return torch.softmax(s, -1) @ v

    compiled = _check(Unsafe().eval(), (q, k, v))
    assert np.all(np.isnan(np.asarray(compiled(q, k, v))[0, :, 2]))


def test_large_logits_and_long_rows():
    """Scores in the thousands (the running max keeps exp2 in range) over more keys than one block."""
    torch.manual_seed(1)
    q, k, v = 40 * torch.randn(1, H, 9, D), 40 * torch.randn(1, H, 300, D), torch.randn(1, H, 300, D)
    compiled = _check(Scores("plain", 9, 300).eval(), (q, k, v), atol=1e-4)
    assert _attention_kernels(compiled)


def test_decode_one_query_per_head_against_a_long_cache():
    """One query per head (its products are sums of products in the extracted program)."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 1, 32), torch.randn(1, 4, 333, 32), torch.randn(1, 4, 333, 32)

    class Sdpa(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    assert _attention_kernels(_check(Sdpa().eval(), (q, k, v)))


def test_fused_and_unfused_groupings_agree_with_the_interpreter():
    """The e-graph's attend grouped with and without the target's fused kernel: both match the
    interpreter, and only the fused one has no scores buffer."""
    q, k, v = (G.input_(n, (3, 20, 8), DType.float32) for n in "qkv")
    kt = G.movement(k, lambda w: w.permute((0, 2, 1)))
    x = G.unary("neg", matmul(q, kt))
    graph = G.Graph([q, k, v], [attend(x, v, -1, View.contiguous((3, 20, 20)), False)], {})
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 20, 8)).astype(np.float32) for _ in range(3)]
    want = run(graph, arrays)[0]
    for fused in (frozenset(), frozenset({"attention"})):
        program = group(graph, fused)
        temps = [b.numel for b in program.buffers.values() if b.role == "temp"]
        assert (max(temps, default=0) >= 3 * 20 * 20) == (not fused)
        got = CpuExecutable(program, 1).run(arrays)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_attention_body_is_recognised_and_nothing_else_is():
    i0, i1 = Var("i0", 0, 3), Var("i1", 0, 7)
    j, d = Var("r9", 0, 4), Var("r10", 0, 7)
    dt = DType.float32
    product = Op("mul", (Load("q", i0 * 8 + d, Num(1), dt), Load("k", j * 8 + d, Num(1), dt)), dt)
    score = Reduce("sum", 8, d, product, dt)
    x = Op("mul", (score, Const(0.5, dt)), dt)
    v = Load("v", j * 8 + i1, Num(1), dt)
    for safe in (False, True):
        body = attention_body(x, v, j, 5, safe, ("r11", "r12"))
        att = as_attention(Kernel("k", "out", (4, 8), body))
        assert att is not None and att.safe == safe and att.score == score and att.size == 5
    broken = Op("mul", (body, Const(2.0, dt)), dt)
    assert as_attention(Kernel("k", "out", (4, 8), broken)) is None


@pytest.mark.parametrize("variant", ["causal", "softcap"])
@pytest.mark.parametrize("queries, keys, strategy", [(300, 300, "attention"), (1, 700, "decode")])
def test_opencl_runs_attention_as_one_kernel(variant, queries, keys, strategy):
    """The GPU renderer on PoCL: a thread per query row where the rows are many (2 heads x 300
    queries), a work-group per row splitting its keys where they are few (decode); online softmax."""
    from tests.gpu_cases import opencl_or_skip

    opencl_or_skip()
    torch.manual_seed(3)
    q, k, v = torch.randn(1, H, queries, D), torch.randn(1, H, keys, D), torch.randn(1, H, keys, D)
    model = Scores(variant, queries, keys).eval()
    compiled = eclat.compile(model, (q, k, v), target="opencl", autotune="none", quiet=True, k=1)
    np.testing.assert_allclose(np.asarray(compiled(q, k, v)), model(q, k, v).numpy(), rtol=1e-4, atol=2e-5)
    (kern,) = _attention_kernels(compiled)
    assert kern.schedule.strategy == strategy


def test_the_search_times_attention_in_one_kernel_and_as_separate_kernels(monkeypatch):
    """Each candidate is grouped both ways; the search keeps the faster verified one and says which."""
    seen = []
    monkeypatch.setattr(pipeline, "_programs", lambda *a, **kw: seen.append(_PROGRAMS(*a, **kw)) or seen[-1])

    torch.manual_seed(4)
    q, k, v = torch.randn(1, H, 40, D), torch.randn(1, H, 40, D), torch.randn(1, H, 40, D)
    compiled = eclat.compile(Scores("causal", 40, 40).eval(), (q, k, v), autotune="none", quiet=True, k=1)
    (programs,) = seen
    assert sorted(fused for _, _, fused, _, _ in programs) == [False, True]
    one_kernel = any(as_attention(k) for k in compiled.executable.program.kernels)
    assert compiled.compile_report.candidates.fused == one_kernel


def test_rows_in_flight_a_few_at_a_time(monkeypatch):
    """Query rows beyond the stack's state (STATE_FLOATS: here one block of rows) run in turns, the
    last turn partial."""
    import eclat.backends.cpu.attention as cpu_attention

    monkeypatch.setattr(cpu_attention, "STATE_FLOATS", 12)
    torch.manual_seed(5)
    q, k, v = torch.randn(1, H, 37, D), torch.randn(1, H, 300, D), torch.randn(1, H, 300, D)
    assert _attention_kernels(_check(Scores("window", 37, 300).eval(), (q, k, v)))


class CausalFromLength(torch.nn.Module):
    """Attention whose causal mask (and, optionally, a cache's offset) is built from the lengths of
    the call, as a model with dynamic_shapes computes it: filled in, or added (transformers' way,
    where the blocks below the diagonal add 0 throughout and run without the mask)."""

    def __init__(self, added: bool = False):
        super().__init__()
        self.added = added

    def forward(self, q, k, v):
        t, s = q.shape[-2], k.shape[-2]
        i, j = torch.arange(t)[:, None] + (s - t), torch.arange(s)[None, :]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if self.added:
            return torch.softmax(scores + torch.where(j > i, -math.inf, 0.0), -1) @ v
        return torch.softmax(scores.masked_fill(j > i, -math.inf), -1) @ v


@pytest.mark.parametrize("state_rows,added", [(4096, False), (12, False), (4096, True)])
def test_one_kernel_over_run_time_numbers_of_queries_and_keys(monkeypatch, state_rows, added):
    """Attention compiled once with the query and key lengths known at run time runs as one kernel
    at every length: rows in blocks and one by one, keys in whole blocks and a partial one, rows
    in flight in turns (STATE_FLOATS made small)."""
    from torch.export import Dim

    import eclat.backends.cpu.attention as cpu_attention

    monkeypatch.setattr(cpu_attention, "STATE_FLOATS", state_rows)
    model = CausalFromLength(added).eval()
    t, s = Dim("t", min=1, max=160), Dim("s", min=1, max=300)
    example = (torch.randn(1, H, 9, D), torch.randn(1, H, 20, D), torch.randn(1, H, 20, D))
    compiled = eclat.compile(model, example, autotune="none", quiet=True, k=1,
                             dynamic_shapes=({2: t}, {2: s}, {2: s}))
    assert _attention_kernels(compiled) and compiled.executable.program.sizes
    torch.manual_seed(2)
    for queries, keys in ((1, 1), (1, 257), (5, 5), (7, 130), (13, 256), (160, 300)):
        args = (torch.randn(1, H, queries, D), torch.randn(1, H, keys, D), torch.randn(1, H, keys, D))
        np.testing.assert_allclose(compiled(*args).numpy(), model(*args).numpy(), rtol=1e-4, atol=2e-5)


class CausalAtPosition(torch.nn.Module):
    """A static cache's attention: the queries sit at `position` onwards (a run-time input), every
    key of the cache is read, the causal mask hides those past each query."""

    def forward(self, q, k, v, position):
        i = torch.arange(q.shape[-2])[:, None] + position
        j = torch.arange(k.shape[-2])[None, :]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return torch.softmax(scores.masked_fill(j > i, -math.inf), -1) @ v


def test_a_mask_known_at_run_time_skips_the_blocks_it_hides(monkeypatch, tmp_path):
    """The mask is built from a run-time position, so no constant table says which key blocks it
    hides: the kernel fills one per call before the heads run and skips the dead blocks. Positions
    where most blocks are dead, none are, and every key is hidden (torch gives NaN rows)."""
    monkeypatch.setenv("ECLAT_CACHE_DIR", str(tmp_path))  # emit the kernel, not load it from the cache
    filled = []
    fill = AttentionEmitter._fill_mask_table
    monkeypatch.setattr(AttentionEmitter, "_fill_mask_table", lambda self: filled.append(1) or fill(self))
    model = CausalAtPosition().eval()
    torch.manual_seed(3)
    q, k, v = torch.randn(1, H, 9, D), torch.randn(1, H, 300, D), torch.randn(1, H, 300, D)
    compiled = eclat.compile(model, (q, k, v, torch.tensor([0])), autotune="none", quiet=True, k=1)
    assert _attention_kernels(compiled) and filled
    for position in (0, 7, 130, 291, -20):
        args = (q, k, v, torch.tensor([position]))
        np.testing.assert_allclose(np.asarray(compiled(*args)), model(*args).numpy(), rtol=1e-4, atol=2e-5,
                                   equal_nan=True)


class GroupedCache(torch.nn.Module):
    """A static cache of 2 key/value heads, updated at the call's positions and read by 4 query
    heads (keys repeated per head as transformers' repeat_kv writes it), causally masked."""

    def __init__(self, length: int = 40):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, 2, length, D))
        self.register_buffer("v_cache", torch.zeros(1, 2, length, D))

    def forward(self, q, k, v, positions):
        self.k_cache.index_copy_(2, positions, k)
        self.v_cache.index_copy_(2, positions, v)
        length = self.k_cache.shape[2]
        keys, values = (c[:, :, None].expand(1, 2, 2, length, D).reshape(1, 4, length, D)
                        for c in (self.k_cache, self.v_cache))
        hidden = torch.arange(length)[None, :] > positions[:, None]
        scores = (q @ keys.transpose(-1, -2) / math.sqrt(D)).masked_fill(hidden, -math.inf)
        return torch.softmax(scores, -1) @ values


def test_keys_repeated_from_an_updated_cache_are_read_from_a_buffer():
    """The repeated keys are read through the repeat from the updated cache, which is computed into
    a buffer of its own: inlined, its update (a gather over the new rows) ran inside the
    attention's loops, which the CPU then ran as plain loops, 100x slower."""
    from eclat.backends.cpu.attention_plan import attention_parts

    torch.manual_seed(4)
    model, twin = GroupedCache().eval(), GroupedCache().eval()
    args = lambda at: (torch.randn(1, 4, 6, D), torch.randn(1, 2, 6, D), torch.randn(1, 2, 6, D),
                       torch.arange(at, at + 6))
    compiled = eclat.compile(model, args(0), autotune="none", quiet=True, k=1)
    kernels = _attention_kernels(compiled)
    assert kernels and all(attention_parts(as_attention(k), k, 8) is not None for k in kernels)
    for at in (0, 6, 30):
        call = args(at)
        with torch.no_grad():
            want = twin(*call)
        np.testing.assert_allclose(np.asarray(compiled(*call)), want.numpy(), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("d", [4, 64])
def test_an_attention_the_cpu_would_run_as_loops_is_not_offered_to_the_search(d):
    """Values narrower than a vector (4 floats) leave the CPU's attention kernel out: the fused
    grouping would run it as plain loops, many times slower than its estimate, so the search is
    offered the separate kernels alone. With 64 it is offered both."""
    from eclat.backends import get_target
    from eclat.frontend import lower

    q, k, v = torch.randn(1, H, 24, d), torch.randn(1, H, 24, d), torch.randn(1, H, 24, d)
    candidates, _ = pipeline._candidates(lower(Scores("causal", 24, 24).eval(), (q, k, v)), "cpu", 1)
    cpu = get_target("cpu")
    programs = _PROGRAMS(candidates, None, 1, cpu, [])
    fused = [p for _, _, _, p, _ in programs if any(as_attention(kern) for kern in p.kernels)]
    assert programs and all(cpu.runs_fused(kern) for p in fused for kern in p.kernels)
    assert bool(fused) == (d == 64)


class GroupedQuery(torch.nn.Module):
    """Grouped-query attention as transformers writes it: keys and values of 2 heads repeated for 4
    query heads each (expand, then reshape), so that no strided view expresses the repeat."""

    def forward(self, q, k, v):
        b, kv, t, d = k.shape
        k = k[:, :, None].expand(b, kv, 4, t, d).reshape(b, kv * 4, t, d)
        v = v[:, :, None].expand(b, kv, 4, t, d).reshape(b, kv * 4, t, d)
        return torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v


@pytest.mark.parametrize("queries", [1, 6])
def test_grouped_query_keys_are_read_where_they_are_not_copied_per_head(queries):
    q, k, v = torch.randn(1, 8, queries, D), torch.randn(1, 2, 11, D), torch.randn(1, 2, 11, D)
    compiled = eclat.compile(GroupedQuery(), (q, k, v), autotune="none", quiet=True)
    want = GroupedQuery()(q, k, v).numpy()
    np.testing.assert_allclose(compiled(q, k, v).numpy(), want, rtol=1e-5, atol=1e-5)
    program = compiled.executable.program
    repeated = 8 * 11 * D  # elements of the keys repeated for every query head
    copies = [k for k in program.kernels if program.buffers[k.out].numel == repeated and not reduces(k.body)]
    assert not copies, "a kernel copies the keys or values once per query head"


def test_a_repeat_along_the_innermost_axis_is_still_copied():
    """repeat_interleave on the last axis: reading through it would cost its readers their
    contiguous rows, so the copy stays (and the answer is torch's)."""
    class Interleaved(torch.nn.Module):
        def forward(self, x, w):
            return x[..., None].expand(*x.shape, 2).reshape(*x.shape[:-1], 2 * x.shape[-1]) @ w

    x, w = torch.randn(3, 5, 8), torch.randn(16, 4)
    compiled = eclat.compile(Interleaved(), (x, w), autotune="none", quiet=True)
    np.testing.assert_allclose(compiled(x, w).numpy(), Interleaved()(x, w).numpy(), rtol=1e-5, atol=1e-5)
    program = compiled.executable.program
    assert any(program.buffers[k.out].numel == 3 * 5 * 16 and not reduces(k.body) for k in program.kernels)


@pytest.mark.parametrize("rows", [6, 14])
def test_query_rows_go_in_blocks_as_tall_as_the_registers_hold(monkeypatch, rows):
    """A block of query rows holds 2 vectors of accumulators per row: 6 rows of 16 registers (AVX2),
    14 of 32 (AVX-512); either height is right on any host (the rows past the last block too)."""
    import eclat.backends.cpu.attention as cpu_attention

    assert (cpu_attention.block_rows(16), cpu_attention.block_rows(32)) == (6, 14)
    monkeypatch.setattr(cpu_attention, "block_rows", lambda registers: rows)
    torch.manual_seed(9)
    q, k, v = torch.randn(1, H, 45, D), torch.randn(1, H, 45, D), torch.randn(1, H, 45, D)
    assert _attention_kernels(_check(Scores("causal", 45, 45).eval(), (q, k, v)))


class PartlyBiased(torch.nn.Module):
    """A causal mask plus a bias on one query row only: the blocks below the diagonal that hold that
    row need the mask, the others do not."""

    def __init__(self, t: int):
        super().__init__()
        mask = _masks(t, t)["causal"].clone()
        mask[t // 2, : t // 2] += 3.0
        self.register_buffer("mask", mask)

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + self.mask, -1) @ v


@pytest.mark.parametrize("model", ["causal", "partly biased"])
def test_blocks_where_the_mask_is_zero_skip_it(model):
    """The live-block table marks blocks where a constant mask is 0 throughout (UNMASKED): their
    scores are computed without the mask, blocks the mask hides are skipped, the rest add it."""
    from eclat.backends.cpu.attention import HIDDEN, LIVE, UNMASKED

    t = 300
    torch.manual_seed(3)
    q, k, v = torch.randn(1, H, t, D), torch.randn(1, H, t, D), torch.randn(1, H, t, D)
    net = Scores("causal", t, t) if model == "causal" else PartlyBiased(t)
    compiled = _check(net.eval(), (q, k, v))
    (table,) = [b.data for name, b in compiled.executable.program.buffers.items() if "live_" in name]
    assert {HIDDEN, LIVE, UNMASKED} <= set(np.unique(table))


class IndexedPositions(torch.nn.Module):
    """A causal mask whose positions are taken from an arange by index, wrapped where negative, as
    transformers' mask functions take them: a gather in the scores (its 1024 x 1024 mask is too
    large to fold into a constant)."""

    def forward(self, q, k, v):
        t, s = q.shape[-2], k.shape[-2]
        i, j = torch.arange(t) - t, torch.arange(s) - s
        rows = torch.arange(t)[torch.where(i < 0, i + t, i)]
        cols = torch.arange(s)[torch.where(j < 0, j + s, j)]
        mask = torch.where(cols[None, :] <= rows[:, None], 0.0, -math.inf)
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask, -1) @ v


def test_a_mask_built_through_a_gather_still_gives_one_kernel():
    """transformers' Qwen2 at 1024 tokens ran its attention as five kernels (0.77x eager) because its
    mask holds a gather; now one (1.02x eager)."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 1, 1024, D) for _ in range(3))
    compiled = _check(IndexedPositions(), (q, k, v))
    (kernel,) = _attention_kernels(compiled)
    assert "gather" in kernel.ops and len(compiled.executable.program.kernels) <= 3


@pytest.mark.parametrize("threads", [32, 64, 128])
def test_gpu_attention_stages_a_heads_keys_in_shared_memory(threads):
    """Where a work-group's query rows are one head's (64 queries a head, groups of 32 or 64), the
    group stages each tile of keys and values in shared memory and every row reads them there; a
    group spanning heads (128) reads them from global memory. Both match the interpreter on PoCL."""
    from eclat.backends.gpu.schedules import GpuSchedule
    from eclat.backends.opencl.runtime import OpenCLExecutable
    from eclat.ir.interpreter import run
    from tests.gpu_cases import CASES, compare, lowered, opencl_or_skip

    opencl_or_skip()
    graph, inputs = CASES["attention"]()
    program = lowered(graph)
    queries = next(k for k in program.kernels if as_attention(k) is not None and k.shape[1] == 64)
    exe = OpenCLExecutable(program, {queries.name: GpuSchedule("attention", threads=threads)})
    source = next(k.source for k in exe.rendered.kernels if k.name == queries.name)
    assert ("float kv0[" in source) == (threads <= 64), source
    compare(exe.run(inputs), run(graph, inputs))


class BucketBias(torch.nn.Module):
    """Scores plus a bias looked up by a logarithmic bucket of the query-key distance, as T5 computes
    its relative-position bias: from positions and a table alone, too large to fold."""

    def __init__(self, t: int):
        super().__init__()
        self.emb = torch.nn.Embedding(16, H)
        self.t = t

    def forward(self, q, k, v):
        i, j = torch.arange(self.t)[:, None], torch.arange(self.t)[None, :]
        distance = (j - i).abs().float().clamp(min=1)
        bucket = (torch.log(distance) / math.log(self.t) * 15).long().clamp(max=15)
        bias = self.emb(bucket).permute(2, 0, 1)[None]
        return torch.softmax(q @ k.transpose(-1, -2) / 4 + bias, -1) @ v


def test_a_bias_with_a_logarithm_is_computed_once_before_the_attention():
    """The bucketed bias is a buffer the attention kernel reads: computed per score inside it, its
    logarithm and lookup made T5's attention at 512 tokens 13 ms against 2 ms."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, H, 300, D) for _ in range(3))
    (kern,) = _attention_kernels(_check(BucketBias(300).eval(), (q, k, v)))
    assert not {"log2", "gather"} & set(kern.ops), kern.ops


@pytest.mark.parametrize("heads, variant, state_floats",
                         [(3, "causal", 4096), (1, "softcap", 4096), (3, "window", 12)])
def test_query_rows_are_cut_into_parts_where_the_heads_would_load_threads_unevenly(
        monkeypatch, heads, variant, state_floats):
    """With 2 threads, 3 heads (or 1) are too few to share evenly: the query rows are cut into
    parts, each a slice of the kernel's outer loop (3 heads at T=1024 on a Zen 4: 1.43x -> 1.70x
    over 1 thread), every part's rows in turns of the stack's state where they exceed it; it
    matches torch, masks and all."""
    import llvmlite.ir as ir

    import eclat.backends.cpu.attention as cpu_attention

    monkeypatch.setattr(cpu_attention, "STATE_FLOATS", state_floats)
    torch.manual_seed(11)
    t = 200
    q, k, v = (torch.randn(1, heads, t, D) for _ in range(3))
    model = Scores(variant, t, t, heads).eval()
    compiled = eclat.compile(model, (q, k, v), threads=2, autotune="none", quiet=True, k=1)
    np.testing.assert_allclose(compiled(q, k, v), model(q, k, v).detach().numpy(), rtol=1e-4, atol=2e-5)
    (kern,) = _attention_kernels(compiled)
    program = compiled.executable.program
    em = emitter(ir.Module(name="k"), kern, program.buffers, {}, 8)
    assert isinstance(em, AttentionEmitter) and em.parts > 1 and kern.schedule.threads == 2


class MaskedDecode(torch.nn.Module):
    """One query a head against a cache, the keys past `seen` hidden (a mask known at run time: the
    whole cache when seen < 0), by torch.softmax (NaN rows) or SDPA's safe softmax (zero rows)."""

    def __init__(self, safe: bool):
        super().__init__()
        self.safe = safe

    def forward(self, q, k, v, seen):
        hidden = (torch.arange(k.shape[-2]) > seen)[None, :]
        if self.safe:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(hidden, -math.inf)
        return torch.softmax(scores, -1) @ v


def _split(compiled: eclat.CompiledModel) -> list[int]:
    """The key parts of the program's attention kernels as the CPU runs them."""
    from eclat.backends.cpu.attention_plan import key_parts
    from eclat.backends.cpu.runtime import layout

    code, _ = layout(compiled.executable.program)
    return [key_parts(k) for k in code.kernels if as_attention(k) is not None and k.scratch is not None]


@pytest.mark.parametrize("model, heads, queries, keys", [("plain", 3, 1, 1000), ("plain", 5, 1, 600),
                                                         ("causal", 3, 3, 777), ("safe", 3, 1, 1100),
                                                         ("unsafe", 3, 1, 1100)])
def test_a_decode_splits_its_keys_among_threads_where_the_heads_would_load_them_unevenly(
        model, heads, queries, keys):
    """A few queries a head, 2 threads, 3 or 5 heads: the keys are cut into parts, each a slice of
    the kernel's outer loop writing its rows unnormalised with their max and sum, which the part
    that finishes last combines (flash-decoding). Scores in the hundreds, a partial last block, a
    constant causal mask (3 queries at the cache's end), a run-time mask hiding most keys or all of
    them; called repeatedly, as the threads race to finish last."""
    from eclat.backends.cpu.schedules import schedule_space

    torch.manual_seed(12)
    q = 20 * torch.randn(1, heads, queries, 64)
    k, v = torch.randn(1, heads, keys, 64), torch.randn(1, heads, keys, 64)
    seen = model in ("safe", "unsafe")
    net = (MaskedDecode(model == "safe") if seen else Scores(model, queries, keys, heads)).eval()
    args = (q, k, v, torch.tensor(300)) if seen else (q, k, v)
    compiled = eclat.compile(net, args, threads=2, autotune="none", quiet=True, k=1)
    assert _split(compiled) and all(p > 1 for p in _split(compiled))
    (kern,) = _attention_kernels(compiled)  # a tuning search times the keys in parts and whole
    assert {s.depth > 0 for s in schedule_space(kern, threads=2)} == {True, False}
    for at in ((300, 0, keys - 1, -1) if seen else (None,)):
        call = (q, k, v, torch.tensor(at)) if seen else args
        want = net(*call).detach().numpy()
        for _ in range(20):
            got = np.asarray(compiled(*call))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5, equal_nan=True)
        if at == -1:
            assert np.all(np.asarray(compiled(*call)) == 0) if model == "safe" else np.isnan(want).all()


def test_a_decode_over_a_run_time_number_of_keys_splits_them_at_every_length(tmp_path):
    """Keys counted at run time: each part's share follows the call's count (parts with no key block
    left, as at 5 keys, add nothing), also once saved and loaded (the loader derives the scratch);
    one thread's compile does not split."""
    from torch.export import Dim

    model = CausalFromLength().eval()
    s = Dim("s", min=1, max=2048)
    example = (torch.randn(1, 3, 1, 64), torch.randn(1, 3, 600, 64), torch.randn(1, 3, 600, 64))
    compiled = eclat.compile(model, example, threads=2, autotune="none", quiet=True, k=1,
                             dynamic_shapes=(None, {2: s}, {2: s}))
    assert _split(compiled) == [2]
    compiled.save(tmp_path / "decode.eclat")
    loaded = eclat.load(tmp_path / "decode.eclat")
    torch.manual_seed(13)
    for keys in (1, 5, 129, 700, 2048):
        args = (torch.randn(1, 3, 1, 64), torch.randn(1, 3, keys, 64), torch.randn(1, 3, keys, 64))
        for runner in (compiled, loaded):
            np.testing.assert_allclose(np.asarray(runner(*args)), model(*args).numpy(), rtol=1e-4, atol=2e-5)
    assert not _split(eclat.compile(model, example, threads=1, autotune="none", quiet=True, k=1,
                                    dynamic_shapes=(None, {2: s}, {2: s})))


@pytest.mark.parametrize("threads", [64, 256])
@pytest.mark.parametrize("model, keys", [("plain", 5), ("plain", 700), ("safe", 700), ("unsafe", 700)])
def test_a_gpu_decode_splits_each_rows_keys_among_a_work_group(threads, model, keys):
    """The decode strategy on PoCL: a work-group per query row, thread lid taking keys lid, lid + t,
    ..., the group combining the threads' maxima, sums and rows in shared memory. Fewer keys than
    threads (most threads hold nothing), scores in the hundreds, a run-time mask hiding most keys or
    all of them (0 under SDPA's safe softmax, NaN under torch.softmax)."""
    from eclat.backends.gpu.schedules import GpuSchedule
    from eclat.backends.opencl.runtime import OpenCLExecutable
    from tests.gpu_cases import opencl_or_skip

    opencl_or_skip()
    torch.manual_seed(14)
    q = 20 * torch.randn(1, 3, 1, 64)
    k, v = torch.randn(1, 3, keys, 64), torch.randn(1, 3, keys, 64)
    seen = model != "plain"
    net = (MaskedDecode(model == "safe") if seen else Scores("plain", 1, keys, 3)).eval()
    args = (q, k, v, torch.tensor(300)) if seen else (q, k, v)
    compiled = eclat.compile(net, args, target="opencl", autotune="none", quiet=True, k=1)
    (kern,) = _attention_kernels(compiled)
    exe = OpenCLExecutable(compiled.executable.program, {kern.name: GpuSchedule("decode", threads=threads)})
    assert "decode" in next(r.source for r in exe.rendered.kernels if r.name == kern.name)
    for at in ((300, -1) if seen else (None,)):
        call = (q, k, v, torch.tensor(at)) if seen else args
        ins = [np.asarray(a.numpy()) for a in call]
        (got,) = exe.run(ins)
        np.testing.assert_allclose(got, net(*call).detach().numpy(), rtol=1e-4, atol=2e-5, equal_nan=True)
        if at == -1:
            assert np.all(got == 0) if model == "safe" else np.isnan(got).all()
