import functools
from typing import Callable, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from zoo import sharding as zs
from zoo import tags
from zoo.config import DTypeLike, dtype_name
from zoo.nn.lora_weight import LoRAWeight, project
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
    if zs.context_axes():
        # Context parallelism splits the sequence as well as the batch: merged, each device's rows would
        # not be one block of them, and the partitioner gathered the whole sequence for the reshape.
        return jnp.einsum("...D,DF->...F", x, w)
    rows = jnp.reshape(x, (-1, x.shape[-1]))
    return jnp.einsum("CD,DF->CF", rows, w).reshape(*x.shape[:-1], w.shape[-1])


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def gated(
    fn: Callable[[Array, Array], Array], gate: Float[Array, "*rows mlp"], up: Float[Array, "*rows mlp"]
) -> Float[Array, "*rows mlp"]:
    """`fn(gate, up)`, the activation of a gated MLP (`fn` elementwise), with a derivative that keeps
    two tensors for the backward pass: fn's partial derivatives by gate and by up.

    The values are fn's own. JAX's derivative of `silu(gate) * up` keeps five [tokens, mlp] tensors
    (gate, up, the sigmoid and two products), each written into the layer scan's stacked residuals
    in the forward pass and read back in the backward; the partials, computed in the forward pass
    by JAX's own derivative of fn, replace them. The whole `100m` step without remat: compiled temp
    21% smaller, time 0.95-1.00 of the old in four A/Bs (`bench/ab_variants.py 100m 6 plainglu base`,
    docs/benchmarks.md); `tiny` 0.985; full remat and the bfloat16 MoE even. A checkpoint policy that keeps gate and up
    (`minimal`) recomputes the partials from those tags; forward-mode AD and higher derivatives go through the rule
    below."""
    return fn(gate, up)


@gated.defjvp
def _gated_jvp(fn, primals, tangents):
    gate, up = primals
    d_gate, d_up = tangents
    out, by_gate = jax.jvp(lambda g: fn(g, up), (gate,), (jnp.ones_like(gate),))
    by_up = jax.jvp(lambda u: fn(gate, u), (up,), (jnp.ones_like(up),))[1]
    return out, by_gate * d_gate + by_up * d_up


def swiglu(gate: Float[Array, "*rows mlp"], up: Float[Array, "*rows mlp"]) -> Float[Array, "*rows mlp"]:
    """Llama, Qwen, Mixtral's experts, DeepSeek-V3."""
    return jax.nn.silu(gate) * up


def geglu_tanh(gate: Float[Array, "*rows mlp"], up: Float[Array, "*rows mlp"]) -> Float[Array, "*rows mlp"]:
    """Gemma 3 (transformers' gelu_pytorch_tanh)."""
    return jax.nn.gelu(gate, approximate=True) * up


# GatedMLP's `activation`: the name of the function applied to the gate.
ACTIVATIONS = {"silu": swiglu, "gelu_tanh": geglu_tanh}


def _ffn_flops(s: tags.FlopShape) -> int | float:
    return 2 * s.tokens * s.config.hidden_size * s.ffn


def _ffn_in_op(s: tags.FlopShape) -> tags.Op:
    return ("matmul", s.config.hidden_size, s.ffn)


# The tags it emits (their records: `GatedMLP.EMITS`).
MLPWI_0 = "mlpwi_0"
MLPWI_1 = "mlpwi_1"
MLPWO = "mlpwo"


@tags.declares
class GatedMLP(eqx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with `silu` (Llama, Qwen, DeepSeek-V3's dense layers and
    shared experts), GeGLU with `gelu_tanh` (Gemma 3)."""

    w_gate: Float[Array, "embed mlp"]
    w_up: Float[Array, "embed mlp"]
    w_down: Float[Array, "mlp embed"]
    compute_dtype: str = eqx.field(static=True)
    activation: str = eqx.field(static=True)

    # zoo.sharding: each weight's logical axes; all three are projections (cast to the compute dtype,
    # adapted by LoRA), named as transformers' LlamaMLP names them (`mlp.gate_proj.weight`, ...).
    PARAMS: ClassVar[dict[str, zs.Leaf]] = {
        "w_gate": zs.projection("embed", "mlp", hub="gate_proj"),
        "w_up": zs.projection("embed", "mlp", hub="up_proj"),
        "w_down": zs.projection("mlp", "embed", hub="down_proj"),
    }
    # zoo.tags: the tags it emits and their producers' forward FLOPs (F: `FlopShape.ffn`, the
    # dense layers' width, or the shared experts' on an MoE stack). Its output only feeds the residual add.
    EMITS: ClassVar[tuple[tags.Emit, ...]] = (
        tags.Emit(
            tags.TagInfo(
                MLPWI_0,
                "B T F",
                "dense MLP gate projection (before the activation); DeepSeek-V3: dense layers and shared experts",
                tags.MLP,
                ((*tags.IN_BLOCK, "mlp"),),
            ),
            _ffn_flops,
            _ffn_in_op,
        ),
        tags.Emit(
            tags.TagInfo(MLPWI_1, "B T F", "dense MLP up projection", tags.MLP, ((*tags.IN_BLOCK, "mlp"),)),
            _ffn_flops,
            _ffn_in_op,
        ),
        tags.Emit(
            tags.TagInfo(
                MLPWO,
                "B T D",
                "dense MLP down projection output",
                tags.MLP,
                ((*tags.IN_BLOCK, "embed"),),
                only_feeds_residual=True,
            ),
            lambda s: 2 * s.tokens * s.ffn * s.config.hidden_size,
            lambda s: ("matmul", s.ffn, s.config.hidden_size),
        ),
    )

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
        # One [tokens, embed] view for both projections: each reshape of x would be a residual of its own.
        rows, per_token = (x if zs.context_axes() else jnp.reshape(x, (-1, x.shape[-1]))), x.shape[:-1]  # (see `dense`)
        gate = tags.tag(_dense(rows, self.w_gate, cdt).reshape(*per_token, -1), MLPWI_0)
        up = tags.tag(_dense(rows, self.w_up, cdt).reshape(*per_token, -1), MLPWI_1)
        if zs.context_axes():
            # Pinned to [chunk, mlp shard] (and so their gradients): left free, the partitioner chose
            # the sequence split over every axis in the backward and then gathered whole sequences
            # of the MLP hidden to reach the tensor split (Llama 3.1 405B with sequence parallelism).
            gate, up = (zs.context_constrain(t, ("batch", None, "mlp")) for t in (gate, up))
        return tags.tag(_dense(gated(ACTIVATIONS[self.activation], gate, up), self.w_down, cdt), MLPWO)


def _dense(x, w, dtype):
    # A LoRA weight training with dropout (zoo.lora) runs its adapter apart; every other weight is `dense`.
    if not isinstance(w, LoRAWeight):
        return dense(x, w.astype(dtype))
    return project("CD,DF->CF", x.reshape(-1, x.shape[-1]), w, dtype).reshape(*x.shape[:-1], -1)


# The name of the Llama-style default (activation "silu").
SwiGLU = GatedMLP
