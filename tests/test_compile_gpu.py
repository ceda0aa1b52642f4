"""GPU targets through compile_model: OpenCL tuned with its own schedule search and the tuning
database; CUDA and Metal where their device is absent kept unverified, saved, and refused clearly
when run."""

from __future__ import annotations

import json
import sys
import zipfile

import numpy as np
import pytest
import torch

import eclat
from eclat.compiler import pipeline
from eclat.compiler.pipeline import device_missing
from tests.gpu_cases import opencl_or_skip


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x):
        return torch.relu(self.fc(x)) * 2.0


def _tiny():
    torch.manual_seed(0)
    return Tiny().eval(), (torch.randn(4, 16),)


def test_opencl_tunes_through_the_database(tmp_path, monkeypatch):
    opencl_or_skip()
    monkeypatch.setattr(pipeline, "_faster_first", lambda *a: True)  # tuned schedules kept: read back below
    model, inputs = _tiny()
    first, second = (eclat.compile(model, inputs, target="opencl", autotune="fast", k=1, cache_dir=tmp_path,
                                   quiet=True) for _ in range(2))
    one, two = first.report()["tuning_cache"], second.report()["tuning_cache"]
    assert one["misses"] >= 2  # the chosen candidate and at least one kernel's GPU schedule
    assert two == {"hits": one["hits"] + one["misses"], "misses": 0}
    with torch.no_grad():
        want = model(*inputs)
    for compiled in (first, second):
        torch.testing.assert_close(compiled(*inputs), want, rtol=1e-3, atol=1e-4)
        kernels = compiled.report()["kernels"]
        assert all(k["measured_us"] > 0 and k["roofline_share"] > 0 for k in kernels)
    chosen = {k.name: k.schedule for k in first.executable.rendered.kernels}
    assert chosen == {k.name: k.schedule for k in second.executable.rendered.kernels}


ABSENT = [pytest.param("cuda", "kernels.cu", "no CUDA device found",
                       marks=pytest.mark.skipif(not device_missing("cuda"), reason="a CUDA device is here")),
          pytest.param("metal", "kernels.metal", "Metal",
                       marks=pytest.mark.skipif(sys.platform == "darwin" and not device_missing("metal"),
                                                reason="a Metal device is here"))]


@pytest.mark.parametrize("target,member,message", ABSENT)
def test_absent_gpu_keeps_an_untimed_candidate_that_can_be_saved(target, member, message, tmp_path):
    model, inputs = _tiny()
    compiled = eclat.compile(model, inputs, target=target, autotune="fast", k=2, cache_dir=tmp_path,
                             quiet=True)
    report = compiled.report()
    assert report["target"] == target and message in report["notes"][0] and "unverified" in report["notes"][0]
    assert report["candidates"]["timed"] == 0 and all(k["measured_us"] is None for k in report["kernels"])
    with pytest.raises(eclat.EclatError, match=message):
        compiled(*inputs)
    path = tmp_path / f"model.{target}.eclat"
    compiled.save(str(path))
    with zipfile.ZipFile(path) as z:
        manifest = json.loads(z.read("manifest.json"))
        source = z.read(member).decode()
    names = [k["name"] for k in report["kernels"]]
    assert all(f"{n}(" in source for n in names)
    native = manifest["native"]
    assert set(native["schedules"]) == set(names) == set(native["launches"])
    assert all(v["groups"] >= 1 and v["threads"] >= 1 for v in native["launches"].values())
    loaded = eclat.load(str(path))
    with pytest.raises(eclat.EclatError, match=message):
        loaded(inputs[0].numpy())
    assert loaded.executable.rendered.source == source


def test_deferred_program_matches_its_reference_when_interpreted(tmp_path):
    """The kept candidate is a sound program: the same kernels built for the CPU give torch's answer."""
    from eclat.backends import get_target

    model, inputs = _tiny()
    compiled = eclat.compile(model, inputs, target="cuda", autotune="none", k=2, quiet=True)
    if not device_missing("cuda"):
        pytest.skip("a CUDA device is here")
    cpu = get_target("cpu").compile(compiled.executable.program, 1)
    with torch.no_grad():
        want = model(*inputs).numpy()
    np.testing.assert_allclose(cpu.run([inputs[0].numpy()])[0], want, rtol=1e-4, atol=1e-5)
