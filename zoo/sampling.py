"""Sampling text from a zoo model with a KV cache: `generate(model, prompts, ...)`. The command line
over it, `python -m zoo.tools.generate model.path=<hf dir> prompt="..."` (or `checkpoint.dir=<train.py
checkpoint>`), is zoo/tools/generate.py; this module never imports it.

How a call runs:

- Prompts (token lists, or strings with a tokenizer) are right-padded into one batch: row b's tokens
  sit at positions 0..n_b-1, padding after them, so causality keeps padding out of every real
  token's result and each prompt gets what it would get alone (up to float rounding).
- The shapes are bucketed (batch and prompt length to powers of two, the cache to a power of two
  holding the longest prompt plus `max_new_tokens`, all within the model's positions), and each
  bucket is compiled once per process: one program that runs the prompts (`CausalLM.prefill`), then
  a `lax.while_loop` of `CausalLM.decode_step`s, sampling on the device, until every row has met a
  stop token or `max_new_tokens` is reached. Sampling settings and `max_new_tokens` are arguments
  of the program, not part of its shape: changing them compiles nothing.
- The cache (zoo.nn.cache) keeps keys and values per layer (a ring of `window` slots on sliding
  layers), or MLA's compressed latent and rope key, and is updated in place. The layer stacks scan
  their params and caches; on CPU the token loop instead runs the layers unrolled over weights
  sliced out of the stacks once per call (`zoo.backend`'s `decode_unstacks_layers`), and programs of models from
  20M parameters compile with LLVM's optimisations (`decode_compile_options`):
  the two backend choices of decoding. Greedy decoding (temperature 0) skips the sampling path (a `lax.cond`).
- MoE layers run the dropless `ragged` kernel whatever `moe.impl` the model was built with
  (`dropless`): a capacity buffer would drop tokens depending on what else is in the batch.
- Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, then the `top_k` most
  likely tokens (0: all), then the smallest set of those whose probability reaches `top_p` (1: all),
  renormalised and sampled. Row i draws from `fold_in(fold_in(key(seed), i), step)`.

A stop token ends its row: it is the last token of that row's result (`Completion.stopped`).
"""

import dataclasses
import functools
import math
import time
from typing import Optional, Sequence, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

from zoo import backend, lora
from zoo.model import CausalLM, abstract
from zoo.ranges import INT_MAX

MIN_PROMPT_BUCKET = 16


class GenerationError(ValueError):
    """Bad generation input, in one line: `<key>: <what is wrong>; <fix>`."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """One prompt's result: its new tokens (the stop token last, if one ended it) and their text."""

    prompt: list[int]
    tokens: list[int]
    stopped: bool  # ended by a stop token (else by max_new_tokens)
    text: Optional[str] = None  # the new tokens decoded, the stop token left out (with a tokenizer)
    logits: Optional[np.ndarray] = None  # [len(tokens), vocab] float32, with keep_logits


# --- the model as decoding runs it ---------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _treedef(config):
    return jax.tree_util.tree_structure(abstract(config))


def dropless(model: CausalLM) -> CausalLM:
    """The same weights with every MoE layer on the `ragged` kernel (dropless, exact): a capacity
    buffer drops assignments depending on the other tokens of the batch, so a prompt's tokens would
    depend on its neighbours. Models without MoE, or already ragged, come back as they are; LoRA
    adapters (zoo.lora.attach) stay attached."""
    c = model.config
    if c.moe is None or c.moe.impl == "ragged":
        return model

    if lora.has_adapters(model):
        base, adapters, config = lora.detach(model)
        return lora.attach(dropless(base), adapters, config)
    target = c.replace(moe=dataclasses.replace(c.moe, impl="ragged"))
    return jax.tree_util.tree_unflatten(_treedef(target), jax.tree_util.tree_leaves(model))


def sample_tokens(
    logits: Float[Array, "batch vocab"],
    keys: Key[Array, " batch"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
) -> Int[Array, " batch"]:
    """One token per row (see the module docstring for the rule); `keys` has one key per row."""
    logits = logits.astype(jnp.float32)
    # A branch, not a select: greedy decoding skips the sort, the cumulative sum and the random
    # draws over the whole vocabulary that sampling needs, every token.
    return jax.lax.cond(
        temperature > 0,
        lambda: _sample(logits, keys, temperature, top_k, top_p),
        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
    )


def _sample(logits, keys, temperature, top_k, top_p):
    scaled = logits / temperature
    order = jnp.argsort(-scaled, axis=-1, stable=True)  # most likely first; ties keep the lower id first
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(logits.shape[-1])
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p  # the most likely token always stays
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, ranked, -jnp.inf))
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _program(
    params,
    tokens: Int[Array, "batch seq"],
    lengths: Int[Array, " batch"],
    active: Bool[Array, " batch"],
    max_new_tokens: Int[Array, ""],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
    is_stop: Bool[Array, " vocab"],
    key: PRNGKeyArray,
    *,
    static,
    max_len: int,
    pad_id: int,
    keep_logits: bool,
    unstack: bool = False,
):
    """Prefill, then decode until every active row stopped or max_new_tokens: ([batch, max_len]
    new tokens, the number of steps run, and with `keep_logits` the [batch, max_len, vocab] logits
    each token was drawn from)."""
    model = eqx.combine(params, static)
    batch = tokens.shape[0]
    row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))

    def pick(logits, step):
        keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys)
        return sample_tokens(logits, keys, temperature, top_k, top_p)

    logits, cache = model.prefill(tokens, lengths, max_len)
    layers = [stack.unstack() for stack in model.stacks] if unstack else None  # once, outside the token loop
    first = pick(logits, 0)
    out = jnp.full((batch, max_len), pad_id, jnp.int32).at[:, 0].set(first)
    seen = jnp.zeros((batch, max_len if keep_logits else 0, logits.shape[-1]), jnp.float32)

    def record(seen, logits, step):
        return jax.lax.dynamic_update_index_in_dim(seen, logits, step, axis=1) if keep_logits else seen

    def running(state):
        step, _, _, _, _, done = state
        return (step < max_new_tokens) & ~done.all()

    def step_once(state):
        step, token, cache, out, seen, done = state
        logits, cache = model.decode_step(token, cache, layers)
        token = jnp.where(done, pad_id, pick(logits, step))
        out = jax.lax.dynamic_update_index_in_dim(out, token, step, axis=1)
        return step + 1, token, cache, out, record(seen, logits, step), done | is_stop[token]

    state = (jnp.int32(1), first, cache, out, record(seen, logits, 0), ~active | is_stop[first])
    steps, _, _, out, seen, _ = jax.lax.while_loop(running, step_once, state)
    return out, steps, seen


# Compiled programs of this process, by (model structure, weight shapes, batch, prompt length, cache length).
_PROGRAMS: dict = {}


def compiled_buckets() -> list[tuple[int, int, int]]:
    """(batch, prompt length, cache length) of every program compiled so far in this process."""
    return [k[-3:] for k in _PROGRAMS]


def decode_compile_options(
    platform: str, params: Union[int, float], cpu_fast_compile: Union[bool, str] = "auto"
) -> Optional[dict]:
    """The compile options of a sampling program: the one place decoding's backend-specific choices
    live. On CPU, `cpu_fast_compile` True compiles with LLVM's optimisations off, False with XLA's
    default level, "auto" off below `zoo.backend`'s `decode_llvm_from_params` and on from there;
    elsewhere XLA's defaults (None)."""
    if cpu_fast_compile not in (True, False, "auto"):
        raise GenerationError(f"cpu_fast_compile: got {cpu_fast_compile!r}; give true, false or auto")
    threshold = backend.choices(platform).decode_llvm_from_params
    if threshold is None:
        return None
    fast = params < threshold if cpu_fast_compile == "auto" else cpu_fast_compile
    return dict(backend.LLVM_OFF) if fast else None


def _compiled(
    model: CausalLM, batch: int, seq: int, max_len: int, keep_logits: bool, cpu_fast_compile, on_compile=None
):
    params, static = eqx.partition(model, eqx.is_array)
    leaves = jax.tree_util.tree_leaves(params)
    options = decode_compile_options(jax.default_backend(), sum(x.size for x in leaves), cpu_fast_compile)
    fast = options is not None
    unstack = backend.choices().decode_unstacks_layers
    key = (
        jax.tree_util.tree_structure(model),
        tuple((x.shape, str(x.dtype)) for x in leaves),
        keep_logits,
        fast,
        unstack,
        batch,
        seq,
        max_len,
    )
    if key not in _PROGRAMS:
        start = time.perf_counter()
        pad_id = model.config.pad_token_id or 0
        fn = jax.jit(
            functools.partial(
                _program, static=static, max_len=max_len, pad_id=pad_id, keep_logits=keep_logits, unstack=unstack
            )
        )
        i32, f32 = jnp.int32, jnp.float32
        shapes = (
            jax.ShapeDtypeStruct((batch, seq), i32),
            jax.ShapeDtypeStruct((batch,), i32),
            jax.ShapeDtypeStruct((batch,), bool),
            jax.ShapeDtypeStruct((), i32),
            jax.ShapeDtypeStruct((), f32),
            jax.ShapeDtypeStruct((), i32),
            jax.ShapeDtypeStruct((), f32),
            jax.ShapeDtypeStruct((model.config.vocab_size,), bool),
            jax.eval_shape(lambda: jax.random.key(0)),
        )
        _PROGRAMS[key] = fn.lower(params, *shapes).compile(options)
        if on_compile is not None:
            on_compile(batch, seq, max_len, time.perf_counter() - start)
    return _PROGRAMS[key], params


# --- shapes and checks ---------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def buckets(
    n_prompts: int, longest: int, max_new_tokens: int, positions: int, max_len: Optional[int] = None
) -> tuple[int, int, int]:
    """(batch, prompt length, cache length) of the program a request runs in: powers of two (the
    prompt at least MIN_PROMPT_BUCKET), never past the model's `positions` (or `max_len`)."""
    limit = positions if max_len is None else min(max_len, positions)
    seq = min(_pow2(max(longest, MIN_PROMPT_BUCKET)), limit)
    cache = min(max(_pow2(longest + max_new_tokens), seq), limit)
    return _pow2(n_prompts), seq, cache


def check_request(
    config,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    stop_tokens: Sequence[int],
    max_len: Optional[int] = None,
    seed: int = 0,
) -> None:
    """Every bad input of a request as one GenerationError naming its key, before anything compiles."""
    vocab, positions = config.vocab_size, config.max_position_embeddings
    if not prompts:
        raise GenerationError('prompt: no prompt given; give at least one, e.g. prompt="Once upon a time"')
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise GenerationError(
            f"max_new_tokens: must be a whole number >= 1, got {max_new_tokens!r}; e.g. max_new_tokens=32"
        )
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise GenerationError(
            f"temperature: must be a finite number >= 0 (0 is greedy), got {temperature!r}; e.g. temperature=0.8"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 0 <= top_k <= INT_MAX:
        raise GenerationError(
            f"top_k: must be a whole number >= 0 and at most {INT_MAX} (0 keeps every token), got {top_k!r}; e.g. "
            "top_k=50"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise GenerationError(f"seed: must be a whole number in [0, 4294967296), got {seed!r}; e.g. seed=0")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise GenerationError(f"top_p: must be in (0, 1] (1 keeps every token), got {top_p!r}; e.g. top_p=0.9")
    bad_stop = [t for t in stop_tokens if not 0 <= t < vocab]
    if bad_stop:
        raise GenerationError(
            f"stop_tokens: id {bad_stop[0]} is outside the model's vocabulary 0..{vocab - 1}; give ids in that range"
        )
    limit, limit_key = positions, "the model's max_position_embeddings"
    if max_len is not None:
        if max_len < 2:
            raise GenerationError(
                f"max_len: must be >= 2 (a prompt token and a new one), got {max_len}; or leave it unset"
            )
        if max_len < positions:
            limit, limit_key = max_len, "max_len"
    for i, p in enumerate(prompts):
        which = f"prompt {i}" if len(prompts) > 1 else "the prompt"
        if len(p) == 0:
            raise GenerationError(f"prompt: {which} is empty (no tokens); give at least one token of text")
        outside = [t for t in p if not 0 <= t < vocab]
        if outside:
            raise GenerationError(
                f"prompt: {which} has token id {outside[0]} outside the model's vocabulary 0..{vocab - 1}; give ids "
                "in that range"
            )
        if len(p) >= limit:
            raise GenerationError(
                f"prompt: {which} has {len(p)} tokens but {limit_key} allows {limit} positions, prompt and new tokens "
                "together; "
                f"shorten it to at most {limit - 1} tokens"
            )
        if len(p) + max_new_tokens > limit:
            raise GenerationError(
                f"max_new_tokens: {max_new_tokens} new tokens after {which}'s {len(p)} tokens pass the {limit} "
                f"positions of {limit_key}; "
                f"use max_new_tokens<={limit - len(p)} or a shorter prompt"
            )


# --- the library function ------------------------------------------------------------------------


def encode_prompts(prompts, tokenizer=None) -> list[list[int]]:
    """Prompts as token lists: a string, a list of strings (needs `tokenizer`), or token lists."""
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (int, np.integer))
    ):
        prompts = [prompts]
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise GenerationError("prompt: text prompts need a tokenizer; pass tokenizer=, or give token id lists")
            out.append([int(t) for t in tokenizer.encode(p)])
        else:
            out.append([int(t) for t in p])
    return out


def generate(
    model: CausalLM,
    prompts: Union[str, Sequence[str], Sequence[Sequence[int]]],
    max_new_tokens: int = 32,
    *,
    tokenizer=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_tokens: Optional[Sequence[int]] = None,
    seed: int = 0,
    max_len: Optional[int] = None,
    keep_logits: bool = False,
    cpu_fast_compile: Union[bool, str] = "auto",
    on_compile=None,
) -> list[Completion]:
    """Continue each prompt by up to `max_new_tokens` tokens (see the module docstring).

    `prompts`: a string, strings (encoded by `tokenizer`, a zoo.data tokenizer), or token id lists.
    `stop_tokens`: ids that end a row (default: the tokenizer's `eos_id`, if any). `max_len` caps the
    cache's positions (default: the model's `max_position_embeddings`). `keep_logits`: each
    Completion also holds the float32 logits every new token was drawn from (`[new tokens, vocab]`).
    `cpu_fast_compile`: on CPU, compile with LLVM's optimisations off (True), on (False), or off only
    below 20M parameters ("auto"; `decode_compile_options`, `zoo.backend`). `on_compile(batch, seq, cache,
    seconds)` is called after a shape bucket compiled. Bad input raises GenerationError (one line).
    """
    tokens = encode_prompts(prompts, tokenizer)
    if stop_tokens is None:
        stop_tokens = [] if tokenizer is None or tokenizer.eos_id is None else [tokenizer.eos_id]
    stop_tokens = [int(t) for t in stop_tokens]
    c = model.config
    check_request(c, tokens, max_new_tokens, temperature, top_k, top_p, stop_tokens, max_len, seed)
    batch, seq, cache_len = buckets(
        len(tokens), max(map(len, tokens)), max_new_tokens, c.max_position_embeddings, max_len
    )
    program, params = _compiled(dropless(model), batch, seq, cache_len, keep_logits, cpu_fast_compile, on_compile)

    pad_id = c.pad_token_id or 0
    padded = np.full((batch, seq), pad_id, np.int32)
    lengths = np.ones((batch,), np.int32)  # rows past the prompts: one pad token, never reported
    for i, p in enumerate(tokens):
        padded[i, : len(p)] = p
        lengths[i] = len(p)
    is_stop = np.zeros((c.vocab_size,), bool)
    is_stop[stop_tokens] = True
    out, steps, seen = program(
        params,
        jnp.asarray(padded),
        jnp.asarray(lengths),
        jnp.asarray(np.arange(batch) < len(tokens)),
        jnp.int32(max_new_tokens),
        jnp.float32(temperature),
        jnp.int32(top_k),
        jnp.float32(top_p),
        jnp.asarray(is_stop),
        jax.random.key(seed),
    )
    out = np.asarray(out)[:, : int(steps)]
    seen = np.asarray(seen)
    results = []
    for i, p in enumerate(tokens):
        row = out[i].tolist()
        end = next((j for j, t in enumerate(row) if is_stop[t]), None)
        new = row if end is None else row[: end + 1]
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(new if end is None else new[:-1])
        logits = seen[i, : len(new)] if keep_logits else None
        results.append(Completion(prompt=p, tokens=new, stopped=end is not None, text=text, logits=logits))
    return results
