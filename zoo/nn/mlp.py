import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from zoo import tags
from zoo.config import DTypeLike, dtype_name
from zoo.nn._init import normal


@jax.custom_vjp
def _matmul_xt(x, w):
    return x @ w


def _matmul_xt_fwd(x, w):
    return x @ w, (x, w)


def _matmul_xt_bwd(res, g):
    x, w = res
    # The weight gradient x^T g with x^T materialised (the smaller operand: [embed, tokens] against
    # [tokens, mlp]). Left to itself, XLA:CPU transposes g instead, inside the fused activation
    # backward, which then reads the scan's stacked residuals column by column: on the 2-core CPU
    # machine llama_100m's step took 16% less time this way (bench/ab_hotpath.py, docs/benchmarks.md).
    xt = jax.lax.optimization_barrier(x.T)
    return g @ w.T, xt @ g


_matmul_xt.defvjp(_matmul_xt_fwd, _matmul_xt_bwd)


def dense(x: Float[Array, "*batch d_in"], w: Float[Array, "d_in d_out"]) -> Float[Array, "*batch d_out"]:
    """`x @ w` over the last axis. On CPU through a custom VJP whose weight gradient transposes the
    activations rather than the incoming gradient (see `_matmul_xt_bwd`); elsewhere a plain einsum
    (GPU matmul libraries take transposed operands as they are)."""
    if jax.default_backend() != "cpu":
        return jnp.einsum("...D,DF->...F", x, w)
    lead = x.shape[:-1]
    return _matmul_xt(x.reshape(-1, x.shape[-1]), w).reshape(*lead, w.shape[-1])


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
