"""The blockwise (flash-style) attention kernel in pure JAX, with its own backward: tiles of
`block_q x block_k` with an online softmax, the tiles that causality and the window mask entirely
skipped, no more than one tile of scores kept by the forward or the backward pass. Its semantics are
`zoo.nn.attention_kernels`' (the entry point, `attend`, and its XLA reference)."""

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero, linear_call
from jaxtyping import Array, Float, Int

from zoo._compat import linear_call_vmappable
from zoo.nn.attention_masks import kv_segments, positions_mask

# Tiles of 256 x 256: on the 2-core CPU machine (bench/attention_kernels.py attention, in git at 6966f25; batch 1, 8
# heads over 2, head dim 64, value and gradient) they were the fastest at T=4096 (1.2x faster than
# 512, 2x faster than 1024), within 8% of 128 at T=8192 and within noise of 64-128 at T<=1024.
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256


@dataclasses.dataclass(frozen=True)
class _Tiling:
    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    scale: float
    causal: bool
    window: Optional[int]
    q_offset: int
    # Context parallelism (`context_shard_attention`): the queries are shard r of `shards` equal
    # chunks of the sequence, at q_offset + r * q_len, with r known only when traced (the device's
    # axis index). 1: the queries' position is q_offset, as everywhere else.
    shards: int = 1
    # 2: balanced context parallelism: shard r's queries are two pieces, chunks r and 2 * shards - 1 - r
    # of the sequence cut in 2 * shards (`block_q` divides a piece).
    pieces: int = 1

    @property
    def n_q(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def n_k(self) -> int:
        return -(-self.kv_len // self.block_k)

    def block_starts(self, shard: int) -> np.ndarray:
        """[n_q]: the global position of each query block's first query on shard `shard`."""
        local = np.arange(self.n_q) * self.block_q
        if self.pieces == 1:
            return self.q_offset + shard * self.q_len + local
        piece = self.q_len // self.pieces
        second = local // piece
        chunk = np.where(second == 0, shard, 2 * self.shards - 1 - shard)
        return self.q_offset + chunk * piece + local - second * piece

    def pairs(self, starts: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        """(query block, key block) of every tile with at least one pair that causality and the
        window keep, query block major (query block i starting at `starts[i]`; default: the
        tiling's queries from q_offset on)."""
        i = np.arange(self.n_q)[:, None]
        j = np.arange(self.n_k)[None, :]
        q_first = self.q_offset + i * self.block_q if starts is None else np.asarray(starts)[:, None]
        q_last = q_first + np.minimum((i + 1) * self.block_q, self.q_len) - i * self.block_q - 1
        k_first = j * self.block_k
        k_last = np.minimum((j + 1) * self.block_k, self.kv_len) - 1
        keep = np.ones((self.n_q, self.n_k), bool)
        if self.causal:
            keep &= k_first <= q_last
        if self.window is not None:
            keep &= k_last > q_first - self.window
        ii, jj = np.nonzero(keep)
        return ii.astype(np.int32), jj.astype(np.int32)

    def shard_pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Under context parallelism: (query block, key block, counts) tables [shards, steps], row r
        the visible tiles of shard r, padded to the longest row with tiles that `counts` (False)
        masks whole. Each device scans its own row (picked by its traced shard index), so that it
        visits only the tiles its queries see; the steps are those of the busiest shard, which every
        device waits for anyway: under causality the last of contiguous chunks (about twice the
        average), about the average with balanced pieces."""
        rows = [self.pairs(self.block_starts(r)) for r in range(self.shards)]
        steps = max(len(ii) for ii, _ in rows)
        ii, jj, ok = (np.zeros((self.shards, steps), dtype) for dtype in (np.int32, np.int32, bool))
        for r, (i, j) in enumerate(rows):
            ii[r, : len(i)], jj[r, : len(j)], ok[r, : len(i)] = i, j, True
        return ii, jj, ok

    def schedule(self, shard):
        """The scan's inputs: (i, j) per visible tile, and with shards a third, whether it counts."""
        if self.shards == 1:
            ii, jj = self.pairs()
            return jnp.asarray(ii), jnp.asarray(jj)
        ii, jj, ok = (jnp.asarray(t)[shard] for t in self.shard_pairs())
        return ii, jj, ok

    def tile_keep(self, i, j, q_seg, kv_seg, q_start=None):
        """[batch or 1, 1, 1, block_q, block_k]: the pairs of tile (i, j) that count (query block i
        starting at global position `q_start`, default the tiling's q_offset + i * block_q)."""
        q_start = self.q_offset + i * self.block_q if q_start is None else q_start
        q_pos = q_start + jnp.arange(self.block_q, dtype=jnp.int32)
        k_pos = j * self.block_k + jnp.arange(self.block_k, dtype=jnp.int32)
        keep = positions_mask(q_pos, k_pos, self.causal, self.window) & (k_pos < self.kv_len)[None, :]
        keep = keep[None]
        if q_seg is not None:
            keep = keep & (q_seg[:, :, None] == kv_seg[:, None, :])
        return keep[:, None, None]

    def masked(self, s, ij, q_seg, kv_seg, shard=None):
        """The tile `ij` = (i, j[, counts]) of scores `s` with the pairs that do not count at -inf.

        The mask is built here, per tile, from the tile's indices. Those indices (and the segment
        ids) do not depend on q, k or v, so without the barrier JAX's partial evaluation (under
        `jax.checkpoint`, or in a layer scan's backward) would compute every tile's mask, broadcast
        to the scores' shape, in a loop of its own, hoist it out of the layer scan as a loop
        invariant, and keep all of them at once: pred[tiles, batch, kv_heads, group, block_q,
        block_k] (8.5 GiB per device at DeepSeek-V3 671B). Tied to the scores, the indices are
        unknown wherever the scores are, so the mask stays inside the tile loop. The barrier costs
        nothing measurable on CPU: value and gradient at T=4096 (batch 1, 8 heads over 2, head dim
        64, float32) took 0.83 s with it and 0.88 s without (medians of 4, alternated; 2026-12-04)."""
        if len(ij) == 2:
            s, i, j = jax.lax.optimization_barrier((s, *ij))
            keep = self.tile_keep(i, j, _block(q_seg, i), _block(kv_seg, j))
            return jnp.where(keep, s, -jnp.inf)
        # Context parallelism: the queries' global position from the shard index (so the causal
        # mask and the window hold across shards), and a padding step (counts False) masked whole.
        s, i, j, counts, shard = jax.lax.optimization_barrier((s, *ij, shard))
        starts = jnp.asarray(np.stack([self.block_starts(r) for r in range(self.shards)]), jnp.int32)
        keep = self.tile_keep(i, j, _block(q_seg, i), _block(kv_seg, j), starts[shard, i]) & counts
        return jnp.where(keep, s, -jnp.inf)


def blockwise_attention(
    q: Float[Array, "batch q_len heads qk"],
    k: Float[Array, "batch kv_len kv_heads qk"],
    v: Float[Array, "batch kv_len kv_heads v"],
    *,
    scale: float,
    causal: bool = True,
    window: Optional[int] = None,
    sinks: Optional[Float[Array, " heads"]] = None,
    segment_ids: Optional[Int[Array, "batch q_len"]] = None,
    kv_segment_ids: Optional[Int[Array, "batch kv_len"]] = None,
    q_offset: int = 0,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    shard: Optional[Int[Array, ""]] = None,
    shards: int = 1,
    pieces: int = 1,
) -> Float[Array, "batch q_len heads v"]:
    """Flash-style attention in pure JAX: neither the forward nor the backward keeps more than one
    [batch, heads, block_q, block_k] tile of scores. Lengths that the blocks do not divide are
    padded (padded keys masked, padded queries dropped); blocks longer than a sequence shrink to it.

    `shard` (traced) of `shards`: the queries are that chunk of a sequence split in `shards` equal
    chunks, at q_offset + shard * q_len (context parallelism, `context_shard_attention`); with
    `pieces=2`, its two halves are chunks shard and 2 * shards - 1 - shard of the sequence cut in
    2 * shards (balanced context parallelism)."""
    if block_q < 1 or block_k < 1:
        raise ValueError(f"attention: block_q and block_k must be positive, got {block_q}, {block_k}")
    if (shard is None) != (shards == 1):
        raise ValueError(f"attention: a shard index comes with shards > 1 (got shards={shards})")
    batch, q_len, heads, qk_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q = min(block_q, q_len)
    if pieces > 1:  # every query block within one piece: the largest block size that divides a piece
        block_q = max(b for b in range(1, min(block_q, q_len // pieces) + 1) if (q_len // pieces) % b == 0)
    tiling = _Tiling(
        q_len, kv_len, block_q, min(block_k, kv_len), float(scale), causal, window, int(q_offset), shards, pieces
    )
    q_pad, k_pad = tiling.n_q * tiling.block_q - q_len, tiling.n_k * tiling.block_k - kv_len

    def blocks(x, pad, size, groups):
        # [batch, len, kv_heads, (group,) dim] -> [n_blocks, batch, kv_heads, (group,) block, dim]:
        # the layout in which every per-tile einsum below is a plain batched matmul.
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        n = x.shape[1] // size
        x = x.reshape(x.shape[0], n, size, *x.shape[2:])
        order = (1, 0, 3, 4, 2, 5) if groups else (1, 0, 3, 2, 4)
        return x.transpose(order)

    qb = blocks(q.reshape(batch, q_len, kv_heads, group, qk_dim), q_pad, tiling.block_q, True)
    kb = blocks(k, k_pad, tiling.block_k, False)
    vb = blocks(v, k_pad, tiling.block_k, False)
    kv_segment_ids = kv_segments(segment_ids, kv_segment_ids, q_len, kv_len)
    if segment_ids is None:
        q_seg = kv_seg = None
    else:
        # Padded positions are masked by position already; any id does.
        q_seg = jnp.pad(segment_ids, ((0, 0), (0, q_pad))).reshape(batch, tiling.n_q, tiling.block_q).transpose(1, 0, 2)
        kv_seg = (
            jnp.pad(kv_segment_ids, ((0, 0), (0, k_pad))).reshape(batch, tiling.n_k, tiling.block_k).transpose(1, 0, 2)
        )
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(kv_heads, group)

    out = _flash(tiling, qb, kb, vb, sink, q_seg, kv_seg, shard)  # [n_q, batch, kv_heads, group, block_q, v]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(batch, tiling.n_q * tiling.block_q, heads, v.shape[-1])
    return out[:, :q_len]


def _flash_forward(tiling: _Tiling, qb, kb, vb, sink, q_seg, kv_seg, shard):
    """Output [n_q, batch, kv_heads, group, block_q, v] and logsumexp (sink included) [n_q, batch,
    kv_heads, group, block_q], one scan step per visible tile."""
    n_q, batch, kv_heads, group, block_q, _ = qb.shape
    v_dim = vb.shape[-1]
    stats_shape = (n_q, batch, kv_heads, group, block_q)
    if sink is None:
        row_max = jnp.full(stats_shape, -jnp.inf, jnp.float32)
        denom = jnp.zeros(stats_shape, jnp.float32)
    else:
        # The sink starts the running softmax: exp(sink - max) is its share of the denominator.
        row_max = jnp.broadcast_to(sink[None, None, :, :, None], stats_shape)
        denom = jnp.ones(stats_shape, jnp.float32)
    acc = jnp.zeros((*stats_shape, v_dim), jnp.float32)

    def step(carry, ij):
        row_max, denom, acc = carry
        i, j = ij[:2]
        qi = jax.lax.dynamic_index_in_dim(qb, i, keepdims=False)
        kj = jax.lax.dynamic_index_in_dim(kb, j, keepdims=False)
        vj = jax.lax.dynamic_index_in_dim(vb, j, keepdims=False)
        s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * tiling.scale
        s = tiling.masked(s, ij, q_seg, kv_seg, shard)
        m_old = jax.lax.dynamic_index_in_dim(row_max, i, keepdims=False)
        m_new = jnp.maximum(m_old, s.max(axis=-1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key seen yet: keep exp() finite
        rescale = jnp.exp(m_old - shift)
        p = jnp.exp(s - shift[..., None])
        l_new = rescale * jax.lax.dynamic_index_in_dim(denom, i, keepdims=False) + p.sum(axis=-1)
        pv = jnp.einsum("bkgqs,bksv->bkgqv", p.astype(vb.dtype), vj, preferred_element_type=jnp.float32)
        a_new = rescale[..., None] * jax.lax.dynamic_index_in_dim(acc, i, keepdims=False) + pv
        return (
            jax.lax.dynamic_update_index_in_dim(row_max, m_new, i, 0),
            jax.lax.dynamic_update_index_in_dim(denom, l_new, i, 0),
            jax.lax.dynamic_update_index_in_dim(acc, a_new, i, 0),
        ), None

    (row_max, denom, acc), _ = jax.lax.scan(step, (row_max, denom, acc), tiling.schedule(shard))
    empty = denom == 0
    out = (acc / jnp.where(empty, 1.0, denom)[..., None]).astype(vb.dtype)
    # An empty row's probabilities are all masked to 0 in the backward whatever this value is.
    lse = jnp.where(empty, 0.0, row_max + jnp.log(jnp.where(empty, 1.0, denom)))
    return out, lse


def _block(x, i):
    return None if x is None else jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _flash(tiling, qb, kb, vb, sink, q_seg, kv_seg, shard):
    return _flash_forward(tiling, qb, kb, vb, sink, q_seg, kv_seg, shard)[0]


def _flash_jvp(tiling, primals, tangents):
    # A custom JVP, so that forward mode (jax.jvp, jax.linearize) works, whose tangent is a
    # `linear_call`: forward-mode AD of the blockwise forward, with FlashAttention-2's backward
    # (`_flash_bwd`) as its transpose. Reverse mode therefore runs the same backward a custom VJP
    # would, keeping one tile of scores at a time, instead of transposing the forward scan (which
    # would keep every tile's probabilities). Only the inputs that have a tangent (not a symbolic
    # zero: a constant key or value, say) are linear operands: a transpose needs all of them unknown.
    qb, kb, vb, sink, q_seg, kv_seg, shard = primals
    out, lse = _flash_forward(tiling, qb, kb, vb, sink, q_seg, kv_seg, shard)
    residuals = (qb, kb, vb, sink, q_seg, kv_seg, shard, out, lse)
    live = tuple(i for i in range(4) if primals[i] is not None and not isinstance(tangents[i], SymbolicZero))
    if not live:
        return out, jnp.zeros_like(out)

    def forward_tangent(res, lin):
        qb, kb, vb, sink, q_seg, kv_seg, shard = res[:7]
        args = (qb, kb, vb, sink)
        full = [None if x is None else jnp.zeros_like(x) for x in args]
        for i, t in zip(live, lin):
            full[i] = t

        def f(*a):
            return _flash_forward(tiling, *a, q_seg, kv_seg, shard)[0]

        return jax.jvp(f, args, tuple(full))[1]

    def transpose(res, d_out):
        grads = _flash_bwd(tiling, res, d_out)
        return tuple(grads[i] for i in live)

    linear_call_vmappable()  # jax.vmap through this reverse mode (per-example gradients) needs a rule jax lacks
    return out, linear_call(forward_tangent, transpose, residuals, tuple(tangents[i] for i in live))


_flash.defjvp(_flash_jvp, symbolic_zeros=True)


def _flash_bwd(tiling, residuals, d_out):
    """FlashAttention-2's backward: per tile, the probabilities from the saved logsumexp, then
    dS = P * (dO V^T - rowsum(dO * O)); dQ, dK, dV accumulate in float32."""
    qb, kb, vb, sink, q_seg, kv_seg, shard, out, lse = residuals
    delta = jnp.einsum("...v,...v->...", d_out.astype(jnp.float32), out.astype(jnp.float32))
    d_out = d_out.astype(vb.dtype)

    def step(carry, ij):
        dq, dk, dv = carry
        i, j = ij[:2]
        qi = jax.lax.dynamic_index_in_dim(qb, i, keepdims=False)
        kj = jax.lax.dynamic_index_in_dim(kb, j, keepdims=False)
        vj = jax.lax.dynamic_index_in_dim(vb, j, keepdims=False)
        doi = jax.lax.dynamic_index_in_dim(d_out, i, keepdims=False)
        s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * tiling.scale
        s = tiling.masked(s, ij, q_seg, kv_seg, shard)
        p = jnp.exp(s - jax.lax.dynamic_index_in_dim(lse, i, keepdims=False)[..., None])
        dp = jnp.einsum("bkgqv,bksv->bkgqs", doi, vj, preferred_element_type=jnp.float32)
        ds = p * (dp - jax.lax.dynamic_index_in_dim(delta, i, keepdims=False)[..., None]) * tiling.scale
        dv_j = jnp.einsum("bkgqs,bkgqv->bksv", p.astype(vb.dtype), doi, preferred_element_type=jnp.float32)
        dq_i = jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(kb.dtype), kj, preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(qb.dtype), qi, preferred_element_type=jnp.float32)

        def add(acc, x, at):
            return jax.lax.dynamic_update_index_in_dim(
                acc, jax.lax.dynamic_index_in_dim(acc, at, keepdims=False) + x, at, 0
            )

        return (add(dq, dq_i, i), add(dk, dk_j, j), add(dv, dv_j, j)), None

    zeros = functools.partial(jnp.zeros, dtype=jnp.float32)
    (dq, dk, dv), _ = jax.lax.scan(step, (zeros(qb.shape), zeros(kb.shape), zeros(vb.shape)), tiling.schedule(shard))
    d_sink = None
    if sink is not None:
        # d out / d sink = -p_sink * out, so dL/d sink = -sum over rows of p_sink * rowsum(dO * O).
        p_sink = jnp.exp(sink[None, None, :, :, None] - lse)
        d_sink = -(p_sink * delta).sum(axis=(0, 1, 4))
    return dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), d_sink, None, None, None
