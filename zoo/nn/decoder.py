"""The decoder layer: `DecoderBlock`, what it is made of for a config (`make_block`) and the classes
that declare its parameters and tags (`block_classes`).

A block reads `x + attn(norm(x))`, then `x + ffn(norm(x))` (Gemma 3 also normalises each branch's
output: sandwich norms); the attention is grouped-query (`GQAttention`, with the family's flags) or
latent (`MLAttention`), the feed-forward a gated MLP or a mixture of experts (`MoE`). zoo.model stacks
and scans them.
"""

import dataclasses
import functools
from typing import ClassVar, Optional, Union

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo import sharding as zs
from zoo import tags
from zoo.config import LayerSpec, ModelConfig
from zoo.nn.attention import GQAttention
from zoo.nn.cache import KVCache, LatentCache
from zoo.nn.mla import MLAttention
from zoo.nn.mlp import GatedMLP
from zoo.nn.moe import MoE, MoEAux
from zoo.nn.norm import RMSNorm

# One attention layer's decode-time cache (zoo.nn.cache).
LayerCache = Union[KVCache, LatentCache]


@tags.declares
class DecoderBlock(eqx.Module):
    attn_norm: RMSNorm
    attn: Union[GQAttention, MLAttention]
    post_attn_norm: Optional[RMSNorm]  # sandwich norms (Gemma 3)
    ffn_norm: RMSNorm
    ffn: Union[GatedMLP, MoE]
    post_ffn_norm: Optional[RMSNorm]

    # zoo.tags: the layer input, which no recomputation can produce (0 FLOPs). Its parameters are its
    # blocks', which declare them.
    EMITS: ClassVar[tuple[tags.Emit, ...]] = (
        tags.Emit(
            tags.TagInfo(
                tags.DECODER_LAYER_INPUT,
                "B T D",
                "residual stream entering a decoder layer",
                tags.LAYER,
                (("batch", "seq", "embed"),),
            ),
            lambda s: 0.0,
        ),
    )

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        positions: Int[Array, "*batch seq"],
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
    ) -> tuple[Float[Array, "batch seq embed"], Optional[MoEAux]]:
        x, aux, _ = self._forward(x, lambda h: (self.attn(h, positions, segment_ids), None))
        return x, aux

    def _forward(self, x, attention):
        """The block around `attention(normed x) -> (h, cache)`: residuals, norms, feed-forward."""
        # Under sequence parallelism (zoo.sharding.sequence_parallel) the residual stream, the norms and
        # the kept layer input stay split along the sequence over the tensor axis; the normed input is
        # gathered whole before the q/k/v and MLP-in projections, and each out-projection's partial
        # sums are reduce-scattered back to sequence shards.
        x = tags.tag(x, tags.DECODER_LAYER_INPUT)
        h, cache = attention(zs.sequence_gathered(self.attn_norm(x)))
        h = zs.sequence_scattered(h)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        normed = zs.sequence_gathered(self.ffn_norm(x))
        h, aux = self.ffn(normed) if isinstance(self.ffn, MoE) else (self.ffn(normed), None)
        h = zs.sequence_scattered(h)
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        return x + h, aux, cache

    def prefill(
        self, x: Float[Array, "batch seq embed"], lengths: Int[Array, " batch"], max_len: int
    ) -> tuple[Float[Array, "batch seq embed"], LayerCache]:
        """Prompts at positions 0..seq-1 and the cache they leave (see `GQAttention.prefill`)."""
        x, _, cache = self._forward(x, lambda h: self.attn.prefill(h, lengths, max_len))
        return x, cache

    def decode(
        self, x: Float[Array, "batch 1 embed"], positions: Int[Array, " batch"], cache: LayerCache
    ) -> tuple[Float[Array, "batch 1 embed"], LayerCache]:
        """One token per row at `positions` through the cache."""
        x, _, cache = self._forward(x, lambda h: self.attn.decode(h, positions, cache))
        return x, cache


def make_block(c: ModelConfig, spec: LayerSpec, key: PRNGKeyArray) -> DecoderBlock:
    ka, kf = jax.random.split(key)
    dtypes = dict(param_dtype=c.param_dtype, compute_dtype=c.compute_dtype)
    rope = c.layer_rope(spec)
    if c.uses_mla:
        attn = MLAttention(
            c.hidden_size, c.num_heads, c.mla, rope, c.max_position_embeddings, impl=c.attention_impl, key=ka, **dtypes
        )
    else:
        attn = GQAttention(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            rope,
            c.max_position_embeddings,
            bias=c.attention_bias,
            out_bias=c.attention_out_bias,
            qk_norm=c.qk_norm,
            norm_eps=c.rms_norm_eps,
            norm_weight_offset=c.norm_weight_offset,
            sinks=c.attention_sinks,
            window=spec.window,
            scale=None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar**-0.5,
            impl=c.attention_impl,
            key=ka,
            **dtypes,
        )
    if spec.moe:
        ffn = MoE(c.hidden_size, c.moe, key=kf, **dtypes)
    else:
        ffn = GatedMLP(c.hidden_size, c.intermediate_size, activation=c.mlp_activation, key=kf, **dtypes)

    def norm():
        return RMSNorm(c.hidden_size, eps=c.rms_norm_eps, weight_offset=c.norm_weight_offset, dtype=c.param_dtype)

    sandwich = c.sandwich_norms
    return DecoderBlock(norm(), attn, norm() if sandwich else None, norm(), ffn, norm() if sandwich else None)


@functools.cache
def block_classes(c: ModelConfig, spec: LayerSpec) -> tuple[type, ...]:
    """The module classes a layer of `spec` is made of, the DecoderBlock first and then what it holds
    (its attention, its feed-forward, a MoE's shared experts, the norms), read from the block
    `make_block` builds (as shapes: nothing is allocated). Their `EMITS` price its tags (zoo.tools.plan)."""
    found: dict[type, None] = {}

    def visit(module):
        found[type(module)] = None
        for f in dataclasses.fields(module):
            value = getattr(module, f.name, None)
            if isinstance(value, eqx.Module):
                visit(value)

    visit(jax.eval_shape(lambda key: make_block(c, spec, key), jax.random.key(0)))
    return tuple(found)
