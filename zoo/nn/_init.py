"""Weight initialisation shared by the blocks."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray


def normal(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int, dtype) -> Float[Array, "..."]:
    """Truncated normal with std 1/sqrt(fan_in): unit-variance outputs for unit-variance inputs."""
    std = fan_in**-0.5
    return (std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)).astype(dtype)
