import equinox as eqx
import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, Float, PRNGKeyArray

from zoo import tags
from zoo.nn._init import normal


@jax.custom_jvp
def _matmul_xt(x, w):
    return x @ w


def _matmul_xt_jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents
    # A custom JVP (not a custom VJP) so that forward-mode AD (jax.jvp, jax.linearize) works; its
    # tangent is linear in (dx, dw), so reverse mode is JAX's transpose of it. The weight term is
    # written against x^T materialised behind an optimisation barrier: its transpose, the weight
    # gradient, is then `x^T @ g` with the smaller operand ([embed, tokens] against [tokens, mlp])
    # transposed. Left to itself, XLA:CPU transposes g instead, inside the fused activation
    # backward, which then reads the scan's stacked residuals column by column: on the 2-core CPU
    # machine llama_100m's step took 16% less time this way (bench/ab_hotpath.py, docs/benchmarks.md).
    # A symbolic-zero tangent (an input not differentiated) adds no term, so no wasted matmul.
    y = x @ w
    terms = []
    if not isinstance(dx, SymbolicZero):
        terms.append(dx @ w)
    if not isinstance(dw, SymbolicZero):
        xt = jax.lax.optimization_barrier(x.T)
        terms.append(jnp.einsum("DT,DF->TF", xt, dw))
    return y, sum(terms[1:], terms[0]) if terms else jnp.zeros_like(y)


_matmul_xt.defjvp(_matmul_xt_jvp, symbolic_zeros=True)


def dense(x: Float[Array, "*batch d_in"], w: Float[Array, "d_in d_out"]) -> Float[Array, "*batch d_out"]:
    """`x @ w` over the last axis. On CPU through a custom JVP whose weight gradient transposes the
    activations rather than the incoming gradient (see `_matmul_xt_jvp`); elsewhere a plain einsum
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
        param_dtype: str = "float32",
        compute_dtype: str = "float32",
        key: PRNGKeyArray,
    ):
        kg, ku, kd = jax.random.split(key, 3)
        self.w_gate = normal(kg, (embed, mlp), embed, param_dtype)
        self.w_up = normal(ku, (embed, mlp), embed, param_dtype)
        self.w_down = normal(kd, (mlp, embed), mlp, param_dtype)
        self.compute_dtype = compute_dtype
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
