"""A GPU target's part of an artifact: the rendered source, the schedules and launch sizes. Loading
renders the stored schedules again and the driver compiles them; where the device is absent, the
executable's run says why."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ...compiler.artifact import CODE_LIMIT
from ...compiler.kernel import Program
from ...errors import ArtifactError
from ..target import Section

if TYPE_CHECKING:
    from .target import GpuTarget


def save(target: GpuTarget, exe: Any) -> Section:
    schedules = {k.name: dataclasses.asdict(k.schedule) for k in exe.rendered.kernels}
    launches = {k.name: {"groups": k.groups, "threads": k.threads, "args": list(k.args)}
                for k in exe.rendered.kernels}
    device: dict[str, Any] = {"kind": target.name}
    queue = getattr(exe, "queue", None)
    if queue is not None:  # OpenCL: the device it was built and tuned on
        device.update(name=queue.device.name.strip(), platform=queue.device.platform.name.strip())
    native = {"device": device, "schedules": schedules, "launches": launches}
    reads = {a for k in exe.rendered.kernels for a in k.args}
    return Section(native, {target.source_member: exe.rendered.source.encode()}, reads)


def load(target: GpuTarget, program: Program, native: dict[str, Any], art: Any) -> Any:
    schedules = {name: target.schedule_from(d) for name, d in native["schedules"].items()}
    for k in program.kernels:  # the program describes what runs
        if k.name in schedules:
            k.schedule = schedules[k.name]
    missing = target.missing()
    exe = target.deferred(program, missing) if missing else target.compile(program)
    if exe.rendered.source.encode() != art.read(target.source_member, CODE_LIMIT):
        raise ArtifactError(f"{art.path}: this eclat renders the stored kernels differently from the eclat "
                            f"that wrote it ({art.manifest.get('eclat_version')}); recompile the model")
    exe.loaded_from = "source"
    return exe
