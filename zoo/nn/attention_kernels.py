"""Attention kernels as pure functions: an XLA reference, a blockwise (flash-style) pure-JAX path with
its own backward, cuDNN's fused kernel (GPU) and Pallas splash attention (TPU), behind one entry
point, `attend`.

Semantics shared by every path (the XLA path is the reference):

- grouped heads: query head n reads kv head n // (heads // kv_heads) (contiguous groups);
- scores, softmax statistics and accumulation in float32; the output in v's dtype;
- query t sits at position `q_offset + t` (default 0), key s at position s; `causal` keeps keys at
  or before the query; `window` W keeps the W keys ending at the query (q - W < s <= q);
- `segment_ids` keep query/key pairs of the same segment (packed documents);
- `sinks` (one float32 logit per query head) join the softmax denominator only;
- a query that sees no key (and has no sink) gets 0.
"""

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, linear_call
import numpy as np
from jaxtyping import Array, Float, Int

from zoo import tags as zoo_tags
from zoo._compat import linear_call_vmappable
from zoo.backend import choices as backend_choices
from zoo.backend import pallas_interpret, target_platform

IMPLS = ("auto", "xla", "blockwise", "cudnn", "splash")

# Tiles of 256 x 256: on the 2-core CPU machine (bench/attention_kernels.py attention, in git at 6966f25; batch 1, 8
# heads over 2, head dim 64, value and gradient) they were the fastest at T=4096 (1.2x faster than
# 512, 2x faster than 1024), within 8% of 128 at T=8192 and within noise of 64-128 at T<=1024.
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MASKED = -1e30  # the XLA path's score for a masked pair: far below any real one, and finite


# The bound on segments per row that attend() calls without their own `max_segments` take (see
# `segments_bound`).
_MAX_SEGMENTS: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("zoo_max_segments", default=None)


@contextlib.contextmanager
def segments_bound(max_segments: Optional[int]) -> Iterator[None]:
    """While tracing inside this block, `attend` calls that pass segment ids but no `max_segments`
    take this one: the static bound on documents per row that cuDNN's packed layout needs. It is a
    property of the data (the trainer sets it from the packed batches), which the model's layers do
    not carry. None: no bound (cuDNN is then not used for segment ids)."""
    token = _MAX_SEGMENTS.set(max_segments)
    try:
        yield
    finally:
        _MAX_SEGMENTS.reset(token)


def _bad(message: str) -> ValueError:
    return ValueError(f"model.attention_impl: {message}; valid choices: {', '.join(IMPLS)}")


def gpu_capabilities() -> tuple[Optional[tuple[int, int]], Optional[int]]:
    """(compute capability, cuDNN version as major*10000 + minor*100 + patch) of the first GPU; None
    where there is no GPU or the value cannot be read."""
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        return None, None
    capability = getattr(device, "compute_capability", None)
    capability = tuple(int(x) for x in capability.split(".")) if capability else None
    from zoo._compat import cudnn_version

    return capability, cudnn_version()


def resolve_impl(
    impl: str,
    *,
    backend: str,
    dtype,
    qk_dim: int,
    v_dim: int,
    seq_len: int,
    has_sinks: bool = False,
    has_segments: bool = False,
    max_segments: Optional[int] = None,
    decoding: bool = False,
    compute_capability: Optional[tuple[int, int]] = None,
) -> str:
    """The attention path `impl` ("auto", "xla", "blockwise", "cudnn", "splash") stands for, or a
    ValueError.

    `auto`: the backend's fused kernel where it can do the case (splash on TPU: `zoo.backend`),
    cuDNN on GPU for half precision where it can; otherwise blockwise from
    `min_blockwise_seq(backend)` query positions on; otherwise XLA. Decoding (`q_offset` /
    `kv_valid_len`) is XLA only. `compute_capability` (major, minor) defaults to the first GPU's.
    """
    if impl not in IMPLS:
        raise _bad(f"got {impl!r}")
    if decoding:
        if impl in ("auto", "xla"):
            return "xla"
        raise _bad(f"{impl} does not take q_offset / kv_valid_len (decoding); use xla or auto")
    if impl == "splash" or (impl == "auto" and backend_choices(backend).fused_attention == "splash"):
        splash_reason = _splash_refusal(backend, seq_len, kv_len=seq_len)
        if impl == "splash" and splash_reason:
            raise _bad(f"splash {splash_reason}")
        if splash_reason is None:
            return "splash"
    cudnn_reason = _cudnn_refusal(
        backend, dtype, qk_dim, v_dim, has_sinks, has_segments, max_segments, compute_capability
    )
    if impl == "cudnn":
        if cudnn_reason:
            raise _bad(f"cudnn {cudnn_reason}")
        return impl
    if impl != "auto":
        return impl
    if cudnn_reason is None:
        return "cudnn"
    return "blockwise" if seq_len >= min_blockwise_seq(backend) else "xla"


def min_blockwise_seq(backend: str) -> int:
    """The query length from which `auto` prefers the blockwise path to the XLA one (`zoo.backend`)."""
    return backend_choices(backend).blockwise_from_seq


def _splash_refusal(backend: str, seq_len: int, kv_len: int) -> Optional[str]:
    """Why splash attention cannot run this case, or None."""
    if backend != "tpu" and pallas_interpret(backend) is None:
        return f"is a TPU kernel (Pallas), and the backend is {backend}; use blockwise, xla or auto"
    for name, n in (("query", seq_len), ("key", kv_len)):
        if n % SPLASH_MIN_BLOCK:
            return (
                f"tiles the sequence in blocks of {SPLASH_MIN_BLOCK} or more, and the {name} length {n} is not "
                f"a multiple of {SPLASH_MIN_BLOCK}"
            )
    return None


def _cudnn_refusal(backend, dtype, qk_dim, v_dim, has_sinks, has_segments, max_segments, capability) -> Optional[str]:
    """Why cuDNN cannot run this case, or None."""
    if backend != "gpu":
        return f"needs a GPU (backend is {backend})"
    if jnp.dtype(dtype) not in _HALF:
        return f"needs bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
    if capability is None:
        capability = gpu_capabilities()[0] or (0, 0)
    hopper = tuple(capability) >= (9, 0)
    limit = 256 if hopper else 128
    # Unequal dims are either passed as they are (cuDNN >= 9.10 on Hopper) or padded to the larger.
    dim = max(qk_dim, v_dim)
    if dim > limit or qk_dim % 8 or v_dim % 8:
        return f"supports head dims that are multiples of 8 up to {limit} on this GPU, got q/k {qk_dim}, v {v_dim}"
    if has_sinks:
        return "has no attention sinks in JAX's cuDNN lowering"
    if has_segments and not hopper:
        return "takes segment ids (packed layout) only on Hopper or later"
    if has_segments and (max_segments is None or max_segments < 2):
        return "needs max_segments >= 2 (a static bound on segments per row) with segment ids"
    return None


def attend(
    q: Float[Array, "batch q_len heads qk"],
    k: Float[Array, "batch kv_len kv_heads qk"],
    v: Float[Array, "batch kv_len kv_heads v"],
    *,
    scale: float,
    impl: str = "auto",
    causal: bool = True,
    window: Optional[int] = None,
    sinks: Optional[Float[Array, " heads"]] = None,
    segment_ids: Optional[Int[Array, "batch q_len"]] = None,
    kv_segment_ids: Optional[Int[Array, "batch kv_len"]] = None,
    q_offset: Union[int, Int[Array, ""], Int[Array, " batch"], None] = None,
    kv_valid_len: Optional[Int[Array, " batch"]] = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    max_segments: Optional[int] = None,
    tag: Optional[str] = None,
) -> Float[Array, "batch q_len heads v"]:
    """softmax(q k^T * scale + masks [+ sink]) v; see the module docstring for the semantics.

    `impl`: "xla" materialises [batch, heads, q_len, kv_len] float32 scores; "blockwise" runs
    (block_q x block_k) tiles with an online softmax and a recomputing backward, skipping the tiles
    that causality and the window mask entirely (the lengths need not divide the blocks); "cudnn"
    is the fused GPU kernel; "auto" picks (`resolve_impl`).

    `kv_segment_ids` defaults to `segment_ids` when q_len == kv_len. `q_offset` (int, traced scalar
    or per-row [batch]) and `kv_valid_len` (keys s >= kv_valid_len[b] are ignored) are for decoding
    against a cache; a traced q_offset or any kv_valid_len takes the XLA path. The blockwise path
    also takes a Python int q_offset. `max_segments` bounds the segments per row for cuDNN's packed
    layout (segments must be contiguous runs there); None: the bound `segments_bound` sets, if any.

    `tag` (a `zoo.tags` name): the output is tagged with it for checkpoint policies. Splash tags its
    own residuals instead (the output in its head-major layout and the softmax statistics), so a
    policy that keeps or offloads the tag spares the backward pass the attention's recomputation;
    the returned output, a transpose of the tagged one, is then recomputed from it.
    """
    if max_segments is None and segment_ids is not None:
        max_segments = _MAX_SEGMENTS.get()
    batch, q_len, heads, qk_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"attention: heads={heads} must be a multiple of kv_heads={kv_heads}")
    if window is not None and (window < 1 or not causal):
        raise ValueError(f"attention: window={window} needs causal=True and window >= 1")
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"attention: sinks must have shape ({heads},), got {sinks.shape}")
    kv_segment_ids = _kv_segments(segment_ids, kv_segment_ids, q_len, kv_len)
    static_offset = q_offset is None or isinstance(q_offset, int)
    decoding = kv_valid_len is not None or not static_offset
    impl = resolve_impl(
        impl,
        backend=target_platform(),
        dtype=q.dtype,
        qk_dim=qk_dim,
        v_dim=v.shape[-1],
        seq_len=q_len,
        has_sinks=sinks is not None,
        has_segments=segment_ids is not None,
        max_segments=max_segments,
        decoding=decoding,
    )
    offset = 0 if q_offset is None else q_offset
    if impl == "splash":
        if offset != 0 or kv_len != q_len:
            raise _bad("splash aligns queries with keys from position 0 (q_offset 0, as many keys as queries)")
        out = splash_attention(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            window=window,
            sinks=sinks,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            residual_tag=tag,
        )
        return out if tag is None else zoo_tags.tag(out, tag, checkpoint=False)
    if impl == "xla":
        out = xla_attention(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            window=window,
            sinks=sinks,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            q_offset=offset,
            kv_valid_len=kv_valid_len,
        )
    elif impl == "blockwise":
        out = blockwise_attention(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            window=window,
            sinks=sinks,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            q_offset=offset,
            block_q=block_q,
            block_k=block_k,
        )
    else:
        if offset != 0:
            raise _bad("cudnn aligns queries with keys from position 0; q_offset must be 0")
        out = cudnn_attention(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            window=window,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            max_segments=max_segments,
        )
    return out if tag is None else zoo_tags.tag(out, tag)


def _kv_segments(segment_ids, kv_segment_ids, q_len, kv_len):
    if segment_ids is not None and kv_segment_ids is None:
        if kv_len != q_len:
            raise ValueError(f"attention: kv_segment_ids is needed when kv_len ({kv_len}) != q_len ({q_len})")
        return segment_ids
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("attention: segment_ids and kv_segment_ids come together")
    return kv_segment_ids


# --- XLA reference -------------------------------------------------------------------------------


def _positions_mask(q_pos, k_pos, causal, window):
    """[..., q, k] booleans from query and key positions (broadcastable)."""
    q_pos, k_pos = q_pos[..., :, None], k_pos[..., None, :]
    keep = jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
    if causal:
        keep &= k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    return keep


def xla_attention(
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
    q_offset: Union[int, Int[Array, ""], Int[Array, " batch"]] = 0,
    kv_valid_len: Optional[Int[Array, " batch"]] = None,
    q_positions: Optional[Int[Array, " q_len"]] = None,
) -> Float[Array, "batch q_len heads v"]:
    """The reference: whole [batch, heads, q_len, kv_len] float32 scores, plain autodiff.
    `q_positions`: each query's position, where they are not consecutive (balanced context
    parallelism); otherwise query t sits at q_offset + t."""
    batch, q_len, heads, qk_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    qg = q.reshape(batch, q_len, kv_heads, group, qk_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale

    offset = jnp.asarray(q_offset, jnp.int32).reshape(-1, 1)  # [1 or batch, 1]
    q_pos = offset + jnp.arange(q_len, dtype=jnp.int32) if q_positions is None else q_positions[None, :]
    k_pos = jnp.arange(kv_len, dtype=jnp.int32)
    keep = _positions_mask(q_pos, k_pos, causal, window)  # [1 or batch, q_len, kv_len]
    if kv_valid_len is not None:
        keep = keep & (k_pos < kv_valid_len[:, None, None])
    kv_segment_ids = _kv_segments(segment_ids, kv_segment_ids, q_len, kv_len)
    if segment_ids is not None:
        keep = keep & (segment_ids[:, :, None] == kv_segment_ids[:, None, :])
    # A finite fill keeps every step below free of inf - inf; rows that see no key come out
    # uniform over the masked keys and are zeroed at the end (a sink's exp(fill - sink) is 0).
    scores = jnp.where(keep[:, None, None], scores, _MASKED)
    shift = scores.max(axis=-1)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(kv_heads, group)[None, :, :, None]
        shift = jnp.maximum(shift, sink)
    shift = jax.lax.stop_gradient(shift)  # it cancels out of the softmax
    total = jnp.exp(scores - shift[..., None]).sum(axis=-1)
    if sinks is not None:
        total = total + jnp.exp(sink - shift)
    # Probabilities as exp(score - logsumexp), with no division over [q_len, kv_len] and no guards
    # on the row statistics: the value and gradient ran 1.8x faster on CPU than dividing by the
    # row sums, and 1.15x faster than guarding the statistics against empty rows (T=1024, 8 heads
    # over 2, head dim 64).
    probs = jnp.exp(scores - (jnp.log(total) + shift)[..., None])
    out = jnp.einsum("bkgts,bskv->btkgv", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = jnp.where(keep.any(axis=-1)[:, :, None, None, None], out, 0.0)
    return out.reshape(batch, q_len, heads, v.shape[-1]).astype(v.dtype)


# --- blockwise -----------------------------------------------------------------------------------


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
        keep = _positions_mask(q_pos, k_pos, self.causal, self.window) & (k_pos < self.kv_len)[None, :]
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
    kv_segment_ids = _kv_segments(segment_ids, kv_segment_ids, q_len, kv_len)
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


def context_shard_attention(
    q: Float[Array, "batch q_chunk heads qk"],
    k: Float[Array, "batch kv_len kv_heads qk"],
    v: Float[Array, "batch kv_len kv_heads v"],
    *,
    shard: Int[Array, ""],
    shards: int,
    scale: float,
    impl: str = "auto",
    window: Optional[int] = None,
    sinks: Optional[Float[Array, " heads"]] = None,
    segment_ids: Optional[Int[Array, "batch q_chunk"]] = None,
    kv_segment_ids: Optional[Int[Array, "batch kv_len"]] = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    balanced: bool = False,
) -> Float[Array, "batch q_chunk heads v"]:
    """Causal attention of one device's query chunk under context parallelism: the sequence is cut in
    `shards` equal chunks, this device holds chunk `shard` (traced: its axis index) of the queries
    and the keys/values of the whole sequence, so the chunk's queries sit at shard * q_chunk. Same
    semantics as `attend` on the whole sequence, restricted to the chunk's rows. `balanced`: the
    sequence is cut in 2 * shards and this device's queries are its chunks shard and
    2 * shards - 1 - shard, one half each, so that every device has about the same causal work; the
    keys and values stay in sequence order.

    `impl`: xla or blockwise (auto picks between them as `attend` would); cuDNN's kernel aligns its
    queries with the keys from position 0, so it cannot run a chunk: a ValueError."""
    q_len, kv_len = q.shape[1], k.shape[1]
    if q_len * shards != kv_len:
        raise ValueError(f"attention: {shards} query chunks of {q_len} do not make the {kv_len} keys")
    if impl == "cudnn":
        raise _bad(
            "cudnn cannot run context-parallel attention (mesh.context_parallel: its queries start at key 0); use "
            "blockwise or xla"
        )
    if impl not in IMPLS:
        raise _bad(f"got {impl!r}")
    if impl == "auto":
        impl = "blockwise" if kv_len >= min_blockwise_seq(target_platform()) else "xla"
    if balanced and q_len % 2:
        raise ValueError(f"attention: balanced context parallelism cuts each device's {q_len} queries in two halves")
    if impl == "xla":
        if balanced:
            half = jnp.arange(q_len // 2, dtype=jnp.int32)
            q_positions = jnp.concatenate([shard * (q_len // 2) + half, (2 * shards - 1 - shard) * (q_len // 2) + half])
            return xla_attention(
                q,
                k,
                v,
                scale=scale,
                window=window,
                sinks=sinks,
                segment_ids=segment_ids,
                kv_segment_ids=kv_segment_ids,
                q_positions=q_positions,
            )
        return xla_attention(
            q,
            k,
            v,
            scale=scale,
            window=window,
            sinks=sinks,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            q_offset=shard * q_len,
        )
    return blockwise_attention(
        q,
        k,
        v,
        scale=scale,
        window=window,
        sinks=sinks,
        segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
        block_q=block_q,
        block_k=block_k,
        shard=shard,
        shards=shards,
        pieces=2 if balanced else 1,
    )


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


# --- splash (Pallas, TPU) -------------------------------------------------------------------------

# Splash tiles the sequence in blocks that are multiples of 128 (the TPU's lanes); the largest of
# SPLASH_BLOCKS that divides the sequence is taken. TPU v5e, llama_1b's attention at 8 x 2048 (value
# and gradient): blocks of 1024 with the fused backward 13.2 ms, 512 fused 13.8, 512 unfused 17.0;
# at 2 x 8192: 32.8, 40.1, 46.9 ms (docs/benchmarks.md, "TPU v5e").
SPLASH_MIN_BLOCK = 128
SPLASH_BLOCKS = (1024, 512, 256, 128)


def _splash_block(n: int) -> int:
    return next(b for b in SPLASH_BLOCKS if n % b == 0)


@functools.lru_cache(maxsize=64)
def _splash_kernel(
    q_len: int,
    kv_len: int,
    group: int,
    causal: bool,
    window: Optional[int],
    residual_tag: Optional[str],
    interpret: bool,
):
    """A splash kernel for one kv head's `group` query heads (the multi-query form: GQA runs it per
    kv head), its mask built once per shape (the kernel reads the mask's block structure, computed
    from it in numpy, to skip the tiles it masks whole)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (q_len, kv_len)
    if window is not None:
        one = sm.LocalMask(shape, window_size=(window - 1, 0 if causal else None), offset=0)
    elif causal:
        one = sm.CausalMask(shape)
    else:
        one = sm.FullMask(shape)
    bq, bk = _splash_block(q_len), _splash_block(kv_len)
    blocks = sk.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        use_fused_bwd_kernel=True,
    )
    # Built outside the trace that first asks for it (the kernel is cached across traces: its mask
    # tables must not be one trace's values), and the tables kept as numpy, embedded in the program:
    # as the arrays the kernel makes of them, a step compiled ahead of time (jit(...).lower(...).compile(),
    # as train.py does) took them as extra arguments it was then called without (TPU v5e, JAX 0.10.2).
    with jax.ensure_compile_time_eval():
        kernel = sk.make_splash_mqa_single_device(
            sm.MultiHeadMask([one] * group),
            block_sizes=blocks,
            residual_checkpoint_name=residual_tag,
            interpret=interpret,
        )
    return jax.tree.map(np.asarray, kernel)


def splash_attention(
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
    residual_tag: Optional[str] = None,
) -> Float[Array, "batch q_len heads v"]:
    """Pallas splash attention (TPU; in Pallas' interpret mode inside `zoo.backend.pallas_interpreted`):
    one multi-query kernel per kv head and row, its own backward (the fused dq/dk/dv kernel). The
    sequence lengths must be multiples of 128 (`resolve_impl` says which cases run). The queries are
    scaled before the kernel, in their own dtype. `residual_tag` names the residuals its backward
    reads (its output and logsumexp), for checkpoint policies."""
    batch, q_len, heads, qk_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    reason = _splash_refusal(target_platform(), q_len, kv_len)
    if reason:
        raise _bad(f"splash {reason}")
    group = heads // kv_heads
    kernel = _splash_kernel(q_len, kv_len, group, causal, window, residual_tag, bool(pallas_interpret()))
    qh = (q * jnp.asarray(scale, q.dtype)).reshape(batch, q_len, kv_heads, group, qk_dim).transpose(0, 2, 3, 1, 4)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [batch, kv_heads, kv_len, dim]
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(kv_heads, group)
    kv_segment_ids = _kv_segments(segment_ids, kv_segment_ids, q_len, kv_len)

    def one_row(qr, kr, vr, q_seg, kv_seg):
        from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

        seg = None if q_seg is None else SegmentIds(q=q_seg, kv=kv_seg)
        per_head = jax.vmap(
            lambda qh_, kh_, vh_, s_: kernel(qh_, kh_, vh_, segment_ids=seg, sinks=s_),
            in_axes=(0, 0, 0, None if sink is None else 0),
        )
        return per_head(qr, kr, vr, sink)

    out = jax.vmap(one_row, in_axes=(0, 0, 0, None if segment_ids is None else 0, None if segment_ids is None else 0))(
        qh, kh, vh, segment_ids, kv_segment_ids
    )  # [batch, kv_heads, group, q_len, v]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, heads, v.shape[-1])


# --- cuDNN ---------------------------------------------------------------------------------------


def segments_to_packed(
    segment_ids: Int[Array, "batch seq"], max_segments: int
) -> tuple[Int[Array, "batch max_segments"], Int[Array, "batch max_segments_plus_one"]]:
    """(lengths [batch, M], starts [batch, M + 1]) of each row's contiguous runs of equal ids, -1
    past the last run: the packed layout of cuDNN's fused attention. Runs past the M-th are dropped
    (their queries then see nothing), so M must bound the runs per row."""
    batch, seq = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)

    def row(flags):
        first = jnp.nonzero(flags, size=max_segments + 1, fill_value=-1)[0].astype(jnp.int32)
        ends = jnp.concatenate([first[1:], jnp.full((1,), -1, jnp.int32)])
        ends = jnp.where((ends < 0) & (first >= 0), seq, ends)
        lengths = jnp.where(first >= 0, ends - first, -1)[:max_segments]
        return lengths, first.at[max_segments].set(-1)

    return jax.vmap(row)(starts)


def cudnn_attention(
    q: Float[Array, "batch q_len heads qk"],
    k: Float[Array, "batch kv_len kv_heads qk"],
    v: Float[Array, "batch kv_len kv_heads v"],
    *,
    scale: float,
    causal: bool = True,
    window: Optional[int] = None,
    segment_ids: Optional[Int[Array, "batch q_len"]] = None,
    kv_segment_ids: Optional[Int[Array, "batch kv_len"]] = None,
    max_segments: Optional[int] = None,
) -> Float[Array, "batch q_len heads v"]:
    """cuDNN's fused flash attention (GPU, half precision; `resolve_impl` says which cases).

    Equal head dims go through `jax.nn.dot_product_attention`. Unequal ones (MLA) and segment ids
    go through JAX's cuDNN lowering, which takes a v head dim of its own from cuDNN 9.10 on Hopper;
    elsewhere the smaller of the two is zero-padded (zero q/k columns add nothing to the scores,
    zero v columns are sliced off) at the cost of the padded FLOPs.

    Segment ids become cuDNN's packed layout (`segments_to_packed`), in which the m-th run of
    queries attends to the m-th run of keys: the same as matching ids when both come from one
    `segment_ids` whose equal ids are contiguous, as in packed documents.
    """
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    kv_segment_ids = _kv_segments(segment_ids, kv_segment_ids, q.shape[1], k.shape[1])
    if segment_ids is not None and (max_segments is None or max_segments < 2):
        raise _bad("cudnn needs max_segments >= 2 (a static bound on segments per row) with segment ids")
    if segment_ids is None and qk_dim == v_dim:
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            scale=scale,
            is_causal=causal,
            local_window_size=None if window is None else (window - 1, 0),
            implementation="cudnn",
        )
    from zoo._compat import cudnn_fused_attention

    fa = cudnn_fused_attention()

    capability, cudnn_version = gpu_capabilities()
    native_mla = capability is not None and capability >= (9, 0) and (cudnn_version or 0) >= 91000
    if qk_dim != v_dim and not native_mla:
        if v_dim < qk_dim:
            v = jnp.pad(v, [(0, 0)] * 3 + [(0, qk_dim - v_dim)])
        else:
            q = jnp.pad(q, [(0, 0)] * 3 + [(0, v_dim - qk_dim)])
            k = jnp.pad(k, [(0, 0)] * 3 + [(0, v_dim - qk_dim)])
    packed = {}
    if segment_ids is not None:
        q_lengths, q_starts = segments_to_packed(segment_ids, max_segments)
        kv_lengths, kv_starts = segments_to_packed(kv_segment_ids, max_segments)
        packed = dict(q_seqlen=q_lengths, kv_seqlen=kv_lengths, q_offsets=q_starts, kv_offsets=kv_starts)
        mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    else:
        mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    out = fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask, sliding_window_length=window, **packed)
    return out[..., :v_dim]
