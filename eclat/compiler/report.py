"""The compile report: what the search found, chose and measured, as typed records with to_dict()
for JSON (`CompiledModel.report()`, artifacts, `eclat inspect`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..autotune.roofline import estimate_us
from .kernel import Program, bytes_moved, flops


@dataclass
class DeviceSummary:
    name: str | None = None
    fingerprint: str | None = None
    peak_gflops: float | None = None
    peak_gbps: float | None = None

    @staticmethod
    def of(device: Any) -> DeviceSummary:
        if device is None:
            return DeviceSummary()
        return DeviceSummary(device.name, device.fingerprint, device.gflops("float32"), device.peak_gbps)


@dataclass
class EgraphStats:
    enodes: int | None = None
    eclasses: int | None = None
    iterations: int | None = None
    seconds: float | None = None
    rules: Any = None  # matches per rule set and rule
    stopped: str | None = None  # how each stage ended: saturated, or which budget stopped it
    merged: int | None = None  # groups of products merged into one (horizontal merges)
    segments: int | None = None  # pieces the graph was cut into between layers (rewrites/blocks.py)
    blocks: int | None = None  # distinct pieces the e-graph saw: the others reuse their candidates


@dataclass
class CandidateStats:
    extracted: int = 0  # candidate programs the e-graph gave
    pruned: int = 0  # not built: beyond the mode's limit, or the roofline says they cannot win
    timed: int = 0
    failed: list[str] = field(default_factory=list)  # "candidate n: error" of each one skipped
    chosen: int | None = None
    fused: bool = True  # the chosen one runs the target's fused kernels (attention in one kernel)
    channels_last: int = 0  # its feature maps of at most this many positions are channels-last
    cached: bool = False  # chosen by an earlier compile (the program cache)
    differences: list[str] = field(default_factory=list)  # what each candidate changes from the first


@dataclass
class KernelRow:
    name: str
    ops: list[str]
    flops: int
    bytes: int
    estimated_us: float | None = None  # the roofline's
    measured_us: float | None = None
    roofline_share: float | None = None  # estimated / measured


@dataclass
class CompileReport:
    target: str
    threads: int
    device: DeviceSummary = field(default_factory=DeviceSummary)
    egraph: EgraphStats = field(default_factory=EgraphStats)
    candidates: CandidateStats = field(default_factory=CandidateStats)
    kernels: list[KernelRow] = field(default_factory=list)
    memory: dict[str, int] | None = None  # arena_bytes, without_reuse_bytes
    compile_seconds: float = 0.0
    # seconds per phase (compiler.phases): lower, device, e-graph, fold, group, reference, build,
    # verify, timing, tuning; the rest of compile_seconds is bookkeeping between them
    phases: dict[str, float] = field(default_factory=dict)
    tuning_cache: dict[str, int] = field(default_factory=lambda: {"hits": 0, "misses": 0})
    notes: list[str] = field(default_factory=list)
    artifact: dict[str, Any] | None = None  # where a loaded model came from
    quantization: dict[str, Any] | None = None  # rounded weights and their error (quantize.accuracy)
    # run-time sizes: the search at each bucket's sizes (compiler.buckets), and whether its program won
    buckets: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for optional in ("notes", "artifact", "quantization", "buckets"):
            if not out[optional]:
                del out[optional]
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> CompileReport:
        """A report back from to_dict's JSON (fields it lacks take their defaults; unknown ones are
        dropped): what an artifact or the program cache stored."""
        def make(cls: type, value: Any) -> Any:
            names = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in value.items() if k in names}) if isinstance(value, dict) else cls()

        plain = make(CompileReport, {"target": "?", "threads": 1, **data})
        plain.device = make(DeviceSummary, data.get("device"))
        plain.egraph = make(EgraphStats, data.get("egraph"))
        plain.candidates = make(CandidateStats, data.get("candidates"))
        plain.kernels = [make(KernelRow, row) for row in data.get("kernels") or () if isinstance(row, dict)]
        return plain

    def add_kernels(self, program: Program, device: Any) -> None:
        """A row per kernel: its FLOPs and bytes, and the roofline's estimate on device."""
        self.kernels = []
        for kern in program.kernels:
            f, b = flops(kern), bytes_moved(kern, program.buffers)
            est = round(estimate_us(f, b, device), 3) if device is not None else None
            self.kernels.append(KernelRow(kern.name, list(kern.ops), f, b, est))

    def add_measured(self, measured_us: list[float] | None) -> None:
        for row, us in zip(self.kernels, measured_us or ()):
            row.measured_us = round(us, 3)
            if row.estimated_us is not None and us > 0:
                row.roofline_share = round(row.estimated_us / us, 4)
