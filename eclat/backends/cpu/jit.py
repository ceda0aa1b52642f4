"""LLVM for the host: target machine, O3 with loop and SLP vectorisation, MCJIT."""

from __future__ import annotations

import re
import warnings
from functools import cache

import llvmlite.binding as llvm
import llvmlite.ir as ir

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


def _host_machine() -> llvm.TargetMachine:
    target = llvm.Target.from_default_triple()
    return target.create_target_machine(cpu=llvm.get_host_cpu_name(),
                                        features=llvm.get_host_cpu_features().flatten(),
                                        opt=3, codemodel="jitdefault")


def _loop_ids(text: str) -> str:
    """llvmlite cannot write self-referencing metadata: make each loop hint node
    `!n = !{!"eclat.loop.hint", !m, ...}` into the loop id `!n = distinct !{!n, !m, ...}`."""
    text = re.sub(r'^(!\d+) = !\{ ?!"eclat\.loop\.hint", ((?:!\d+, )*!\d+) ?\}$', r"\1 = distinct !{\1, \2}",
                  text, flags=re.M)
    return re.sub(r'^!eclat\.loop\.hint\.\d+ = !\{[^}]*\}$', "", text, flags=re.M)


class Jitted:
    """A compiled module; keeps the engine alive for as long as its code is used."""

    def __init__(self, module: ir.Module):
        tm = target_machine()
        module.triple = llvm.get_process_triple()
        module.data_layout = str(tm.target_data)
        mod = llvm.parse_assembly(_loop_ids(str(module)))
        mod.verify()
        pto = llvm.create_pipeline_tuning_options(speed_level=3)
        pto.loop_vectorization = True
        pto.slp_vectorization = True
        pto.loop_interleaving = True  # several vectors in flight hide fma latency
        pto.loop_unrolling = False  # full unrolling of small constant loops explodes compile time
        pb = llvm.create_pass_builder(tm, pto)
        pb.getModulePassManager().run(mod, pb)
        self.engine = llvm.create_mcjit_compiler(mod, tm)
        self.engine.finalize_object()
        self.llvm_module = mod

    def address(self, name: str) -> int:
        return self.engine.get_function_address(name)
