"""LLVM for the host: target machine, O3 with loop and SLP vectorisation, MCJIT."""

from __future__ import annotations

import hashlib
import re
import threading
import warnings
from collections import OrderedDict
from functools import cache
from typing import Any

import llvmlite.binding as llvm
import llvmlite.ir as ir

from . import code_store
from .host import vector_bytes
from .llvm_worker import compile_all, compiled, machine, optimised
from .threads import pool_address, pool_unavailable

# eclat_parallel without the pool: the whole range on the calling thread
SERIAL_POOL = """
define void @eclat_parallel(ptr %fn, ptr %args, i64 %n, i32 %threads) {
  call void %fn(ptr %args, i64 0, i64 %n)
  ret void
}
"""


@cache
def _init() -> None:
    """LLVM's native target, and eclat_parallel for generated code to call: the pool, or its serial
    stand-in when the pool is unavailable (code built for several threads, an artifact's too, then
    runs on one)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    address = pool_address()
    if address is None:
        engine = llvm.create_mcjit_compiler(llvm.parse_assembly(SERIAL_POOL), _host_machine())
        engine.finalize_object()
        _serial.append(engine)
        address = engine.get_function_address("eclat_parallel")
    llvm.add_symbol("eclat_parallel", address)


_serial: list[llvm.ExecutionEngine] = []  # keeps the stand-in's code alive


def one_thread_warning(threads: int) -> None:
    """Warn that code meant for several threads runs on one here, and why."""
    why = pool_unavailable() if threads > 1 else None
    if why:
        warnings.warn(f"eclat: kernels run on one thread, not {threads}: {why}", RuntimeWarning, stacklevel=3)


def target_machine() -> llvm.TargetMachine:
    """The host CPU by name and features (AVX2 and FMA where present). A fresh one each
    time: an execution engine takes ownership of the target machine it is given."""
    _init()
    return _host_machine()


@cache
def _host_cpu() -> tuple[str, str]:
    """LLVM's name and features of the host CPU."""
    return llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()


def _host_machine() -> llvm.TargetMachine:
    return machine(*_host_cpu())


def _loop_ids(text: str) -> str:
    """llvmlite cannot write self-referencing metadata: make each loop hint node
    `!n = !{!"eclat.loop.hint", !m, ...}` into the loop id `!n = distinct !{!n, !m, ...}`."""
    text = re.sub(r'^(!\d+) = !\{ ?!"eclat\.loop\.hint", ((?:!\d+, )*!\d+) ?\}$', r"\1 = distinct !{\1, \2}",
                  text, flags=re.M)
    return re.sub(r'^!eclat\.loop\.hint\.\d+ = !\{[^}]*\}$', "", text, flags=re.M)


def _prepared(module: Any, tm: llvm.TargetMachine) -> str:
    """module's IR text for tm, its loop hints made loop ids, each function asking the vectoriser
    for the host's widest vectors: LLVM prefers 256 bits on Intel's AVX-512 cores, where the
    contractions use all 512 (SiLU, GELU and softmax ran 1.1-1.2x faster at 512, whole vision
    models up to 1.1x; A/B in one process, Xeon emeraldrapids)."""
    module.triple = llvm.get_process_triple()
    module.data_layout = str(tm.target_data)
    return widest_vectors(_loop_ids(str(module)), 8 * vector_bytes())


def widest_vectors(text: str, bits: int) -> str:
    """IR text with each function defined in it preferring vectors of bits (none: 0; a text that
    states a preference, LLVM's own print of a prepared module, is kept)."""
    if not bits or "prefer-vector-width" in text:
        return text
    return re.sub(r"^(define [^\n]*?)( \{)?$", rf'\1 "prefer-vector-width"="{bits}"\2', text, flags=re.M)


CODE_CACHE_BYTES = 256 << 20  # compiled kernel functions kept in this process, least recently used out
_code: OrderedDict[str, tuple[bytes, str]] = OrderedDict()  # IR digest -> (object code, optimised IR)
_code_bytes = 0  # what _code holds
_code_lock = threading.Lock()


@cache
def code_environment() -> str:
    """What a kernel's code depends on besides its IR text: LLVM's version and the host."""
    cpu, features = _host_cpu()
    return f"{llvm.llvm_version_info}|{target_machine().triple}|{cpu}|{features}"


def prepared_text(module: ir.Module) -> str:
    """A kernel module's IR text as the host's code is compiled from."""
    return _prepared(module, target_machine())


def kernel_codes(kernels: list[ir.Module | str]) -> list[tuple[bytes, str]]:
    """The object code and optimised IR of kernels, modules (or their prepared_text) each holding
    one kernel function. Compiled once per process and kept on disk (code_store): the candidates
    of a compile, the layers of a model and the schedules a tuner tries share most kernels, a second
    compile of a model all of them, and optimising them is most of a build's time. What is new is
    compiled on every core (llvm_worker)."""
    env = code_environment()
    texts = {}
    keys = []
    for kernel in kernels:
        text = kernel if isinstance(kernel, str) else prepared_text(kernel)
        key = hashlib.sha256(f"{env}|{text}".encode()).hexdigest()
        texts[key] = text
        keys.append(key)
    with _code_lock:
        for key in keys:
            if key in _code:
                _code.move_to_end(key)
        missing = [k for k in dict.fromkeys(keys) if k not in _code]
    stored = {k: kept for k in missing if (kept := _stored_code(k)) is not None}
    missing = [k for k in missing if k not in stored]
    made = {}
    if missing:
        tm = target_machine()
        made = dict(zip(missing, compile_all(*_host_cpu(), [texts[k] for k in missing],
                                             lambda text: compiled(text, tm))))
        for k, (obj, opt) in made.items():
            code_store.write("object", k, None, [obj, opt.encode()])
        code_store.trim()
    _keep(stored | made)
    with _code_lock:
        return [_code[k] for k in keys]


def _stored_code(key: str) -> tuple[bytes, str] | None:
    kept = code_store.read("object", key, parts=2)
    return None if kept is None else (kept[1][0], kept[1][1].decode())


def _keep(made: dict[str, tuple[bytes, str]]) -> None:
    """Compiled code into the process's cache, the least recently used out past its size."""
    global _code_bytes
    with _code_lock:
        for key, code in made.items():
            if key not in _code:
                _code[key] = code
                _code_bytes += len(code[0]) + len(code[1])
        while _code_bytes > CODE_CACHE_BYTES and len(_code) > len(made):
            o, t = _code.popitem(last=False)[1]
            _code_bytes -= len(o) + len(t)


def linked(module: Any) -> llvm.ModuleRef:
    """A codegen Module as one LLVM module, not optimised: its entry points and every kernel."""
    tm = target_machine()
    whole = llvm.parse_assembly(_prepared(module.ir, tm))
    for kernel in module.kernels.values():
        whole.link_in(llvm.parse_assembly(kernel))  # codegen's prepared text
    return whole


class Jitted:
    """Compiled code: a module's (one that defines all it calls), or a codegen Module's entry points
    with its kernels' cached object code. Keeps the engine alive for as long as its code is used."""

    def __init__(self, module: Any, kernels: dict[str, str] | None = None):
        tm = target_machine()
        self.kernel_code = kernel_codes(list((kernels or {}).values()))
        self.llvm_module = optimised(_prepared(module, tm), tm)
        self.engine = llvm.create_mcjit_compiler(self.llvm_module, tm)
        for obj, _ in self.kernel_code:
            self.engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        self.engine.finalize_object()

    def address(self, name: str) -> int:
        return self.engine.get_function_address(name)

    def objects(self) -> list[bytes]:
        """The code as object files (an artifact's): the entry points', then each kernel's as it was
        compiled, so that saving compiles nothing again."""
        entry = bytes(target_machine().emit_object(llvm.parse_assembly(str(self.llvm_module))))
        return [entry, *(obj for obj, _ in self.kernel_code)]
