import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


class RMSNorm(eqx.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, computed in float32 whatever the input dtype."""

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype=jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __check_init__(self):
        if self.eps <= 0:
            raise ValueError(f"RMSNorm eps must be positive, got {self.eps}")

    def __call__(self, x: Float[Array, "*batch dim"], out_dtype=None) -> Float[Array, "*batch dim"]:
        out_dtype = out_dtype or x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight.astype(jnp.float32) * x32).astype(out_dtype)
