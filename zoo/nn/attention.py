"""Grouped-query attention (GQA), the attention of every family but DeepSeek-V3 (whose MLA lives in
`zoo.nn.mla`): Llama, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 3 and GPT-OSS differ only in flags (q/k/v and
output biases, per-head q/k RMSNorm, a sliding window, attention sinks, the softmax scale) and in
their rope. The softmax(q k^T) v core is `zoo.nn.attention_kernels.attend` (XLA, blockwise, cuDNN).
"""

from typing import ClassVar, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo import sharding as zs
from zoo import tags
from zoo.config import DTypeLike, RopeConfig, dtype_name
from zoo.nn.lora_weight import project
from zoo.nn._init import normal
from zoo.nn.attention_kernels import attend
from zoo.nn.cache import KVCache, cache_slots, from_prompt, visible_slots, write
from zoo.nn.context_parallel import context_attention, context_parallel
from zoo.nn.norm import RMSNorm
from zoo.nn.rope import Rope


# GQAttention's array fields: their logical axes and dtype in use (the projections and their biases
# are cast to the compute dtype; the sinks stay float32). The output projection reads heads x head_dim.
PARAMS: dict[str, zs.Leaf] = {
    "wq": zs.projection("embed", "heads", None),
    "wk": zs.projection("embed", "kv_heads", None),
    "wv": zs.projection("embed", "kv_heads", None),
    "wo": zs.projection("heads", None, "embed", inputs=2),
    "bq": zs.compute("heads", None),
    "bk": zs.compute("kv_heads", None),
    "bv": zs.compute("kv_heads", None),
    "bo": zs.compute(None),
    "sinks": zs.float32("heads"),
}
# Inside the block the per-head queries, keys, values and context, as the projections lay them out
# (the context is what the output projection reads).
QUERY_AXES = (*tags.IN_BLOCK, *PARAMS["wq"].output_axes)
KV_AXES = (*tags.IN_BLOCK, *PARAMS["wk"].output_axes)
CONTEXT_AXES = (*tags.IN_BLOCK, *PARAMS["wo"].axes[: PARAMS["wo"].inputs])

# The attention tags; MLA emits them too, with its own FLOPs (zoo.nn.mla).
QUERY_PROJ = tags.TagInfo(
    tags.QUERY_PROJ,
    "B T N H",
    "queries after the q projection (and its bias), before q-norm and RoPE (MLA: q_b_proj output)",
    tags.ATTENTION,
    (QUERY_AXES,),
)
KEY_PROJ = tags.TagInfo(
    tags.KEY_PROJ,
    "B T K H",
    "keys after the k projection (and its bias), before k-norm and RoPE (MLA: per-head nope keys from kv_b_proj)",
    tags.ATTENTION,
    (KV_AXES,),
)
VALUE_PROJ = tags.TagInfo(
    tags.VALUE_PROJ,
    "B T K H",
    "values after the v projection (MLA: per-head values from kv_b_proj)",
    tags.ATTENTION,
    (KV_AXES,),
)
# Splash attention names its own residuals under this tag, in its per-kv-head layout: the output
# (B, K, G, T, V) and the softmax statistics (B, K, G, T). The statistics share the length of the
# first layout, which the planner then reads for them; per-device bytes agree whichever heads dim a
# tensor-parallel rule divides.
CONTEXT = tags.TagInfo(
    tags.CONTEXT,
    "B T N V",
    "attention output, before the out projection",
    tags.ATTENTION,
    (CONTEXT_AXES, ("batch", "kv_heads", None, None, None)),
)
OUT_PROJ = tags.TagInfo(
    tags.OUT_PROJ,
    "B T D",
    "attention output after the out projection",
    tags.ATTENTION,
    ((*tags.IN_BLOCK, *PARAMS["wo"].output_axes),),
)


def context_flops(s: tags.FlopShape) -> int | float:
    """Scores and context products over the keys a query attends (causal: T/2; sliding: the window,
    as `zoo.counts.flops_per_token` counts them)."""
    c = s.config
    return 2 * s.batch * c.num_heads * s.seq * s.keys * (c.qk_head_dim + c.v_head_dim)


def context_op(s: tags.FlopShape) -> tags.Op:
    return ("attention", s.seq, s.config.qk_head_dim)


def _kv_proj_op(s: tags.FlopShape) -> tags.Op:
    return ("matmul", s.config.hidden_size, s.config.num_kv_heads * s.config.head_dim)


def out_proj_op(s: tags.FlopShape) -> tags.Op:
    return ("matmul", s.config.num_heads * s.config.v_head_dim, s.config.hidden_size)


def out_proj_flops(s: tags.FlopShape) -> int | float:
    c = s.config
    return 2 * s.tokens * c.num_heads * c.v_head_dim * c.hidden_size


@tags.declares
class GQAttention(eqx.Module):
    """Grouped-query attention: query head n reads kv head n // (heads / kv_heads).

    Optional parts, each `None` when the family lacks it: q/k/v biases (Qwen2, GPT-OSS), an output
    bias (GPT-OSS), per-head q/k RMSNorms over head_dim applied before RoPE (Qwen3, Gemma 3), and
    per-head sink logits (GPT-OSS).
    """

    wq: Float[Array, "embed heads head_dim"]
    wk: Float[Array, "embed kv_heads head_dim"]
    wv: Float[Array, "embed kv_heads head_dim"]
    wo: Float[Array, "heads head_dim embed"]
    bq: Optional[Float[Array, "heads head_dim"]]
    bk: Optional[Float[Array, "kv_heads head_dim"]]
    bv: Optional[Float[Array, "kv_heads head_dim"]]
    bo: Optional[Float[Array, " embed"]]
    q_norm: Optional[RMSNorm]
    k_norm: Optional[RMSNorm]
    sinks: Optional[Float[Array, " heads"]]
    rope: Rope
    scale: float = eqx.field(static=True)
    window: Optional[int] = eqx.field(static=True)
    compute_dtype: str = eqx.field(static=True)
    impl: str = eqx.field(static=True)

    # zoo.sharding: each array field's logical axes and dtype in use (`PARAMS` above).
    PARAMS: ClassVar[dict[str, zs.Leaf]] = PARAMS
    # zoo.tags: the tags it emits, each with its producer's forward FLOPs (matmuls: 2 * outputs * contraction).
    EMITS: ClassVar[tuple[tags.Emit, ...]] = (
        tags.Emit(
            QUERY_PROJ,
            lambda s: 2 * s.tokens * s.config.hidden_size * (s.config.num_heads * s.config.head_dim),
            lambda s: ("matmul", s.config.hidden_size, s.config.num_heads * s.config.head_dim),
        ),
        tags.Emit(
            KEY_PROJ,
            lambda s: 2 * s.tokens * s.config.hidden_size * s.config.num_kv_heads * s.config.head_dim,
            _kv_proj_op,
        ),
        tags.Emit(
            VALUE_PROJ,
            lambda s: 2 * s.tokens * s.config.hidden_size * s.config.num_kv_heads * s.config.head_dim,
            _kv_proj_op,
        ),
        tags.Emit(CONTEXT, context_flops, context_op),
        tags.Emit(OUT_PROJ, out_proj_flops, out_proj_op),
    )

    def __init__(
        self,
        embed: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        rope: RopeConfig,
        max_position_embeddings: int,
        *,
        bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_weight_offset: float = 0.0,
        sinks: bool = False,
        window: Optional[int] = None,
        scale: Optional[float] = None,
        param_dtype: DTypeLike = "float32",
        compute_dtype: DTypeLike = "float32",
        impl: str = "auto",
        key: PRNGKeyArray,
    ):
        kq, kk, kv, ko = jax.random.split(key, 4)
        param_dtype = dtype_name(param_dtype, "param_dtype")
        self.wq = normal(kq, (embed, heads, head_dim), embed, param_dtype)
        self.wk = normal(kk, (embed, kv_heads, head_dim), embed, param_dtype)
        self.wv = normal(kv, (embed, kv_heads, head_dim), embed, param_dtype)
        self.wo = normal(ko, (heads, head_dim, embed), heads * head_dim, param_dtype)
        zeros = lambda *shape: jnp.zeros(shape, param_dtype)  # noqa: E731
        self.bq, self.bk, self.bv = (
            (zeros(heads, head_dim), zeros(kv_heads, head_dim), zeros(kv_heads, head_dim))
            if bias
            else (None, None, None)
        )
        self.bo = zeros(embed) if out_bias else None
        norm = lambda: RMSNorm(head_dim, eps=norm_eps, weight_offset=norm_weight_offset, dtype=param_dtype)  # noqa: E731
        self.q_norm, self.k_norm = (norm(), norm()) if qk_norm else (None, None)
        self.sinks = zeros(heads) if sinks else None
        self.rope = Rope(head_dim, rope, max_position_embeddings)
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window
        self.compute_dtype = dtype_name(compute_dtype, "compute_dtype")
        self.impl = impl

    def __check_init__(self):
        heads, kv_heads = self.wq.shape[-2], self.wk.shape[-2]
        if heads % kv_heads:
            raise ValueError(f"heads={heads} must be divisible by kv_heads={kv_heads}")
        if (self.bq is None) != (self.bk is None) or (self.bk is None) != (self.bv is None):
            raise ValueError("GQAttention: q, k and v biases come together or not at all")
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("GQAttention: q_norm and k_norm come together or not at all")

    def _project(self, x, w, b, name: str):
        cdt = self.compute_dtype
        y = project("BTD,DKH->BTKH", x, w, cdt)
        if b is not None:
            y = y + b.astype(cdt)
        return tags.tag(y, name)

    def _queries_keys_values(self, x, positions):
        """q, k, v `[B T N|K H]` of `x`, q and k normed (where the family norms them) and rotated."""
        q = self._project(x, self.wq, self.bq, tags.QUERY_PROJ)
        k = self._project(x, self.wk, self.bk, tags.KEY_PROJ)
        v = self._project(x, self.wv, self.bv, tags.VALUE_PROJ)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rope(q, positions), self.rope(k, positions), v

    def _output(self, context):
        """The out projection of the (already tagged) attention output."""
        out = project("BTNH,NHD->BTD", context, self.wo, self.compute_dtype)
        if self.bo is not None:
            out = out + self.bo.astype(self.compute_dtype)
        return tags.tag(out, tags.OUT_PROJ)

    def _forward(self, x, positions, segment_ids):
        q, k, v = self._queries_keys_values(x, positions)
        if context_parallel():  # each device its own query chunk, the keys and values gathered once
            context = context_attention(
                q,
                k,
                v,
                kv_logical=KV_AXES[2],
                scale=self.scale,
                impl=self.impl,
                window=self.window,
                sinks=self.sinks,
                segment_ids=segment_ids,
            )
            return self._output(tags.tag(context, tags.CONTEXT)), k, v
        # Whole sequences into the kernel (split over heads): never sequence shards, which the
        # blockwise kernel's tiles would gather one by one.
        q = zs.sequence_gathered(q, QUERY_AXES)
        k, v = (zs.sequence_gathered(t, KV_AXES) for t in (k, v))
        context = attend(
            q,
            k,
            v,
            scale=self.scale,
            impl=self.impl,
            window=self.window,
            sinks=self.sinks,
            segment_ids=segment_ids,
            tag=tags.CONTEXT,
        )
        context = zs.sequence_gathered(context, CONTEXT_AXES)  # and so its gradient, in the backward
        return self._output(context), k, v

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        positions: Int[Array, "*batch seq"],
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
    ) -> Float[Array, "batch seq embed"]:
        return self._forward(x, positions, segment_ids)[0]

    # --- decoding with a cache (zoo.nn.cache) --------------------------------------------------

    def prefill(
        self, x: Float[Array, "batch seq embed"], lengths: Int[Array, " batch"], max_len: int
    ) -> tuple[Float[Array, "batch seq embed"], KVCache]:
        """The forward pass over prompts at positions 0..seq-1 (row b's first lengths[b] are real) and
        the cache of `max_len` positions they leave (a ring of `window` slots on a sliding layer)."""
        out, k, v = self._forward(x, jnp.arange(x.shape[1], dtype=jnp.int32), None)
        slots = cache_slots(max_len, self.window)
        return out, KVCache(from_prompt(k, lengths, slots), from_prompt(v, lengths, slots))

    def decode(
        self, x: Float[Array, "batch 1 embed"], positions: Int[Array, " batch"], cache: KVCache
    ) -> tuple[Float[Array, "batch 1 embed"], KVCache]:
        """One new token per row, at `positions`, against (and into) the cache."""
        q, k, v = self._queries_keys_values(x, positions[:, None])
        cache = KVCache(write(cache.k, k[:, 0], positions), write(cache.v, v[:, 0], positions))
        # Causality and the window are the slots' business (zoo.nn.cache): every visible slot counts.
        visible = visible_slots(positions, cache.k.shape[1])
        context = attend(
            q,
            cache.k,
            cache.v,
            scale=self.scale,
            impl="xla",
            causal=False,
            sinks=self.sinks,
            kv_valid_len=visible,
            tag=tags.CONTEXT,
        )
        return self._output(context), cache
