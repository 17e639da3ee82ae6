"""DeepSeek-V3 multi-head latent attention (MLA)."""

import math
from typing import ClassVar, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo import sharding as zs
from zoo import tags
from zoo.config import DTypeLike, MLAConfig, RopeConfig, dtype_name
from zoo.nn.lora_weight import project
from zoo.nn import attention as gqa
from zoo.nn._init import normal
from zoo.nn.attention_kernels import attend
from zoo.nn.cache import LatentCache, from_prompt, visible_slots, write
from zoo.nn.context_parallel import context_attention, context_parallel
from zoo.nn.norm import RMSNorm
from zoo.nn.rope import Rope, softmax_scale_multiplier

# transformers' DeepSeek-V3 uses this eps for both latent norms, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def weight_shapes(embed: int, heads: int, mla: MLAConfig) -> dict[str, Optional[tuple[int, ...]]]:
    """Each weight's shape (None: absent, `wq_a` without a q LoRA), the one place they are written:
    `MLAttention` builds them, its tags' FLOPs are counted from them."""
    return {
        "wq_a": None if mla.q_lora_rank is None else (embed, mla.q_lora_rank),
        "wq_b": (mla.q_lora_rank or embed, heads, mla.qk_head_dim),
        "wkv_a": (embed, mla.kv_lora_rank + mla.qk_rope_head_dim),
        "wk_b": (mla.kv_lora_rank, heads, mla.qk_nope_head_dim),
        "wv_b": (mla.kv_lora_rank, heads, mla.v_head_dim),
        "wo": (heads, mla.v_head_dim, embed),
    }


def _widths(s: tags.FlopShape, field: str) -> tuple[int, int]:
    """Projection `field` of the model `s` describes, as one matmul: (what it reads, what it writes);
    an absent one (`wq_a` without a q LoRA) reads the embedding and writes nothing."""
    c = s.config
    shape = weight_shapes(c.hidden_size, c.num_heads, c.mla)[field]
    return (c.hidden_size, 0) if shape is None else MLAttention.PARAMS[field].widths(shape)


def _projection(info: tags.TagInfo, field: str) -> tags.Emit:
    """Tag `info` on projection `field`'s output: its FLOPs and matmul shape are the weight's."""
    return tags.Emit(
        info,
        lambda s: 2 * s.tokens * math.prod(_widths(s, field)),
        lambda s: ("matmul", _widths(s, field)[0], _widths(s, field)[1] or 1),
    )


@tags.declares
class MLAttention(eqx.Module):
    """Queries through a low-rank latent (or a plain projection), keys and values through a shared
    compressed latent, and one rope key shared by all heads.

    Per head, a query is `[nope | rope]` (qk_nope + qk_rope dims); a key is `[k_nope | shared rope key]`;
    a value has v_head_dim dims. The weights' shapes are `weight_shapes`; their axes `PARAMS`, which the
    tags' layouts and the per-head activations' axes are read from.
    """

    wq_a: Optional[Float[Array, "embed q_lora"]]
    q_norm: Optional[RMSNorm]
    wq_b: Float[Array, "q_in heads qk_dim"]  # q_in = q_lora, or embed when q_lora_rank is null
    wkv_a: Float[Array, "embed kv_lora_plus_rope"]
    kv_norm: RMSNorm
    wk_b: Float[Array, "kv_lora heads nope"]
    wv_b: Float[Array, "kv_lora heads v_dim"]
    wo: Float[Array, "heads v_dim embed"]
    rope: Rope
    softmax_scale: float = eqx.field(static=True)
    compute_dtype: str = eqx.field(static=True)
    impl: str = eqx.field(static=True)

    # zoo.sharding: each weight's logical axes; all are cast to the compute dtype (the latent norms
    # are RMSNorms, which declare their own). `latent`: the up-projections' inputs.
    PARAMS: ClassVar[dict[str, zs.Leaf]] = {
        "wq_a": zs.projection("embed", None),
        "wq_b": zs.projection("latent", "heads", None),
        "wkv_a": zs.projection("embed", None),
        "wk_b": zs.projection("latent", "heads", None),
        "wv_b": zs.projection("latent", "heads", None),
        "wo": zs.projection("heads", None, "embed", inputs=2),
    }
    # zoo.tags: the attention tags (GQA's records, MLA's FLOPs) and the latent ones, laid out as the
    # down-projections' outputs; the norms cost about 5 FLOPs per element. The q latent's are 0 when
    # q_lora_rank is null (they are not emitted).
    EMITS: ClassVar[tuple[tags.Emit, ...]] = (
        _projection(gqa.QUERY_PROJ, "wq_b"),
        _projection(gqa.KEY_PROJ, "wk_b"),
        _projection(gqa.VALUE_PROJ, "wv_b"),
        tags.Emit(gqa.CONTEXT, gqa.context_flops, gqa.context_op),
        _projection(gqa.OUT_PROJ, "wo"),
        _projection(
            tags.TagInfo(
                tags.QUERY_WA_PROJ,
                "B T R",
                "MLA q down-projection (q_a_proj) output; absent when q_lora_rank is null",
                tags.MLA,
                ((*tags.IN_BLOCK, *PARAMS["wq_a"].output_axes),),
            ),
            "wq_a",
        ),
        tags.Emit(
            tags.TagInfo(
                tags.MLA_Q,
                "B T R",
                "MLA q latent after its RMSNorm; absent when q_lora_rank is null",
                tags.MLA,
                ((*tags.IN_BLOCK, *PARAMS["wq_a"].output_axes),),
            ),
            lambda s: 5 * s.tokens * _widths(s, "wq_a")[1],
        ),
        _projection(
            tags.TagInfo(
                tags.KV_WA_PROJ,
                "B T L+P",
                "MLA kv down-projection (kv_a_proj_with_mqa) output: kv latent and the shared rope key",
                tags.MLA,
                ((*tags.IN_BLOCK, *PARAMS["wkv_a"].output_axes),),
            ),
            "wkv_a",
        ),
        tags.Emit(
            tags.TagInfo(
                tags.MLA_KV,
                "B T L",
                "MLA kv latent after its RMSNorm",
                tags.MLA,
                ((*tags.IN_BLOCK, *PARAMS["wkv_a"].output_axes),),
            ),
            lambda s: 5 * s.tokens * _widths(s, "wk_b")[0],  # the latent the up-projections read
        ),
    )

    def __init__(
        self,
        embed: int,
        heads: int,
        mla: MLAConfig,
        rope: RopeConfig,
        max_position_embeddings: int,
        *,
        param_dtype: DTypeLike = "float32",
        compute_dtype: DTypeLike = "float32",
        impl: str = "auto",
        key: PRNGKeyArray,
    ):
        param_dtype = dtype_name(param_dtype, "param_dtype")
        keys = jax.random.split(key, 6)
        for k, (field, shape) in zip(keys, weight_shapes(embed, heads, mla).items(), strict=True):
            made = None if shape is None else normal(k, shape, self.PARAMS[field].widths(shape)[0], param_dtype)
            setattr(self, field, made)

        def latent_norm(rank: int) -> RMSNorm:
            return RMSNorm(rank, eps=LATENT_NORM_EPS, dtype=param_dtype)

        self.q_norm = None if mla.q_lora_rank is None else latent_norm(mla.q_lora_rank)
        self.kv_norm = latent_norm(mla.kv_lora_rank)
        self.rope = Rope(mla.qk_rope_head_dim, rope, max_position_embeddings)
        self.softmax_scale = mla.qk_head_dim**-0.5 * softmax_scale_multiplier(rope)
        self.compute_dtype = dtype_name(compute_dtype, "compute_dtype")
        self.impl = impl

    def __check_init__(self):
        if (self.wq_a is None) != (self.q_norm is None):
            raise ValueError("MLA: wq_a and q_norm come together (q_lora_rank) or not at all")

    @property
    def kv_lora_rank(self) -> int:
        return self.wk_b.shape[-3]

    def _queries(self, x, positions):
        """(q_nope, rotated q_rope) per head."""
        cdt = self.compute_dtype
        if self.wq_a is None:
            q = project("BTD,DNH->BTNH", x, self.wq_b, cdt)
        else:
            q_latent = tags.tag(project("BTD,DR->BTR", x, self.wq_a, cdt), tags.QUERY_WA_PROJ)
            q_latent = tags.tag(self.q_norm(q_latent), tags.MLA_Q)
            q = project("BTR,RNH->BTNH", q_latent, self.wq_b, cdt)
        q = tags.tag(q, tags.QUERY_PROJ)
        rope_dim = self.rope.dim
        return q[..., :-rope_dim], self.rope(q[..., -rope_dim:], positions)

    def _latent(self, x, positions):
        """(normed kv latent [B T L], rotated shared rope key [B T P]): what the cache keeps."""
        kv = tags.tag(project("BTD,DC->BTC", x, self.wkv_a, self.compute_dtype), tags.KV_WA_PROJ)
        kv_latent, k_rope = kv[..., : self.kv_lora_rank], kv[..., self.kv_lora_rank :]
        kv_latent = tags.tag(self.kv_norm(kv_latent), tags.MLA_KV)
        return kv_latent, self.rope(k_rope[:, :, None, :], positions)[:, :, 0]  # one rope key for all heads

    def _output(self, context):
        """The out projection of the (already tagged) attention output."""
        return tags.tag(project("BTNV,NVD->BTD", context, self.wo, self.compute_dtype), tags.OUT_PROJ)

    def _forward(self, x, positions, segment_ids):
        cdt = self.compute_dtype
        q_nope, q_rope = self._queries(x, positions)
        kv_latent, k_rope = self._latent(x, positions)
        k_nope = tags.tag(project("BTL,LNH->BTNH", kv_latent, self.wk_b, cdt), tags.KEY_PROJ)
        v = tags.tag(project("BTL,LNV->BTNV", kv_latent, self.wv_b, cdt), tags.VALUE_PROJ)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate(
            [k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (*k_nope.shape[:-1], self.rope.dim))], axis=-1
        )
        if context_parallel():  # see GQAttention._forward
            context = context_attention(
                q, k, v, kv_logical=PER_HEAD[2], scale=self.softmax_scale, impl=self.impl, segment_ids=segment_ids
            )
            return self._output(tags.tag(context, tags.CONTEXT)), jnp.concatenate([kv_latent, k_rope], axis=-1)
        # Whole sequences into the kernel under sequence parallelism (see GQAttention._forward).
        q, k, v = (zs.sequence_gathered(t, PER_HEAD) for t in (q, k, v))
        context = attend(q, k, v, scale=self.softmax_scale, impl=self.impl, segment_ids=segment_ids, tag=tags.CONTEXT)
        context = zs.sequence_gathered(context, PER_HEAD)  # and so its gradient, in the backward
        return self._output(context), jnp.concatenate([kv_latent, k_rope], axis=-1)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        positions: Int[Array, "*batch seq"],
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
    ) -> Float[Array, "batch seq embed"]:
        return self._forward(x, positions, segment_ids)[0]

    # --- decoding with the latent cache (zoo.nn.cache) -----------------------------------------

    def prefill(
        self, x: Float[Array, "batch seq embed"], lengths: Int[Array, " batch"], max_len: int
    ) -> tuple[Float[Array, "batch seq embed"], LatentCache]:
        """The forward pass over prompts at positions 0..seq-1 and the latent cache they leave."""
        out, latent = self._forward(x, jnp.arange(x.shape[1], dtype=jnp.int32), None)
        return out, LatentCache(from_prompt(latent, lengths, max_len))

    def decode(
        self, x: Float[Array, "batch 1 embed"], positions: Int[Array, " batch"], cache: LatentCache
    ) -> tuple[Float[Array, "batch 1 embed"], LatentCache]:
        """One new token per row against the latent cache, with the up-projections absorbed (as
        DeepSeek-V3's inference does): q_nope . (W_kb c) = (W_kb^T q_nope) . c and
        softmax . (W_vb c) = W_vb (softmax . c), so per step the queries move into the latent space
        and attend to the cached latents as one shared key/value head; no per-head key or value of
        a cached token is ever formed."""
        cdt = self.compute_dtype
        q_nope, q_rope = self._queries(x, positions[:, None])
        kv_latent, k_rope = self._latent(x, positions[:, None])
        cache = LatentCache(write(cache.kv, jnp.concatenate([kv_latent, k_rope], axis=-1)[:, 0], positions))
        q_latent = jnp.einsum("BTNH,LNH->BTNL", q_nope, self.wk_b.astype(cdt))
        q = jnp.concatenate([q_latent, q_rope], axis=-1)
        keys = cache.kv[:, :, None, :]  # [B S 1 L+P]: the rope part scores against q_rope
        values = keys[..., : self.kv_lora_rank]
        visible = visible_slots(positions, cache.kv.shape[1])
        context_latent = attend(
            q, keys, values, scale=self.softmax_scale, impl="xla", causal=False, kv_valid_len=visible
        )
        context = jnp.einsum("BTNL,LNV->BTNV", context_latent, self.wv_b.astype(cdt))
        return self._output(tags.tag(context, tags.CONTEXT)), cache


# The per-head queries', keys', values' and context's axes (all heads: the keys and values are per
# query head), as the up-projections write them.
PER_HEAD = (*tags.IN_BLOCK, *MLAttention.PARAMS["wq_b"].output_axes)
