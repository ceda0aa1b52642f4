"""Generation with an eclat-owned KV cache: transformers decoders exported with their static cache,
a prefill and a decode program sharing the cache; greedy tokens match transformers' generate."""

import json

import numpy as np
import pytest
import torch

import eclat
from eclat.errors import ArtifactError

transformers = pytest.importorskip("transformers")

MAX_LEN, CHUNK = 24, 4


def _config(arch: str):
    # no end token: transformers would stop at it (or mask it), where LM.generate runs on
    common = dict(vocab_size=97, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    if arch == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64,
                                       initializer_range=0.3, **common)
    small = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3, **common)
    extra = {"gemma2": dict(head_dim=8, sliding_window=6), "qwen3": dict(head_dim=8),
             "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}.get(arch, {})
    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig, "gemma2": transformers.Gemma2Config,
            "phi3": transformers.Phi3Config, "qwen3": transformers.Qwen3Config,
            "mixtral": transformers.MixtralConfig}[arch](**small, **extra)


def _model(arch: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(arch)).eval()


def _reference(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    assert out.shape[1] == len(prompt) + new
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def gpt2():
    model = _model("gpt2")
    return model, eclat.compile_lm(model, max_len=MAX_LEN, chunk=CHUNK, autotune="none", quiet=True)


@pytest.mark.parametrize("prompt", [[5], [5, 17, 42], [5, 17, 42, 8, 9, 60], list(range(3, 22))],
                         ids=["one", "under-a-chunk", "two-chunks-padded", "last-chunk-recomputed"])
def test_greedy_tokens_match_transformers(gpt2, prompt):
    model, lm = gpt2
    new = MAX_LEN - len(prompt)
    assert lm.generate(prompt, new) == _reference(model, prompt, new)


def test_layers_share_one_e_graph(gpt2):
    _, lm = gpt2
    for program in (lm.prefill, lm.decode):
        stats = program.report()["egraph"]
        assert stats["blocks"] < stats["segments"]  # the layers' cache inputs and updates do not stop reuse


def test_the_cache_is_one_set_of_arrays_written_in_place(gpt2):
    _, lm = gpt2
    assert lm.decode.states is lm.prefill.states is lm.states
    before = {name: a for name, a in lm.states.items()}
    lm.generate([4, 5, 6], 5)
    assert all(lm.states[name] is a for name, a in before.items())
    keys = [a for name, a in lm.states.items() if name.startswith("key_cache")]
    assert keys and all(k.shape[2] == MAX_LEN for k in keys) and keys[0][:, :, :8].any()


def test_a_saved_model_stores_its_weights_once(gpt2, tmp_path):
    """The decode's artifact stores none of the weights it shares with the prefill's; the folder
    loads back and generates the same tokens; the decode's artifact alone is a clear error."""
    from eclat.compiler.artifact import SHARED, WEIGHTS, Artifact

    model, lm = gpt2
    lm.save(str(tmp_path / "lm"))
    stored = {}
    for name in ("prefill", "decode"):
        with Artifact(tmp_path / "lm" / f"{name}.eclat") as art:
            stored[name], shared = art.sizes()[WEIGHTS], art.manifest.get(SHARED)
    assert any("c_attn" in name for name in shared) and any("mlp" in name for name in shared)
    assert stored["decode"] < stored["prefill"] / 4
    prompt = [5, 17, 42]
    assert eclat.load(str(tmp_path / "lm")).generate(prompt, 8) == lm.generate(prompt, 8)
    with pytest.raises(ArtifactError, match="saved beside"):
        eclat.load(str(tmp_path / "lm" / "decode.eclat"))


def test_sampling_is_seeded_and_top_k_one_is_greedy(gpt2):
    _, lm = gpt2
    prompt = [7, 8, 9]
    a = lm.generate(prompt, 10, do_sample=True, temperature=1.5, seed=3)
    assert a == lm.generate(prompt, 10, do_sample=True, temperature=1.5, seed=3)
    assert lm.generate(prompt, 10, do_sample=True, top_k=1, seed=5) == lm.generate(prompt, 10)
    assert all(0 <= t < 97 for t in a)


def test_generation_stops_at_the_end_token(gpt2):
    _, lm = gpt2
    prompt = [5, 17]
    first = lm.generate(prompt, 6)
    assert lm.generate(prompt, 6, eos_token_id=first[2]) == first[:first.index(first[2]) + 1]


def test_bad_requests_name_the_problem(gpt2):
    _, lm = gpt2
    with pytest.raises(ValueError, match="exceed the cache's length 24"):
        lm.generate(list(range(20)), 5)
    with pytest.raises(ValueError, match="temperature must be positive"):
        lm.generate([1], 2, do_sample=True, temperature=0)
    with pytest.raises(ValueError, match="a prompt of 0 tokens"):
        lm.logits([])
    with pytest.raises(ValueError, match="chunk must be"):
        eclat.compile_lm(_model("gpt2"), max_len=8, chunk=9)
    with pytest.raises(ValueError, match=r"one prompt .* given shape \[2, 2\]"):  # not read as one
        lm.generate([[5, 6], [7, 8]], 3)
    with pytest.raises(ValueError, match="token ids must be integers, given float64"):  # not truncated
        lm.generate([5.7, 6.2], 3)
    assert lm.generate(np.array([[5, 6]]), 2) == lm.generate([5, 6], 2)  # a batch of one is a prompt


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2", "phi3", "qwen3", "mixtral"])
def test_greedy_tokens_match_transformers_for_each_architecture(arch):
    model = _model(arch)
    lm = eclat.compile_lm(model, max_len=MAX_LEN, chunk=CHUNK, autotune="none", quiet=True)
    for prompt in ([5, 17, 42], list(range(3, 13))):
        new = MAX_LEN - len(prompt)
        assert lm.generate(prompt, new) == _reference(model, prompt, new)
    np.testing.assert_equal(lm.logits([5, 17, 42]).shape, (97,))


def test_the_cli_compiles_saves_and_generates(tmp_path, capsys):
    from eclat.cli import main

    factory = tmp_path / "lm.py"
    factory.write_text("import torch, transformers\n"
                       "def make():\n"
                       "    torch.manual_seed(0)\n"
                       "    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4,\n"
                       "        n_positions=64, vocab_size=97, bos_token_id=1, eos_token_id=2,\n"
                       "        initializer_range=0.3)\n"
                       "    return transformers.GPT2LMHeadModel(config).eval()\n")
    out = tmp_path / "lm"
    assert main(["compile", f"{factory}:make", "--lm", "--max-len", "16", "--chunk", "4",
                 "--autotune", "none", "--quiet", "-o", str(out)]) == 0
    lm = eclat.load(str(out))
    assert isinstance(lm, eclat.CausalLM) and (lm.max_len, lm.chunk) == (16, 4)
    want = lm.generate([5, 6, 7], 6)
    meta = json.loads((out / "lm.json").read_text())
    for edit in ({"max_len": 160}, {"chunk": 8}):  # an lm.json that disagrees with its programs
        (out / "lm.json").write_text(json.dumps({**meta, **edit}))
        with pytest.raises(ArtifactError, match="disagrees with its programs"):
            eclat.load(str(out))
    (out / "lm.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["generate", str(out), "--tokens", "5,6,7", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, want))
    assert main(["generate", str(out), "--tokens", "5,x"]) == 1
    assert "comma-separated integers" in capsys.readouterr().err


def test_a_second_compile_loads_the_kept_model_and_checks_it(tmp_path, monkeypatch):
    from eclat import generate

    model = _model("gpt2")
    options = dict(max_len=16, chunk=4, autotune="fast", quiet=True, cache_dir=str(tmp_path))
    first = eclat.compile_lm(model, **options)
    kept = list((tmp_path / "lms").iterdir())
    assert len(kept) == 1 and (kept[0] / "lm.json").is_file()
    assert not (tmp_path / "programs").exists()  # the programs are kept once, in the model's folder
    monkeypatch.setattr(generate, "_compile_programs", lambda *a: pytest.fail("compiled again"))
    second = eclat.compile_lm(model, **options)
    assert second.generate([5, 6, 7], 8) == first.generate([5, 6, 7], 8) == _reference(model, [5, 6, 7], 8)
    with torch.no_grad():  # other weights: another entry, compiled afresh
        model.lm_head.weight.mul_(2)
    with pytest.raises(pytest.fail.Exception, match="compiled again"):
        eclat.compile_lm(model, **options)


def test_a_decoder_transformers_cannot_export_is_a_clear_error(monkeypatch):
    """transformers' cached export raising (OPT's one-token step trips a data-dependent guard in
    torch.export) reaches the user as an ExportError naming the model and the step's length."""
    from transformers.integrations import executorch

    def refuse(self, *args, **kwargs):
        raise RuntimeError("Could not guard on data-dependent expression u2 > 1")

    monkeypatch.setattr(executorch.TorchExportableModuleForDecoderOnlyLM, "export", refuse)
    with pytest.raises(eclat.ExportError, match=r"GPT2LMHeadModel \(4 tokens\).*data-dependent"):
        eclat.compile_lm(_model("gpt2"), max_len=MAX_LEN, chunk=CHUNK, autotune="none", quiet=True)
