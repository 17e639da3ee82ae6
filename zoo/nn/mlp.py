import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from zoo import tags
from zoo.config import DTypeLike, dtype_name
from zoo.nn._init import normal


def dense(x: Float[Array, "*batch d_in"], w: Float[Array, "d_in d_out"]) -> Float[Array, "*batch d_out"]:
    """`x @ w` over the last axis, as one [tokens, d_in] x [d_in, d_out] matmul on every backend.

    The leading axes are merged into one row axis first (a free reshape). Over [batch, seq] rows
    (the weight gradient contracting both) XLA:CPU built the weight gradients from transposed copies
    of the activations and of the incoming gradient: bench/peer_parts.py's SwiGLU at `100m` took
    215 ms before and 167 ms after, and bench/peer.py's whole steps 0.90x (`100m`) and 0.95x (`tiny`)
    of the old time with bit-identical losses (`bench/ab_variants.py CONFIG 4 base plaindense`,
    docs/benchmarks.md). The batch axis is the major part of the merged rows, so a batch-sharded
    input stays sharded without communication.

    (On CPU this was once a custom VJP that transposed the activations for the weight gradient; the
    plain product was 10% faster under train.py's CPU defaults and needs no rule for forward-mode AD.)"""
    rows = jnp.reshape(x, (-1, x.shape[-1]))
    return jnp.einsum("CD,DF->CF", rows, w).reshape(*x.shape[:-1], w.shape[-1])


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
