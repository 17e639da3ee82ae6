"""Causal self-attention: the shared score/softmax/context core and Llama's grouped-query attention."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo import tags
from zoo.config import RopeConfig
from zoo.nn._init import normal
from zoo.nn.rope import Rope


def resolve_attention_impl(impl: str, dtype, qk_dim: int, v_dim: int) -> str:
    """`auto` picks cuDNN flash attention on GPU for half precision and head dims it supports, else XLA."""
    if impl != "auto":
        return impl
    on_gpu = jax.default_backend() == "gpu"
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    supported = max(qk_dim, v_dim) <= 128 and qk_dim % 8 == 0
    return "cudnn" if on_gpu and half and supported else "xla"


def causal_attention(
    q: Float[Array, "batch seq heads qk"],
    k: Float[Array, "batch seq kv_heads qk"],
    v: Float[Array, "batch seq kv_heads v"],
    *,
    scale: float,
    impl: str = "auto",
) -> Float[Array, "batch seq heads v"]:
    """softmax(q k^T * scale + causal mask) v, scores and softmax in float32.

    `jax.nn.dot_product_attention` wants one head dim for q, k and v. When v's differs (MLA: q/k 192,
    v 128 in DeepSeek-V3) the XLA path computes the two einsums directly (no wasted FLOPs); the cuDNN
    path zero-pads v to the q/k head dim and slices the context back (cuDNN needs the fused kernel's
    shape; the padded columns cost (qk - v) / v extra context FLOPs, 50% for DeepSeek-V3).
    """
    impl = resolve_attention_impl(impl, q.dtype, q.shape[-1], v.shape[-1])
    v_dim = v.shape[-1]
    if v_dim == q.shape[-1]:
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=impl)
    if impl == "cudnn":
        pad = q.shape[-1] - v_dim
        v_padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, pad)))
        out = jax.nn.dot_product_attention(q, k, v_padded, scale=scale, is_causal=True, implementation=impl)
        return out[..., :v_dim]
    if k.shape[2] != q.shape[2]:
        # The einsum path is only used by MLA, where every query head has its own key head.
        raise ValueError(f"grouped heads with v dim {v_dim} != qk dim {q.shape[-1]} are not supported")
    seq = q.shape[1]
    scores = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bsnv->btnv", probs, v)


class GQAttention(eqx.Module):
    """Llama 3.x grouped-query attention: query head n reads kv head n // (heads / kv_heads)."""

    wq: Float[Array, "embed heads head_dim"]
    wk: Float[Array, "embed kv_heads head_dim"]
    wv: Float[Array, "embed kv_heads head_dim"]
    wo: Float[Array, "heads head_dim embed"]
    rope: Rope
    compute_dtype: str = eqx.field(static=True)
    impl: str = eqx.field(static=True)

    def __init__(
        self,
        embed: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        rope: RopeConfig,
        max_position_embeddings: int,
        *,
        param_dtype: str = "float32",
        compute_dtype: str = "float32",
        impl: str = "auto",
        key: PRNGKeyArray,
    ):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = normal(kq, (embed, heads, head_dim), embed, param_dtype)
        self.wk = normal(kk, (embed, kv_heads, head_dim), embed, param_dtype)
        self.wv = normal(kv, (embed, kv_heads, head_dim), embed, param_dtype)
        self.wo = normal(ko, (heads, head_dim, embed), heads * head_dim, param_dtype)
        self.rope = Rope(head_dim, rope, max_position_embeddings)
        self.compute_dtype = compute_dtype
        self.impl = impl

    def __check_init__(self):
        heads, kv_heads = self.wq.shape[-2], self.wk.shape[-2]
        if heads % kv_heads:
            raise ValueError(f"heads={heads} must be divisible by kv_heads={kv_heads}")

    def __call__(self, x: Float[Array, "batch seq embed"], positions: Int[Array, " seq"]) -> Float[Array, "batch seq embed"]:
        cdt = self.compute_dtype
        q = tags.tag(jnp.einsum("BTD,DNH->BTNH", x, self.wq.astype(cdt)), tags.QUERY_PROJ)
        k = tags.tag(jnp.einsum("BTD,DKH->BTKH", x, self.wk.astype(cdt)), tags.KEY_PROJ)
        v = tags.tag(jnp.einsum("BTD,DKH->BTKH", x, self.wv.astype(cdt)), tags.VALUE_PROJ)
        q, k = self.rope(q, positions), self.rope(k, positions)
        head_dim = q.shape[-1]
        context = tags.tag(causal_attention(q, k, v, scale=head_dim**-0.5, impl=self.impl), tags.CONTEXT)
        return tags.tag(jnp.einsum("BTNH,NHD->BTD", context, self.wo.astype(cdt)), tags.OUT_PROJ)
