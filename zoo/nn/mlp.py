import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from zoo import tags
from zoo.config import DTypeLike, dtype_name
from zoo.nn._init import normal


def dense(x: Float[Array, "*batch d_in"], w: Float[Array, "d_in d_out"]) -> Float[Array, "*batch d_out"]:
    """`x @ w` over the last axis, a plain einsum on every backend.

    On CPU this was a custom VJP whose weight gradient transposed the activations rather than the
    incoming gradient (16% faster on llama_100m when it was written). With LLVM's optimisations on and
    only matmuls handed to YNNPACK (train.py's CPU defaults now) the plain einsum was 10% faster on
    both of bench/peer.py's Llamas (`bench/ab_variants.py ... base plaindense`, docs/benchmarks.md), and
    it needs no custom rule for forward-mode AD."""
    return jnp.einsum("...D,DF->...F", x, w)


ACTIVATIONS = {
    "silu": jax.nn.silu,  # SwiGLU (Llama, Qwen, Mixtral experts, DeepSeek)
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # GeGLU (Gemma's gelu_pytorch_tanh)
}


class GatedMLP(eqx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with `silu` (Llama, Qwen, DeepSeek-V3's dense layers and
    shared experts), GeGLU with `gelu_tanh` (Gemma 3)."""

    w_gate: Float[Array, "embed mlp"]
    w_up: Float[Array, "embed mlp"]
    w_down: Float[Array, "mlp embed"]
    compute_dtype: str = eqx.field(static=True)
    activation: str = eqx.field(static=True)

    def __init__(
        self,
        embed: int,
        mlp: int,
        *,
        activation: str = "silu",
        param_dtype: DTypeLike = "float32",
        compute_dtype: DTypeLike = "float32",
        key: PRNGKeyArray,
    ):
        kg, ku, kd = jax.random.split(key, 3)
        param_dtype = dtype_name(param_dtype, "param_dtype")
        self.w_gate = normal(kg, (embed, mlp), embed, param_dtype)
        self.w_up = normal(ku, (embed, mlp), embed, param_dtype)
        self.w_down = normal(kd, (mlp, embed), mlp, param_dtype)
        self.compute_dtype = dtype_name(compute_dtype, "compute_dtype")
        self.activation = activation

    def __check_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"GatedMLP activation {self.activation!r}: choose one of {', '.join(ACTIVATIONS)}")

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        cdt = self.compute_dtype
        gate = tags.tag(dense(x, self.w_gate.astype(cdt)), tags.MLPWI_0)
        up = tags.tag(dense(x, self.w_up.astype(cdt)), tags.MLPWI_1)
        return tags.tag(dense(ACTIVATIONS[self.activation](gate) * up, self.w_down.astype(cdt)), tags.MLPWO)


# The name of the Llama-style default (activation "silu").
SwiGLU = GatedMLP
