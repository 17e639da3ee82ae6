"""Decode-time caches of the attention layers, and where a position lives in one.

A cache has `slots` rows per sequence, preallocated. Position p lives in slot `p % slots`:

- a full-attention layer gets as many slots as the cache's maximum length, so slot = position;
- a sliding-window layer of window W gets `min(W, max_len)` slots, a ring: once position p is written,
  its slots hold exactly positions p-W+1 .. p, the keys its window lets the next query see, so a
  Gemma 3 or GPT-OSS model's sliding layers cost W rows whatever the context length.

Either way the keys a decoding query at position p may read are the first `min(p + 1, slots)` slots
(`visible_slots`), in whatever order the ring left them: attention sums over keys, so their order
only changes float rounding.

`KVCache` (grouped-query attention) holds keys after q/k-norm and RoPE, and values;
`LatentCache` (DeepSeek-V3's MLA) holds the compressed latent after its norm followed by the
rotated, head-shared rope key: `kv_lora_rank + qk_rope_head_dim` numbers per token, whatever the
head count.
"""

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class KVCache(eqx.Module):
    """One grouped-query attention layer's keys and values (a leading layer axis inside a stack)."""

    k: Float[Array, "*layers batch slots kv_heads head_dim"]
    v: Float[Array, "*layers batch slots kv_heads v_dim"]


class LatentCache(eqx.Module):
    """One MLA layer's `[normed kv latent | rotated rope key]` per token."""

    kv: Float[Array, "*layers batch slots latent_plus_rope"]


def cache_slots(max_len: int, window: Optional[int]) -> int:
    """Slots of a layer whose attention keeps `window` keys (None: all) in a cache of `max_len` positions."""
    return max_len if window is None else min(window, max_len)


def from_prompt(
    x: Float[Array, "batch seq *rest"], lengths: Int[Array, " batch"], slots: int
) -> Float[Array, "batch slots *rest"]:
    """The cache rows of a prompt's per-position values `x` (row b's positions 0..lengths[b]-1 are
    real): slot s gets the latest real position p with p % slots == s. Slots no real position
    reaches hold anything; `visible_slots` never shows them."""
    seq = x.shape[1]
    if seq <= slots:  # every position has its own slot: slot = position
        return jnp.pad(x, [(0, 0), (0, slots - seq)] + [(0, 0)] * (x.ndim - 2))
    s = jnp.arange(slots, dtype=jnp.int32)
    latest = s + slots * jnp.floor_divide(lengths[:, None] - 1 - s, slots)  # [batch, slots]; < 0: never written
    index = jnp.clip(latest, 0, seq - 1)
    return jnp.take_along_axis(x, index.reshape(*index.shape, *([1] * (x.ndim - 2))), axis=1)


def write(
    cache: Float[Array, "batch slots *rest"],  # noqa: F821 - jaxtyping's variadic dims
    x: Float[Array, "batch *rest"],  # noqa: F821
    positions: Int[Array, " batch"],
) -> Float[Array, "batch slots *rest"]:
    """`cache` with row b's value `x[b]` for position `positions[b]` in its slot."""
    slot = positions % cache.shape[1]
    return jax.vmap(lambda c, v, i: jax.lax.dynamic_update_index_in_dim(c, v.astype(c.dtype), i, 0))(cache, x, slot)


def visible_slots(positions: Int[Array, " batch"], slots: int) -> Int[Array, " batch"]:
    """How many leading slots hold keys a query at `positions` (already written) may attend to."""
    return jnp.minimum(positions + 1, slots)
