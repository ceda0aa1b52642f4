"""Models nobody here wrote, from timm: one of each family the other benchmarks lack (mixed and
large depthwise kernels, channels-last blocks, split attention, reparameterised and hybrid
convolution/attention networks), random weights, eval, batch 1, each at its own input size,
BatchNorm statistics set to non-trivial values; timed as run.py times its workloads, side by side
with torch eager, torch.compile and onnxruntime.

    TORCHVISION_DIR=DIR TIMM_DIR=DIR2 python benchmarks/timm_models.py --threads 1 --autotune none \
        [--only mixnet_s,edgenext_xx_small]

timm imports torchvision (installed as vision.py says); timm itself is pure Python and can be
installed the same way (`pip install timm --no-deps --target DIR2`). No weights are downloaded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import Workload, main  # noqa: E402
from vision import _torchvision  # noqa: E402

MODELS = ["mixnet_s", "ghostnet_100", "rexnet_100", "lcnet_050", "repvgg_a0", "skresnet18", "resnest14d",
          "dla34", "ese_vovnet19b_dw", "hgnetv2_b0", "fastvit_t8", "repvit_m0_9", "efficientvit_b0",
          "mobilevit_xxs", "edgenext_xx_small", "levit_128s", "convnextv2_atto", "inception_next_tiny",
          "mambaout_femto", "vit_tiny_patch16_224"]


def _make(name: str):
    def make():
        _torchvision()
        folder = os.environ.get("TIMM_DIR")
        if folder and folder not in sys.path:
            sys.path.insert(0, folder)
        import timm

        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False).eval()
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)
        return model, (torch.randn(1, *model.default_cfg.get("input_size", (3, 224, 224))),)
    return make


TIMM = [Workload(name, _make(name)) for name in MODELS]

if __name__ == "__main__":
    main(workloads=TIMM)
