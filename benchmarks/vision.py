"""Vision models nobody here wrote: torchvision classifiers (random weights, eval, batch 1,
BatchNorm statistics set to non-trivial values), timed as run.py times its workloads, side by side
with torch eager, torch.compile and onnxruntime.

    python benchmarks/vision.py --threads 1 --autotune none [--only resnet18,mobilenet_v3_small]

torchvision's wheel is built for the CUDA torch, so it is installed beside the CPU torch without
its compiled ops (`pip install torchvision==0.28.0 --no-deps --target DIR`, then TORCHVISION_DIR=DIR)
and the two operator schemas its Python code registers against are defined here first. Its model
definitions are pure Python; no weights are downloaded.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from run import Workload, main  # noqa: E402

# (model, input side): densenet121 at 64x64 as the issue measured it, the rest at 224x224; then
# models of other kinds of convolution (grouped: resnext50; dilated: DeepLabV3's atrous pyramid, its
# "out" map the output; narrow 3x3 stems over large images and 1x7 / 7x1 factorised ones:
# inception_v3 at its own 299x299)
MODELS = [("resnet18", 224), ("efficientnet_b0", 224), ("regnet_y_400mf", 224), ("mobilenet_v3_small", 224),
          ("squeezenet1_1", 224), ("shufflenet_v2_x0_5", 224), ("densenet121", 64), ("convnext_tiny", 224),
          ("swin_t", 224), ("resnext50_32x4d", 224), ("segmentation.deeplabv3_mobilenet_v3_large", 256),
          ("inception_v3", 299)]


class _Out(torch.nn.Module):
    """A segmentation model's "out" map alone (its forward returns a dict)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]


@functools.cache
def _torchvision():
    folder = os.environ.get("TORCHVISION_DIR")
    if folder:
        sys.path.insert(0, folder)
    schemas = torch.library.Library("torchvision", "DEF")
    schemas.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    schemas.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    return torchvision, schemas  # the library object keeps the schemas defined


def _make(name: str, side: int):
    def make():
        *family, short = name.split(".")
        models = _torchvision()[0].models
        for part in family:
            models = getattr(models, part)
        model = getattr(models, short)(weights=None, **({"weights_backbone": None} if family else {})).eval()
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)
        return (_Out(model).eval() if family else model), (torch.randn(1, 3, side, side),)
    return make


VISION = [Workload(f"{name.split('.')[-1]}_{side}", _make(name, side)) for name, side in MODELS]

if __name__ == "__main__":
    main(workloads=VISION)
