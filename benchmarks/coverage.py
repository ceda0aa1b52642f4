"""Which models nobody here wrote compile and match torch: transformers architectures from small
random configs (encoders, decoders, encoder-decoders, vision and audio models), greedy generation
of cached decoders against transformers' generate, and torchvision's segmentation, video and other
classifiers. One row per model: ok (the largest output error relative to the output's scale, the
compile's seconds), or what failed and why. Nothing is downloaded.

    python benchmarks/coverage.py [--only NAME ...] [--kind hf|lm|vision|timm]

`autotune="none"`; torchvision as benchmarks/vision.py installs it (TORCHVISION_DIR), timm as
benchmarks/timm_models.py does (TIMM_DIR): one model of each of fifty families, each at its own
input size, the classifier head's output compared (its weights random, not zero)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import eclat  # noqa: E402

TXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
           max_position_embeddings=128)
VIS = {k: v for k, v in TXT.items() if k not in ("vocab_size", "max_position_embeddings")}
GQA = dict(TXT, num_key_value_heads=2)
# the decoders compile_lm serves (transformers' cached export), by their names in _hf
GENERATION = ("gpt2_lm", "gpt_neox", "opt", "bloom", "falcon", "phi", "phi3", "llama_lm", "qwen2_lm", "qwen3",
              "gemma", "gemma2", "mistral", "mixtral", "olmo", "stablelm")
AUDIO = dict(conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
             num_conv_pos_embedding_groups=4)


NOPOS = {k: v for k, v in TXT.items() if k != "max_position_embeddings"}
SMALL_VISION = dict(image_size=64, patch_size=8)
# name: (config class, its arguments, model class), transformers' names
HF: dict[str, tuple[str, dict, str]] = {
    "bert": ("BertConfig", TXT, "BertModel"),
    "roberta": ("RobertaConfig", TXT, "RobertaModel"),
    "distilbert": ("DistilBertConfig", dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=256),
                   "DistilBertModel"),
    "albert": ("AlbertConfig", dict(TXT, embedding_size=32), "AlbertModel"),
    "electra": ("ElectraConfig", dict(TXT, embedding_size=32), "ElectraModel"),
    "deberta_v2": ("DebertaV2Config", TXT, "DebertaV2Model"),
    "mpnet": ("MPNetConfig", TXT, "MPNetModel"),
    "squeezebert": ("SqueezeBertConfig", dict(TXT, embedding_size=64), "SqueezeBertModel"),
    "funnel": ("FunnelConfig", dict(d_model=64, n_head=4, d_head=16, d_inner=128, vocab_size=256,
                                    block_sizes=[1, 1]), "FunnelModel"),
    "xlnet": ("XLNetConfig", dict(d_model=64, n_layer=2, n_head=4, d_inner=128, vocab_size=256),
        "XLNetModel"),
    "bert_cls": ("BertConfig", dict(TXT, num_labels=3), "BertForSequenceClassification"),
    "gpt2_lm": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64),
                "GPT2LMHeadModel"),
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, rotary_dim=8),
             "GPTJModel"),
    "gpt_neox": ("GPTNeoXConfig", TXT, "GPTNeoXModel"),
    "opt": ("OPTConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                              vocab_size=256, word_embed_proj_dim=64, max_position_embeddings=128),
                                  "OPTModel"),
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=256), "BloomModel"),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    vocab_size=256), "FalconModel"),
    "phi": ("PhiConfig", TXT, "PhiModel"),
    "phi3": ("Phi3Config", dict(GQA, pad_token_id=0), "Phi3Model"),
    "llama_lm": ("LlamaConfig", GQA, "LlamaForCausalLM"),
    "qwen2_lm": ("Qwen2Config", GQA, "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", dict(GQA, head_dim=16), "Qwen3Model"),
    "gemma": ("GemmaConfig", dict(GQA, head_dim=16), "GemmaModel"),
    "gemma2": ("Gemma2Config", dict(GQA, head_dim=16), "Gemma2Model"),
    "mistral": ("MistralConfig", GQA, "MistralModel"),
    "mixtral": ("MixtralConfig", dict(GQA, num_local_experts=4, num_experts_per_tok=2), "MixtralModel"),
    "olmo": ("OlmoConfig", TXT, "OlmoModel"),
    "stablelm": ("StableLmConfig", GQA, "StableLmModel"),
    "t5": ("T5Config", dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=256,
                            decoder_start_token_id=0), "T5ForConditionalGeneration"),
    "bart": ("BartConfig", dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                vocab_size=256, max_position_embeddings=64), "BartModel"),
    "clip_text": ("CLIPTextConfig", TXT, "CLIPTextModel"),
    "vit": ("ViTConfig", dict(VIS, **SMALL_VISION), "ViTModel"),
    "deit": ("DeiTConfig", dict(VIS, **SMALL_VISION), "DeiTModel"),
    "beit": ("BeitConfig", dict(VIS, **SMALL_VISION, use_relative_position_bias=True), "BeitModel"),
    "dinov2": ("Dinov2Config", dict({k: v for k, v in VIS.items() if k != "intermediate_size"},
                                    **SMALL_VISION), "Dinov2Model"),
    "clip_vision": ("CLIPVisionConfig", dict(VIS, **SMALL_VISION), "CLIPVisionModel"),
    "yolos": ("YolosConfig", dict(VIS, image_size=[64, 64], patch_size=8, num_detection_tokens=5),
        "YolosModel"),
    "swin": ("SwinConfig", dict(image_size=64, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                window_size=4), "SwinModel"),
    "convnext": ("ConvNextConfig", dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2), "ConvNextModel"),
    "mobilevit": ("MobileViTConfig", dict(image_size=64, hidden_sizes=[32, 48, 64],
                                          neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 64]), "MobileViTModel"),
    "mobilenetv2": ("MobileNetV2Config", dict(image_size=64, depth_multiplier=0.35), "MobileNetV2Model"),
    "levit": ("LevitConfig", dict(image_size=64, hidden_sizes=[32, 48, 64], num_attention_heads=[2, 2, 2],
                                  depths=[1, 1, 1], key_dim=[8, 8, 8]), "LevitModel"),
    "poolformer": ("PoolFormerConfig", dict(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1]),
                   "PoolFormerModel"),
    "pvt_v2": ("PvtV2Config", dict(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1],
                                   num_attention_heads=[1, 2, 2, 4]), "PvtV2Model"),
    "focalnet": ("FocalNetConfig", dict(embed_dim=16, depths=[1, 1], image_size=64), "FocalNetModel"),
    "segformer": ("SegformerConfig", dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                          hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                                          patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
                                          decoder_hidden_size=32),
                  "SegformerForSemanticSegmentation"),
    "dpt": ("DPTConfig", dict(VIS, num_hidden_layers=4, **SMALL_VISION, backbone_out_indices=[0, 1, 2, 3],
                              neck_hidden_sizes=[16, 32, 48, 64], fusion_hidden_size=32),
                                  "DPTForDepthEstimation"),
    "resnet": ("ResNetConfig", dict(hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16), "ResNetModel"),
    "wav2vec2": ("Wav2Vec2Config", dict(NOPOS, **AUDIO), "Wav2Vec2Model"),
    "hubert": ("HubertConfig", dict(NOPOS, **AUDIO), "HubertModel"),
}


def _config(name: str) -> Any:
    import transformers

    return getattr(transformers, HF[name][0])(**HF[name][1])


def _model(name: str) -> torch.nn.Module:
    import transformers

    return getattr(transformers, HF[name][2])(_config(name)).eval()


def _inputs(model: Any) -> tuple:
    g = torch.Generator().manual_seed(0)
    kind = getattr(model, "main_input_name", "input_ids")
    if kind == "pixel_values":
        return (torch.randn(1, 3, 64, 64, generator=g),)
    if kind == "input_values":
        return (torch.randn(1, 4000, generator=g),)
    ids = torch.randint(0, 256, (1, 16), generator=g)
    if model.config.is_encoder_decoder and "ForConditionalGeneration" in type(model).__name__:
        return (ids, None, torch.randint(0, 256, (1, 5), generator=g))
    return (ids,)


def _compared(model: torch.nn.Module, inputs: tuple) -> str:
    """ok with the largest error relative to each output's scale and the compile's seconds."""
    with torch.no_grad():
        want = [t for t in torch.utils._pytree.tree_leaves(model(*inputs)) if isinstance(t, torch.Tensor)]
    start = time.perf_counter()
    compiled = eclat.compile(model, inputs, autotune="none", quiet=True)
    seconds = time.perf_counter() - start
    got = [t for t in torch.utils._pytree.tree_leaves(compiled(*inputs)) if isinstance(t, torch.Tensor)]
    if len(got) != len(want):
        return f"WRONG: {len(got)} outputs, torch {len(want)}"
    err = max(float((g.float() - w.float()).abs().max()) / max(1.0, float(w.float().abs().max()))
              for g, w in zip(got, want))
    return f"{'ok' if err < 1e-4 else 'WRONG'} | {err:.1e} | {seconds:.1f}"


def _generation(model: torch.nn.Module) -> str:
    """ok when compile_lm's greedy tokens equal transformers' generate (no end token)."""
    prompt, new = [5, 17, 42, 7, 99], 10
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    want = out[0, len(prompt):].tolist()
    start = time.perf_counter()
    lm = eclat.compile_lm(model, max_len=32, chunk=8, autotune="none", quiet=True)
    seconds = time.perf_counter() - start
    return f"{'ok' if lm.generate(prompt, new) == want else 'WRONG'} | tokens | {seconds:.1f}"


def _vision() -> list[tuple[str, Callable[[], torch.nn.Module], tuple[int, ...]]]:
    from vision import _torchvision

    _torchvision()
    import torchvision.models as M
    import torchvision.models.segmentation as S
    import torchvision.models.video as V

    return [
        ("lraspp_mobilenet_v3", lambda: S.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                    num_classes=5), (1, 3, 128, 128)),
        ("deeplabv3_mobilenet_v3", lambda: S.deeplabv3_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=5, aux_loss=False), (1, 3, 128, 128)),
        ("fcn_resnet50", lambda: S.fcn_resnet50(weights=None, weights_backbone=None, num_classes=5,
                                                aux_loss=False), (1, 3, 96, 96)),
        ("r3d_18", lambda: V.r3d_18(weights=None), (1, 3, 8, 64, 64)),
        ("r2plus1d_18", lambda: V.r2plus1d_18(weights=None), (1, 3, 8, 64, 64)),
        ("mvit_v2_s", lambda: V.mvit_v2_s(weights=None), (1, 3, 16, 224, 224)),
        ("maxvit_t", lambda: M.maxvit_t(weights=None), (1, 3, 224, 224)),
        ("swin_v2_t", lambda: M.swin_v2_t(weights=None), (1, 3, 128, 128)),
        ("efficientnet_v2_s", lambda: M.efficientnet_v2_s(weights=None), (1, 3, 128, 128)),
        ("googlenet", lambda: M.googlenet(weights=None, aux_logits=False, init_weights=True),
         (1, 3, 128, 128)),
        ("regnet_x_400mf", lambda: M.regnet_x_400mf(weights=None), (1, 3, 128, 128)),
        ("wide_resnet50_2", lambda: M.wide_resnet50_2(weights=None), (1, 3, 96, 96)),
        ("resnext50_32x4d", lambda: M.resnext50_32x4d(weights=None), (1, 3, 96, 96)),
    ]


# timm families beyond benchmarks/timm_models.py's, one model each
TIMM_MORE = ["tinynet_e", "gernet_s", "res2net50_14w_8s", "selecsls42b", "regnetz_b16", "nf_resnet26",
             "cspresnet50", "dpn68", "ghostnetv2_100", "mobileone_s0", "efficientformer_l1",
             "efficientvit_m0", "mobilevitv2_050", "poolformerv2_s12", "coat_lite_tiny",
             "crossvit_tiny_240", "pvt_v2_b0", "gcvit_xxtiny", "tiny_vit_5m_224", "eva02_tiny_patch14_224",
             "xcit_nano_12_p16_224", "cait_xxs24_224", "resmlp_12_224", "gmlp_ti16_224", "sequencer2d_s",
             "visformer_tiny", "focalnet_tiny_srf", "starnet_s1", "rdnet_tiny", "twins_svt_small",
             "maxvit_nano_rw_256"]


def _timm(name: str) -> tuple[torch.nn.Module, tuple]:
    """name from timm with random weights (a zero-initialised head given random ones: its output
    is then compared, not a constant) and its own input size."""
    from timm_models import _make

    model, inputs = _make(name)()
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    if isinstance(head, torch.nn.Linear) and not head.weight.any():
        torch.nn.init.normal_(head.weight, std=0.02)
    return model, inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--kind", choices=["hf", "lm", "vision", "timm"], nargs="*",
                    default=["hf", "lm", "vision"])
    args = ap.parse_args()
    os.environ.setdefault("ECLAT_CACHE_DIR", tempfile.mkdtemp())
    warnings.simplefilter("ignore")
    print("| kind | model | result | max relative error | compile s |\n|---|---|---|---|---|")

    def row(kind: str, name: str, run: Callable[[], str]) -> None:
        if args.only and name not in args.only:
            return
        torch.manual_seed(0)
        try:
            result = run()
        except Exception as e:  # noqa: BLE001 - a survey: every failure is a row
            result = f"{type(e).__name__} | {str(e).splitlines()[0][:160]} |"
        print(f"| {kind} | {name} | {result} |", flush=True)

    if "hf" in args.kind:
        for name in HF:
            row("transformers", name, lambda name=name: _compared(model := _model(name), _inputs(model)))
    if "lm" in args.kind:
        import transformers
        for name in GENERATION:
            row("generation", name, lambda name=name: _generation(
                transformers.AutoModelForCausalLM.from_config(_config(name)).eval()))
    if "vision" in args.kind:
        for name, make, shape in _vision():
            row("torchvision", name, lambda make=make, shape=shape: _compared(
                make().eval(), (torch.randn(*shape, generator=torch.Generator().manual_seed(0)),)))
    if "timm" in args.kind:
        from timm_models import MODELS

        for name in MODELS + TIMM_MORE:
            row("timm", name, lambda name=name: _compared(*_timm(name)))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
