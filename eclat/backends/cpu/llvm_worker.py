"""The one recipe that optimises and emits a kernel module, and the worker processes that run it.

llvmlite serialises every LLVM call of a process behind one lock, so a process compiles one module
at a time. A build's kernels are independent modules: the other cores compile them in worker
processes, each this file run as a script (it imports llvmlite and nothing of eclat, so a worker
starts in a fraction of a second and never re-runs the user's program)."""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO

import llvmlite.binding as llvm

WORKERS_ENV = "ECLAT_COMPILE_WORKERS"  # how many worker processes (default: the usable cores less one)
MAX_WORKERS = 7


def machine(cpu: str, features: str) -> llvm.TargetMachine:
    """A target machine for cpu with features, as every kernel is compiled for."""
    target = llvm.Target.from_default_triple()
    return target.create_target_machine(cpu=cpu, features=features, opt=3, codemodel="jitdefault")


def optimised(text: str, tm: llvm.TargetMachine) -> llvm.ModuleRef:
    """IR text parsed, verified and run through O3 with loop and SLP vectorisation."""
    mod = llvm.parse_assembly(text)
    mod.verify()
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pto.loop_interleaving = True  # several vectors in flight hide fma latency
    pto.loop_unrolling = False  # full unrolling of small constant loops explodes compile time
    pb = llvm.create_pass_builder(tm, pto)
    with _without_missed_vectorisation_warnings():
        pb.getModulePassManager().run(mod, pb)
    return mod


MISSED = b"loop not vectorized"
_stderr_lock = threading.Lock()  # one redirection at a time: nested ones could leave fd 2 astray


@contextlib.contextmanager
def _without_missed_vectorisation_warnings() -> Iterator[None]:
    """LLVM writes a warning to stderr for each loop it was asked to vectorise and could not (a
    short row's hint is given before anyone knows whether its loop vectorises): noise to a user of
    the compiler. fd 2 is caught while the passes run, and every other line passed on."""
    with _stderr_lock, tempfile.TemporaryFile() as caught:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):  # no stderr to catch
            yield
            return
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            rest = [line for line in caught.read().splitlines(keepends=True) if MISSED not in line]
            if rest:
                os.write(2, b"".join(rest))


def compiled(text: str, tm: llvm.TargetMachine) -> tuple[bytes, str]:
    """The object code and the optimised IR of a module's text."""
    mod = optimised(text, tm)
    return bytes(tm.emit_object(mod)), str(mod)


def _send(stream: BinaryIO, value: object) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> object:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the other side closed the pipe")
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other side closed the pipe")
    return pickle.loads(data)


def _serve() -> None:
    """Worker loop: (cpu, features, text) in, ("ok", (object, IR)) or ("error", message) out, until
    the parent closes stdin."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    machines: dict[tuple[str, str], llvm.TargetMachine] = {}
    while True:
        try:
            cpu, features, text = _receive(sys.stdin.buffer)
        except EOFError:
            return
        try:
            tm = machines.get((cpu, features)) or machines.setdefault((cpu, features), machine(cpu, features))
            reply: tuple = ("ok", compiled(text, tm))
        except Exception as e:  # the parent compiles it again itself, and raises the real error
            reply = ("error", f"{type(e).__name__}: {e}")
        _send(sys.stdout.buffer, reply)


class _Worker:
    def __init__(self) -> None:
        # -P: the script's own folder (eclat's CPU modules) does not go on sys.path
        pipe = subprocess.PIPE
        self.process = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)],
                                        stdin=pipe, stdout=pipe, stderr=subprocess.DEVNULL)

    def compile(self, cpu: str, features: str, text: str) -> tuple[bytes, str] | None:
        """The module compiled by this worker; None if it could not (the caller compiles it)."""
        _send(self.process.stdin, (cpu, features, text))
        status, value = _receive(self.process.stdout)
        return value if status == "ok" else None


@atexit.register
def _stop_workers() -> None:
    """Workers end when their stdin closes; wait for them so that none outlives this process."""
    for w in _workers:
        w.process.stdin.close()
    for w in _workers:
        try:
            w.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            w.process.kill()


def worker_count() -> int:
    """Worker processes a build uses: WORKERS_ENV, or the cores this process may use less one."""
    if WORKERS_ENV in os.environ:
        return max(0, min(int(os.environ[WORKERS_ENV]), MAX_WORKERS))
    return max(0, min(len(os.sched_getaffinity(0)) - 1, MAX_WORKERS))


_workers: list[_Worker] = []
_workers_lock = threading.Lock()  # one batch at a time uses the workers


def compile_all(cpu: str, features: str, texts: list[str],
                local: Callable[[str], tuple[bytes, str]]) -> list[tuple[bytes, str]]:
    """Each text compiled, longest first, by this process (with local) and the worker processes at
    once. A worker that fails or dies leaves its module to this process, which then raises the error
    a bad module deserves."""
    results: list[tuple[bytes, str] | None] = [None] * len(texts)
    jobs: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in sorted(range(len(texts)), key=lambda i: -len(texts[i])):
        jobs.put(i)

    def drain(compile_one: Callable[[str], tuple[bytes, str] | None]) -> None:
        while True:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            results[i] = compile_one(texts[i])
            if results[i] is None:
                return

    with _workers_lock:
        want = min(worker_count(), len(texts) - 1)
        _workers[:] = [w for w in _workers if w.process.poll() is None]  # the dead are replaced
        try:
            while len(_workers) < want:
                _workers.append(_Worker())
        except OSError:
            pass  # no worker can start here: this process compiles alone
        live = _workers[:want]

        def remote(w: _Worker) -> None:
            try:
                drain(lambda text: w.compile(cpu, features, text))
            except (OSError, EOFError, pickle.PickleError):
                _workers.remove(w)  # dead: a later build starts another
        threads = [threading.Thread(target=remote, args=(w,), daemon=True) for w in live]
        for t in threads:
            t.start()
        try:
            drain(local)
        finally:
            for t in threads:
                t.join()
    return [r if r is not None else local(texts[i]) for i, r in enumerate(results)]


if __name__ == "__main__":
    _serve()
