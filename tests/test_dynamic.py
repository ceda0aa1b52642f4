"""Sizes known only at run time (dynamic_shapes): one compile serves every size within the bounds,
its kernels reading the sizes of each call; a size outside them is a clear error."""

from __future__ import annotations

import itertools
import random
import re

import numpy as np
import pytest
import torch
from torch.export import Dim

import eclat
from eclat.errors import EclatError
from eclat.ir.symbolic import BinOp, Num, Var, evaluate, floordiv, index_var, lt, mod, to_expr
from eclat.ir.view import contiguous_strides


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.ln = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16), torch.nn.LayerNorm(64)

    def forward(self, x):
        return torch.softmax(self.l2(torch.relu(self.ln(self.l1(x)))), -1)


class Block(torch.nn.Module):
    """A pre-norm transformer block with a causal mask built from the sequence length."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.att = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.ff = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))

    def forward(self, x):
        h, t = self.ln1(x), x.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        x = x + self.att(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class Pair(torch.nn.Module):
    def forward(self, x, y):
        return torch.cat([x, y], 1).sum(0)


class Calling(torch.nn.Module):
    """inner called as call(inner, *args): a transformers model with its keywords, tensors out."""

    def __init__(self, inner: torch.nn.Module, call) -> None:
        super().__init__()
        self.inner, self.call = inner, call

    def forward(self, ids, mask=None):  # named: torch.export takes *args as one argument
        return self.call(self.inner, ids) if mask is None else self.call(self.inner, ids, mask)


def _compiled(model, example, dynamic, **options):
    return eclat.compile(model.eval(), example, dynamic_shapes=dynamic, autotune="none", **options)


def _check(compiled, model, *args, tol: float = 1e-4) -> None:
    with torch.no_grad():
        want = model(*args)
    np.testing.assert_allclose(compiled(*args).numpy(), want.numpy(), rtol=tol, atol=tol)


def test_one_compile_serves_every_batch_size_in_the_bounds():
    model = Mlp().eval()
    compiled = _compiled(model, (torch.randn(8, 32),), ({0: Dim("batch", min=1, max=64)},))
    program = compiled.executable.program
    assert [v.name for v in program.sizes] and program.input_shapes[0][1] == 32
    for n in (*range(1, 18), 63, 64):  # every tail of a row block: one micro-kernel per height
        _check(compiled, model, torch.randn(n, 32))
    assert compiled.executable.program is program  # nothing recompiled


def test_a_transformer_block_over_every_sequence_length():
    model = Block().eval()
    compiled = _compiled(model, (torch.randn(1, 16, 32),), ({1: Dim("t", min=2, max=48)},))
    for t in range(2, 49, 3):
        _check(compiled, model, torch.randn(1, t, 32))


def test_convolutions_and_embeddings_with_run_time_sizes():
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 8, 3, stride=2, padding=1), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 4)).eval()
    conv[1].running_mean.uniform_(-1, 1)
    conv[1].running_var.uniform_(0.5, 2)
    compiled = _compiled(conv, (torch.randn(2, 3, 12, 12),), ({0: Dim("b", min=1, max=6)},))
    for b in (1, 4, 6):
        _check(compiled, conv, torch.randn(b, 3, 12, 12))
    emb = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Tanh(), torch.nn.Linear(16, 50),
                              torch.nn.LogSoftmax(-1)).eval()
    ids = torch.randint(0, 50, (2, 7))
    compiled = _compiled(emb, (ids,), ({0: Dim("b", min=1, max=4), 1: Dim("t", min=1, max=20)},))
    for shape in ((1, 1), (3, 9), (4, 20)):
        _check(compiled, emb, torch.randint(0, 50, shape))


def test_sizes_outside_their_bounds_or_disagreeing_are_clear_errors():
    """Named as the user named them: the Dim's name, not torch's symbol (s27)."""
    compiled = _compiled(Mlp(), (torch.randn(8, 32),), ({0: Dim("batch", min=2, max=16)},))
    expected = r"input 0 \(x\): expected shape \[batch in 2\.\.16, 32\], given \[17, 32\] \(batch must be"
    with pytest.raises(ValueError, match=expected):
        compiled(torch.randn(17, 32))
    with pytest.raises(ValueError, match=r"given \[1, 32\]"):
        compiled(torch.randn(1, 32))
    with pytest.raises(ValueError, match=r"given \[4, 31\]"):
        compiled(torch.randn(4, 31))
    batch = Dim("batch", min=1, max=8)
    pair = _compiled(Pair(), (torch.randn(3, 2), torch.randn(3, 5)), ({0: batch}, {0: batch}))
    _check(pair, Pair(), torch.randn(5, 2), torch.randn(5, 5))
    with pytest.raises(ValueError, match=r"input 1 \(y\)"):
        pair(torch.randn(5, 2), torch.randn(4, 5))


def test_a_size_without_a_maximum_or_on_a_fixed_size_target_is_refused():
    with pytest.raises(EclatError, match="give it a maximum"):
        _compiled(Mlp(), (torch.randn(8, 32),), ({0: Dim("batch")},))
    with pytest.raises(EclatError, match="fixed sizes only"):
        _compiled(Mlp(), (torch.randn(8, 32),), ({0: Dim("batch", max=16)},), target="opencl")


def test_artifacts_keep_the_program_with_run_time_sizes(tmp_path):
    model = Block().eval()
    compiled = _compiled(model, (torch.randn(1, 8, 32),), ({1: Dim("t", min=2, max=24)},))
    compiled.save(str(tmp_path / "block.eclat"))
    loaded = eclat.load(str(tmp_path / "block.eclat"))
    for t in (2, 11, 24):
        _check(loaded, model, torch.randn(1, t, 32))
    with pytest.raises(ValueError, match="must be in 2..24"):
        loaded(torch.randn(1, 25, 32))


def test_a_transformers_decoder_compiles_once_for_every_prompt_length():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(config).eval()
    model = Calling(lm, lambda m, ids: m(input_ids=ids, use_cache=False).logits).eval()
    compiled = _compiled(model, (torch.randint(0, 97, (1, 12)),), ({1: Dim("t", min=1, max=32)},))
    for t in range(1, 33):
        _check(compiled, model, torch.randint(0, 97, (1, t)), tol=2e-4)


# --- index arithmetic over run-time sizes ------------------------------------------------------

def _c_value(e, env):
    """e evaluated as the compiled code does: // and % truncate (C), where Python's floor."""
    if isinstance(e, Num):
        return e.v
    if isinstance(e, Var):
        return env[e.name]
    a, b = _c_value(e.a, env), _c_value(e.b, env)
    if e.op == "//":
        return int(a / b)
    if e.op == "%":
        return a - int(a / b) * b
    return int(evaluate(BinOp(e.op, Num(a), Num(b))))


@pytest.mark.parametrize("seed", range(12))
def test_division_by_strides_of_run_time_shapes_is_exact(seed: int):
    """A flat index of a shape with run-time sizes, divided and reduced by the strides of another
    shape (what grouping's unravel does): simplified exactly, never to a division of a negative."""
    rng = random.Random(seed)
    sizes = [Var(f"s{k}", 1, 9) for k in range(2)]
    shape = [rng.choice([3, 4, *sizes, (sizes[0] - 1) // 2 + 1]) for _ in range(3)]  # a conv's output
    idx = [index_var(f"i{k}", n) for k, n in enumerate(shape)]
    flat = to_expr(rng.randint(-4, 0))
    for i, s in zip(idx, contiguous_strides(shape)):
        flat = flat + i * s
    other = [shape[1], shape[0], shape[2]]  # a shape its elements may be read in
    for _ in range(30):
        env = {v.name: rng.randint(v.lo, v.hi) for v in sizes}
        env |= {i.name: rng.randrange(int(evaluate(n, env))) for i, n in zip(idx, shape)}
        at = int(evaluate(flat, env))
        assert _c_value(lt(idx[0], shape[0]), env) == 1
        if at < 0:  # grouping divides only indices that are in range
            continue
        for stride, n in zip(contiguous_strides(other), other):
            step, size = int(evaluate(stride, env)), int(evaluate(n, env))
            if step:
                assert _c_value(floordiv(flat, stride), env) == at // step, (floordiv(flat, stride), env)
            assert _c_value(mod(flat, n), env) == at % size, (mod(flat, n), env)


def test_the_cli_compiles_a_factory_with_dynamic_shapes_and_runs_other_sizes(tmp_path, capsys):
    from eclat.cli import main

    (tmp_path / "m.py").write_text(
        "import torch\nfrom torch.export import Dim\n\n\ndef make():\n    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()).eval()\n"
        "    return model, (torch.randn(4, 8),), ({0: Dim('rows', min=1, max=32)},)\n")
    artifact = tmp_path / "m.eclat"
    spec = f"{tmp_path / 'm.py'}:make"
    assert main(["compile", spec, "-o", str(artifact), "--autotune", "none", "--quiet"]) == 0
    assert main(["inspect", str(artifact)]) == 0
    assert re.search(r"float32\[rows in 1\.\.32, 8\]", capsys.readouterr().out)  # the Dim's name
    namespace: dict = {}
    exec((tmp_path / "m.py").read_text(), namespace)
    model = namespace["make"]()[0]
    for rows in (1, 13):
        x = torch.randn(rows, 8)
        np.save(tmp_path / "x.npy", x.numpy())
        out = tmp_path / "y.npz"
        assert main(["run", str(artifact), "--inputs", str(tmp_path / "x.npy"), "-o", str(out)]) == 0
        with torch.no_grad():
            np.testing.assert_allclose(np.load(out)["output0"], model(x).numpy(), rtol=1e-5, atol=1e-6)


def test_torch_compile_with_eclat_keeps_eclat_when_a_size_changes(monkeypatch):
    """Dynamo recompiles a graph with the size that changed symbolic: eclat compiles that graph
    once for every size up to max_size, and a larger size runs in PyTorch."""
    import eclat.dynamo  # noqa: F401 - registers the backend

    compiles: list = []
    real = eclat.compile
    monkeypatch.setattr(eclat, "compile",
                        lambda *a, **k: compiles.append(k.get("dynamic_shapes")) or real(*a, **k))
    torch._dynamo.reset()
    model = Mlp().eval()
    fast = torch.compile(model, backend="eclat", options={"max_size": 40})
    with torch.no_grad():
        for n in (3, 5, 9, 33, 40, 41):
            x = torch.randn(n, 32)
            np.testing.assert_allclose(fast(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    assert len(compiles) == 2 and compiles[0] is None and compiles[1] is not None  # the first size, then all
    torch._dynamo.reset()


def test_an_encoder_with_a_padding_mask_over_run_time_batch_and_length():
    """Two run-time sizes at once (batch and length), and a padding mask: index arithmetic over
    strides that are products of both (B * T * d) stays exact."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=61, hidden_size=32, num_attention_heads=4,
                                     intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64)
    torch.manual_seed(0)
    bert = transformers.BertModel(config).eval()
    model = Calling(bert, lambda m, ids, mask: m(input_ids=ids, attention_mask=mask).last_hidden_state).eval()
    batch, length = Dim("batch", min=1, max=4), Dim("length", min=2, max=32)
    example = (torch.randint(0, 61, (2, 9)), torch.ones(2, 9, dtype=torch.long))
    compiled = _compiled(model, example, ({0: batch, 1: length}, {0: batch, 1: length}))
    for b, t in ((1, 2), (3, 17), (4, 32)):
        mask = torch.ones(b, t, dtype=torch.long)
        mask[-1, t // 2:] = 0
        _check(compiled, model, torch.randint(0, 61, (b, t)), mask)


def test_a_stride_two_window_over_run_time_sizes_divides_exactly():
    """A 2x2 window of an h x w plane read from an output position (i1, i2) of the (h // 2) x
    (w // 2) plane: dividing by the plane's size and its width uses 2 * (h // 2) <= h (exact, and
    checked at every point of every size in range)."""
    h, w = Var("s1", 2, 7), Var("s2", 2, 7)
    i1, i2 = index_var("i1", h // 2), index_var("i2", w // 2)
    r1, r2 = Var("r1", 0, 1), Var("r2", 0, 1)
    flat = (i1 * 2 + r1) * w + i2 * 2 + r2
    plane, row = floordiv(flat, h * w), mod(floordiv(flat, w), h)
    assert plane == Num(0) and "/" not in str(mod(flat, w))  # simplified, not merely evaluated
    for hv, wv, a, b, c, d in itertools.product(range(2, 8), range(2, 8), *[range(3)] * 2, *[range(2)] * 2):
        if a < hv // 2 and b < wv // 2:
            env = {"s1": hv, "s2": wv, "i1": a, "i2": b, "r1": c, "r2": d}
            at = int(evaluate(flat, env))
            assert _c_value(row, env) == at // wv % hv and _c_value(mod(flat, w), env) == at % wv


def test_a_multiple_of_a_run_time_size_leaves_no_remainder():
    """0 and multiples of a run-time size s leave 0 modulo s (the rows of an s-wide softmax read
    whole: online.plan_online), where `0 % s` stayed an expression the plans could not prove 0."""
    s, t = Var("s", 1, 300), Var("t", 1, 160)
    assert mod(0, s) == Num(0) and mod(s * t, s) == Num(0) and mod(s * 16, s) == Num(0)
    assert mod(s * 16 + 3, s) != Num(0)


def test_the_search_runs_again_at_the_sizes_ends_and_a_call_runs_the_nearest(tmp_path, monkeypatch):
    """With a search, the compile searches again at the sizes' ends; a program that wins there is kept
    for them (here every one is made to win), chosen by each call's sizes, kept by the program cache
    and by artifacts, and right at every size. The least size gets a program of its own, every size
    a constant, which runs that size alone."""
    from eclat.compiler import pipeline
    from eclat.compiler.buckets import SizeBuckets

    monkeypatch.setattr(pipeline, "_faster_first", lambda a, b, arrays: True)
    monkeypatch.setattr(pipeline, "_bucket_wins", lambda *args: True)  # even the example's program again
    model = Mlp().eval()
    example, dynamic = (torch.randn(8, 32),), ({0: Dim("batch", min=1, max=256)},)
    first = eclat.compile(model, example, dynamic_shapes=dynamic, cache_dir=tmp_path, quiet=True)
    rows = first.report()["buckets"]
    assert [(list(r["sizes"].values()), r["exact"]) for r in rows] == [([1], True), ([128], False)], rows
    assert all(r["kept"] for r in rows)
    again = eclat.compile(model, example, dynamic_shapes=dynamic, cache_dir=tmp_path, quiet=True)
    assert again.report()["candidates"]["cached"] and again.report()["buckets"] == rows
    first.save(str(tmp_path / "mlp.eclat"))
    loaded = eclat.load(str(tmp_path / "mlp.eclat"))
    for compiled in (first, again, loaded):
        exe = compiled.executable
        assert isinstance(exe, SizeBuckets)
        assert [(list(b.sizes.values()), b.exact) for b in exe.buckets] == [([8], False), ([1], True),
                                                                           ([128], False)]
        example_program, one, large = (b.executable for b in exe.buckets)
        assert not one.program.sizes  # every size a constant
        for n, runs in ((1, one), (2, example_program), (30, example_program), (40, large), (256, large)):
            x = torch.randn(n, 32)
            assert exe.pick([x.numpy()]) is runs, n
            _check(compiled, model, x)


def test_size_representatives_span_the_bounds_within_sixteen_times():
    from eclat.compiler.buckets import representatives

    s = Var("s", 1, 100)
    x = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    ends = representatives([(s, 4)], [x])
    assert [([a.shape for a in at], least) for at, least in ends] == [([(1, 4)], True), ([(96, 4)], False)]
    assert (ends[1][0][0][:6] == x).all() and (ends[1][0][0][90:] == x).all()  # the example's rows, cycled
    assert representatives([(Var("s", 0, 100), 4)], [x])[0][1]  # one is the least size with a call's rows
    assert representatives([(Var("s", 4, 20), 4)], [x]) == []  # no end 4x away


def test_a_kernel_over_run_time_sizes_is_timed_as_the_code_that_runs():
    """The tuner times a kernel with run-time sizes as the program runs it, reading its sizes at run
    time, not as code for the caller's sizes as constants (which a product of one row miscompiled)."""
    from eclat.backends.cpu.trials import Trials, isolate
    from eclat.compiler.group import group
    from eclat.frontend.lower import lower

    graph = lower(Mlp().eval(), (torch.randn(8, 32),), dynamic_shapes=({0: Dim("batch", min=1, max=64)},))
    program = group(graph)
    trials = Trials(program, 1, [np.ones((5, 32), np.float32)])
    for k in program.kernels:
        assert isolate(program, k).sizes == program.sizes, k.name
        assert trials(k, None)() > 0


def test_a_weight_only_number_folds_with_run_time_sizes():
    """A strided, padded 1x1 convolution and nan_to_num over a run-time batch (found by fuzzing):
    a weight-only number was computed as [1] and folding it crashed the compile (expand to ())."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(9, 16, 1, stride=(2, 1), padding=2)

        def forward(self, x):
            return torch.nan_to_num(self.conv(x))

    torch.manual_seed(0)
    model = Model().eval()
    compiled = eclat.compile(model, (torch.randn(7, 9, 1, 33),), autotune="none", quiet=True,
                             dynamic_shapes=({0: Dim("b", min=3, max=17)},))
    for b in (3, 8, 17):
        x = torch.randn(b, 9, 1, 33)
        with torch.no_grad():
            np.testing.assert_allclose(compiled(x.numpy()), model(x).numpy(), rtol=1e-5, atol=1e-5)


def test_variance_over_a_run_time_number_of_elements():
    """var, std and var_mean along an axis whose length is known at run time divide by the count
    then (the lowering refused them); one element with correction 1 is 0 / 0, as torch's."""
    class Model(torch.nn.Module):
        def forward(self, x):
            return x.var(1), x.std(1, correction=0), torch.var_mean(x, 1, keepdim=True)[0]

    model = Model()
    compiled = eclat.compile(model, (torch.randn(3, 9),), autotune="none", quiet=True,
                             dynamic_shapes=({1: Dim("n", min=1, max=64)},))
    for n in (1, 2, 33, 64):
        x = torch.randn(3, n) * 3 + 1
        for got, want in zip(compiled(x), model(x)):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, equal_nan=True)


def test_a_negative_index_along_a_run_time_axis():
    """x[:, -1] along an axis whose length is known at run time: the slice n - 1 .. n is ordered
    whatever n is (the view refused to order n - 1 and n; found by fuzzing)."""
    class Model(torch.nn.Module):
        def forward(self, x):
            return x[:, -1] * 2 + x[:, -2]

    model = Model()
    compiled = eclat.compile(model, (torch.randn(3, 9),), autotune="none", quiet=True,
                             dynamic_shapes=({1: Dim("n", min=2, max=64)},))
    for n in (2, 9, 64):
        x = torch.randn(3, n)
        np.testing.assert_allclose(compiled(x).numpy(), model(x).numpy(), rtol=1e-6, atol=1e-6)


def test_upsampling_by_whole_scales_over_run_time_sizes():
    """Nearest and bilinear (half-pixel) upsampling of a map whose height and width are known at
    run time, by scale_factor or by an output size twice the input's: each output's source is a
    function of its position modulo the scale, so one compile serves every size (edges included:
    a single row). A scale that is not a whole number is refused, naming the op and its line."""
    def upsampled(y):
        F = torch.nn.functional
        near = F.interpolate(y, scale_factor=2, mode="nearest")
        smooth = F.interpolate(y, size=(y.shape[2] * 2, y.shape[3] * 2), mode="bilinear", align_corners=False)
        return near * smooth, F.interpolate(y, scale_factor=3, mode="bilinear")

    _matches_at_image_sizes(ConvThen(upsampled), (6, 5), 1, 32, ((1, 1), (1, 7), (6, 5), (13, 32)), 1e-5)

    class Fractional(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, scale_factor=1.5, mode="nearest")

    with pytest.raises(eclat.UnsupportedOpError, match=r"upsample_nearest2d.*test_dynamic.py.*1\.5"):
        eclat.compile(Fractional(), (torch.randn(1, 2, 4, 4),), autotune="none", quiet=True,
                      dynamic_shapes=({2: Dim("h", min=2, max=16)},))


def test_slices_from_a_run_time_end_and_slices_export_sized_at_the_example():
    """x[-3:], x[-3:-1] and x[-3::2] along an axis whose length is known at run time start at
    n - 3 (they started at -3, reading before the buffer; found by fuzzing). torch.export sizes
    x[:2] as 2 rows whatever the size, which is wrong below 2: with a minimum of 1 the compile
    refuses it and says how to mend it; with a minimum of 2 it runs."""
    class Tails(torch.nn.Module):
        def forward(self, x):
            return x[-3:] * 2, x[-3:-1] + 1, x[-3::2], x[:2]

    model = Tails()
    compiled = eclat.compile(model, (torch.randn(5, 4),), autotune="none", quiet=True,
                             dynamic_shapes=({0: Dim("n", min=3, max=40)},))
    for n in (3, 4, 7, 40):
        x = torch.arange(n * 4.0).reshape(n, 4)
        for got, want in zip(compiled(x), model(x)):
            np.testing.assert_array_equal(got.numpy(), want.numpy())

    class Head(torch.nn.Module):
        def forward(self, x):
            return x[:2] * 2

    with pytest.raises(eclat.UnsupportedOpError, match=r"aten.slice.*at least 1.*Dim\(min="):
        eclat.compile(Head(), (torch.randn(5, 3),), autotune="none", quiet=True,
                      dynamic_shapes=({0: Dim("d", min=1, max=33)},))


def test_adaptive_pooling_over_run_time_sizes():
    """Adaptive average and max pooling of a map whose size is known at run time (VGG's 7 x 7 head,
    a pyramid's 1, 2, 3 and 6 bins): which inputs each output covers is computed at each call, in
    integers; sizes below the output's (bins that overlap) included."""
    def pooled(y):
        F = torch.nn.functional
        return (F.adaptive_avg_pool2d(y, (7, 7)), F.adaptive_max_pool2d(y, 1),
                F.adaptive_avg_pool2d(y, (2, 3)), F.adaptive_max_pool2d(y, (6, 6)),
                F.adaptive_avg_pool1d(y.flatten(2), 5))

    _matches_at_image_sizes(ConvThen(pooled), (12, 10), 2, 40, ((2, 3), (5, 7), (12, 10), (17, 40)), 1e-6)


class ConvThen(torch.nn.Module):
    """A 3 -> 4 channel 3 x 3 convolution, then `head` of its output."""

    def __init__(self, head) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = torch.nn.Conv2d(3, 4, 3, padding=1), head

    def forward(self, x):
        return self.head(self.conv(x))


def _matches_at_image_sizes(model: torch.nn.Module, example: tuple[int, int], low: int, high: int,
                            sizes: tuple, atol: float) -> None:
    """model compiled once for 3-channel images of every height and width in [low, high], matching
    torch at each of `sizes`."""
    dims = {2: Dim("h", min=low, max=high), 3: Dim("w", min=low, max=high)}
    compiled = eclat.compile(model, (torch.randn(1, 3, *example),), autotune="none", quiet=True,
                             dynamic_shapes=(dims,))
    for h, w in sizes:
        x = torch.randn(1, 3, h, w)
        with torch.no_grad():
            for got, want in zip(compiled(x), model(x)):
                np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=atol)
