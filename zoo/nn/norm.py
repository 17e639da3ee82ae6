from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from zoo import sharding as zs
from zoo.config import dtype_name


class RMSNorm(eqx.Module):
    """`(offset + weight) * x / sqrt(mean(x^2) + eps)`, computed in float32 whatever the input dtype.

    `weight_offset` 0 is the Llama form; 1 is Gemma's `(1 + w)`, whose stored weight starts at zero.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    weight_offset: float = eqx.field(static=True)

    # zoo.sharding: the scale is small and stays float32 where it is used.
    PARAMS: ClassVar[dict[str, zs.Leaf]] = {"weight": zs.float32(None)}

    def __init__(self, dim: int, *, eps: float = 1e-5, weight_offset: float = 0.0, dtype=jnp.float32):
        self.weight = jnp.full((dim,), 1.0 - weight_offset, dtype_name(dtype, "dtype"))
        self.eps = eps
        self.weight_offset = weight_offset

    def __check_init__(self):
        if self.eps <= 0:
            raise ValueError(f"RMSNorm eps must be positive, got {self.eps}")

    def __call__(self, x: Float[Array, "*batch dim"], out_dtype=None) -> Float[Array, "*batch dim"]:
        out_dtype = out_dtype or x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.weight.astype(jnp.float32) + self.weight_offset
        return (scale * x32).astype(out_dtype)
