"""Decoder blocks, scanned layer stacks, the causal LM and its loss.

One core serves both families: a block is `norm -> attention -> residual; norm -> MLP or MoE ->
residual`; Llama fills it with GQA + SwiGLU, DeepSeek-V3 with MLA + SwiGLU (dense prefix) or MLA + MoE.
Layers of a stack are stored stacked (leading layer axis) and run under `lax.scan`, so compile time
does not grow with depth, and the scan body is where checkpoint (remat/offload) policies apply.
"""

from typing import Callable, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from zoo import tags
from zoo.config import ModelConfig
from zoo.nn import GQAttention, MLAttention, MoE, MoEAux, RMSNorm, SwiGLU
from zoo.nn._init import normal

# A function applied to one layer's parameters inside the scan body, before use: e.g. moving
# host-resident weights to the device one layer at a time.
LayerTransform = Callable[[PyTree], PyTree]
# A function applied to the residual stream at every block boundary: e.g. a sharding constraint.
ActivationConstraint = Callable[[Array], Array]


class DecoderBlock(eqx.Module):
    attn_norm: RMSNorm
    attn: Union[GQAttention, MLAttention]
    ffn_norm: RMSNorm
    ffn: Union[SwiGLU, MoE]

    def __call__(
        self, x: Float[Array, "batch seq embed"], positions: Int[Array, " seq"]
    ) -> tuple[Float[Array, "batch seq embed"], Optional[MoEAux]]:
        x = tags.tag(x, tags.DECODER_LAYER_INPUT)
        x = x + self.attn(self.attn_norm(x), positions)
        h = self.ffn(self.ffn_norm(x))
        h, aux = h if isinstance(self.ffn, MoE) else (h, None)
        return x + h, aux


def make_block(c: ModelConfig, moe: bool, key: PRNGKeyArray) -> DecoderBlock:
    ka, kf = jax.random.split(key)
    dtypes = dict(param_dtype=c.param_dtype, compute_dtype=c.compute_dtype)
    if c.family == tags.LLAMA:
        attn = GQAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rope, c.max_position_embeddings,
                           impl=c.attention_impl, key=ka, **dtypes)
    else:
        attn = MLAttention(c.hidden_size, c.num_heads, c.mla, c.rope, c.max_position_embeddings,
                           impl=c.attention_impl, key=ka, **dtypes)
    ffn = MoE(c.hidden_size, c.moe, key=kf, **dtypes) if moe else SwiGLU(c.hidden_size, c.intermediate_size, key=kf, **dtypes)
    def norm():
        return RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.param_dtype)

    return DecoderBlock(norm(), attn, norm(), ffn)


class Stack(eqx.Module):
    """`num_layers` blocks of one structure; every array leaf of `layers` has a leading layer axis."""

    layers: DecoderBlock
    num_layers: int = eqx.field(static=True)

    def __init__(self, make: Callable[[PRNGKeyArray], DecoderBlock], num_layers: int, *, key: PRNGKeyArray):
        self.layers = eqx.filter_vmap(make)(jax.random.split(key, num_layers))
        self.num_layers = num_layers

    def __check_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"a Stack needs at least one layer, got {self.num_layers}")

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        positions: Int[Array, " seq"],
        *,
        remat_policy: Optional[Callable] = None,
        layer_transform: Optional[LayerTransform] = None,
        constrain: Optional[ActivationConstraint] = None,
    ) -> tuple[Float[Array, "batch seq embed"], Optional[MoEAux]]:
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, layer_params):
            if layer_transform is not None:
                layer_params = layer_transform(layer_params)
            if constrain is not None:
                h = constrain(h)
            h, aux = eqx.combine(layer_params, static)(h, positions)
            return (h if constrain is None else constrain(h)), aux

        if remat_policy is not None:
            # The policy decides, per tagged intermediate, what the backward pass keeps, offloads or recomputes.
            body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
        return jax.lax.scan(body, x, params)


class CausalLM(eqx.Module):
    """`model(tokens)`: int32 `[batch, seq]` -> float32 logits `[batch, seq, vocab]`."""

    embed: Float[Array, "vocab embed"]
    dense_layers: Optional[Stack]  # Llama: all layers; DeepSeek-V3: the first_k_dense_replace prefix
    moe_layers: Optional[Stack]
    final_norm: RMSNorm
    lm_head: Optional[Float[Array, "embed vocab"]]  # None when tied to the embedding
    config: ModelConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        ke, kd, km, kh = jax.random.split(key, 4)
        c = config
        self.embed = normal(ke, (c.vocab_size, c.hidden_size), c.hidden_size, c.param_dtype)
        self.dense_layers = Stack(lambda k: make_block(c, False, k), c.num_dense_layers, key=kd) if c.num_dense_layers else None
        self.moe_layers = Stack(lambda k: make_block(c, True, k), c.num_moe_layers, key=km) if c.num_moe_layers else None
        self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.param_dtype)
        self.lm_head = None if c.tie_word_embeddings else normal(kh, (c.hidden_size, c.vocab_size), c.hidden_size, c.param_dtype)
        self.config = config

    @property
    def stacks(self) -> tuple[Stack, ...]:
        return tuple(s for s in (self.dense_layers, self.moe_layers) if s is not None)

    def forward_with_aux(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        remat_policy: Optional[Callable] = None,
        layer_transform: Optional[LayerTransform] = None,
        constrain: Optional[ActivationConstraint] = None,
    ) -> tuple[Float[Array, "batch seq vocab"], Optional[MoEAux]]:
        """Logits and the MoE layers' routing statistics (stacked over MoE layers; None for Llama).

        `constrain` is applied to the residual stream `[batch seq embed]` at every block boundary.
        """
        c = self.config
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = jnp.take(self.embed, tokens, axis=0).astype(c.compute_dtype)
        aux = None
        for stack in self.stacks:
            x, stack_aux = stack(x, positions, remat_policy=remat_policy, layer_transform=layer_transform, constrain=constrain)
            aux = stack_aux if stack_aux is not None else aux
        x = self.final_norm(x)
        head = self.embed.T if self.lm_head is None else self.lm_head
        logits = jnp.einsum("BTD,DV->BTV", x, head.astype(c.compute_dtype), preferred_element_type=jnp.float32)
        return logits, aux

    def __call__(self, tokens: Int[Array, "batch seq"], **kwargs) -> Float[Array, "batch seq vocab"]:
        return self.forward_with_aux(tokens, **kwargs)[0]


def build(config: ModelConfig, *, key: PRNGKeyArray) -> CausalLM:
    """A randomly initialised model, built under jit: one compiled program rather than hundreds of
    eagerly dispatched initialiser ops (repeated builds of one config reuse it)."""
    return eqx.filter_jit(CausalLM)(config, key=key)


def abstract(config: ModelConfig) -> CausalLM:
    """The model with `jax.ShapeDtypeStruct` leaves: no memory, any size (DeepSeek-V3 671B included)."""
    return eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))


def next_token_loss(
    logits: Float[Array, "batch seq vocab"], tokens: Int[Array, "batch seq"], mask: Optional[Float[Array, "batch seq"]] = None
) -> Float[Array, ""]:
    """Mean cross-entropy of predicting tokens[:, t+1] from logits[:, t], in float32.

    `mask` (1 = count) weights the target positions; mask[:, 0] is ignored (no prediction targets it).
    """
    # Every position is scored against the next token (the last against a dummy target) and the last
    # position dropped from the [batch, seq] losses: slicing the [batch, seq, vocab] logits instead
    # copies the largest activation (and pads its gradient back); the head + loss ran 7-8% faster on CPU
    # (bench/ab_hotpath.py --part head).
    logits = logits.astype(jnp.float32)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = (logz - target_logit)[:, :-1]
    if mask is None:
        return nll.mean()
    weights = mask[:, 1:].astype(jnp.float32)
    return (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def loss_fn(model: CausalLM, tokens: Int[Array, "batch seq"], **kwargs) -> Float[Array, ""]:
    return next_token_loss(model(tokens, **kwargs), tokens)


def count_leaves(model: PyTree) -> int:
    """Parameters actually held by a (possibly abstract) model: the sum of its array leaves' sizes."""
    leaves = jax.tree_util.tree_leaves(model)
    return int(sum(x.size for x in leaves if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))))


def is_buffer_path(path) -> bool:
    """Leaves that are state, not parameters: the MoE correction bias (no gradient, no optimizer)."""
    return any(getattr(k, "name", None) == "e_score_correction_bias" for k in path)


def trainable_mask(model: CausalLM) -> PyTree:
    """Same structure as `model`; True for leaves the optimizer should update."""
    return jax.tree_util.tree_map_with_path(lambda p, _: not is_buffer_path(p), model)
