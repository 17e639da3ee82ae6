"""Scanned layer stacks, the causal LM and its loss.

One core serves every family: its layers are decoder blocks (`zoo.nn.decoder.DecoderBlock`, built
for a config by `make_block`; both importable from here too). What differs between layers of one
model (a sliding window, the rope of sliding layers, a MoE in place of the MLP) is a `LayerSpec`;
layers of equal spec have equal structure.

Layers are stored stacked and run under `lax.scan`, so compile time does not grow with depth. A
model's layers are cut into as few stacks as possible (`plan_stacks`): runs of one spec scan one
block (Llama: one stack; DeepSeek-V3: the dense prefix and the MoE layers), and a repeating pattern
scans its period (Gemma 3's five sliding layers and one global layer, GPT-OSS's alternation) with
one block per position, each block checkpointed on its own so remat/offload policies act per layer.
"""

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from zoo import backend
from zoo import sharding as zs
from zoo import tags
from zoo.config import LayerSpec, ModelConfig
from zoo.lora import merge_block
from zoo.loss import vocab_parallel_lookup
from zoo.nn import MoEAux, RMSNorm
from zoo.nn._init import normal
from zoo.nn.decoder import DecoderBlock, LayerCache, block_classes, make_block  # noqa: F401 - public here

# How a stack's scan body runs one layer: `(h, block_params, j) -> ((h, aux), kept tags)`, where j is the
# layer's position in the stack's period (static) and `block_params` its array leaves.
LayerFn = Callable[..., tuple]
# Wraps that function, e.g. in `jax.checkpoint` with a remat/offload policy, or with a move of
# host-resident weights to the device (`layer_wrapper` below builds the trainer's), given whether the
# stack's scan runs more than one trip (`looped`). The forward values are unchanged; only what the
# program keeps, recomputes or moves is.
LayerWrapper = Callable[[LayerFn, bool], LayerFn]
# --- how layers are cut into scanned stacks ----------------------------------------------------


def _runs(specs: Sequence[LayerSpec], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Maximal runs of one spec in [lo, hi), as (first layer, period 1, repeats)."""
    out, i = [], lo
    while i < hi:
        j = i
        while j < hi and specs[j] == specs[i]:
            j += 1
        out.append((i, 1, j - i))
        i = j
    return out


def plan_stacks(specs: Sequence[LayerSpec], max_period: int = 8) -> list[tuple[int, int, int]]:
    """Cut the layers into the fewest scanned stacks: `(first layer, period, repeats)` each, covering
    the layers in order. A stack repeats a period of `period` layers `repeats` times; a repeating
    pattern with a prefix or a tail (DeepSeek-V3's dense layers, Gemma 3-27B's 62 = 10 x 6 + 2 layers)
    gives a few stacks, so the count does not grow with depth. Ties go to the shorter period, then the
    earlier start. Every start of every period is judged at once (numpy), so the time is linear in
    the layers: a config of a million layers is planned, and its size judged, in about a second."""
    n = len(specs)
    index = {s: i for i, s in enumerate(dict.fromkeys(specs))}
    ids = np.array([index[s] for s in specs], dtype=np.int64)
    # boundaries[k]: layers i < k that start a new run of one spec (i > 0 and spec i != spec i - 1)
    boundaries = np.concatenate([[0, 0], np.cumsum(ids[1:] != ids[:-1])])

    def runs_in(lo, hi):  # how many runs of one spec cover layers [lo, hi) (elementwise)
        return np.where(hi > lo, 1 + boundaries[hi] - boundaries[np.minimum(lo + 1, n)], 0)

    every_run = int(runs_in(np.array(0), np.array(n)))
    best, best_key = None, (every_run, every_run)  # one stack per run
    for p in range(2, min(max_period, n) + 1):
        starts = np.arange(n - p + 1)
        # chain[a]: how many layers from a on each equal the layer p after them, so the period at a
        # repeats 1 + chain[a] // p times
        differs = np.flatnonzero(ids[: n - p] != ids[p:])
        next_differs = np.append(differs, n - p)[np.searchsorted(differs, starts)]
        repeats = 1 + (next_differs - starts) // p
        count = runs_in(np.zeros_like(starts), starts) + 1 + runs_in(starts + repeats * p, np.full_like(starts, n))
        key = np.where(repeats >= 2, count * (n + max_period + 1) + count - 1 + p, np.iinfo(np.int64).max)
        a = int(np.argmin(key))  # the first of the best: the earlier start
        if repeats[a] >= 2 and (int(count[a]), int(count[a]) - 1 + p) < best_key:
            best, best_key = (a, p, int(repeats[a])), (int(count[a]), int(count[a]) - 1 + p)
    if best is None:
        return _runs(specs, 0, n)
    a, p, r = best
    return _runs(specs, 0, a) + [best] + _runs(specs, a + r * p, n)


def _stack_names(config: ModelConfig, plan: Sequence[tuple[int, int, int]]) -> list[str]:
    """`dense_layers`, `moe_layers` or `layers` (mixed), with the layer range where that repeats."""
    kinds = []
    for first, period, _ in plan:
        moe = {config.layer_spec(first + j).moe for j in range(period)}
        kinds.append("moe_layers" if moe == {True} else "dense_layers" if moe == {False} else "layers")
    names = []
    for (first, period, repeats), kind in zip(plan, kinds):
        names.append(kind if kinds.count(kind) == 1 else f"{kind}_{first}_{first + period * repeats - 1}")
    return names


def stack_layout(config: ModelConfig) -> list[tuple[str, int, int, int]]:
    """`(name, first layer, period, repeats)` of each stack a model of `config` scans, in order."""
    plan = plan_stacks([config.layer_spec(i) for i in range(config.num_layers)])
    return [(name, *segment) for name, segment in zip(_stack_names(config, plan), plan)]


class Stack(eqx.Module):
    """Layers `first .. first + period * repeats - 1`: `layers[j]` holds the blocks at position j of
    the repeating period, every array leaf with a leading `repeats` axis. Layer `first + r * period + j`
    is `layers[j]` at index r."""

    layers: tuple[DecoderBlock, ...]
    name: str = eqx.field(static=True)
    first: int = eqx.field(static=True)
    repeats: int = eqx.field(static=True)
    compute_dtype: str = eqx.field(static=True)

    def __init__(self, config: ModelConfig, name: str, first: int, period: int, repeats: int, *, key: PRNGKeyArray):
        keys = jax.random.split(key, period)
        self.layers = tuple(
            eqx.filter_vmap(lambda k, j=j: make_block(config, config.layer_spec(first + j), k))(
                jax.random.split(keys[j], repeats)
            )
            for j in range(period)
        )
        self.name = name
        self.first = first
        self.repeats = repeats
        self.compute_dtype = config.compute_dtype

    def __check_init__(self):
        if self.repeats < 1 or not self.layers:
            raise ValueError(f"a Stack needs at least one layer, got {self.repeats} x {len(self.layers)}")

    @property
    def period(self) -> int:
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        return self.period * self.repeats

    def layer_index(self, repeat: int, position: int) -> int:
        return self.first + repeat * self.period + position

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        positions: Int[Array, "*batch seq"],
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
        *,
        wrap_layer: Optional[LayerWrapper] = None,
    ) -> tuple[Float[Array, "batch seq embed"], tuple[Optional[MoEAux], ...]]:
        """The stack's layers in order under one `lax.scan`; per period position, the MoE statistics of
        its layers (None for dense blocks). `wrap_layer` wraps each layer's call (see `LayerWrapper`)."""
        params, static = eqx.partition(self.layers, eqx.is_array)

        def run_block(h, block_params, j):
            with tags.layer_scope() as kept:  # the tags a zoo.capture asks for (none otherwise)
                out = self._block(block_params, static, j)(h, positions, segment_ids)
            return out, kept

        if wrap_layer is not None:
            run_block = wrap_layer(run_block, self.repeats > 1)

        def body(h, period_params):
            auxes, kept = [], []
            for j in range(self.period):
                (h, aux), found = run_block(zs.constrain(h, zs.ACTIVATION_AXES), period_params[j], j)
                auxes.append(aux)
                kept.append(found)
            return zs.constrain(h, zs.ACTIVATION_AXES), (tuple(auxes), tuple(kept))

        x, (auxes, kept) = jax.lax.scan(body, x, params)
        for j, found in enumerate(kept):
            for name, values in found.items():
                tags.record(name, tuple(self.layer_index(r, j) for r in range(self.repeats)), values)
        return x, auxes

    def _block(self, block_params, static, j: int) -> DecoderBlock:
        block_params = zs.cast_for_compute(
            block_params, self.compute_dtype, gather_context=True
        )  # before FSDP gathers them
        # LoRA adapters (zoo.lora) are folded into this one layer's weights here, inside the scan.
        return merge_block(eqx.combine(block_params, static[j]))

    def prefill(
        self, x: Float[Array, "batch seq embed"], lengths: Int[Array, " batch"], max_len: int
    ) -> tuple[Float[Array, "batch seq embed"], tuple[LayerCache, ...]]:
        """The stack over prompts; per period position, its layers' caches stacked (leading repeats axis)."""
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, period_params):
            caches = []
            for j in range(self.period):
                h, cache = self._block(period_params[j], static, j).prefill(h, lengths, max_len)
                caches.append(cache)
            return h, tuple(caches)

        return jax.lax.scan(body, x, params)

    def decode(
        self, x: Float[Array, "batch 1 embed"], positions: Int[Array, " batch"], caches: tuple[LayerCache, ...]
    ) -> tuple[Float[Array, "batch 1 embed"], tuple[LayerCache, ...]]:
        """One token per row through the stack, scanning layers; the caches ride in the scan's carry,
        each layer's slice updated in place. (As a scan input and output, every token would build a
        fresh buffer for the whole cache and copy it in: a copy per token that grows with context.)"""
        params, static = eqx.partition(self.layers, eqx.is_array)

        def at(tree, r):
            return jax.tree_util.tree_map(lambda c: jax.lax.dynamic_index_in_dim(c, r, 0, keepdims=False), tree)

        def body(carry, layer):
            h, caches = carry
            period_params, r = layer
            caches = list(caches)
            for j in range(self.period):
                h, cache = self._block(period_params[j], static, j).decode(h, positions, at(caches[j], r))
                caches[j] = jax.tree_util.tree_map(
                    lambda c, new: jax.lax.dynamic_update_index_in_dim(c, new, r, 0), caches[j], cache
                )
            return (h, tuple(caches)), None

        (x, caches), _ = jax.lax.scan(body, (x, tuple(caches)), (params, jnp.arange(self.repeats, dtype=jnp.int32)))
        return x, caches

    def cut(self, start: int, stop: int) -> list["Stack"]:
        """Layers `start .. stop - 1` (model layer numbers, within this stack) as stacks of their own,
        in order, for scans of their own (a remat/offload policy per layer range, `run_layers`). The
        array leaves are sliced along the layer (repeats) axis, so gradients flow back into this
        stack's. A cut inside the repeating period gives a stack of the period's remaining positions,
        one repeat long; whole repeats in between stay one stack. The whole stack is `[self]`; a piece
        is named `<stack>[<first>-<last>]`. Works on an abstract model too (shapes only)."""
        if not self.first <= start < stop <= self.first + self.num_layers:
            raise ValueError(
                f"{self.name}: cannot cut layers {start}-{stop - 1} out of layers "
                f"{self.first}-{self.first + self.num_layers - 1}"
            )
        if (start, stop) == (self.first, self.first + self.num_layers):
            return [self]
        p, out = self.period, []
        i, hi = start - self.first, stop - self.first  # positions in this stack
        while i < hi:
            r, j = divmod(i, p)
            if j or hi - i < p:  # part of one period: positions j .. k - 1 of repeat r
                k = min(p, j + hi - i)
                out.append(self._piece(j, k, r, r + 1))
                i += k - j
            else:  # whole periods
                n = (hi - i) // p
                out.append(self._piece(0, p, r, r + n))
                i += n * p
        return out

    def _piece(self, j0: int, j1: int, r0: int, r1: int) -> "Stack":
        """Positions j0 .. j1 - 1 of repeats r0 .. r1 - 1 as a Stack (its period is j1 - j0)."""

        def rows(x):
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct((r1 - r0, *x.shape[1:]), x.dtype)
            return x[r0:r1] if eqx.is_array(x) else x

        piece = object.__new__(Stack)
        first, last = self.layer_index(r0, j0), self.layer_index(r1 - 1, j1 - 1)
        fields = dict(
            layers=tuple(jax.tree_util.tree_map(rows, b) for b in self.layers[j0:j1]),
            name=f"{self.name}[{first}-{last}]",
            first=first,
            repeats=r1 - r0,
            compute_dtype=self.compute_dtype,
        )
        for k, v in fields.items():
            object.__setattr__(piece, k, v)
        return piece

    def unstack(self) -> list:
        """Each layer period's parameters sliced out of the stack, for `decode_layers`."""
        params = eqx.partition(self.layers, eqx.is_array)[0]
        return [jax.tree_util.tree_map(lambda p: p[r], params) for r in range(self.repeats)]

    def decode_layers(
        self,
        x: Float[Array, "batch 1 embed"],
        positions: Int[Array, " batch"],
        caches: tuple[LayerCache, ...],
        layers: Sequence,
    ) -> tuple[Float[Array, "batch 1 embed"], tuple[LayerCache, ...]]:
        """`decode` with the layers unrolled over parameters `unstack` sliced out once (before a decode
        loop): a scan slices every layer's weights out of the stack, a copy of all of them per token."""
        static = eqx.partition(self.layers, eqx.is_array)[1]
        caches = list(caches)
        for r, period_params in enumerate(layers):
            # A traced layer index, as the scan has: with a constant one XLA copied both the keys' and
            # the values' whole caches in and out of the step (one of them still is; see the tests).
            i = jax.lax.optimization_barrier(jnp.int32(r))
            for j in range(self.period):
                layer_cache = jax.tree_util.tree_map(
                    lambda c: jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False), caches[j]
                )
                x, cache = self._block(period_params[j], static, j).decode(x, positions, layer_cache)
                caches[j] = jax.tree_util.tree_map(
                    lambda c, new: jax.lax.dynamic_update_index_in_dim(c, new, i, 0), caches[j], cache
                )
        return x, tuple(caches)


class DecodeCache(eqx.Module):
    """What decoding carries from step to step: per row, how many positions it holds (the position
    of the next token), and per stack and period position its layers' caches (zoo.nn.cache)."""

    lengths: Int[Array, " batch"]
    stacks: tuple[tuple[LayerCache, ...], ...]


class CausalLM(eqx.Module):
    """`model(tokens)`: int32 `[batch, seq]` -> float32 logits `[batch, seq, vocab]`."""

    embed: Float[Array, "vocab embed"]
    stacks: tuple[Stack, ...]
    final_norm: RMSNorm
    lm_head: Optional[Float[Array, "embed vocab"]]  # None when tied to the embedding
    config: ModelConfig = eqx.field(static=True)

    # zoo.sharding: the embedding and the output head, both cast to the compute dtype before a gather.
    PARAMS: ClassVar[dict[str, zs.Leaf]] = {
        "embed": zs.compute("vocab", "embed"),
        "lm_head": zs.compute("embed", "vocab"),
    }

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        ke, ks, kh = jax.random.split(key, 3)
        c = config
        self.embed = normal(ke, (c.vocab_size, c.hidden_size), c.hidden_size, c.param_dtype)
        layout = stack_layout(c)
        keys = jax.random.split(ks, len(layout))
        self.stacks = tuple(
            Stack(c, name, first, period, repeats, key=k) for (name, first, period, repeats), k in zip(layout, keys)
        )
        self.final_norm = RMSNorm(
            c.hidden_size, eps=c.rms_norm_eps, weight_offset=c.norm_weight_offset, dtype=c.param_dtype
        )
        self.lm_head = (
            None if c.tie_word_embeddings else normal(kh, (c.hidden_size, c.vocab_size), c.hidden_size, c.param_dtype)
        )
        self.config = config

    def __check_init__(self):
        covered = [s.layer_index(r, j) for s in self.stacks for r in range(s.repeats) for j in range(s.period)]
        if sorted(covered) != list(range(self.config.num_layers)):
            raise ValueError(f"the stacks cover layers {sorted(covered)}, not 0..{self.config.num_layers - 1}")

    def stack(self, name: str) -> Stack:
        for s in self.stacks:
            if s.name == name:
                return s
        raise KeyError(f"no stack {name!r}; the stacks are {', '.join(s.name for s in self.stacks)}")

    def blocks(self) -> list[tuple[int, DecoderBlock]]:
        """(layer index, block with a leading repeats axis) for every position of every stack."""
        return [(s.first + j, b) for s in self.stacks for j, b in enumerate(s.layers)]

    def moe_aux_order(self) -> list[tuple[int, int, np.ndarray]]:
        """For each MoE block position `(stack index, position)`, the rows of `forward_with_aux`'s
        per-MoE-layer statistics that its repeats fill (layers in model order)."""
        return _moe_aux_order(self.config, self.stacks)

    def embed_tokens(self, tokens: Int[Array, "batch seq"]) -> Float[Array, "batch seq embed"]:
        c = self.config
        table = self.embed
        if not c.scale_embeddings:
            table = zs.cast_for_compute(
                table, c.compute_dtype, declared=self.PARAMS["embed"]
            )  # gathered in the compute dtype
        x = vocab_parallel_lookup(table, tokens)
        if x is None:
            # The lookup reads whole rows: give it the table gathered over its embed dim, so each device
            # looks up its own tokens (otherwise the partitioner gathers the batch instead).
            table = zs.constrain(table, ("vocab", None))
            x = jnp.take(table, tokens, axis=0)
        if c.pad_token_id is not None:
            x = jnp.where((tokens == c.pad_token_id)[..., None], jax.lax.stop_gradient(x), x)
        if c.scale_embeddings:
            # Gemma keeps sqrt(hidden) as a buffer in the weights' dtype: in bf16, sqrt(3072) = 55.5.
            x = x * jnp.asarray(math.sqrt(c.hidden_size), self.embed.dtype)
        return x.astype(c.compute_dtype)

    def head_weight(self) -> Float[Array, "embed vocab"]:
        """The output projection `[embed, vocab]` in the compute dtype (the embedding's transpose when tied)."""
        cdt = self.config.compute_dtype
        if self.lm_head is None:
            return zs.cast_for_compute(self.embed, cdt, declared=self.PARAMS["embed"]).T.astype(cdt)
        return zs.cast_for_compute(self.lm_head, cdt, declared=self.PARAMS["lm_head"]).astype(cdt)

    def logits(self, hidden: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq vocab"]:
        c = self.config
        if self.lm_head is None:
            # Contract the embedding's own embed axis: its transpose, in a one-token decode step,
            # became a loop fusion that re-laid the whole [vocab, embed] table out every token.
            table = zs.cast_for_compute(self.embed, c.compute_dtype, declared=self.PARAMS["embed"]).astype(
                c.compute_dtype
            )
            logits = jnp.einsum("BTD,VD->BTV", hidden, table, preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("BTD,DV->BTV", hidden, self.head_weight(), preferred_element_type=jnp.float32)
        if c.final_logit_softcap is not None:
            logits = c.final_logit_softcap * jnp.tanh(logits / c.final_logit_softcap)
        return logits

    def features(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        positions: Optional[Int[Array, "*batch seq"]] = None,
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
    ) -> tuple[Float[Array, "batch seq embed"], Optional[MoEAux]]:
        """The final-normed hidden states and the MoE layers' routing statistics, one row per MoE
        layer in model order (None without MoE layers).

        `positions` (default 0..seq-1) feed RoPE; `segment_ids` confine attention to a document.
        (The trainer runs the same layers under its remat/offload policy through `zoo.model.features`.)
        """
        return run_layers(self, tokens, positions=positions, segment_ids=segment_ids)

    def forward_with_aux(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        positions: Optional[Int[Array, "*batch seq"]] = None,
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
    ) -> tuple[Float[Array, "batch seq vocab"], Optional[MoEAux]]:
        """Logits and the routing statistics (see `features`)."""
        hidden, aux = self.features(tokens, positions=positions, segment_ids=segment_ids)
        return self.logits(hidden), aux

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        positions: Optional[Int[Array, "*batch seq"]] = None,
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
    ) -> Float[Array, "batch seq vocab"]:
        return self.forward_with_aux(tokens, positions=positions, segment_ids=segment_ids)[0]

    # --- decoding with a cache -----------------------------------------------------------------

    def prefill(
        self, tokens: Int[Array, "batch seq"], lengths: Int[Array, " batch"], max_len: int
    ) -> tuple[Float[Array, "batch vocab"], DecodeCache]:
        """Run right-padded prompts (row b's first `lengths[b]` tokens are real, at positions
        0..lengths[b]-1) and return the logits after each row's last real token and a cache of
        `max_len` positions (>= seq). Padding sits after every real token, so causality keeps it
        out of their results; its cache rows are overwritten before any query can see them."""
        x = self.embed_tokens(tokens)
        caches = []
        for stack in self.stacks:
            x, cache = stack.prefill(x, lengths, max_len)
            caches.append(cache)
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)
        return self.logits(self.final_norm(last))[:, 0], DecodeCache(lengths, tuple(caches))

    def decode_step(
        self, tokens: Int[Array, " batch"], cache: DecodeCache, layers: Optional[Sequence] = None
    ) -> tuple[Float[Array, "batch vocab"], DecodeCache]:
        """Feed one token per row at position `cache.lengths`; the logits of the token after it.
        `layers`: per stack, its `Stack.unstack()` (the layers then run unrolled; see `decode_layers`)."""
        positions = cache.lengths
        x = self.embed_tokens(tokens[:, None])
        caches = []
        for i, (stack, stack_cache) in enumerate(zip(self.stacks, cache.stacks)):
            if layers is None:
                x, stack_cache = stack.decode(x, positions, stack_cache)
            else:
                x, stack_cache = stack.decode_layers(x, positions, stack_cache, layers[i])
            caches.append(stack_cache)
        return self.logits(self.final_norm(x))[:, 0], DecodeCache(positions + 1, tuple(caches))


def _moe_aux_order(config: ModelConfig, stacks: Sequence[Stack]) -> list[tuple[int, int, np.ndarray]]:
    """`CausalLM.moe_aux_order` over these stacks (the model's, or the pieces `split_stacks` cut)."""
    moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    row = {layer: r for r, layer in enumerate(moe_layers)}
    out = []
    for s_idx, s in enumerate(stacks):
        for j in range(s.period):
            if config.is_moe_layer(s.first + j):
                out.append((s_idx, j, np.asarray([row[s.layer_index(r, j)] for r in range(s.repeats)])))
    return out


# Layers `first .. stop - 1` (model layer numbers, 0-based across the stacks) run with this wrapper.
LayerSegment = tuple[int, int, Optional[LayerWrapper]]


def split_stacks(stacks: Sequence[Stack], segments: Sequence[tuple[int, int, Any]]) -> list[tuple[Stack, Any]]:
    """The stacks cut at every segment boundary (`Stack.cut`), each piece with its segment's third
    item (a `LayerWrapper` for `run_layers`; `features` passes its policies): one scan per piece, so
    a segment's layers stay one flat loop under their own policy. The segments cover the layers in
    order, without gaps."""
    out = []
    for stack in stacks:
        lo, hi = stack.first, stack.first + stack.num_layers
        for first, stop, wrap in segments:
            a, b = max(lo, first), min(hi, stop)
            if a < b:
                out += [(piece, wrap) for piece in stack.cut(a, b)]
    covered = sum(p.num_layers for p, _ in out)
    total = sum(s.num_layers for s in stacks)
    if covered != total:
        raise ValueError(f"the layer segments {[(f, s) for f, s, _ in segments]} cover {covered} of the {total} layers")
    return out


def run_layers(
    model: CausalLM,
    tokens: Int[Array, "batch seq"],
    *,
    positions: Optional[Int[Array, "*batch seq"]] = None,
    segment_ids: Optional[Int[Array, "batch seq"]] = None,
    wrap_layer: Optional[LayerWrapper] = None,
    segments: Optional[Sequence[LayerSegment]] = None,
    context_order: bool = False,
) -> tuple[Float[Array, "batch seq embed"], Optional[MoEAux]]:
    """`model.features` with each layer's call wrapped by `wrap_layer` (see `LayerWrapper`): the one
    forward loop that `CausalLM.features` (no wrapper) and the trainer's `features` share.

    `segments` (instead of `wrap_layer`): `(first, stop, wrapper)` per layer range, covering every
    layer; the stacks are cut at their boundaries (`split_stacks`) and each piece scans on its own
    under its range's wrapper (a remat/offload policy per layer range, zoo.offload).

    Under balanced context parallelism (`zoo.sharding.context_balanced`) the layers run on the
    sequence in its balanced order: the tokens, positions and segment ids are taken into it here, and
    the hidden states come back in sequence order, or with `context_order=True` as they are (the
    trainer's loss takes its targets into that order instead: no exchange of the hidden states)."""
    if positions is None:
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    shards = zs.context_balanced()
    if shards:
        tokens = zs.to_context_order(tokens, shards)
        positions = zs.to_context_order(positions, shards, axis=positions.ndim - 1)
        segment_ids = None if segment_ids is None else zs.to_context_order(segment_ids, shards)
    if segments is not None and wrap_layer is not None:
        raise ValueError("run_layers: give wrap_layer or segments, not both")
    pieces = [(s, wrap_layer) for s in model.stacks] if segments is None else split_stacks(model.stacks, segments)
    x = zs.constrain(model.embed_tokens(tokens), zs.ACTIVATION_AXES)
    # Under sequence parallelism every layer reads whole rows of these (rope on the gathered q/k, the
    # attention mask): gathered once here, not in every layer (or, for the blockwise kernel, every tile).
    if positions.ndim == 2:
        positions = zs.sequence_gathered(positions, ("batch", None))
    if segment_ids is not None:
        segment_ids = zs.sequence_gathered(segment_ids, ("batch", None), whole=True)
    per_stack = []
    for stack, wrap in pieces:
        # A cut model names each piece's scans (forward and backward) after it, so that zoo.tools.inspect_step
        # can tell which backward scan recomputes which piece's tags.
        with jax.named_scope(stack.name) if segments is not None else contextlib.nullcontext():
            x, auxes = stack(x, positions, segment_ids, wrap_layer=wrap)
        per_stack.append(auxes)
    order = _moe_aux_order(model.config, [s for s, _ in pieces])
    aux = None
    if order:
        rows = np.concatenate([r for _, _, r in order])
        inverse = np.argsort(rows)
        counts = jnp.concatenate([per_stack[s][j].tokens_per_expert for s, j, _ in order])[inverse]
        dropped = jnp.concatenate([per_stack[s][j].dropped for s, j, _ in order])[inverse]
        rounds = jnp.concatenate([per_stack[s][j].exchange_rounds for s, j, _ in order])[inverse]
        entropy = jnp.concatenate([per_stack[s][j].router_entropy for s, j, _ in order])[inverse]
        aux = MoEAux(counts, dropped, rounds, entropy)
    # Whole sequences for the head (its logits stay split over the vocabulary, as without sequence parallelism).
    hidden = zs.sequence_gathered(model.final_norm(x))
    if shards and not context_order:
        hidden = zs.from_context_order(hidden, shards)
    return hidden, aux


def init_compile_options(platform: str, params_per_device: Union[int, float]) -> Optional[dict]:
    """The compile options of a model's initialiser on `platform` (`zoo.backend`): on CPU, LLVM level
    1 from `init_llvm_from_params` parameters per device, else 0; elsewhere XLA's defaults (None)."""
    threshold = backend.choices(platform).init_llvm_from_params
    if threshold is None:
        return None
    return {"xla_backend_optimization_level": 1 if params_per_device >= threshold else 0}


# (config, key shape, key dtype) -> the compiled initialiser and the model's non-array part.
_INITIALISERS: dict = {}


def build(config: ModelConfig, *, key: PRNGKeyArray) -> CausalLM:
    """A randomly initialised model, built by one compiled program rather than hundreds of eagerly
    dispatched initialiser ops; repeated builds of one config reuse it.

    On CPU the initialiser is compiled at the level `init_compile_options` picks, as `Trainer.init`
    does: it runs once.
    """
    if isinstance(key, jax.core.Tracer):  # inside a caller's jit (Trainer.init): part of its program
        return CausalLM(config, key=key)
    cache_key = (config, key.shape, str(key.dtype))
    if cache_key not in _INITIALISERS:
        static = eqx.partition(eqx.filter_eval_shape(CausalLM, config, key=key), eqx.is_array)[1]
        lowered = jax.jit(lambda k: eqx.filter(CausalLM(config, key=k), eqx.is_array)).lower(key)
        options = init_compile_options(jax.default_backend(), count_leaves(abstract(config)))
        _INITIALISERS[cache_key] = (lowered.compile(options), static)
    compiled, static = _INITIALISERS[cache_key]
    return eqx.combine(compiled(key), static)


@functools.lru_cache(maxsize=64)
def abstract(config: ModelConfig) -> CausalLM:
    """The model with `jax.ShapeDtypeStruct` leaves: no memory, any size (DeepSeek-V3 671B included).
    Cached per config (tracing the model takes seconds; the result is immutable shapes)."""
    return eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))


def next_token_loss(
    logits: Float[Array, "batch seq vocab"],
    tokens: Int[Array, "batch seq"],
    mask: Optional[Float[Array, "batch seq"]] = None,
) -> Float[Array, ""]:
    """Mean cross-entropy of predicting tokens[:, t+1] from logits[:, t], in float32.

    `mask` (1 = count) weights the target positions; mask[:, 0] is ignored (no prediction targets it).
    """
    # Every position is scored against the next token (the last against a dummy target) and the last
    # position dropped from the [batch, seq] losses: slicing the [batch, seq, vocab] logits instead
    # copies the largest activation (and pads its gradient back); the head + loss ran 7-8% faster on CPU
    # (bench/ab_hotpath.py --part head, in git at 6966f25).
    logits = logits.astype(jnp.float32)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = (logz - target_logit)[:, :-1]
    if mask is None:
        return nll.mean()
    weights = mask[:, 1:].astype(jnp.float32)
    return (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)


# A function applied to one layer's parameters inside the scan body, before use: the trainer's
# `zoo.sharding.to_device`, which moves host-resident weights to the device one layer at a time.
LayerTransform = Callable[[PyTree], PyTree]


@dataclasses.dataclass(frozen=True)
class RangedPolicy:
    """What `remat_policy` returns for a config with `offload.ranges`: a `jax.checkpoint` policy per
    consecutive layer segment, `(first, stop, policy)` covering every layer. `features` cuts the
    scanned stacks at the segments' boundaries and runs each piece under its segment's policy."""

    segments: tuple[tuple[int, int, Optional[Callable]], ...]


# --- running the model under a remat/offload policy ---------------------------------------------
#
# The model's own API (`model(tokens, positions=, segment_ids=)`, `model.features`) knows nothing of
# policies; these run the same layers (`run_layers`) with each layer's call wrapped. The policies
# themselves are built from a config by `zoo.offload.remat_policy`.


def layer_wrapper(remat_policy: Optional[Callable] = None, layer_transform: Optional[LayerTransform] = None):
    """The `zoo.model.LayerWrapper` of a `jax.checkpoint` policy (`remat_policy(...)`; None: no
    checkpoint) and a transform of each layer's parameters (None: use them where they are), or None
    when there is neither. Each layer is checkpointed on its own, the transform inside the checkpoint,
    so the backward pass moves a host-resident layer's weights again rather than keeping them."""
    if remat_policy is None and layer_transform is None:
        return None

    def wrap(run_block, looped: bool = True):
        def run(h, block_params, j):
            if layer_transform is not None:
                block_params = layer_transform(block_params)
            return run_block(h, block_params, j)

        if remat_policy is not None:
            # The policy decides, per tagged intermediate, what the backward pass keeps, offloads or recomputes.
            # A scan of one trip is no loop once XLA simplifies it: the layer's forward and its backward's
            # recomputation then sit in one computation, and XLA's CSE merges them unless barred
            # (prevent_cse), so the recomputation keeps the forward's values instead.
            run = jax.checkpoint(run, policy=remat_policy, prevent_cse=not looped, static_argnums=(2,))
        return run

    return wrap


def features(
    model,
    tokens: Int[Array, "batch seq"],
    *,
    positions: Optional[Int[Array, "*batch seq"]] = None,
    segment_ids: Optional[Int[Array, "batch seq"]] = None,
    remat_policy: Optional[Union[Callable, RangedPolicy]] = None,
    layer_transform: Optional[LayerTransform] = None,
    context_order: bool = False,
):
    """`model.features(tokens, positions=, segment_ids=)` (hidden states, MoE statistics) with every
    layer run under `remat_policy` and `layer_transform` (see `layer_wrapper`): the same forward
    values, what the backward pass keeps, offloads or recomputes set by the policy. A `RangedPolicy`
    (a config with `offload.ranges`) runs each layer segment as scans of its own under its policy.
    `context_order`: see `run_layers`."""
    if isinstance(remat_policy, RangedPolicy):  # a policy per layer range: a scan per piece
        segments = [(first, stop, layer_wrapper(p, layer_transform)) for first, stop, p in remat_policy.segments]
        return run_layers(
            model, tokens, positions=positions, segment_ids=segment_ids, segments=segments, context_order=context_order
        )
    wrap = layer_wrapper(remat_policy, layer_transform)
    return run_layers(
        model, tokens, positions=positions, segment_ids=segment_ids, wrap_layer=wrap, context_order=context_order
    )


def loss_fn(
    model: CausalLM,
    tokens: Int[Array, "batch seq"],
    *,
    positions: Optional[Int[Array, "*batch seq"]] = None,
    segment_ids: Optional[Int[Array, "batch seq"]] = None,
    remat_policy: Optional[Union[Callable, RangedPolicy]] = None,
    layer_transform: Optional[Callable] = None,
) -> Float[Array, ""]:
    """Mean next-token loss of `model(tokens)`. With a remat/offload policy
    (`zoo.offload.remat_policy`: a `jax.checkpoint` policy, or a `RangedPolicy`, one per layer range)
    or a transform of each layer's parameters, every layer runs as
    `features` runs it: the same values, what the backward pass keeps set by the policy."""
    hidden, _ = features(
        model,
        tokens,
        positions=positions,
        segment_ids=segment_ids,
        remat_policy=remat_policy,
        layer_transform=layer_transform,
    )
    return next_token_loss(model.logits(hidden), tokens)


def count_leaves(model: PyTree) -> int:
    """Parameters actually held by a (possibly abstract) model: the sum of its array leaves' sizes."""
    leaves = jax.tree_util.tree_leaves(model)
    return int(sum(x.size for x in leaves if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))))


def is_buffer_path(path) -> bool:
    """Leaves that are state, not parameters: the MoE correction bias (no gradient, no optimizer)."""
    return any(getattr(k, "name", None) == "e_score_correction_bias" for k in path)


def trainable_mask(model: CausalLM) -> PyTree:
    """Same structure as `model`; True for leaves the optimizer should update."""
    return jax.tree_util.tree_map_with_path(lambda p, _: not is_buffer_path(p), model)
