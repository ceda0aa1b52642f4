"""onnxruntime as a language-model runner for benchmarks/lm.py.

A transformers causal LM's forward is exported to ONNX (torch.onnx, dynamo) with its KV cache as
inputs and outputs: the cache grows by the tokens fed each call, as onnxruntime's decoders run
without IO binding. onnxruntime runs it in float32, or after its dynamic int8 quantization
(`onnxruntime.quantization.quantize_dynamic`, QInt8 weights, activations quantized per call).

The cache starts with one masked slot (a cache of length 0 is a shape torch.export specialises),
so the first call is the prefill, later ones decode steps.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import numpy as np
import torch


class _Step(torch.nn.Module):
    """One forward over new tokens: (input ids, positions, attention mask over cache + new, cache
    tensors) -> (the last position's logits, the grown cache tensors)."""

    def __init__(self, model: Any):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, mask, kv):
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer in range(len(kv) // 2):
            cache.update(kv[2 * layer], kv[2 * layer + 1], layer)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                         use_cache=True)
        grown = tuple(t for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
        return (out.logits[:, -1], *grown)


class OrtDecoder:
    def __init__(self, model: Any, threads: int, int8: bool):
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic

        cfg = model.config
        self.layers = cfg.num_hidden_layers
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.slot = (1, heads, 1, cfg.hidden_size // cfg.num_attention_heads)
        s, t, m = (torch.export.Dim(n, min=2, max=4096) for n in ("s", "t", "m"))
        ids = torch.zeros(1, 3, dtype=torch.long)
        kv = [torch.zeros(self.slot[:2] + (4,) + self.slot[3:]) for _ in range(2 * self.layers)]
        example = (ids, torch.arange(3)[None], torch.ones(1, 7, dtype=torch.long), kv)
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = os.path.join(d, "lm.onnx")
            torch.onnx.export(_Step(model), example, path, dynamo=True, optimize=True, verbose=False,
                              dynamic_shapes=({1: s}, {1: s}, {1: m}, [{2: t}] * len(kv)))
            if int8:
                quantize_dynamic(path, path + ".q", weight_type=QuantType.QInt8)
                path += ".q"
            opts = ort.SessionOptions()
            opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
            self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]
        self.start()

    def start(self) -> None:
        """An empty cache: one masked slot."""
        self.kv = [np.zeros(self.slot, np.float32) for _ in range(2 * self.layers)]
        self.position = 0

    def feed(self, tokens: list[int]) -> np.ndarray:
        """The logits after tokens, which join the cache."""
        n = len(tokens)
        positions = np.arange(self.position, self.position + n)[None]
        mask = np.ones((1, 1 + self.position + n), np.int64)
        mask[0, 0] = 0
        feed = [np.array([tokens], np.int64), positions, mask, *self.kv]
        logits, *self.kv = self.session.run(None, dict(zip(self.names, feed)))
        self.position += n
        return logits[0]


__all__ = ["OrtDecoder"]
