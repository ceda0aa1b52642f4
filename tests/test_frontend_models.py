"""Whole models through the frontend: every zoo model lowers and the interpreter matches
PyTorch; symbolic sizes; output structure; and the errors a user sees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

from eclat.errors import ExportError, UnsupportedOpError
from eclat.frontend import lower
from eclat.frontend.lower import export
from eclat.ir.interpreter import run
from tests.zoo import ZOO, make_llama

RTOL, ATOL = 1e-4, 1e-5


def _compare(model: torch.nn.Module, graph, args: tuple) -> float:
    """Max abs error of the interpreter against torch; asserts the tolerance."""
    with torch.no_grad():
        ref = pytree.tree_leaves(model(*args))
    got = run(graph, [a.numpy() for a in args])
    assert len(got) == len(ref)
    err = 0.0
    for r, o in zip(ref, got):
        np.testing.assert_allclose(o, r.numpy(), rtol=RTOL, atol=ATOL)
        err = max(err, float(np.abs(o - r.numpy()).max()))
    return err


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_matches_torch(name: str) -> None:
    model, args = ZOO[name]()
    graph = lower(model, args)
    err = _compare(model, graph, args)
    print(f"{name}: max abs error vs torch {err:.3g}, {sum(graph.op_counts().values())} nodes")
    assert set(graph.op_counts()) <= {
        "input", "weight", "const", "iota", "exp2", "log2", "sin", "sqrt", "recip", "neg", "cast", "add",
        "mul", "div", "mod", "lt", "max", "where", "sum", "max_reduce", "contiguous", "gather", "view"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_mlp(dtype: torch.dtype) -> None:
    model, (x,) = ZOO["mlp"]()
    model, x = model.to(dtype), x.to(dtype)
    graph = lower(model, (x,))
    assert graph.inputs[0].dtype.name == str(dtype).removeprefix("torch.")
    (got,) = run(graph, [x.float().numpy() if dtype is torch.bfloat16 else x.numpy()])
    with torch.no_grad():
        ref = model(x).float().numpy()
    np.testing.assert_allclose(got.astype(np.float32), ref, rtol=2e-2, atol=2e-3)  # half-precision rounding


def test_inputs_weights_and_output_structure() -> None:
    model, args = ZOO["hf_bert"]()
    graph = lower(model, args)
    assert [n.arg for n in graph.inputs] == ["input_ids"]
    assert graph.inputs[0].dtype.name == "int64"
    assert "embeddings.word_embeddings.weight" in graph.weights
    assert "encoder.layer.0.attention.self.query.weight" in graph.weights
    rebuilt = pytree.tree_unflatten(run(graph, [a.numpy() for a in args]), graph.out_spec)
    with torch.no_grad():
        ref = model(*args)
    assert type(rebuilt) is type(ref)
    np.testing.assert_allclose(rebuilt.pooler_output, ref.pooler_output.numpy(), rtol=RTOL, atol=ATOL)


def test_tied_weights_are_stored_once() -> None:
    model, args = make_llama(layers=1)
    graph = lower(model, args)
    assert sum(a is model.embed.weight for a in model.parameters()) == 1
    assert "head.weight" not in graph.weights and "embed.weight" in graph.weights


def test_symbolic_sequence_length() -> None:
    model, (ids,) = make_llama(layers=1)
    seq = torch.export.Dim("seq", min=2, max=32)
    graph = lower(model, (ids,), dynamic_shapes=({1: seq},))
    assert isinstance(graph.inputs[0].shape[1], object) and not isinstance(graph.inputs[0].shape[1], int)
    for s in (3, 13):
        _compare(model, graph, (torch.randint(0, 128, (1, s)),))


def test_symbolic_sequence_length_hf_llama() -> None:
    model, (ids,) = ZOO["hf_llama"]()
    graph = lower(model, (ids,), dynamic_shapes=({1: torch.export.Dim("seq", min=2, max=30)},))
    for s in (5, 17):
        _compare(model, graph, (torch.randint(0, 128, (1, s)),))


def test_symbolic_batch_cnn() -> None:
    model, (x,) = ZOO["cnn"]()
    graph = lower(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=16)},))
    for b in (1, 5):
        _compare(model, graph, (torch.randn(b, *x.shape[1:]),))


def test_symbolic_image_size() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, stride=2), torch.nn.MaxPool2d(2),
                                torch.nn.ReLU(), torch.nn.AvgPool2d(2, padding=1)).eval()
    side = torch.export.Dim("side", min=2, max=64)
    graph = lower(model, (torch.randn(1, 3, 16, 16),), dynamic_shapes=({2: 4 * side, 3: 4 * side},))
    for s in (8, 20):
        _compare(model, graph, (torch.randn(1, 3, s, s),))


class Attention(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
        return causal + masked


def test_scaled_dot_product_attention() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    args = (q, k, v, torch.rand(5, 5) > 0.3)
    _compare(Attention(), lower(Attention(), args), args)


class ChannelsLastTail(torch.nn.Module):
    """convnext's and swin's tail: channels moved last for a LayerNorm and back, then global
    average pooling; torch.export writes the pooled result's layout as an aten.as_strided."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 4, stride=4)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(y, 1), 1))


class StridedReads(torch.nn.Module):
    """as_strided on tensors torch lays out otherwise than row-major: a transpose (its storage is
    x), a slice (a storage offset), and overlapping windows."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        transposed = x.t().as_strided((3, 4), (1, 6), 1)
        sliced = (x + 1)[1:].as_strided((2, 3), (6, 1), 7)
        windows = x.as_strided((3, 3, 2), (6, 1, 1))
        return transposed * 2, sliced, windows.sum(-1)


class SymbolicStridedRead(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return x.t().as_strided((4, n), (1, 4)) * 2  # x.t() stores x: this reads x.t()


class SparseStridedRead(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1:].as_strided((2, 2), (6, 1), 1) + 1  # the refused line


def test_channels_last_tail_with_as_strided() -> None:
    torch.manual_seed(0)
    model, x = ChannelsLastTail().eval(), torch.randn(2, 3, 16, 16)
    ops = {str(n.target) for n in export(model, (x,)).graph.nodes}
    assert "aten.as_strided.default" in ops  # what this test is about
    _compare(model, lower(model, (x,)), (x,))
    graph = lower(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=16)},))
    for b in (1, 3):
        _compare(model, graph, (torch.randn(b, 3, 16, 16),))


def test_as_strided_follows_torch_layouts() -> None:
    x = torch.randn(4, 6)
    _compare(StridedReads(), lower(StridedReads(), (x,)), (x,))


def test_as_strided_of_a_symbolic_permuted_layout() -> None:
    x = torch.randn(5, 4)
    graph = lower(SymbolicStridedRead(), (x,), dynamic_shapes=({0: torch.export.Dim("n", min=2, max=64)},))
    for n in (3, 9):
        _compare(SymbolicStridedRead(), graph, (torch.randn(n, 4),))


def test_as_strided_of_a_sparse_layout_is_refused_clearly() -> None:
    with pytest.raises(UnsupportedOpError, match="not densely") as info:
        lower(SparseStridedRead(), (torch.randn(4, 6),))
    assert info.value.op == "aten.as_strided.default"
    assert "in forward: return x[:, 1:].as_strided((2, 2), (6, 1), 1) + 1" in str(info.value)


class SizeArithmetic(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        n = x.shape[0]
        y = x.reshape(n // 2, 2 * x.shape[1]) * (n % 3 + n - 1)
        return y, x.sum(0) * n + x.mean(0), 3


def test_size_arithmetic_and_non_tensor_outputs() -> None:
    x = torch.randn(8, 3)
    graph = lower(SizeArithmetic(), (x,), dynamic_shapes=({0: torch.export.Dim("n", min=1, max=32) * 2},))
    assert graph.out_spec.constants == {2: 3}  # a Python number returned: the program does not compute it
    for rows in (4, 10):
        x = torch.randn(rows, 3)
        y, s = run(graph, [x.numpy()])
        ry, rs, rk = SizeArithmetic()(x)
        np.testing.assert_allclose(y, ry.numpy(), rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(s, rs.numpy(), rtol=RTOL, atol=ATOL)


class Constants(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0, 4.0]), persistent=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        shift = torch.tensor([0.5, -0.5, 1.5, 2.5])  # a lifted constant
        return {"y": x * self.scale + shift * x.shape[0], "picked": x[ids], "n": ids.sum()}


def test_buffers_lifted_constants_and_dict_outputs() -> None:
    args = (torch.randn(3, 4), torch.tensor([2, 0, -1]))
    graph = lower(Constants(), args)
    assert "scale" in graph.weights and len(graph.weights) == 2
    got = pytree.tree_unflatten(run(graph, [a.numpy() for a in args]), graph.out_spec)
    ref = Constants()(*args)
    assert set(got) == {"y", "picked", "n"}
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k].numpy(), rtol=RTOL, atol=ATOL)


class Scatters(torch.nn.Module):
    def forward(self, x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 2
        y[:, 1:3] = 0.5
        y[0] = x[1]
        y[:, ::2] += 1
        y[y > 2] = 0.0
        y[i] = -1.0
        z = x.clone()
        z[i] += x[0]
        return y, z, x.new_zeros(3).index_add(0, i, x[:2, 0]), torch.zeros(3, 5).scatter_add(0, i[:, None], x)


def test_in_place_updates_of_intermediates() -> None:
    args = (torch.randn(3, 5), torch.tensor([2, 0]))
    graph = lower(Scatters(), args)
    for got, ref in zip(run(graph, [a.numpy() for a in args]), Scatters()(*args)):
        np.testing.assert_allclose(got, ref.numpy(), rtol=RTOL, atol=ATOL)


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return x + self.count


def test_a_buffer_update_is_a_state_with_its_update_as_an_output() -> None:
    graph = lower(Counter(), (torch.randn(2),))
    assert [s.name for s in graph.states] == ["count"] and graph.states[0].axis is None
    assert [n.arg for n in graph.inputs] == ["x", "count"] and len(graph.outputs) == 2


class AddsToItsInput(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2


def test_mutating_an_input_is_refused_clearly() -> None:
    with pytest.raises(UnsupportedOpError, match="user input mutation"):
        lower(AddsToItsInput(), (torch.randn(2),))


class UsesBessel(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 0.5
        return torch.special.i0(y)  # the unsupported line


def test_unsupported_op_names_op_and_source_line() -> None:
    with pytest.raises(UnsupportedOpError) as info:
        lower(UsesBessel(), (torch.randn(4, 5),))
    lines = open(__file__).read().splitlines()
    line = next(k for k, text in enumerate(lines, 1) if "i0(y)" in text and "# the unsupported line" in text)
    msg = str(info.value)
    assert "aten.i0.default" in msg
    assert f"test_frontend_models.py:{line} in forward: return torch.special.i0(y)" in msg
    assert info.value.op == "aten.i0.default"


class Inverts(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.inv(x + 4 * torch.eye(3))


def test_an_op_with_side_effects_is_named_with_the_function_called() -> None:
    """linalg's error checks reach eclat as an effect token: the refusal names them, their linalg
    function and the source line, not the token."""
    with pytest.raises(UnsupportedOpError, match=r"_linalg_check_errors.*test_frontend_models.py:\d+ in "
                                                  r"forward.*side effects \(of linalg.inv"):
        lower(Inverts(), (torch.randn(3, 3),))


class DataDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x + 1
        return x - 1


def test_export_failure_carries_torch_reason() -> None:
    with pytest.raises(ExportError, match="torch.export failed for DataDependent") as info:
        lower(DataDependent(), (torch.randn(3),))
    assert "data-dependent" in str(info.value).lower() or "guard" in str(info.value).lower()


def test_bad_inputs_have_clear_errors() -> None:
    with pytest.raises(TypeError, match="example_inputs must be a tuple"):
        lower(torch.nn.ReLU(), torch.randn(3))
    with pytest.raises(UnsupportedOpError, match="float64"):
        lower(torch.nn.ReLU(), (torch.randn(3, dtype=torch.float64),))


def test_model_without_parameters_lowers() -> None:
    """A bare Softmax module: torch.export reports an unbounded (int_oo) range for it."""
    x = torch.randn(4, 16)
    (got,) = run(lower(torch.nn.Softmax(dim=-1), (x,)), [x.numpy()])
    np.testing.assert_allclose(got, torch.softmax(x, -1).numpy(), rtol=1e-5, atol=1e-6)


def test_lowerings_share_weights_only_when_asked():
    from eclat.frontend.lower import lower, sharing_weights

    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    x = torch.randn(2, 4)
    with sharing_weights():
        a, b = lower(model, (x,)), lower(model, (x[:1],))
    assert all(a.weights[n] is b.weights[n] for n in a.weights)  # one copy for both programs
    c = lower(model, (x,))
    assert all(c.weights[n] is not a.weights[n] for n in a.weights)
    np.testing.assert_array_equal(a.weights[next(iter(a.weights))], c.weights[next(iter(c.weights))])
    # read in place, read-only (a compile holds no second copy; the executable copies what its code
    # reads directly: test_compile's test_a_compiled_model_does_not_see_later_changes_to_the_weights)
    w = c.weights["0.weight"]
    assert np.shares_memory(w, model[0].weight.detach().numpy()) and not w.flags.writeable


def test_a_decoder_that_returns_its_cache_by_default_compiles_for_one_pass() -> None:
    """transformers' decoders return a fresh DynamicCache with their outputs unless told not to,
    which torch.export refuses: eclat exports them with config.use_cache off, says so in a warning
    pointing at the caller's line, and leaves the model's config as it was."""
    import transformers

    import eclat

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                     max_position_embeddings=32)
    model = transformers.MistralModel(cfg).eval()
    ids = torch.randint(0, 64, (1, 7))
    with pytest.warns(UserWarning, match="use_cache=False") as caught:
        compiled = eclat.compile(model, (ids,), autotune="none", quiet=True)
    assert caught[0].filename == __file__
    assert model.config.use_cache
    with torch.no_grad():
        want = model(ids, use_cache=False).last_hidden_state
    np.testing.assert_allclose(compiled(ids).last_hidden_state.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


def test_a_mixture_of_experts_decoder_matches_torch() -> None:
    """Mixtral's experts run through transformers' grouped_mm_fallback (rows sorted by expert,
    each group's rows times its expert's matrix) and route with histc: both lowered. Also the op
    alone, with an empty group and rows past the last group (zeros, as its loop leaves them)."""
    import transformers
    from transformers.integrations import moe  # noqa: F401  (registers the op)

    import eclat

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=48, vocab_size=64,
                                     num_local_experts=4, num_experts_per_tok=2, use_cache=False)
    model = transformers.MixtralModel(cfg).eval()
    ids = torch.randint(0, 64, (1, 9))
    compiled = eclat.compile(model, (ids,), autotune="none", quiet=True)
    with torch.no_grad():
        want = model(ids).last_hidden_state
    np.testing.assert_allclose(compiled(ids).last_hidden_state.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)

    class Grouped(torch.nn.Module):
        def forward(self, x, w, ends):
            return torch.ops.transformers.grouped_mm_fallback(x, w, ends)

    x, w = torch.randn(7, 5), torch.randn(3, 5, 4)
    ends = torch.tensor([2, 2, 6])  # expert 1's group is empty; row 6 lies past the last group
    got = run(lower(Grouped(), (x, w, ends)), [x.numpy(), w.numpy(), ends.numpy()])[0]
    np.testing.assert_allclose(got, Grouped()(x, w, ends).numpy(), rtol=1e-5, atol=1e-6)
