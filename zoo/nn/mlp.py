import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from zoo import tags
from zoo.nn._init import normal


class SwiGLU(eqx.Module):
    """down(silu(gate(x)) * up(x)): Llama's MLP, DeepSeek-V3's dense layers and shared experts."""

    w_gate: Float[Array, "embed mlp"]
    w_up: Float[Array, "embed mlp"]
    w_down: Float[Array, "mlp embed"]
    compute_dtype: str = eqx.field(static=True)

    def __init__(self, embed: int, mlp: int, *, param_dtype: str = "float32", compute_dtype: str = "float32", key: PRNGKeyArray):
        kg, ku, kd = jax.random.split(key, 3)
        self.w_gate = normal(kg, (embed, mlp), embed, param_dtype)
        self.w_up = normal(ku, (embed, mlp), embed, param_dtype)
        self.w_down = normal(kd, (mlp, embed), mlp, param_dtype)
        self.compute_dtype = compute_dtype

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        cdt = self.compute_dtype
        gate = tags.tag(jnp.einsum("BTD,DF->BTF", x, self.w_gate.astype(cdt)), tags.MLPWI_0)
        up = tags.tag(jnp.einsum("BTD,DF->BTF", x, self.w_up.astype(cdt)), tags.MLPWI_1)
        return tags.tag(jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, self.w_down.astype(cdt)), tags.MLPWO)
