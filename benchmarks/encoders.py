"""Transformer encoders and audio front ends nobody here wrote, at batch 1 (random weights from
offline configs), timed as run.py times its workloads, side by side with torch eager,
torch.compile and onnxruntime.

    python benchmarks/encoders.py --threads 1 --autotune none [--only bert_base_128,vit_s16]

The vision transformer comes from torchvision (installed as vision.py says, TORCHVISION_DIR); the
rest from transformers configs, which need no download.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from run import Workload, main  # noqa: E402
from vision import _torchvision  # noqa: E402


class HiddenStates(torch.nn.Module):
    """A transformers encoder returning its last hidden state as one tensor."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).last_hidden_state


def _bert(layers: int, d: int, heads: int, seq: int):
    def make():
        from transformers import BertConfig, BertModel

        cfg = BertConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=4 * d, attn_implementation="eager")
        tokens = torch.randint(0, cfg.vocab_size, (1, seq))
        return HiddenStates(BertModel(cfg, add_pooling_layer=False)), (tokens,)
    return make


def _vit_s16():
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                    attn_implementation="eager")
    return HiddenStates(ViTModel(cfg, add_pooling_layer=False)), (torch.randn(1, 3, 224, 224),)


def _vit_b16():
    model = _torchvision()[0].models.vit_b_16(weights=None)
    torch.nn.init.normal_(model.heads.head.weight, std=0.02)  # torchvision starts it at zero
    return model, (torch.randn(1, 3, 224, 224),)


def _wav2vec2_features():
    """wav2vec2's convolutional feature encoder (seven strided 1-d convolutions, GELU, a group
    norm after the first) on one second of 16 kHz audio."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    model = Wav2Vec2Model(Wav2Vec2Config(attn_implementation="eager")).feature_extractor
    return model, (torch.randn(1, 16000),)


def _wav2vec2_base():
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    model = Wav2Vec2Model(Wav2Vec2Config(num_hidden_layers=4, attn_implementation="eager"))
    return HiddenStates(model), (torch.randn(1, 16000),)


def _whisper_tiny_encoder():
    """Whisper tiny's encoder: two 1-d convolutions over 80 mel bins x 3000 frames, then four
    transformer layers at d=384."""
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                        decoder_layers=1, attn_implementation="eager")
    return HiddenStates(WhisperModel(cfg).encoder), (torch.randn(1, 80, 3000),)


ENCODERS = [
    Workload("minilm_l6_128", _bert(6, 384, 12, 128)),
    Workload("bert_base_128", _bert(12, 768, 12, 128)),
    Workload("vit_s16", _vit_s16),
    Workload("vit_b16_tv", _vit_b16),
    Workload("wav2vec2_features_1s", _wav2vec2_features),
    Workload("wav2vec2_l4_1s", _wav2vec2_base),
    Workload("whisper_tiny_encoder", _whisper_tiny_encoder),
]

if __name__ == "__main__":
    main(workloads=ENCODERS)
