"""Never a wrong answer, never a crash, over the space of bad inputs (issue 14).

Every case must end in the right answer (compared with torch: values, NaN and inf where torch has
them, shapes, dtypes, the output structure) or in an EclatError, ValueError, TypeError or
IndexError with a message; never a crash, a hang, a raw internal exception (KeyError,
AttributeError, RecursionError, ...) or a silent wrong answer. The space:

- calls of compiled models with spoiled inputs: wrong shapes and dtypes, NaN and inf, empty and
  0-d tensors, non-contiguous layouts, tensors that require grad, numpy arrays, Python objects in
  place of tensors, too many or too few arguments, keywords, dicts and nested inputs with keys in
  another order (answered), missing, unknown or renamed (refused with a ValueError);
- models compiled with odd example inputs (NaN, empty dims, integers, bool, half precision, 0-d);
- damaged artifacts: truncated, a byte flipped, a member flipped, replaced, cut or dropped, the
  manifest edited (shapes, arena size, offsets, nodes, deep nesting, keys deleted, wrong types):
  an ArtifactError (an EclatError) at load, or right answers;
- damaged caches (programs/*.zip, tuning.db, devices/*.json): a compile still gives the right answer.

Every case runs in a worker process (tests/fuzz_cases.py), which compiles each model once: a
segfault, abort or hang there is a failed case here, and the next case gets a new worker. Cases
are drawn by hypothesis, derandomized so that CI sees the same ones each run; the `slow` variants
draw many more. ECLAT_FUZZ_LOG=path writes every case and its outcome there (JSON lines).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.fuzz_cases import (
    ARTIFACT_MODELS,
    BODIES,
    CALL_MODELS,
    DTYPES,
    EXAMPLE_DTYPES,
    EXAMPLE_SHAPES,
    GOOD,
    JSON_VALUES,
    KINDS,
    LAYOUTS,
    SHAPES,
    STRUCTURES,
    VALUES,
    WorkerClient,
    copy_cache,
    damage_file,
    damage_zip,
    explain,
)

QUICK = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much])
LONG = settings(QUICK, derandomize=False)
# cases that compile take seconds each: reported as drawn (they are small already), not shrunk
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]


# --- the worker and what it made ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    client = WorkerClient(folder)
    answer = client.request({"op": "ping", "compile": CALL_MODELS}, timeout=600)
    assert answer["outcome"] == "right", explain({"op": "ping"}, answer)
    yield client
    client.close()
    if os.environ.get("ECLAT_FUZZ_LOG"):
        with open(os.environ["ECLAT_FUZZ_LOG"], "a") as f:
            for req, answer in client.log:
                f.write(json.dumps({"request": req, "answer": answer}) + "\n")


def check(worker: WorkerClient, req: dict, timeout: float = 120) -> dict:
    """Run req in the worker; a failed assertion (one per kind of failure, so that hypothesis reports
    each kind) unless it ended in the right answer or a clean refusal."""
    answer = worker.request(req, timeout)
    outcome, why = answer["outcome"], explain(req, answer)
    assert outcome != "harness", "the fuzz test's own code failed: " + why
    assert outcome != "crash", why
    assert outcome != "hang", why
    assert outcome != "raw", why
    assert outcome != "wrong", why
    assert outcome != "bad_refusal", why
    assert outcome in GOOD, why
    return answer


class Saved(dict):
    """model name -> the bytes of its artifact (shown by name only in hypothesis's reports)."""

    def __repr__(self) -> str:
        return f"<artifacts of {', '.join(self)}>"


@pytest.fixture(scope="module")
def artifacts(worker, tmp_path_factory):
    """model name -> the bytes of its artifact, as saved by the worker."""
    folder = tmp_path_factory.mktemp("artifacts")
    saved = Saved()
    for name in ARTIFACT_MODELS:
        path = folder / f"{name}.eclat"
        check(worker, {"op": "save", "model": name, "path": str(path)})
        saved[name] = path.read_bytes()
    return saved


def _warm(worker: WorkerClient, folder: Path, model: str) -> Path:
    answer = check(worker, {"op": "warm_cache", "model": model, "cache": str(folder)}, timeout=600)
    files = answer["files"]
    assert "tuning.db" in files and any(f.startswith("programs/") for f in files) and \
        any(f.startswith("devices/") for f in files), files
    return folder


@pytest.fixture(scope="module")
def warm_cache(worker, tmp_path_factory):
    """A cache folder filled by one compile of "mlp" with autotune: its device, tuning database and
    program cache entry."""
    return _warm(worker, tmp_path_factory.mktemp("warm") / "cache", "mlp")


@pytest.fixture(scope="module")
def warm_zero_cache(worker, tmp_path_factory):
    """The same for "mlp_zero": the same model compiled with an all-zero example."""
    return _warm(worker, tmp_path_factory.mktemp("warm_zero") / "cache", "mlp_zero")


# --- strategies -------------------------------------------------------------------------------------

def mostly(options: list, weight: int = 1) -> st.SearchStrategy:
    """options[0] with probability weight/(weight+1) (and what hypothesis shrinks to), else any."""
    return st.one_of(*[st.just(options[0])] * weight, st.sampled_from(options))


# an input spoiled in a way the model must still answer (values, memory layout, numpy or tensor), or in
# any way; two in three are the former, so that most calls (of models with several inputs) can be answered
answerable = st.fixed_dictionaries({
    "values": st.sampled_from(VALUES), "dtype": st.just("same"), "shape": st.just("same"),
    "layout": st.sampled_from(LAYOUTS), "kind": st.sampled_from(["tensor", "numpy", "parameter"])})
anything = st.fixed_dictionaries({
    "values": st.sampled_from(VALUES), "dtype": mostly(DTYPES), "shape": mostly(SHAPES),
    "layout": st.sampled_from(LAYOUTS), "kind": mostly(KINDS)})
spoils = st.one_of(answerable, answerable, anything)
call_cases = st.fixed_dictionaries({
    "model": st.sampled_from(CALL_MODELS), "seed": st.integers(0, 2**16),
    "structure": mostly(STRUCTURES, 3), "leaves": st.lists(spoils, min_size=4, max_size=4)})

example_cases = st.fixed_dictionaries({
    "body": st.sampled_from(BODIES), "shape": st.sampled_from(sorted(EXAMPLE_SHAPES)),
    "dtype": st.sampled_from(EXAMPLE_DTYPES), "seed": st.integers(0, 2**16),
    "leaf": st.fixed_dictionaries({"values": mostly(VALUES),
                                   "layout": st.sampled_from(["contiguous", "transposed", "strided",
                                                              "expanded", "requires_grad"])})})

fraction = st.integers(0, 9999).map(lambda n: n / 10000)
MANIFEST_ROOTS = ["", "inputs", "memory_plan", "memory_plan.offsets", "memory_plan.arena_bytes",
                  "program.buffers", "program.kernels", "program.nodes", "program.input_shapes",
                  "program.output_shapes", "program.inputs", "program.outputs", "native", "native.slot_names",
                  "device", "sha256", "out_spec", "format_version", "target", "report", "in_structure"]
PROGRAM_ROOTS = ["", "program.buffers", "program.kernels", "program.nodes", "program.input_shapes",
                 "program.output_shapes", "inputs", "in_structure", "tuned", "out_spec", "report"]
DEVICE_ROOTS = ["", "schema", "device", "device.peak_gflops", "device.info"]


def json_edits(roots: list[str]) -> st.SearchStrategy:
    return st.fixed_dictionaries({
        "root": st.sampled_from(roots), "path": st.lists(st.integers(0, 1000), max_size=5),
        "op": st.sampled_from(["set", "delete", "scale", "dup", "swap"]),
        "value": st.sampled_from(JSON_VALUES), "factor": st.integers(0, 5)})


def zip_damages(roots: list[str]) -> st.SearchStrategy:
    member = st.integers(0, 7)
    return st.one_of(
        st.fixed_dictionaries({"kind": st.just("truncate"), "at": fraction}),
        st.fixed_dictionaries({"kind": st.just("flip"), "at": fraction, "mask": st.integers(1, 255)}),
        st.fixed_dictionaries({"kind": st.just("member_flip"), "index": member, "at": fraction,
                               "mask": st.integers(1, 255)}),
        st.fixed_dictionaries({"kind": st.just("member_garbage"), "index": member, "seed": st.integers(0, 99),
                               "size": st.integers(0, 4096)}),
        st.fixed_dictionaries({"kind": st.just("member_truncate"), "index": member, "at": fraction}),
        st.fixed_dictionaries({"kind": st.just("member_drop"), "index": member}),
        st.fixed_dictionaries({"kind": st.just("member_weights"), "member": st.just("weights.safetensors"),
                               "prefix": st.sampled_from(["", "w_0.", "w_2.", "w_0.weight", "w_2.bias"]),
                               "factor": st.sampled_from([-3.0, 0.0, 0.999, 1.0005, 1.01, 2.0])}),
        st.fixed_dictionaries({"kind": st.just("json_edit"), "edit": json_edits(roots)}),
    )


artifact_cases = st.fixed_dictionaries({
    "model": st.sampled_from(ARTIFACT_MODELS),
    "damages": st.lists(zip_damages(MANIFEST_ROOTS), min_size=1, max_size=2)})

file_damages = [
    st.fixed_dictionaries({"kind": st.just("garbage"), "seed": st.integers(0, 99),
                           "size": st.integers(0, 4096)}),
    st.fixed_dictionaries({"kind": st.just("truncate"), "at": fraction}),
    st.fixed_dictionaries({"kind": st.just("flip"), "at": fraction, "mask": st.integers(1, 255)}),
    st.just({"kind": "empty"}), st.just({"kind": "directory"})]
cache_damages = st.one_of(
    st.tuples(st.just("programs"), st.one_of(*file_damages, zip_damages(PROGRAM_ROOTS))),
    st.tuples(st.just("tuning.db"), st.one_of(*file_damages, st.fixed_dictionaries(
        {"kind": st.just("db_edit"), "edit": json_edits([""])}))),
    st.tuples(st.just("devices"), st.one_of(*file_damages, st.fixed_dictionaries(
        {"kind": st.just("json_edit"), "edit": json_edits(DEVICE_ROOTS)}))),
)
cache_cases = st.lists(cache_damages, min_size=1, max_size=3)


# --- calls of compiled models ---------------------------------------------------------------------------

def _call(worker: WorkerClient, case: dict) -> None:
    check(worker, {"op": "call", "case": case}, timeout=60)


@settings(QUICK, max_examples=1000)
@given(case=call_cases)
def test_calls_with_spoiled_inputs(worker, case):
    _call(worker, case)


@pytest.mark.slow
@settings(LONG, max_examples=5000)
@given(case=call_cases)
def test_calls_with_spoiled_inputs_long(worker, case):
    _call(worker, case)


def _case(model: str, structure: str = "nested", *leaves: dict, seed: int = 1) -> dict:
    return {"model": model, "seed": seed, "structure": structure, "leaves": [*leaves, {}, {}, {}, {}][:4]}


# (name, case, the outcome required, the start of the error required when refused)
NAMED_CALLS = [
    ("embedding ids 10, 11, 12, 2**31, 2**33 of 10", _case("embed", "nested", {"values": "high"}), "refused",
     "IndexError"),
    ("embedding id -1", _case("embed", "nested", {"values": "negative"}), "refused", "IndexError"),
    ("x[i] with i = -6 for 5 rows", _case("index", "nested", {}, {"values": "negative"}), "refused",
     "IndexError"),
    ("x[i] with i = -1..-5 wraps as torch", _case("index", "nested", {}, {}), "right", None),
    ("gather index 3 of 3", _case("index", "nested", {}, {}, {"values": "high"}), "refused", "IndexError"),
    ("integer division by zero", _case("intdiv", "nested", {}, {"values": "zero"}), "refused", None),
    ("integer division, extreme values", _case("intdiv", "nested", {"values": "extreme"}, {}), "right", None),
    ("argmax, sort, topk with NaN", _case("ranks", "nested", {"values": "nan"}), "right", None),
    ("argmax, sort, topk with inf", _case("ranks", "nested", {"values": "inf"}), "right", None),
    ("argmax, sort, topk with NaN, inf, -0.0, denormals", _case("ranks", "nested", {"values": "special"}),
     "right", None),
    ("dict keys in another order", _case("nested", "shuffled"), "right", None),
    ("tuple and list swapped", _case("nested", "swap_seq"), "right", None),
    ("the flat form", _case("nested", "flat"), "right", None),
    ("a missing key", _case("nested", "missing_key"), "refused", "ValueError"),
    ("an unknown key", _case("nested", "unknown_key"), "refused", "ValueError"),
    ("a renamed key", _case("nested", "renamed_key"), "refused", "ValueError"),
    ("a dict given as a list", _case("nested", "dict_as_list"), "refused", None),
    ("NaN in a linear layer", _case("mlp", "nested", {"values": "nan"}), "right", None),
    ("inf in a linear layer", _case("mlp", "nested", {"values": "inf"}), "right", None),
    ("1e30 in a convolution", _case("conv", "nested", {"values": "extreme"}), "right", None),
    *[(f"a {d} input for float32", _case("mlp", "nested", {"dtype": d}), "refused", "ValueError")
      for d in ("float64", "float16", "bfloat16", "int64", "bool")],
    ("an empty dimension", _case("mlp", "nested", {"shape": "empty"}), "refused", "ValueError"),
    ("a 0-d tensor", _case("mlp", "nested", {"shape": "scalar"}), "refused", "ValueError"),
    ("a batch too many", _case("mlp", "nested", {"shape": "bigger"}), "refused", "ValueError"),
    *[(f"a {layout} tensor", _case("conv", "nested", {"layout": layout}), "right", None)
      for layout in ("transposed", "strided", "expanded", "offset", "requires_grad", "channels_last")],
    ("a transposed numpy array", _case("mlp", "nested", {"layout": "transposed", "kind": "numpy"}), "right",
     None),
    ("a numpy array with negative strides", _case("mlp", "nested", {"layout": "reversed", "kind": "numpy"}),
     "right", None),
    ("an nn.Parameter", _case("mlp", "nested", {"kind": "parameter"}), "right", None),
    *[(f"a Python {kind}", _case("mlp", "nested", {"kind": kind}), "refused", None)
      for kind in ("list", "int", "none", "str", "meta")],
    ("an argument too many", _case("mlp", "extra_arg"), "refused", None),
    ("an argument too few", _case("intdiv", "missing_arg"), "refused", None),
    ("no arguments", _case("mlp", "no_args"), "refused", None),
    ("the arguments wrapped in a tuple", _case("mlp", "wrapped"), "refused", None),
]


@pytest.mark.parametrize("case, outcome, error", [pytest.param(*c[1:], id=c[0]) for c in NAMED_CALLS])
def test_named_calls(worker, case, outcome, error):
    answer = check(worker, {"op": "call", "case": case}, timeout=60)
    assert answer["outcome"] == outcome, explain(case, answer)
    if error is not None:
        assert answer["detail"].startswith(error), explain(case, answer)


# --- compiling with odd example inputs ------------------------------------------------------------------

def _compile(worker: WorkerClient, case: dict) -> None:
    check(worker, {"op": "compile", "case": case}, timeout=180)


@settings(QUICK, max_examples=12, phases=NO_SHRINK)
@given(case=example_cases)
def test_compile_with_odd_examples(worker, case):
    _compile(worker, case)


@pytest.mark.slow
@settings(LONG, max_examples=300, phases=NO_SHRINK)
@given(case=example_cases)
def test_compile_with_odd_examples_long(worker, case):
    _compile(worker, case)


def _example(body: str, shape: str, dtype: str, values: str = "normal", layout: str = "contiguous") -> dict:
    return {"body": body, "shape": shape, "dtype": dtype, "seed": 3,
            "leaf": {"values": values, "layout": layout}}


NAMED_EXAMPLES = [
    ("relu of a NaN example", _example("relu", "mat", "float32", "nan")),
    ("argmax of a NaN example", _example("argmax", "mat", "float32", "nan")),
    ("sort of an inf example", _example("sort", "mat", "float32", "inf")),
    ("sum over an empty dimension", _example("sum", "empty_last", "float32")),
    ("relu of an empty batch", _example("relu", "empty_lead", "float32")),
    ("int64 floor division", _example("floordiv", "vec", "int64", "negative")),
    ("int32 true division", _example("div", "mat", "int32")),
    ("a 0-d example", _example("ew", "scalar", "float32")),
    ("a bool example", _example("ew", "vec", "bool")),
    ("a float16 softmax", _example("softmax", "mat", "float16")),
    ("a bfloat16 example", _example("ew", "4d", "bfloat16", "normal", "transposed")),
    ("an example that requires grad", _example("linear", "mat", "float32", "normal", "requires_grad")),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=name) for name, c in NAMED_EXAMPLES])
def test_named_examples(worker, case):
    _compile(worker, case)


# --- damaged artifacts --------------------------------------------------------------------------------

class Damaged:
    """Damaged copies of artifacts, each in a file of its own."""

    def __init__(self, folder: Path):
        self.folder, self.count = folder, 0

    def write(self, data: bytes) -> str:
        self.count += 1
        path = self.folder / f"damaged{self.count}.eclat"
        path.write_bytes(data)
        return str(path)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    return Damaged(tmp_path_factory.mktemp("damaged"))


def _load(worker: WorkerClient, artifacts: dict, damaged: Damaged, model: str, damages: list[dict]) -> None:
    data = artifacts[model]
    for damage in damages:
        data = damage_zip(data, damage, "manifest.json")
    path = damaged.write(data)
    check(worker, {"op": "load", "model": model, "path": path, "damages": damages}, timeout=120)
    os.unlink(path)


@settings(QUICK, max_examples=600)
@given(case=artifact_cases)
def test_damaged_artifacts(worker, artifacts, damaged, case):
    _load(worker, artifacts, damaged, case["model"], case["damages"])


@pytest.mark.slow
@settings(LONG, max_examples=2000)
@given(case=artifact_cases)
def test_damaged_artifacts_long(worker, artifacts, damaged, case):
    _load(worker, artifacts, damaged, case["model"], case["damages"])


def _edit(root: str, op: str = "set", value=None, path=(), factor: int = 0) -> dict:
    return {"kind": "json_edit", "edit": {"root": root, "op": op, "value": value, "path": list(path),
                                          "factor": factor}}


NO_CHECKSUMS = _edit("sha256", "set", {})
TOP_KEYS = ["format", "format_version", "eclat_version", "created", "target", "device", "program",
            "memory_plan", "native", "inputs", "out_spec", "report", "sha256"]
MEMBERS = ["manifest.json", "manifest.sha256", "weights.safetensors", "kernels.ll", "kernels.o"]
NAMED_DAMAGES = [
    *[(f"truncated to {at:.0%}", [{"kind": "truncate", "at": at}]) for at in (0.0, 0.1, 0.5, 0.9, 0.999)],
    *[(f"a byte of {m} flipped in the file", [{"kind": "flip", "member": m, "at": 0.5}]) for m in MEMBERS],
    *[(f"{m}: a byte flipped", [{"kind": "member_flip", "member": m, "at": 0.5}]) for m in MEMBERS],
    *[(f"{m}: garbage", [{"kind": "member_garbage", "member": m, "size": 300}]) for m in MEMBERS],
    *[(f"{m}: dropped", [{"kind": "member_drop", "member": m}]) for m in MEMBERS],
    *[(f"{m}: garbage, no checksums", [NO_CHECKSUMS, {"kind": "member_garbage", "member": m, "size": 300}])
      for m in MEMBERS[1:]],
    ("kernels.o flipped, no checksums", [NO_CHECKSUMS, {"kind": "member_flip", "member": "kernels.o",
                                                         "at": 0.5}]),
    *[(f"manifest without {key}", [_edit(key, "delete")]) for key in TOP_KEYS],
    *[(f"manifest {key} as a list", [_edit(key, "set", [1, 2])]) for key in TOP_KEYS],
    ("manifest is a list", [_edit("", "set", [1, 2])]),
    ("manifest nested 100000 deep", [_edit("report", "set", "__DEEP__")]),
    ("input shape [4, 8] for [3, 8]", [_edit("inputs.0.shape.0", "set", 4)]),
    ("input shape [3, 8, 1]", [_edit("inputs.0.shape", "set", [3, 8, 1])]),
    ("input shape []", [_edit("inputs.0.shape", "set", [])]),
    ("input shape [-3, 8]", [_edit("inputs.0.shape.0", "set", -3)]),
    ("input shape [2**31, 8]", [_edit("inputs.0.shape.0", "set", 2**31)]),
    ("program input shape [4, 8]", [_edit("program.input_shapes.0.0", "set", 4)]),
    ("input and program input shapes [4, 8]", [_edit("inputs.0.shape.0", "set", 4),
                                                _edit("program.input_shapes.0.0", "set", 4)]),
    ("input and program input shapes [2, 8]", [_edit("inputs.0.shape.0", "set", 2),
                                                _edit("program.input_shapes.0.0", "set", 2)]),
    ("input dtype float64", [_edit("inputs.0.dtype", "set", "float64")]),
    ("input dtype int64", [_edit("inputs.0.dtype", "set", "int64")]),
    ("input dtype unknown", [_edit("inputs.0.dtype", "set", "float7")]),
    ("a buffer's dtype float64", [_edit("program.buffers.0.dtype", "set", "float64")]),
    ("a weight's role temp", [_edit("program.buffers.1.role", "set", "temp")]),
    ("arena of 0 bytes", [_edit("memory_plan.arena_bytes", "set", 0)]),
    ("arena of -64 bytes", [_edit("memory_plan.arena_bytes", "set", -64)]),
    ("arena of 2**62 bytes", [_edit("memory_plan.arena_bytes", "set", 2**62)]),
    ("arena size a string", [_edit("memory_plan.arena_bytes", "set", "x")]),
    ("offsets far outside the arena", [_edit("memory_plan.offsets", "scale", path=[0], factor=5)]),
    ("every buffer's numel doubled", [_edit(f"program.buffers.{k}.numel", "scale") for k in range(8)]),
    ("a buffer's numel 0", [_edit("program.buffers.0.numel", "set", 0)]),
    ("an output shape changed", [_edit("program.output_shapes.0.0", "scale", factor=2)]),
    ("an output shape and its buffer changed", [_edit("program.output_shapes.0.0", "set", 6),
                                               _edit("program.buffers.8.numel", "set", 24)]),
    ("a weight's dtype float64", [_edit("program.buffers.3.dtype", "set", "float64")]),
    ("a weight's dtype int32", [_edit("program.buffers.3.dtype", "set", "int32")]),
    ("two weights' names swapped", [_edit("program.buffers.1.name", "set", "w_0.bias"),
                                    _edit("program.buffers.2.name", "set", "w_2.bias")]),
    ("two weights' slots swapped", [_edit("native.slot_names.1", "set", "w_0.bias"),
                                    _edit("native.slot_names.2", "set", "w_2.bias")]),
    ("two temporaries at one offset", [_edit("memory_plan.offsets.t13", "set", 0)]),
    ("in_structure a dict", [_edit("in_structure", "set", {"dict": [["x", None]]})]),
    ("in_structure garbage", [_edit("in_structure", "set", "__DEEP__")]),
    ("a kernel's shape doubled", [_edit("program.kernels.0.shape.0", "scale")]),
    ("a node's child out of range", [_edit("program.nodes.5.a", "set", 10**6)]),
    ("a node's child a later node", [_edit("program.nodes.0.index", "set", 7)]),
    ("a node of an unknown type", [_edit("program.nodes.0.t", "set", "Nope")]),
    ("every node's first field 0", [_edit(f"program.nodes.{k}", "set", 0, path=[0]) for k in range(12)]),
    ("kernels reversed", [_edit("program.kernels", "swap")]),
    ("a kernel dropped", [_edit("program.kernels.0", "delete")]),
    ("a kernel's output renamed", [_edit("program.kernels.0.out", "set", "x")]),
    ("a schedule's field a string", [_edit("program.kernels.0.schedule", "set", "x", path=[0])]),
    ("slot names reversed", [_edit("native.slot_names", "swap")]),
    ("entry point unknown", [_edit("native.entry", "set", "nope")]),
    ("device for another triple", [_edit("device.triple", "set", "riscv64-unknown-linux-gnu")]),
    ("device for another triple, kernels.ll garbage, no checksums",
     [_edit("device.triple", "set", "x"), NO_CHECKSUMS, {"kind": "member_garbage", "member": "kernels.ll"}]),
    ("device for another triple, kernels.ll cut, no checksums",
     [_edit("device.triple", "set", "x"), NO_CHECKSUMS, {"kind": "member_truncate", "member": "kernels.ll",
                                                        "at": 0.5}]),
    ("target tpu", [_edit("target", "set", "tpu")]),
    ("format version 0", [_edit("format_version", "set", 0)]),
    ("format version 1.5", [_edit("format_version", "set", 1.5)]),
    ("out_spec garbage", [_edit("out_spec", "set", "{not json")]),
]


@pytest.mark.parametrize("damages", [pytest.param(d, id=name) for name, d in NAMED_DAMAGES])
def test_named_artifact_damages(worker, artifacts, damaged, damages):
    _load(worker, artifacts, damaged, "mlp", damages)


# the artifact of "nested": dict inputs and outputs
NAMED_NESTED_DAMAGES = [
    ("manifest without out_spec", [_edit("out_spec", "delete")]),
    ("out_spec null", [_edit("out_spec", "set", None)]),
    ("out_spec of another structure", [_edit("out_spec", "set", '[1, {"type": null, "context": "null", '
                                                             '"children_spec": []}]')]),
    ("manifest without in_structure", [_edit("in_structure", "delete")]),
    ("in_structure null", [_edit("in_structure", "set", None)]),
    ("in_structure keys renamed", [_edit("in_structure.0.dict.0.0", "set", "b"),
                                   _edit("in_structure.0.dict.1.0", "set", "a")]),
]


@pytest.mark.parametrize("damages", [pytest.param(d, id=name) for name, d in NAMED_NESTED_DAMAGES])
def test_named_nested_artifact_damages(worker, artifacts, damaged, damages):
    _load(worker, artifacts, damaged, "nested", damages)


@pytest.mark.parametrize("model", ARTIFACT_MODELS)
def test_intact_artifacts_answer(worker, artifacts, damaged, model):
    """Loaded as written, an artifact answers flat and nested calls, with numpy and torch."""
    path = damaged.write(artifacts[model])
    check(worker, {"op": "load", "model": model, "path": path, "intact": True})


def test_every_named_member_is_in_the_artifact(artifacts):
    """The named damages above reach every member of an artifact."""
    import zipfile
    from io import BytesIO

    assert sorted(zipfile.ZipFile(BytesIO(artifacts["mlp"])).namelist()) == sorted(MEMBERS)


# --- damaged caches -----------------------------------------------------------------------------------

def _cached_compile(worker: WorkerClient, warm: Path, folder: Path, damages: list,
                    model: str = "mlp") -> None:
    copy_cache(warm, folder)
    for target, damage in damages:
        if target == "programs":
            files = sorted((folder / "programs").glob("*.zip"))
        elif target == "devices":
            files = sorted((folder / "devices").glob("*.json"))
        else:
            files = [folder / "tuning.db"]
        for f in files:
            if f.is_file():
                damage_file(f, damage)
    check(worker, {"op": "cache", "model": model, "cache": str(folder), "damages": damages}, timeout=300)


@settings(QUICK, max_examples=6, phases=NO_SHRINK)
@given(damages=cache_cases)
def test_damaged_caches(worker, warm_cache, damaged, damages):
    damaged.count += 1
    _cached_compile(worker, warm_cache, damaged.folder / f"cache{damaged.count}", damages)


@pytest.mark.slow
@settings(LONG, max_examples=200, phases=NO_SHRINK)
@given(damages=cache_cases)
def test_damaged_caches_long(worker, warm_cache, damaged, damages):
    damaged.count += 1
    _cached_compile(worker, warm_cache, damaged.folder / f"cache{damaged.count}", damages)


NAMED_CACHE_DAMAGES = [
    *[(f"{target}: {kind}", [(target, {"kind": kind, "at": 0.5, "size": 100})])
      for target, kinds in [("programs", ("garbage", "truncate", "directory")),
                            ("tuning.db", ("garbage", "empty", "directory")),
                            ("devices", ("garbage", "directory"))]  # each a measurement again: seconds
      for kind in kinds],
    ("programs: program.json nested 100000 deep", [("programs", _edit("report", "set", "__DEEP__"))]),
    ("programs: a buffer's numel doubled", [("programs", _edit("program.buffers", "scale", path=[0, 2]))]),
    ("programs: an input shape changed", [("programs", _edit("program.input_shapes", "scale", path=[0, 0]))]),
    ("programs: weights garbage", [("programs", {"kind": "member_garbage", "member": "weights.safetensors",
                                                 "size": 200})]),
    # (the program cache garbage too: a hit that needs no database would not read the schedules)
    ("tuning.db: schedules as lists", [("programs", {"kind": "garbage"}),
                                       ("tuning.db", {"kind": "db_edit", "edit": {"root": "", "op": "set",
                                                                                  "value": [1, 2]}})]),
    ("tuning.db: schedule fields as strings", [("programs", {"kind": "garbage"}),
                                               *[("tuning.db", {"kind": "db_edit", "edit": {
                                                   "root": "", "op": "set", "value": "x", "path": [k]}})
                                                 for k in range(6)]]),
    ("devices: peaks as strings", [("devices", _edit("device.peak_gflops", "set", "x", path=[0]))]),
    ("devices: JSON nested 100000 deep", [("devices", _edit("schema", "set", "__DEEP__"))]),
    ("tuning.db: schedules nested 100000 deep", [("programs", {"kind": "garbage"}),
                                                  ("tuning.db", {"kind": "db_edit", "edit": {
                                                      "root": "", "op": "set", "value": "__DEEP__"}})]),
]


@pytest.mark.parametrize("damages", [pytest.param(d, id=name) for name, d in NAMED_CACHE_DAMAGES])
def test_named_cache_damages(worker, warm_cache, damaged, damages):
    damaged.count += 1
    _cached_compile(worker, warm_cache, damaged.folder / f"cache{damaged.count}", damages)


def test_damaged_cached_weights_that_the_example_cannot_show(worker, warm_zero_cache, damaged):
    """A program cache hit is checked against torch on the example; compiled with zeros, the example's
    output does not depend on the first layer's weights, so a damaged copy of them must be caught
    otherwise (their digest, or the model's own weights)."""
    damaged.count += 1
    damage = {"kind": "member_weights", "member": "weights.safetensors", "prefix": "w_0.weight",
              "factor": -3.0}
    _cached_compile(worker, warm_zero_cache, damaged.folder / f"cache{damaged.count}", [("programs", damage)],
                    "mlp_zero")
