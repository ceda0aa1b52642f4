"""The CPU backend reads the host: vector lanes and registers from LLVM's feature names, schedules
whose register tiles scale with them, and code generated for another lane count than the host's
(run here, where LLVM legalises the wide vectors, and compiled for an AVX-512 CPU)."""

from __future__ import annotations

import re
from dataclasses import replace

import llvmlite.binding as llvm
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import eclat
from eclat.backends.cpu import host
from eclat.backends.cpu.codegen import build_module
from eclat.backends.cpu.contraction import contraction_of
from eclat.backends.cpu.runtime import CpuExecutable, layout
from eclat.backends.cpu.schedules import default_schedule, fits, gemm_tiles, gemv_tiles, schedule_space
from eclat.compiler.group import group
from eclat.compiler.kernel import Schedule, as_contraction
from eclat.frontend import lower

AVX512 = frozenset({"sse", "sse2", "avx", "avx2", "fma", "avx512f", "avx512vl", "avx512bw", "avx512dq"})
AVX2 = frozenset({"sse", "sse2", "avx", "avx2", "fma"})
NEON = frozenset({"neon", "fp-armv8"})


@pytest.mark.parametrize("features, lanes, registers, unit", [
    (AVX512, 16, 32, "AVX-512"),
    (AVX2, 8, 16, "AVX2+FMA"),
    (AVX2 - {"fma"}, 8, 16, "AVX2"),
    (frozenset({"sse", "sse2", "avx"}), 8, 16, "AVX"),
    (NEON, 4, 32, "NEON"),
    (frozenset({"sse", "sse2", "sse4.2"}), 4, 16, "SSE"),
    (frozenset(), 1, 16, "scalar"),
])
def test_lanes_registers_and_unit_follow_the_features(features, lanes, registers, unit):
    assert host.vector_lanes(features) == lanes
    assert host.vector_registers(features) == registers
    assert host.vector_unit(features) == unit


def test_lanes_scale_with_the_item_size():
    assert [host.vector_lanes(AVX512, n) for n in (1, 2, 4, 8)] == [64, 32, 16, 8]
    assert [host.vector_lanes(NEON, n) for n in (2, 4, 8)] == [8, 4, 2]
    assert host.vector_lanes(frozenset(), 8) == 1


def test_host_is_what_llvm_says():
    feats = host.features()
    assert isinstance(feats, frozenset) and host.features() is feats  # cached
    text = llvm.get_host_cpu_features().flatten()
    assert feats == {f[1:] for f in text.split(",") if f.startswith("+")}
    about = host.description()
    assert about["cpu"] == host.cpu_name() == llvm.get_host_cpu_name()
    assert about["triple"] == host.triple() == llvm.get_process_triple()
    assert about["features"] == sorted(feats)
    assert about["lanes"] == host.vector_lanes() == host.vector_lanes(feats)
    assert about["vector_unit"] == host.vector_unit(feats)


# --- schedules ------------------------------------------------------------------------------------

class Linear(nn.Module):
    def __init__(self, d_in: int = 40, d_out: int = 56):
        super().__init__()
        self.a, self.b = nn.Linear(d_in, 72), nn.Linear(72, d_out)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def _program(model: nn.Module, inputs: tuple):
    """The model's kernels as lowered and grouped (the e-graph's rewrites are not needed here)."""
    return group(lower(model, inputs))


@pytest.fixture(scope="module")
def kernels():
    """A matrix-matrix kernel (64 rows) and a matrix-vector one (1 row)."""
    torch.manual_seed(0)
    out = {}
    for rows in (64, 1):
        program = _program(Linear().eval(), (torch.randn(rows, 40),))
        out[rows] = next(k for k in program.kernels if contraction_of(k, program.buffers) is not None)
    return out


def test_eight_lanes_keep_the_avx2_tiles(kernels):
    gemm = [(6, 16), (4, 16), (8, 8), (4, 24), (3, 32), (2, 32), (6, 8), (12, 8)]
    gemv = [(1, 16), (1, 32), (1, 64), (1, 8), (1, 24)]  # its own widths, then the GEMM tiles' others
    assert gemm_tiles(8, 16) == gemm and gemv_tiles(8, 16) == gemv
    big, small = kernels[64], kernels[1]
    assert default_schedule(big, lanes=8, registers=16) == Schedule(tile=(6, 16))
    assert default_schedule(small, lanes=8, registers=16) == Schedule(tile=(1, 16))
    space = schedule_space(big, lanes=8, registers=16)
    # the tiles in both orientations: the product's 64 rows can be its vectors' lanes too
    assert [s.tile for s in space if not s.transposed] == gemm
    assert {s.tile for s in space if s.transposed} <= set(gemm + gemv)
    assert [s.tile for s in schedule_space(small, lanes=8, registers=16)] == gemv
    two = schedule_space(big, threads=2, lanes=8, registers=16)
    assert two[0] == Schedule(tile=(6, 16), threads=2) and len(two) == 2 * len(space)


@pytest.mark.parametrize("lanes, registers", [(16, 32), (8, 16), (4, 16), (4, 32), (1, 16)])
def test_tiles_are_whole_vectors_that_fit_the_registers(kernels, lanes, registers):
    for tile in gemm_tiles(lanes, registers) + gemv_tiles(lanes, registers):
        assert tile[1] % lanes == 0 and fits(tile, lanes, registers)
    gemm, gemv = gemm_tiles(lanes, registers), gemv_tiles(lanes, registers)
    # every width a product of many rows may pack is one a one-row product of the weight may read
    assert len(gemm) == 8 and {nr for _, nr in gemm} <= {nr for _, nr in gemv} and len(set(gemv)) == len(gemv)
    base = default_schedule(kernels[64], lanes=lanes, registers=registers)
    assert base.tile == gemm_tiles(lanes, registers)[0]
    assert default_schedule(kernels[1], lanes=lanes, registers=registers).tile == (1, 2 * lanes)


def _default_of(model: nn.Module, x: torch.Tensor, known_weights: bool = True) -> Schedule:
    """The default schedule, for 16 lanes and 32 registers, of the model's one product kernel."""
    program = _program(model.eval(), (x,))
    (kern,) = [k for k in program.kernels if contraction_of(k, program.buffers) is not None]
    weights = program.weights if known_weights else {}
    return default_schedule(kern, lanes=16, registers=32, weights=weights, caches=(48 << 10, 2 << 20))


def test_a_weight_read_on_the_left_is_packed_on_the_right_where_that_pays():
    """A convolution reads its weight as the left operand (out[channel, pixel]). Transposed, the
    weight is packed at compile time as the right one: the default where the reduction is deep and
    the pixels few (WEIGHT_RIGHT_*), and the activation, read again by every panel, stays within a
    quarter of L2 (2 MiB here: 1152 x 784 does not); a linear layer's weight is on the right already.
    The tile's height divides 49 rows (HEIGHT_GAIN), not an 8 row block that is one eighth idle."""
    torch.manual_seed(0)
    conv = _default_of(nn.Conv2d(64, 64, 3, padding=1, bias=False), torch.randn(1, 64, 14, 14))
    assert conv == Schedule(tile=(8, 32), transposed=True)
    unknown = _default_of(nn.Conv2d(64, 64, 3, padding=1, bias=False), torch.randn(1, 64, 14, 14), False)
    assert not unknown.transposed  # no weight known: the tiles fill about alike either way
    large = _default_of(nn.Conv2d(128, 128, 3, padding=1, bias=False), torch.randn(1, 128, 28, 28))
    assert not large.transposed
    many_pixels = _default_of(nn.Conv2d(64, 64, 3, padding=1, bias=False), torch.randn(1, 64, 56, 56))
    shallow = _default_of(nn.Conv2d(16, 128, 3, padding=1, bias=False), torch.randn(1, 16, 28, 28))
    assert not many_pixels.transposed and not shallow.transposed
    linear = _default_of(nn.Linear(1152, 128, bias=False), torch.randn(784, 1152))
    assert linear == Schedule(tile=(8, 32))
    assert _default_of(nn.Linear(1024, 512, bias=False), torch.randn(49, 1024)).tile == (7, 32)
    late = _default_of(nn.Conv2d(512, 512, 3, padding=1, bias=False), torch.randn(1, 512, 7, 7))
    assert late == Schedule(tile=(7, 32), transposed=True, depth=96)  # the test below says why


def test_a_transposed_product_runs_in_chunks_that_keep_all_its_rows_in_l1():
    """Transposed, the row blocks reread the lines of the left operand (pixels, consecutive in
    memory): where the panel's slice and all the rows' (32 floats + 49 pixels a step here) outgrow L1,
    the reduction runs in chunks that hold both in 2/3 of it (48 kB: 96 steps), though the panel fits
    L2; the plain orientation, or too many rows for a useful chunk, keeps the panel rule."""
    torch.manual_seed(0)
    few = _default_of(nn.Conv2d(320, 1280, 1, bias=False), torch.randn(1, 320, 7, 7))
    assert few == Schedule(tile=(7, 32), transposed=True, depth=96)
    shallow = _default_of(nn.Conv2d(64, 1280, 1, bias=False), torch.randn(1, 64, 7, 7))
    assert shallow.transposed and shallow.depth == 0  # 64 steps fit L1 whole
    assert _default_of(nn.Conv2d(320, 1280, 1, bias=False), torch.randn(1, 320, 28, 28)).depth == 0


def test_a_block_is_as_high_as_leaves_no_rows_idle_while_its_accumulators_hide_the_fma_latency():
    """A grouped convolution's 8 output channels a group (regnet's) run, with 8 lanes and 16
    registers, as 2 blocks of 4 rows (2 vectors wide: 8 accumulators), not a block of 6 and one of 2
    nor 2 of 5; 12 rows as 2 of 6; 49 rows as blocks of 5 (7 and 3 of them would leave more idle)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(104, 104, 3, padding=1, groups=13, bias=False).eval()
    program = _program(conv, (torch.randn(1, 104, 28, 28),))
    (kern,) = [k for k in program.kernels if contraction_of(k, program.buffers) is not None]
    assert default_schedule(kern, lanes=8, registers=16, weights=program.weights).tile == (4, 16)
    assert default_schedule(kern, lanes=16, registers=32, weights=program.weights).tile[0] in (4, 8)
    from eclat.backends.cpu.schedules import _tile_for
    assert _tile_for(12, 8, 16) == (6, 16) and _tile_for(49, 8, 16) == (5, 16)


def test_a_large_weight_broadcast_from_the_left_is_not_timed():
    """A weight of a quarter of L2 or more read on the left, unpacked, stays in cache while a trial
    repeats the kernel and comes from memory in a model (resnet18's tuned 512-channel convolutions
    ran 1.5-2x slower than their defaults): where the default packs it on the right, the space
    holds the transposed orientation only. A smaller weight keeps both; the default is always kept."""
    torch.manual_seed(0)

    def space(model: nn.Module, x: torch.Tensor) -> list[Schedule]:
        program = _program(model.eval(), (x,))
        (kern,) = [k for k in program.kernels if contraction_of(k, program.buffers) is not None]
        return schedule_space(kern, lanes=16, registers=32, weights=program.weights,
                              caches=(48 << 10, 2 << 20))
    late = space(nn.Conv2d(512, 512, 3, padding=1, bias=False), torch.randn(1, 512, 7, 7))  # 9.4 MB
    assert late[0].transposed and all(s.transposed for s in late)
    small = space(nn.Conv2d(64, 64, 3, padding=1, bias=False), torch.randn(1, 64, 14, 14))  # 147 kB
    assert small[0].transposed and any(not s.transposed for s in small)
    large = space(nn.Conv2d(128, 128, 3, padding=1, bias=False), torch.randn(1, 128, 28, 28))  # 590 kB
    assert not large[0].transposed and any(s.transposed for s in large)


def test_a_product_of_a_very_large_weight_is_timed_at_its_default_panel_width_only(monkeypatch):
    """Each panel width a trial times packs the weight anew (GPT-2's output head: 154 MB a width, the
    compile's peak): a product reading a weight of ONE_WIDTH_BYTES or more is timed at the default's
    width and orientation only (its tiles' heights, chunks and thread counts still vary); a smaller
    weight keeps every width."""
    from eclat.backends.cpu import schedules

    program = _program(nn.Linear(768, 1024, bias=False).eval(), (torch.randn(64, 768),))  # 3 MB
    (kern,) = [k for k in program.kernels if contraction_of(k, program.buffers) is not None]

    def space() -> list[Schedule]:
        return schedule_space(kern, threads=2, lanes=16, registers=32, weights=program.weights,
                              caches=(48 << 10, 2 << 20))
    widths = {(s.tile[1], s.transposed) for s in space()}
    assert len(widths) > 1
    monkeypatch.setattr(schedules, "ONE_WIDTH_BYTES", 1 << 20)
    narrowed = space()
    assert {(s.tile[1], s.transposed) for s in narrowed} == {(narrowed[0].tile[1], narrowed[0].transposed)}
    assert len({s.tile[0] for s in narrowed}) > 1 and {s.threads for s in narrowed} == {1, 2}


def test_a_reduction_runs_in_chunks_where_its_panel_would_fill_l2():
    """A product whose K x NR panel is over a quarter of L2 runs its reduction in chunks of L1's
    size (a dilated convolution's 8640-deep product: 51 -> 106 GFLOP/s on an AVX-512 Xeon); a
    shallower one, one row block, or no known depth keeps it whole."""
    deep = _default_of(nn.Linear(8640, 256, bias=False), torch.randn(256, 8640))
    assert deep.depth == 256  # 2/3 of 48 kB over 32 floats a step, a multiple of 8
    assert _default_of(nn.Linear(1024, 1024, bias=False), torch.randn(256, 1024)).depth == 0
    assert _default_of(nn.Linear(8640, 256, bias=False), torch.randn(4, 8640)).depth == 0  # one row block


@pytest.mark.parametrize("conv, shape", [
    (nn.Conv2d(8, 16, 3, stride=2, padding=1), (2, 8, 15, 13)),
    (nn.Conv2d(4, 8, 3, stride=2, padding=1), (1, 4, 6, 70)),  # rows of 35: panels stepping by two
    (nn.Conv2d(3, 8, 7, stride=2, padding=3), (1, 3, 30, 30)),
    (nn.Conv3d(4, 8, 3, padding=1), (1, 4, 5, 9, 11)),
    (nn.Conv1d(16, 32, 10, stride=5), (1, 16, 203)),
    (nn.Conv2d(16, 16, 3, padding=2, dilation=2, groups=4), (1, 16, 12, 12)),
])
@pytest.mark.parametrize("transposed", [False, True])
def test_a_product_reads_its_windows_in_place(conv, shape, transposed):
    """With the CPU's "windows" grouping an im2col is not written: the product reads the padded
    input through the windows as it copies each panel (an implicit GEMM), one vector load where a
    panel's positions are consecutive in the input, two and a shuffle where they step by two (a
    stride-2 row), and a gather elsewhere (a row's end); strided, 3-d, 1-d, dilated and grouped
    convolutions, in both orientations, match torch. Output rows of SHORT_ROW or fewer positions
    run as one flat axis of columns."""
    from eclat.compiler.kernel import SHORT_ROW

    torch.manual_seed(0)
    x = torch.randn(*shape)
    graph = lower(conv.eval(), (x,))
    im2col = group(graph)
    program = group(graph, frozenset({"windows"}))
    assert len(program.kernels) < len(im2col.kernels)  # the patches' copy is gone
    with torch.no_grad():
        want = conv(x).numpy()
    if 1 < want.shape[-1] <= SHORT_ROW and want.ndim > 3:  # short rows run as one flat axis (flatten_rows)
        (product,) = [k for k in program.kernels if as_contraction(k) is not None]
        assert product.shape[-1] > want.shape[-1], product.shape
    program.kernels = [replace(k, schedule=replace(default_schedule(k), transposed=transposed))
                       for k in program.kernels]
    exe = CpuExecutable(program)
    np.testing.assert_allclose(exe.run([x.numpy()])[0], want, rtol=1e-4, atol=1e-4)
    # transposed, the windows are the broadcast operand: their offset at each step of the reduction
    # (a division and two remainders of it) is read from a table
    tabled = [text for text in exe.module.kernels.values() if '.steps" = internal constant' in text]
    assert len(tabled) == transposed, list(exe.module.kernels.values())


def test_avx512_tiles_use_its_32_registers():
    tiles = gemm_tiles(16, 32)
    assert tiles[0] == (8, 32) and (12, 32) in tiles  # 16 and 24 zmm accumulators
    assert max(mr * nr // 16 for mr, nr in tiles) <= 30
    assert not fits((12, 32), 16, 16) and fits((6, 32), 16, 16)


# --- code for 16 lanes ----------------------------------------------------------------------------

class Block(nn.Module):
    """Linear layers at two batch sizes' worth of rows, a convolution, layernorm and softmax."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 20, 3, padding=1)
        self.ln = nn.LayerNorm(20 * 4 * 4)
        self.fc = nn.Linear(20 * 4 * 4, 37)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return torch.softmax(self.fc(self.ln(x.flatten(1))), -1)


def _with_lanes(program, lanes: int, registers: int):
    """program with every kernel's default schedule for that vector unit."""
    kernels = [replace(k, schedule=default_schedule(k, lanes=lanes, registers=registers))
               for k in program.kernels]
    return replace(program, buffers=dict(program.buffers), kernels=kernels)


@pytest.mark.parametrize("make", [
    lambda: (Linear().eval(), (torch.randn(64, 40),)),
    lambda: (Linear().eval(), (torch.randn(1, 40),)),
    lambda: (Block().eval(), (torch.randn(2, 3, 8, 8),)),
], ids=["gemm", "gemv", "conv_ln_softmax"])
def test_sixteen_lanes_run_right_on_this_host(make):
    torch.manual_seed(0)
    model, inputs = make()
    program = _program(model, inputs)
    exe = CpuExecutable(_with_lanes(program, 16, 32), lanes=16)
    assert exe.module.lanes == 16
    text = exe.module.text()
    assert "<16 x float>" in text and "<8 x float>" not in text
    (got,) = exe.run([x.numpy() for x in inputs])
    want = model(*inputs).detach().numpy()
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-5)


def _x86_machine(cpu: str, features: str):
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    try:
        target = llvm.Target.from_triple("x86_64-unknown-linux-gnu")
    except RuntimeError:
        pytest.skip("this LLVM has no x86 target")
    return target.create_target_machine(cpu=cpu, features=features, opt=3)


def test_sixteen_lane_gemm_compiles_to_zmm_for_avx512():
    torch.manual_seed(0)
    program = _with_lanes(_program(Linear().eval(), (torch.randn(64, 40),)), 16, 32)
    code, plan = layout(program)
    module = build_module(code, plan, lanes=16)
    tm = _x86_machine("skylake-avx512", "+avx512f,+avx512vl,+avx512bw,+avx512dq,+avx2,+avx,+fma,+sse4.2")
    mod = llvm.parse_assembly(module.text())
    mod.triple = "x86_64-unknown-linux-gnu"
    mod.data_layout = str(tm.target_data)
    mod.verify()
    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
    pb.getModulePassManager().run(mod, pb)
    asm = tm.emit_assembly(mod)
    gemm = next(k.name for k in code.kernels if contraction_of(k, code.buffers) is not None)
    start = asm.index(f"{module.functions[gemm]}:")
    body = asm[start:asm.index(".Lfunc_end", start)]
    assert "zmm" in body and "vfmadd" in body
    # and for AVX2 the same kernel at 8 lanes is ymm only
    program8 = _with_lanes(program, 8, 16)
    code8, plan8 = layout(program8)
    tm8 = _x86_machine("haswell", "+avx2,+avx,+fma,+sse4.2")
    asm8 = tm8.emit_assembly(llvm.parse_assembly(build_module(code8, plan8, lanes=8).text()))
    assert "ymm" in asm8 and "zmm" not in asm8


def test_kernel_functions_compile_once_per_process():
    """A kernel's code is compiled once (jit.kernel_codes): a second executable of the same model
    (lowered and grouped again) optimises nothing again, and runs the same."""
    from eclat.backends.cpu import jit

    torch.manual_seed(0)
    program = _program(Block().eval(), (torch.randn(2, 3, 8, 8),))
    first = CpuExecutable(program)
    compiled = len(jit._code)
    torch.manual_seed(0)
    again = _program(Block().eval(), (torch.randn(2, 3, 8, 8),))
    second = CpuExecutable(again)
    assert len(jit._code) == compiled and set(second.module.kernels) == set(first.module.kernels)
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(first.run([x])[0], second.run([x])[0])


def test_kernel_code_is_kept_on_disk_for_the_next_process(tmp_path, monkeypatch):
    """A kernel's emitted IR and object code are kept under <cache_dir>/code: a process that has
    neither in memory (the caches cleared here) builds the same model emitting and optimising
    nothing, and runs the same. A damaged file is a miss, compiled and written again; with
    ECLAT_CODE_STORE=0 nothing is written."""
    from eclat.backends.cpu import codegen, jit, llvm_worker
    from eclat.backends.cpu.emitter import KernelEmitter

    monkeypatch.setenv("ECLAT_CACHE_DIR", str(tmp_path))
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)

    def fresh_build():
        jit._code.clear()
        codegen._emitted.clear()
        torch.manual_seed(0)
        return CpuExecutable(_program(Block().eval(), (torch.randn(2, 3, 8, 8),)))

    want = fresh_build().run([x])[0]
    stored = sorted(p.name for p in (tmp_path / "code").iterdir())
    assert any(n.startswith("function-") for n in stored) and any(n.startswith("object-") for n in stored)

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again")
    with monkeypatch.context() as m:
        m.setattr(llvm_worker, "compile_all", refuse)
        m.setattr(jit, "compile_all", refuse)
        m.setattr(KernelEmitter, "function", refuse)
        np.testing.assert_array_equal(fresh_build().run([x])[0], want)

    damaged = next(p for p in (tmp_path / "code").iterdir() if p.name.startswith("object-"))
    damaged.write_bytes(damaged.read_bytes()[:-10] + b"0123456789")
    np.testing.assert_array_equal(fresh_build().run([x])[0], want)
    assert sorted(p.name for p in (tmp_path / "code").iterdir()) == stored  # rewritten, not added
    assert not damaged.read_bytes().endswith(b"0123456789")

    monkeypatch.setenv("ECLAT_CACHE_DIR", str(tmp_path / "off"))
    monkeypatch.setenv("ECLAT_CODE_STORE", "0")
    np.testing.assert_array_equal(fresh_build().run([x])[0], want)
    assert not (tmp_path / "off").exists()

    monkeypatch.delenv("ECLAT_CODE_STORE")  # a compile's cache_dir= holds its code too
    eclat.compile(nn.Linear(5, 3), (torch.randn(2, 5),), autotune="none", cache_dir=tmp_path / "option")
    assert any((tmp_path / "option" / "code").iterdir())


def _kernel_texts(n: int) -> list[str]:
    """n different one-function modules: a loop LLVM vectorises, each with its own constant."""
    return [f"""define void @k{i}(ptr noalias %a, ptr noalias %b) {{
entry:
  br label %loop
loop:
  %j = phi i64 [0, %entry], [%next, %loop]
  %pa = getelementptr float, ptr %a, i64 %j
  %x = load float, ptr %pa
  %y = fmul float %x, {float(i + 2)!r}
  %pb = getelementptr float, ptr %b, i64 %j
  store float %y, ptr %pb
  %next = add i64 %j, 1
  %done = icmp eq i64 %next, 1024
  br i1 %done, label %exit, label %loop
exit:
  ret void
}}""" for i in range(n)]


def test_worker_processes_compile_what_this_process_would(monkeypatch):
    """llvm_worker.compile_all hands modules to worker processes (llvmlite lets a process compile one
    module at a time): each comes back as the same object code this process makes, a module that
    does not verify raises its own error here, and a worker that died is replaced."""
    from eclat.backends.cpu import jit, llvm_worker

    monkeypatch.setenv(llvm_worker.WORKERS_ENV, "2")
    tm = jit.target_machine()
    cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    texts = _kernel_texts(6)
    local_calls = []

    def local(text):
        local_calls.append(text)
        return llvm_worker.compiled(text, tm)
    made = llvm_worker.compile_all(cpu, features, texts, local)
    assert [obj for obj, _ in made] == [llvm_worker.compiled(t, tm)[0] for t in texts]
    assert len(llvm_worker._workers) == 2 and len(local_calls) < len(texts)  # the workers took some
    assert all("<16 x float>" in ir or "<8 x float>" in ir for _, ir in made)  # optimised: vectorised

    broken = texts[:2] + ["define void @bad() {\nentry:\n  %x = add i32 %x, 1\n  ret void\n}"]
    with pytest.raises(RuntimeError, match="Only PHI nodes may reference their own value"):
        llvm_worker.compile_all(cpu, features, broken, local)

    llvm_worker._workers[0].process.kill()
    llvm_worker._workers[0].process.wait()
    again = llvm_worker.compile_all(cpu, features, _kernel_texts(8)[6:] + texts, local)
    assert [obj for obj, _ in again[2:]] == [obj for obj, _ in made]
    assert len(llvm_worker._workers) == 2 and all(w.process.poll() is None for w in llvm_worker._workers)



def test_loops_are_vectorised_at_the_hosts_widest_vectors():
    """LLVM's vectoriser prefers 256-bit vectors on Intel's AVX-512 cores, where the contractions
    use all 512; kernel functions ask for the host's widest (jit.widest_vectors), so an
    elementwise loop runs on zmm where it ran on ymm."""
    from eclat.backends.cpu import jit

    tm = _x86_machine("skylake-avx512", "+avx512f,+avx512vl,+avx512bw,+avx512dq,+avx2,+avx,+fma,+sse4.2")

    def assembly(text: str) -> str:
        mod = llvm.parse_assembly(text)
        mod.triple = "x86_64-unknown-linux-gnu"
        mod.data_layout = str(tm.target_data)
        pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
        pb.getModulePassManager().run(mod, pb)
        return tm.emit_assembly(mod)

    printed = _kernel_texts(1)[0]  # LLVM's form, `define ... {`; llvmlite's puts `{` on a line of its own
    written = printed.replace(") {\nentry", ")\n{\nentry")
    for text in (printed, written):
        assert "ymm" in assembly(text) and "zmm" not in assembly(text)
        assert "zmm" in assembly(jit.widest_vectors(text, 512))
    assert jit.widest_vectors(written, 0) == written
    again = str(llvm.parse_assembly(jit.widest_vectors(printed, 512)))
    assert jit.widest_vectors(again, 512) == again  # a prepared text's print is kept (an artifact's)
    # and this host's kernels ask for its own widest
    program = _with_lanes(_program(nn.SiLU().eval(), (torch.randn(8, 64),)), host.vector_lanes(), 32)
    code, plan = layout(program)
    texts = build_module(code, plan).kernels.values()
    want = f'"prefer-vector-width"="{8 * host.vector_bytes()}"'
    assert host.vector_bytes() == 0 or all(want in text for text in texts)


class GatherColumns(nn.Module):
    def forward(self, x, idx):
        return x[:, idx] * 2.0


def test_a_gather_reads_its_rows_in_place_and_vectorised():
    """x[:, idx] gathers rows of x in place (its leading axis joins the gathered one: no copy of x
    with the indexed axis moved to the front, no permute of the result), and each row's start is
    computed once per row, not per element: the loop along the row vectorises."""
    from eclat.backends.cpu import jit

    x, idx = torch.randn(4, 10, 64), torch.tensor([3, 0, 9, 3, 5, 1])
    compiled = eclat.compile(GatherColumns().eval(), (x, idx), autotune="none", k=1, quiet=True)
    torch.testing.assert_close(compiled(x, idx), GatherColumns()(x, idx))
    program = compiled.executable.program
    assert len(program.kernels) == 1, program.kernels
    (text,) = compiled.executable.module.kernels.values()
    optimised = jit.kernel_codes([text])[0][1]
    assert host.vector_lanes() == 1 or re.search(r"load <\d+ x float>", optimised), optimised
