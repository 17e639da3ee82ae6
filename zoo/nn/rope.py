"""Rotary position embeddings: four frequency rules (default, linear, llama3, yarn) and two layouts.

The frequencies are a function of the static config, computed once in numpy at trace time, so a
Rope module holds no arrays (nothing to train, shard or offload).
"""

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from zoo.config import RopeConfig


def _default_inv_freq(dim: int, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _llama3_inv_freq(dim: int, c: RopeConfig) -> np.ndarray:
    # Long wavelengths (beyond the pretraining context / low_freq_factor) are slowed by `factor`,
    # short ones (below context / high_freq_factor) kept, and the band between blended linearly.
    inv_freq = _default_inv_freq(dim, c.theta)
    old_len = c.original_max_position_embeddings
    low_freq_wavelen = old_len / c.low_freq_factor
    high_freq_wavelen = old_len / c.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / c.factor, inv_freq)
    smooth = (old_len / wavelen - c.low_freq_factor) / (c.high_freq_factor - c.low_freq_factor)
    blended = (1 - smooth) * scaled / c.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, c: RopeConfig, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    # Dimensions that rotate fewer than beta_slow times over the original context are interpolated
    # (divided by factor), those rotating more than beta_fast times extrapolated, a linear ramp between.
    original = c.original_max_position_embeddings or max_position_embeddings
    if c.attention_factor is not None:
        attention_factor = c.attention_factor
    elif c.mscale and c.mscale_all_dim:
        attention_factor = yarn_mscale(c.factor, c.mscale) / yarn_mscale(c.factor, c.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(c.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(c.theta))

    low, high = correction_dim(c.beta_fast), correction_dim(c.beta_slow)
    if c.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = c.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = (1 / (c.factor * pos_freqs)) * (1 - extrapolation_weight) + (1 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor


def rope_frequencies(dim: int, c: RopeConfig, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies `[dim/2]` and the factor cos/sin are multiplied by (1 unless yarn)."""
    if c.type == "default":
        return _default_inv_freq(dim, c.theta), 1.0
    if c.type == "linear":  # positions divided by factor: every frequency slowed alike
        return _default_inv_freq(dim, c.theta) / c.factor, 1.0
    if c.type == "llama3":
        return _llama3_inv_freq(dim, c), 1.0
    if c.type == "yarn":
        return _yarn(dim, c, max_position_embeddings)
    raise ValueError(f"model.rope.type: unknown rule {c.type!r}")


def softmax_scale_multiplier(c: RopeConfig) -> float:
    """DeepSeek's YaRN multiplies the softmax scale by mscale(factor, mscale_all_dim)^2."""
    if c.type == "yarn" and c.mscale_all_dim:
        return yarn_mscale(c.factor, c.mscale_all_dim) ** 2
    return 1.0


class Rope(eqx.Module):
    """Rotates the last axis of `x` by position. No arrays: frequencies derive from static config."""

    dim: int = eqx.field(static=True)
    config: RopeConfig = eqx.field(static=True)
    max_position_embeddings: int = eqx.field(static=True)

    def __check_init__(self):
        if self.dim % 2:
            raise ValueError(f"RoPE needs an even dim, got {self.dim}")

    def cos_sin(
        self, positions: Int[Array, "*batch seq"]
    ) -> tuple[Float[Array, "*batch seq half"], Float[Array, "*batch seq half"]]:
        inv_freq, attention_factor = rope_frequencies(self.dim, self.config, self.max_position_embeddings)
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
        return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor

    def __call__(
        self, x: Float[Array, "batch seq heads dim"], positions: Int[Array, "*batch seq"]
    ) -> Float[Array, "batch seq heads dim"]:
        """`positions`: `[seq]` shared by every row, or `[batch, seq]` (packed documents, decoding)."""
        cos, sin = self.cos_sin(positions)
        if positions.ndim == 1:
            cos, sin = cos[None], sin[None]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        x32 = x.astype(jnp.float32)
        if self.config.interleaved:
            # Pairs (x[2i], x[2i+1]) rotate by angle i. Like transformers, the result is laid out as
            # [all even | all odd]; q and k share the layout, so q.k is the interleaved product.
            first, second = x32[..., 0::2], x32[..., 1::2]
        else:
            first, second = jnp.split(x32, 2, axis=-1)
        rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
        return rotated.astype(x.dtype)
