"""A small CNN (strided, dilated and grouped convolutions, batch norm, max/avg/adaptive
pooling, a linear head; random weights) compiled for the CPU, saved as an artifact and
reloaded, checked against PyTorch.

    python examples/cnn.py
    eclat compile examples/cnn.py:make --target cpu -o cnn.eclat
"""

import os
import tempfile
import time

import torch
from torch import nn
from torch.nn import functional as F

import eclat


class CNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.avg = nn.AvgPool2d(2, stride=1)
        self.adapt = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16 * 2 * 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.pool(x)
        x = self.avg(F.relu(self.conv3(x)))
        x = torch.flatten(self.adapt(x), 1)
        return self.fc(x)


def make(batch: int = 2, size: int = 16):
    """(model, example_inputs): a batch of two 3x16x16 images."""
    torch.manual_seed(0)
    model = CNN()
    for bn in (model.bn1, model.bn2):  # batch norm statistics as if trained, not the identity
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    return model.eval(), (torch.randn(batch, 3, size, size),)


def main() -> None:
    model, (x,) = make()
    t0 = time.perf_counter()
    fast = eclat.compile(model, (x,), target="cpu", autotune="none", k=4)  # 4 candidate programs
    print(f"compiled in {time.perf_counter() - t0:.1f} s, {len(fast.report()['kernels'])} kernels")
    with torch.inference_mode():
        want = model(x)
    err = (fast(x) - want).abs().max().item()
    print(f"max |eclat - torch| = {err:.2e}")
    assert err < 1e-3, "eclat disagrees with PyTorch"

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cnn.eclat")
        fast.save(path)
        t0 = time.perf_counter()
        loaded = eclat.load(path)  # no search, no torch needed
        print(f"artifact: {os.path.getsize(path)} bytes, loaded in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        again = loaded(x.numpy())
    assert abs(again - want.numpy()).max() < 1e-3
    print("predicted classes:", want.argmax(-1).tolist())


if __name__ == "__main__":
    main()
