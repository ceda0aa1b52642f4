"""Text generation with a compiled causal language model and an eclat-owned KV cache.

    lm = eclat.compile_lm(hf_model, max_len=256)      # a transformers decoder (GPT-2, Llama, ...)
    tokens = lm.generate([15496, 11, 616], max_new_tokens=32)

The model is exported by transformers' own path for cached decoders (its static cache,
`transformers.integrations.executorch`): the forward takes token ids and their positions in the
cache and updates the cache in place. eclat compiles it twice, a prefill program over a chunk of
`chunk` tokens and a decode program over one, whose states (the cache, ir.graph.State) are one set
of arrays: each call returns only the rows it adds, which are written into the cache in place.

Both programs compute the logits of their last row only (transformers' `logits_to_keep`): over a
chunk, the output head is otherwise most of a prefill's work, and only the last token's are
used. A prompt runs through the prefill program chunk by chunk, so its last token must be the
chunk's last row: when the prompt is longer than a chunk, the last chunk is its last `chunk`
tokens (recomputing rows the cache holds already, with the same values); a shorter prompt is
padded with token 0 after its end, then its last token runs again as a decode step, which
rewrites its row and gives its logits. The padding writes cache rows that no real position
reads before a later step overwrites them (attention masks keys past the query's position).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .compiler.model import CompiledModel
from .errors import EclatError, ExportError

LM_JSON, PREFILL, DECODE = "lm.json", "prefill.eclat", "decode.eclat"


class CausalLM:
    """A prefill and a decode program sharing one KV cache (`states`). Not for concurrent use: a
    generation is a sequence of steps over one cache."""

    def __init__(self, prefill: CompiledModel, decode: CompiledModel, max_len: int, chunk: int,
                 agreement: dict[str, Any] | None = None):
        _check_programs(prefill, decode, max_len, chunk)
        self.prefill, self.decode, self.max_len, self.chunk = prefill, decode, max_len, chunk
        # with rounded weights: how its next-token distributions compare with the model's (agreement())
        self.agreement = agreement
        decode.states = prefill.states  # one cache: a step sees the rows the prompt wrote
        self.states = prefill.states
        share = getattr(decode.executable, "share_weights", None)  # one copy of the weights too
        self.shared_bytes = share(prefill.executable) if share is not None else 0

    def save(self, path: str) -> None:
        """Write a folder that `eclat.load` reads back as a CausalLM: the two programs' artifacts
        and lm.json. The weights the programs share are stored once, in the prefill's."""
        os.makedirs(path, exist_ok=True)
        self.prefill.save(os.path.join(path, PREFILL))
        self.decode.save(os.path.join(path, DECODE), beside=self.prefill)
        with open(os.path.join(path, LM_JSON), "w") as f:
            json.dump({"format": "eclat-causal-lm", "max_len": self.max_len, "chunk": self.chunk,
                       **({"agreement": self.agreement} if self.agreement else {})}, f)

    def logits(self, tokens: list[int]) -> np.ndarray:
        """The next-token logits after the prompt `tokens` (a fresh cache: positions from 0)."""
        n, c = len(tokens), self.chunk
        if not 1 <= n <= self.max_len:
            raise ValueError(f"a prompt of {n} tokens: expected 1 to {self.max_len} (the cache's length)")
        calls = []
        for start in range(0, n, c):
            window, positions = tokens[start:start + c], list(range(start, min(start + c, n)))
            if len(window) < c and n >= c:  # the last c tokens, recomputing rows the cache holds
                window, positions = tokens[n - c:], list(range(n - c, n))
            elif len(window) < c:  # a short prompt: padded, then its last token again, as a step
                window, positions = window + [0] * (c - n), list(range(c))
            calls.append((np.array([window], np.int64), np.array(positions, np.int64)))
        last = calls.pop() if n >= c else None
        for args in calls:  # chunks whose logits nobody reads: the cache's updates alone
            self.prefill.update_states(*args)
        if last is None:
            return self.step(tokens[-1], n - 1)
        return np.asarray(self.prefill(*last)[0, -1], np.float32)  # the last row's logits only

    def step(self, token: int, position: int) -> np.ndarray:
        """The next-token logits after `token` at `position`, the cache holding every earlier one."""
        if not 0 <= position < self.max_len:
            raise ValueError(f"position {position} is outside the cache (length {self.max_len})")
        out = self.decode(np.array([[token]], np.int64), np.array([position], np.int64))
        return np.asarray(out[0, -1], np.float32)

    def generate(self, prompt: Any, max_new_tokens: int, *, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, seed: int | None = None,
                 eos_token_id: int | None = None) -> list[int]:
        """The prompt's continuation: greedy (the most likely token each step, as transformers'
        generate(do_sample=False)), or sampled at `temperature` from the `top_k` most likely with a
        numpy generator seeded by `seed`. Stops after max_new_tokens or at eos_token_id."""
        tokens = _token_ids(prompt)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, given {max_new_tokens}")
        if len(tokens) + max_new_tokens > self.max_len:
            raise ValueError(f"{len(tokens)} prompt tokens + {max_new_tokens} new ones exceed the cache's "
                             f"length {self.max_len}: compile with a larger max_len")
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be positive, given {temperature}")
        rng = np.random.default_rng(seed)
        new: list[int] = []
        logits = self.logits(tokens) if max_new_tokens else None
        while len(new) < max_new_tokens:
            token = _sample(logits, rng, temperature, top_k) if do_sample else int(np.argmax(logits))
            new.append(token)
            if token == eos_token_id or len(new) == max_new_tokens:
                break
            logits = self.step(token, len(tokens) + len(new) - 1)
        return new

    def tokens_per_second(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        """(seconds to the first token, decode tokens per second) of one greedy generation."""
        start = time.perf_counter()
        logits = self.logits(prompt)
        first = time.perf_counter() - start
        token = int(np.argmax(logits))
        start = time.perf_counter()
        for k in range(new_tokens):
            token = int(np.argmax(self.step(token, len(prompt) + k)))
        return first, new_tokens / (time.perf_counter() - start)


def _token_ids(prompt: Any) -> list[int]:
    """One prompt's token ids: a sequence of integers, or a [1, n] array (batch 1). A batch of
    several prompts or ids that are not integers is a ValueError, not read as something else."""
    ids = np.asarray(prompt)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"generate takes one prompt (a list of token ids, or shape [1, n]), given shape "
                         f"{list(ids.shape)}")
    if ids.size and ids.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, given {ids.dtype}")
    return [int(t) for t in ids]


def _check_programs(prefill: CompiledModel, decode: CompiledModel, max_len: int, chunk: int) -> None:
    """That the two programs take chunk and one token ids and hold caches of max_len positions (a
    saved folder's lm.json edited, or programs of another compile, fail here, not mid-generation)."""
    for name, program, rows in (("prefill", prefill, chunk), ("decode", decode, 1)):
        ids = tuple(program.inputs[0].shape) if program.inputs else None
        if ids != (1, rows):
            raise ValueError(f"the {name} program takes token ids of shape {list(ids or [])}, "
                             f"not [1, {rows}]")
        lengths = {s.initial.shape[s.axis] for s in program.state_specs if s.axis is not None}
        if lengths and lengths != {max_len}:
            raise ValueError(f"the {name} program's cache holds {sorted(lengths)} positions, not {max_len}")


def load_lm(path: str) -> CausalLM:
    """The CausalLM a folder written by CausalLM.save holds."""
    from .compiler.model import load
    from .errors import ArtifactError

    try:
        with open(os.path.join(path, LM_JSON)) as f:
            meta = json.load(f)
        max_len, chunk = int(meta["max_len"]), int(meta["chunk"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{path}: not a saved language model ({type(e).__name__}: {e})") from None
    prefill = load(os.path.join(path, PREFILL))
    decode = load(os.path.join(path, DECODE), beside=prefill)
    try:
        return CausalLM(prefill, decode, max_len, chunk, meta.get("agreement"))
    except ValueError as e:
        raise ArtifactError(f"{path}: its {LM_JSON} disagrees with its programs: {e}") from None


def _sample(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_k: int | None) -> int:
    z = logits.astype(np.float64) / temperature
    if top_k is not None and 0 < top_k < z.size:
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
    p = np.exp(z - z.max())
    return int(rng.choice(z.size, p=p / p.sum()))


def compile_lm(model: Any, max_len: int = 256, chunk: int = 32, target: str = "cpu",
               **options: Any) -> CausalLM:
    """A transformers causal LM (random or trained weights, batch 1) compiled for generation with a
    static KV cache of max_len positions; options as eclat.compile's. With a search (autotune
    "fast" or "full"), the result is kept in the cache folder, and a second compile of the same
    model (config, weights, options, eclat's sources) loads it and checks it against the model's
    own logits, without exporting again."""
    if not 1 <= chunk <= max_len:
        raise ValueError(f"chunk must be 1 to max_len ({max_len}), given {chunk}")
    remember = _cache_folder(model, max_len, chunk, target, options)
    if remember is not None and remember.is_dir():
        lm = _checked(remember, model)
        if lm is not None:
            return lm
    lm = _compile_programs(model, max_len, chunk, target, options)
    if options.get("weights", "fp32") != "fp32":
        lm.agreement = agreement(lm, model)
    if remember is not None:
        _keep(lm, remember)
    return lm


def _compile_programs(model: Any, max_len: int, chunk: int, target: str, options: dict) -> CausalLM:
    """The prefill and decode programs, not in the program cache: compile_lm keeps them itself
    where the program cache would (a search, verified, float32 weights)."""
    import torch
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from .compiler.phases import release_free_memory
    from .compiler.pipeline import compile_model
    from .frontend.lower import sharing_weights

    config = model.generation_config
    saved = (config.use_cache, config.cache_implementation, config.cache_config)
    own = vars(model).get("forward")  # a forward the user set on the instance, kept
    config.use_cache, config.cache_implementation = True, "static"
    config.cache_config = {"batch_size": 1, "max_cache_len": max_len}
    model.forward = functools.partial(model.forward, logits_to_keep=1)  # the last row's only
    try:
        exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_len)
        exported = []  # both before either compile: an export's peak does not stack on a compiled program
        for n in (chunk, 1):
            ids, positions = torch.zeros(1, n, dtype=torch.long), torch.arange(n)
            with torch.no_grad(), warnings.catch_warnings():
                # dynamo notes transformers' output-capturing global: not the user's concern
                warnings.filterwarnings("ignore", message=".*side effects happened.*")
                try:
                    program = exportable.export(input_ids=ids, cache_position=positions)
                except Exception as e:  # torch raises many types; all mean "could not export"
                    raise ExportError(f"transformers' cached export failed for {type(model).__name__} "
                                      f"({n} tokens): {type(e).__name__}: {e}") from e
            exported.append((program, (ids, positions)))
            release_free_memory()
        with sharing_weights():
            programs = [compile_model(program, args, target, program_cache_used=False, **options)
                        for program, args in exported]
    finally:
        config.use_cache, config.cache_implementation, config.cache_config = saved
        if own is None:
            del model.forward  # the class's own forward again
        else:
            model.forward = own
    return CausalLM(programs[0], programs[1], max_len, chunk)


AGREEMENT_POSITIONS = 64  # positions of a fixed random sequence compared by agreement()


def agreement(lm: CausalLM, model: Any, positions: int = AGREEMENT_POSITIONS) -> dict[str, Any]:
    """How lm's next-token distributions compare with the model's own (torch, float32): see
    next_token_agreement. Rounded weights (`weights=`) move these; a faithful compile gives about 0
    and 1."""
    return next_token_agreement(model, min(positions, lm.max_len), lambda tokens: np.stack(
        [lm.logits(tokens[:1])] + [lm.step(t, k) for k, t in enumerate(tokens[1:], 1)]))


def next_token_agreement(model: Any, positions: int, logits_of: Any) -> dict[str, Any]:
    """At each position of a fixed random token sequence, the model's next-token distribution
    against a runner's (logits_of(tokens): its logits at every position): the mean KL divergence
    KL(model || runner) in nats and the share of positions where both rank the same token first."""
    import torch

    tokens = np.random.default_rng(0).integers(1, model.config.vocab_size, positions).tolist()
    with torch.no_grad():
        want = model(torch.tensor([tokens]), use_cache=False).logits[0].double().numpy()
    got = np.asarray(logits_of(tokens), np.float64)
    log_p, log_q = (z - np.logaddexp.reduce(z, axis=-1, keepdims=True) for z in (want, got))
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    return {"positions": positions, "mean_kl": round(float(kl.mean()), 6),
            "top1": round(float(np.mean(want.argmax(-1) == got.argmax(-1))), 4)}


# --- the cache of compiled language models -------------------------------------------------------

LM_CACHE_BYTES = 4 << 30  # compiled models kept (each holds its weights twice), least recently used out


def _cache_folder(model: Any, max_len: int, chunk: int, target: str, options: dict) -> Path | None:
    """Where this model compiled with these options is kept; None without a search (as for
    eclat.compile's program cache) or without verification."""
    if options.get("autotune", "fast") == "none" or options.get("verify", True) is False:
        return None
    if options.get("weights", "fp32") != "fp32":  # _checked compares with the model's own logits
        return None
    import torch

    from .autotune.cache import cache_dir, source_version

    chosen = {key: options.get(key) for key in ("autotune", "threads", "k")}
    h = hashlib.sha256(f"{type(model).__name__}|{model.config.to_json_string()}|{max_len}|{chunk}|{target}|"
                       f"{sorted(chosen.items())}|{source_version()}".encode())
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    return cache_dir(options.get("cache_dir")) / "lms" / h.hexdigest()[:32]


def _checked(folder: Path, model: Any) -> CausalLM | None:
    """The model kept in folder, if it loads and its prefill and decode logits agree with the
    model's own on a few tokens; else None (then the caller compiles afresh)."""
    import torch

    try:
        lm = load_lm(str(folder))
        tokens = [(7 * k + 3) % model.config.vocab_size for k in range(min(lm.chunk, 6) + 1)]
        with torch.no_grad():
            want = model(torch.tensor([tokens])).logits[0].float().numpy()
        got = [lm.logits(tokens[:-1]), lm.step(tokens[-1], len(tokens) - 1)]
        scale = max(1.0, float(np.abs(want).max()))
        if not all(np.allclose(g, w, rtol=1e-3, atol=1e-4 * scale) for g, w in zip(got, want[-2:])):
            return None
        os.utime(folder)  # used now: the last to be trimmed
        return lm
    except Exception:  # damaged, foreign, or built by another eclat: compile afresh
        return None


def _keep(lm: CausalLM, folder: Path) -> None:
    """Save lm as folder (atomically: a reader never sees half of one); a cache that cannot be
    written is only slower."""
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        lm.save(str(tmp))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        _trim(folder.parent)
    except (OSError, EclatError):
        shutil.rmtree(tmp, ignore_errors=True)


def _trim(root: Path, limit: int = LM_CACHE_BYTES) -> None:
    kept = []
    for d in root.iterdir():
        try:
            kept.append((d.stat().st_mtime, sum(f.stat().st_size for f in d.iterdir()), d))
        except OSError:  # another process trimmed it
            continue
    total = sum(size for _, size, _ in kept)
    for _, size, d in sorted(kept, key=lambda t: t[0]):
        if total <= limit:
            break
        shutil.rmtree(d, ignore_errors=True)
        total -= size
