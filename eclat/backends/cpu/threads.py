"""A small blocking thread pool for generated code, written in C and built on first use.

Why C and not threads in the generated LLVM: the pool is sixty lines of pthreads that
every kernel shares, and it must not spin for long (on shared VMs a spinning pool steals
the cores it waits for: OpenMP's default made torch 60x slower here). A call cuts [0, n)
into contiguous slices, CHUNKS_PER_THREAD per thread, that the caller and the workers take in
turn. A worker that finishes watches for the next call for at most SPIN_NS (the kernels of one
model run follow each other within microseconds, and waking a sleeping vCPU costs tens of
them), then sleeps on a condition variable; the caller likewise watches for the others' slices
before it sleeps.
The library is compiled once per source version into eclat's cache folder; without a C
compiler (or a folder to build in), kernels run on one thread and compiling says why.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#define SPIN_NS 100000L  /* how long a finished worker, or the caller, watches before sleeping */
/* slices a call is cut into per thread, taken in turn by whichever thread is free: a thread that
   stalls (a shared VM's vCPU descheduled, a late wake-up) leaves its slices to the others instead
   of the caller waiting out a whole half. 2 threads, znver3 VM, one process, whole models in turns:
   medians 0.86-0.97x of one slice per thread at 4 (resnet18, regnet_y_400mf, squeezenet1_1,
   mobilenet_v3_small), best runs 1-4% slower; 8 no better than 4 */
#define CHUNKS_PER_THREAD 4
#if defined(__x86_64__) || defined(__i386__)
#define PAUSE() __builtin_ia32_pause()
#else
#define PAUSE() ((void)0)
#endif
/* busy-wait (without mu) until cond holds or SPIN_NS pass */
#define SPIN_UNTIL(cond) do { long s_ = now_ns(); \
    for (int i_ = 1; !(cond); i_++) { PAUSE(); if (i_ % 64 == 0 && now_ns() - s_ > SPIN_NS) break; } \
} while (0)
typedef void (*kernel_t)(void *, int64_t, int64_t);
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER, call_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;
static int workers, chunks, next_chunk, pending, sleepers, waiting;
static long generation;
static kernel_t job;
static void *job_args;
static int64_t job_n;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* called with mu held; returns with mu held */
static void work(void) {
    while (next_chunk < chunks) {
        int c = next_chunk++;
        int64_t lo = job_n * c / chunks, hi = job_n * (c + 1) / chunks;
        kernel_t fn = job; void *args = job_args;
        pthread_mutex_unlock(&mu);
        if (lo < hi) fn(args, lo, hi);
        pthread_mutex_lock(&mu);
        if (__atomic_sub_fetch(&pending, 1, __ATOMIC_ACQ_REL) == 0 && waiting) pthread_cond_broadcast(&done);
    }
}

static void *worker(void *unused) {
    long seen = 0;
    (void)unused;
    pthread_mutex_lock(&mu);
    for (;;) {
        pthread_mutex_unlock(&mu);
        SPIN_UNTIL(__atomic_load_n(&generation, __ATOMIC_ACQUIRE) != seen);
        pthread_mutex_lock(&mu);
        while (generation == seen) { sleepers++; pthread_cond_wait(&wake, &mu); sleepers--; }
        seen = generation;
        work();
    }
    return 0;
}

/* a forked child has none of the parent's workers: start afresh */
static void after_fork(void) {
    pthread_mutex_init(&mu, 0); pthread_mutex_init(&call_mu, 0);
    pthread_cond_init(&wake, 0); pthread_cond_init(&done, 0);
    workers = sleepers = waiting = 0;
}

__attribute__((constructor)) static void setup(void) { pthread_atfork(0, 0, after_fork); }

void eclat_parallel(kernel_t fn, void *args, int64_t n, int threads) {
    if (threads <= 1 || n <= 1) { fn(args, 0, n); return; }
    pthread_mutex_lock(&call_mu);
    pthread_mutex_lock(&mu);
    while (workers < threads - 1) {
        pthread_t t;
        if (pthread_create(&t, 0, worker, 0) != 0) break;
        pthread_detach(t);
        workers++;
    }
    job = fn; job_args = args; job_n = n;
    chunks = (int64_t)threads * CHUNKS_PER_THREAD < n ? threads * CHUNKS_PER_THREAD : (int)n;
    next_chunk = 0; pending = chunks;
    __atomic_store_n(&generation, generation + 1, __ATOMIC_RELEASE);
    if (sleepers) pthread_cond_broadcast(&wake);
    work();
    if (pending > 0) {
        pthread_mutex_unlock(&mu);
        SPIN_UNTIL(__atomic_load_n(&pending, __ATOMIC_ACQUIRE) == 0);
        pthread_mutex_lock(&mu);
    }
    waiting = 1;
    while (pending > 0) pthread_cond_wait(&done, &mu);
    waiting = 0;
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&call_mu);
}
"""


class NoPool(Exception):
    """Why the pool library cannot be had here."""


@cache
def pool_address() -> int | None:
    """Address of eclat_parallel, or None when the library cannot be built or loaded (then kernels
    run on one thread: see jit.serial_pool and pool_unavailable)."""
    try:
        handle = ctypes.CDLL(_library(), mode=ctypes.RTLD_GLOBAL)
    except (NoPool, OSError) as e:
        _why.append(str(e))
        return None
    _keep.append(handle)
    return ctypes.cast(handle.eclat_parallel, ctypes.c_void_p).value


def pool_unavailable() -> str | None:
    """Why kernels cannot run on several threads here; None when they can."""
    return None if pool_address() is not None else _why[-1]


def _library() -> str:
    """The path of a checked build of SOURCE: in eclat's cache folder, where a build is kept with its
    digest and one that does not match it (truncated, damaged) is built again; in a private
    temporary folder when the cache cannot be written."""
    from ...autotune.cache import cache_dir

    cc = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if cc is None:
        raise NoPool("no C compiler found to build eclat's thread pool (install gcc, or set CC)")
    lib = cache_dir() / "lib" / f"pool-{hashlib.sha256(SOURCE.encode()).hexdigest()[:16]}.so"
    digest = lib.with_suffix(".sha256")
    try:
        data = lib.read_bytes()
        if data and hashlib.sha256(data).hexdigest() == digest.read_text().strip():
            return str(lib)
    except OSError:  # not built yet, or unreadable: build it
        pass
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        return _build(cc, lib, digest)
    except OSError:  # a cache folder we cannot write: a build of this process's own, removed at exit
        private = Path(tempfile.mkdtemp(prefix="eclat-pool-"))
        atexit.register(shutil.rmtree, private, ignore_errors=True)
        return _build(cc, private / lib.name, private / digest.name)


def _build(cc: str, lib: Path, digest: Path) -> str:
    """Compile SOURCE to lib, then write its digest; each file appears whole (written beside it, then
    renamed), so a concurrent reader sees the old pair, the new pair, or a mismatch it rebuilds."""
    src = lib.with_name(f"{lib.stem}.{os.getpid()}.c")
    tmp = lib.with_name(f"{lib.stem}.{os.getpid()}.tmp")
    try:
        src.write_text(SOURCE)
        r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", str(src), "-o", str(tmp)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise NoPool(f"{cc} could not build eclat's thread pool: {r.stderr.strip()[-300:]}")
        data = tmp.read_bytes()
        os.replace(tmp, lib)
        tmp.write_text(hashlib.sha256(data).hexdigest())
        os.replace(tmp, digest)
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return str(lib)


_keep: list[ctypes.CDLL] = []
_why: list[str] = []
