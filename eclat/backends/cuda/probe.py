"""CUDA devices through pycuda (imported only when a CUDA device is asked for)."""

from __future__ import annotations

from typing import Any

from ...autotune.device import Device, DeviceError, fingerprint_of
from ..gpu.probe import gpu_source, measure_gpu

MACROS = {"KERNEL": 'extern "C" __global__', "GLOBAL": "", "GID": "(blockIdx.x * blockDim.x + threadIdx.x)",
          "FMA": "fmaf"}


class CudaProbe:
    @staticmethod
    def _driver() -> Any:
        try:
            import pycuda.driver as cuda
        except ImportError:
            return None
        try:
            cuda.init()
        except cuda.Error:
            return None
        return cuda

    def names(self) -> list[str]:
        cuda = self._driver()
        return [cuda.Device(i).name() for i in range(cuda.Device.count())] if cuda else []

    def identify(self, index: int, threads: int | None) -> dict[str, Any]:
        cuda = self._driver()
        if cuda is None:
            raise DeviceError("CUDA target needs pycuda and an NVIDIA driver: `pip install pycuda`")
        if index >= cuda.Device.count():
            raise DeviceError(f"no CUDA device {index}: this machine has {cuda.Device.count()}")
        d = cuda.Device(index)
        attrs = d.get_attributes()
        info = {"compute_capability": ".".join(map(str, d.compute_capability())),
                "driver": cuda.get_driver_version(), "sms": attrs[cuda.device_attribute.MULTIPROCESSOR_COUNT],
                "memory_bytes": d.total_memory(), "index": index}
        return {"fingerprint": fingerprint_of("cuda", d.name(), *info.values()), "info": info}

    def measure(self, index: int, ident: dict[str, Any]) -> Device:
        cuda = self._driver()
        from pycuda.compiler import SourceModule

        d = cuda.Device(index)
        ctx = d.make_context()
        try:
            mod = SourceModule(gpu_source(MACROS), no_extern_c=True)
            kernels = {k: mod.get_function(k) for k in ("fma_peak", "triad", "noop")}
            block = 256
            grid = lambda size: ((size + block - 1) // block, 1)
            launch = lambda k, size, args: kernels[k](*args, block=(block, 1, 1), grid=grid(size))
            alloc = lambda host: cuda.to_device(host)
            read = lambda buf, host: cuda.memcpy_dtoh(host, buf)
            return measure_gpu("cuda", d.name(), ident, ident["info"]["sms"], 1, launch, alloc,
                                ctx.synchronize, read)
        finally:
            ctx.pop()
