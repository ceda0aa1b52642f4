"""Never a wrong answer, never a crash: concurrent calls, the thread pool's library, the program
cache's key, freed models. Each case failed before its fix."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

import eclat

ROOT = Path(__file__).resolve().parent.parent


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)).eval()


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """code in a fresh interpreter (a crash there is a failed assertion here, not a dead test run)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=300)


def _on_threads(fn, count: int) -> None:
    """fn(0), ..., fn(count - 1), each on a thread of its own, all at once."""
    workers = [threading.Thread(target=fn, args=(k,)) for k in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


@pytest.mark.parametrize("threads", [1, 2])
def test_calls_from_several_python_threads_are_each_right(threads):
    model = _mlp()
    fast = eclat.compile(model, (torch.randn(4, 64),), autotune="none", threads=threads, quiet=True)
    errors: list[float] = []

    def calls(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(100):
            x = rng.standard_normal((4, 64)).astype(np.float32)
            with torch.no_grad():
                want = model(torch.from_numpy(x)).numpy()
            errors.append(float(np.abs(fast(x) - want).max()))

    _on_threads(calls, 4)
    assert len(errors) == 400 and max(errors) < 1e-4


SEVERAL_THREADS_NO_COMPILER = """
    import os, warnings
    import numpy as np, torch, eclat
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).eval()
    x = torch.randn(64, 64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fast = eclat.compile(model, (x,), autotune="none", threads=2, quiet=True)
    print([str(w.message) for w in seen if "one thread" in str(w.message)])
    assert np.allclose(fast(x).numpy(), model(x).detach().numpy(), atol=1e-5)
    fast.save(os.environ["ARTIFACT"])  # and a threads=2 artifact loads and runs on one as well
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = eclat.load(os.environ["ARTIFACT"])
    print([str(w.message) for w in seen if "one thread" in str(w.message)])
    assert np.allclose(loaded(x.numpy()), model(x).detach().numpy(), atol=1e-5)
    print("ok")
"""


def test_several_threads_without_a_c_compiler_run_on_one_and_say_why(tmp_path):
    out = _run(SEVERAL_THREADS_NO_COMPILER, {"CC": "/nonexistent/cc", "PATH": "/nonexistent",
                                              "ECLAT_CACHE_DIR": str(tmp_path),
                                              "ARTIFACT": str(tmp_path / "two.eclat")})
    assert out.returncode == 0, out.stderr[-2000:]
    compiling, loading, done = out.stdout.strip().splitlines()  # the warnings seen by each, then ok
    for seen in (compiling, loading):
        assert "kernels run on one thread, not 2: no C compiler found" in seen, out.stdout
    assert done == "ok"


POOL = """
    from eclat.backends.cpu import threads
    print(threads.pool_address() is not None, threads.pool_unavailable())
"""


def test_thread_pool_library_lives_in_the_cache_and_is_rebuilt_when_damaged(tmp_path):
    env = {"ECLAT_CACHE_DIR": str(tmp_path / "cache"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert _run(POOL, env).stdout.split() == ["True", "None"]
    (lib,) = (tmp_path / "cache" / "lib").glob("pool-*.so")
    assert not (tmp_path / "xdg").exists()
    good = lib.read_bytes()
    for damaged in (good[:1000], os.urandom(len(good)), b""):  # truncated (a Bus error once), garbage
        lib.write_bytes(damaged)
        out = _run(POOL, env)
        assert out.returncode == 0 and out.stdout.split() == ["True", "None"], out.stderr[-2000:]
        assert len(lib.read_bytes()) == len(good)  # built again


def test_an_unwritable_cache_still_gets_a_thread_pool_and_leaves_no_build_behind(tmp_path):
    blocker, scratch = tmp_path / "file", tmp_path / "tmp"
    blocker.write_text("a file where the cache folder would be")
    scratch.mkdir()
    out = _run(POOL, {"ECLAT_CACHE_DIR": str(blocker / "cache"), "TMPDIR": str(scratch)})
    assert out.returncode == 0 and out.stdout.split() == ["True", "None"], out.stderr[-2000:]
    assert list(scratch.iterdir()) == []  # the process's private build went with it


def test_program_cache_tells_apart_models_that_differ_outside_their_state_dict(tmp_path):
    """Hardtanh's bounds are constructor arguments, not state: the key is the lowered graph. The
    example inputs stay inside both bounds, so checking a hit on them alone cannot tell the two apart."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8)
    example, large = torch.randn(4, 8) * 0.1, torch.randn(4, 8) * 100
    for low, high in [(-100.0, 100.0), (-10.0, 10.0)]:
        model = torch.nn.Sequential(linear, torch.nn.Hardtanh(low, high)).eval()
        fast = eclat.compile(model, (example,), autotune="fast", k=1, cache_dir=tmp_path, quiet=True)
        assert not fast.report()["candidates"].get("cached")
        with torch.no_grad():
            torch.testing.assert_close(fast(large), model(large))


def test_a_compiled_model_is_freed_when_dropped():
    """The first compile imports egglog, which keeps the frames that define its classes (and, before,
    every caller's frame below them: the first model was never freed)."""
    out = _run("""
        import gc, weakref, torch, eclat
        def compiled():
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
            fast = eclat.compile(model, (torch.randn(2, 8),), autotune="none", quiet=True)
            return weakref.ref(fast), weakref.ref(model)
        refs = compiled()
        gc.collect()
        print([r() is None for r in refs])
    """)
    assert out.stdout.split() == ["[True,", "True]"], out.stderr[-2000:]


def test_dropped_models_do_not_accumulate_in_this_process():
    refs = []
    for seed in range(2):
        fast = eclat.compile(_mlp(seed), (torch.randn(2, 64),), autotune="none", quiet=True)
        refs.append(weakref.ref(fast))
        del fast
    gc.collect()
    assert [r() for r in refs] == [None, None]


class DictDifference(torch.nn.Module):
    def forward(self, d: dict[str, torch.Tensor], scale: int) -> torch.Tensor:
        return (d["a"] - 2 * d["b"]) * scale


def test_dict_inputs_are_matched_by_key_and_wrong_keys_refused():
    a, b = torch.ones(3), torch.full((3,), 5.0)
    fast = eclat.compile(DictDifference(), ({"a": a, "b": b}, 3), autotune="none", quiet=True)
    torch.testing.assert_close(fast({"b": b, "a": a}, 3), torch.full((3,), -27.0))
    torch.testing.assert_close(fast(a, b), torch.full((3,), -27.0))  # the flat form: inputs in order
    with pytest.raises(ValueError, match=r"expected the keys \['a', 'b'\]; missing \['b'\]; unknown \['c'\]"):
        fast({"a": a, "c": b}, 3)
    with pytest.raises(ValueError, match=r"unknown \['c'\]"):
        fast({"a": a, "b": b, "c": b}, 3)
    with pytest.raises(ValueError, match="compiled for the constant 3, given 4"):
        fast({"a": a, "b": b}, 4)
    with pytest.raises(ValueError, match="expected a dict with keys"):
        fast([a, b], 3)


def test_a_python_list_input_is_named_as_such():
    model = torch.nn.Linear(4, 4)
    fast = eclat.compile(model, (torch.randn(2, 4),), autotune="none", quiet=True)
    with pytest.raises(ValueError, match=r"input 0 \(input\): expected a torch.Tensor or .*, given list"):
        fast(torch.randn(2, 4).tolist())
    with pytest.raises(ValueError, match=r"expected 1 arguments, given 2; the inputs are input: float32\[2"):
        fast(torch.randn(2, 4), torch.randn(2, 4))


def test_opencl_calls_from_several_threads_take_turns():
    pytest.importorskip("pyopencl")
    from eclat.backends.opencl.runtime import context

    try:
        context()
    except eclat.EclatError as e:
        pytest.skip(str(e))
    model = _mlp()
    fast = eclat.compile(model, (torch.randn(4, 64),), target="opencl", autotune="none", quiet=True)
    inputs = [np.random.default_rng(s).standard_normal((4, 64)).astype(np.float32) for s in range(4)]
    with torch.no_grad():
        wants = [model(torch.from_numpy(x)).numpy() for x in inputs]
    errors: list[float] = []

    def calls(k: int) -> None:
        for _ in range(20):
            errors.append(float(np.abs(fast(inputs[k]) - wants[k]).max()))

    _on_threads(calls, 4)
    assert len(errors) == 80 and max(errors) < 1e-4


class Rows(torch.nn.Module):
    """A table read four ways: t[i] (negatives wrap), index_select, gather, an embedding."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.table = torch.nn.Parameter(torch.arange(40.0).reshape(10, 4))

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return {"getitem": lambda: self.table[i], "index_select": lambda: self.table.index_select(0, i),
                "gather": lambda: self.table.gather(0, i.reshape(-1, 1).expand(-1, 4)),
                "embedding": lambda: torch.nn.functional.embedding(i, self.table)}[self.how]()


@pytest.mark.parametrize("how, low", [("getitem", -10), ("index_select", 0), ("gather", 0), ("embedding", 0)])
def test_an_index_out_of_range_raises_as_in_torch(how, low):
    model = Rows(how).eval()
    fast = eclat.compile(model, (torch.tensor([1, 2, 3]),), autotune="none", quiet=True)
    for good in ([low, 9, 0], [9, 9, 9]):
        i = torch.tensor(good)
        torch.testing.assert_close(fast(i), model(i))
    for bad in ([10, 1, 2], [low - 1, 0, 0], [12, 0, 0]):
        with pytest.raises((IndexError, RuntimeError)):
            model(torch.tensor(bad))  # torch refuses it too
        with pytest.raises(IndexError, match=rf"input 0 \(i\): index {bad[0]} is out of range.* size 10, "
                                             rf"valid indices are {low} to 9"):
            fast(torch.tensor(bad))


def test_index_checks_survive_an_artifact_and_the_program_cache(tmp_path):
    model = Rows("embedding").eval()
    i = torch.tensor([1, 2, 3])
    for _ in range(2):  # the second compile is a program-cache hit
        fast = eclat.compile(model, (i,), autotune="fast", k=1, cache_dir=tmp_path, quiet=True)
        with pytest.raises(IndexError, match="index 10 is out of range"):
            fast(torch.tensor([10, 0, 0]))
    assert fast.report()["candidates"].get("cached")
    fast.save(tmp_path / "rows.eclat")
    loaded = eclat.load(tmp_path / "rows.eclat")
    with pytest.raises(IndexError, match="index -1 is out of range"):
        loaded(np.array([-1, 0, 0]))
    np.testing.assert_array_equal(loaded(i.numpy()), model(i).detach().numpy())


def test_a_bfloat16_model_returns_bfloat16():
    x = torch.randn(1, 2, 3, 3, dtype=torch.bfloat16) * 3
    model = torch.nn.Hardtanh()
    fast = eclat.compile(model, (x,), autotune="none", quiet=True)
    out = fast(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, model(x))


def test_a_product_of_two_dtypes_is_refused_as_torch_refuses_it():
    model, x = torch.nn.Linear(5, 3), torch.tensor([1, -2, 3, 0, 4])
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        model(x)
    with pytest.raises(eclat.UnsupportedOpError, match=r"aten.addmm.* same dtype, but got int64"):
        eclat.compile(model, (x,), autotune="none", quiet=True)


@pytest.mark.parametrize("fn", [torch.relu, torch.abs, torch.floor, torch.nn.functional.gelu],
                         ids=["relu", "abs", "floor", "gelu"])
def test_an_op_torch_runs_on_no_bool_tensor_is_refused_as_torch_refuses_it(fn):
    """torch.export traces these on a bool tensor, but torch has no bool kernel for them (found by the
    long fuzzer: relu of a bool answered where torch raises)."""
    from tests.test_rewrites_termination import Fn

    x, model = torch.tensor([[True, False, True]]), Fn(fn)
    with pytest.raises(RuntimeError):
        model(x)
    with pytest.raises(eclat.UnsupportedOpError, match=r"aten\.\w+\.default\b.*no bool tensor"):
        eclat.compile(model, (x,), autotune="none", quiet=True)


def test_rebuilding_a_built_program_with_other_schedules_is_an_error_not_a_crash():
    """A built program keeps only the weight forms its own schedules read (a weight read through its
    packed panels is not held twice). Built again with a schedule that packs it otherwise, or reads
    it directly, it was a segfault, or code reading the arena for the weight: now an error."""
    from dataclasses import replace

    from eclat.backends.cpu.runtime import CpuExecutable
    from eclat.compiler.kernel import Schedule, as_contraction
    from eclat.errors import EclatError

    class Product(torch.nn.Module):  # the weight on the left: read packed, transposed (the default
        # over 8 columns with any vector width)
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(96, 64))

        def forward(self, x):
            return self.w @ x

    torch.manual_seed(0)
    program = eclat.compile(Product().eval(), (torch.randn(64, 8),), autotune="none", quiet=True) \
        .executable.program
    dropped = [n for n, b in program.buffers.items() if b.role == "weight" and b.data is None]
    assert dropped
    j = next(j for j, k in enumerate(program.kernels) if as_contraction(k) is not None)
    for flip in (False, True):
        other = replace(program.kernels[j], schedule=Schedule(tile=(4, 32), transposed=flip))
        with pytest.raises(EclatError, match="holds? no data|held only packed"):
            CpuExecutable(replace(program, kernels=[*program.kernels[:j], other, *program.kernels[j + 1:]]))
