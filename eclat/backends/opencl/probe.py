"""OpenCL devices through pyopencl (PoCL on a machine without a GPU): listed, identified, measured."""

from __future__ import annotations

from typing import Any

from ...autotune.device import Device, DeviceError, fingerprint_of
from ..gpu.probe import gpu_source, measure_gpu

MACROS = {"KERNEL": "__kernel", "GLOBAL": "__global", "GID": "get_global_id(0)", "FMA": "mad"}


class OpenCLProbe:
    @staticmethod
    def _devices() -> list[Any]:
        try:
            import pyopencl as cl
        except ImportError:
            return []
        try:
            return [d for p in cl.get_platforms() for d in p.get_devices()]
        except cl.Error:  # no ICD / no platform installed
            return []

    def names(self) -> list[str]:
        return [d.name.strip() for d in self._devices()]

    def identify(self, index: int, threads: int | None) -> dict[str, Any]:
        devices = self._devices()
        if index >= len(devices):
            have = ", ".join(f"opencl:{i} ({d.name.strip()})" for i, d in enumerate(devices)) or "none"
            raise DeviceError(f"no OpenCL device {index}: found {have} "
                              "(are pyopencl and an OpenCL driver such as PoCL installed?)")
        d = devices[index]
        info = {"platform": d.platform.name.strip(), "platform_version": d.platform.version.strip(),
                "driver": d.driver_version.strip(), "compute_units": d.max_compute_units,
                "clock_mhz": d.max_clock_frequency, "global_mem_bytes": d.global_mem_size, "index": index}
        return {"fingerprint": fingerprint_of("opencl", d.name.strip(), *info.values()), "device": d,
                "info": info}

    def measure(self, index: int, ident: dict[str, Any]) -> Device:
        import pyopencl as cl

        d = ident["device"]
        ctx = cl.Context([d])
        queue = cl.CommandQueue(ctx)
        lanes = max(1, d.preferred_vector_width_float)
        prog = cl.Program(ctx, gpu_source(MACROS, lanes)).build()
        kernels = {k: getattr(prog, k) for k in ("fma_peak", "triad", "noop")}
        mf = cl.mem_flags
        alloc = lambda host: cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=host)
        launch = lambda k, size, args: kernels[k](queue, (size,), None, *args)
        read = lambda buf, host: cl.enqueue_copy(queue, host, buf).wait()
        return measure_gpu("opencl", d.name.strip(), ident, d.max_compute_units, lanes, launch, alloc,
                            queue.finish, read)
