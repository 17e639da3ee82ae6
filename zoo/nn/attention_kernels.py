"""Attention kernels as pure functions: an XLA reference, a blockwise (flash-style) pure-JAX path with
its own backward (`zoo.nn.blockwise_attention`), cuDNN's fused kernel (GPU) and Pallas splash
attention (TPU), behind one entry point, `attend`.

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
import functools
from collections.abc import Iterator
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from zoo import tags as zoo_tags
from zoo.backend import choices as backend_choices
from zoo.backend import pallas_interpret, target_platform
from zoo.nn.attention_masks import kv_segments, positions_mask
from zoo.nn.blockwise_attention import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, blockwise_attention

IMPLS = ("auto", "xla", "blockwise", "cudnn", "splash")

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
    kv_segment_ids = kv_segments(segment_ids, kv_segment_ids, q_len, kv_len)
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
    # What every path takes alike: the scale and the masks.
    masks = dict(scale=scale, causal=causal, window=window, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
    if impl == "splash":
        if offset != 0 or kv_len != q_len:
            raise _bad("splash aligns queries with keys from position 0 (q_offset 0, as many keys as queries)")
        out = splash_attention(q, k, v, sinks=sinks, residual_tag=tag, **masks)
        return out if tag is None else zoo_tags.tag(out, tag, checkpoint=False)
    if impl == "xla":
        out = xla_attention(q, k, v, sinks=sinks, q_offset=offset, kv_valid_len=kv_valid_len, **masks)
    elif impl == "blockwise":
        out = blockwise_attention(q, k, v, sinks=sinks, q_offset=offset, block_q=block_q, block_k=block_k, **masks)
    else:
        if offset != 0:
            raise _bad("cudnn aligns queries with keys from position 0; q_offset must be 0")
        out = cudnn_attention(q, k, v, max_segments=max_segments, **masks)
    return out if tag is None else zoo_tags.tag(out, tag)


# --- XLA reference -------------------------------------------------------------------------------


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
    keep = positions_mask(q_pos, k_pos, causal, window)  # [1 or batch, q_len, kv_len]
    if kv_valid_len is not None:
        keep = keep & (k_pos < kv_valid_len[:, None, None])
    kv_segment_ids = kv_segments(segment_ids, kv_segment_ids, q_len, kv_len)
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
    masks = dict(scale=scale, window=window, sinks=sinks, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
    if impl == "xla":
        if balanced:
            half = jnp.arange(q_len // 2, dtype=jnp.int32)
            q_positions = jnp.concatenate([shard * (q_len // 2) + half, (2 * shards - 1 - shard) * (q_len // 2) + half])
            return xla_attention(q, k, v, q_positions=q_positions, **masks)
        return xla_attention(q, k, v, q_offset=shard * q_len, **masks)
    pieces = 2 if balanced else 1
    return blockwise_attention(
        q, k, v, block_q=block_q, block_k=block_k, shard=shard, shards=shards, pieces=pieces, **masks
    )


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
    fused_backward: bool = True,
):
    """A splash kernel for one kv head's `group` query heads (the multi-query form: GQA runs it per
    kv head), its mask built once per shape (the kernel reads the mask's block structure, computed
    from it in numpy, to skip the tiles it masks whole). `fused_backward`: dq, dk and dv in one kernel
    (`splash_fused_backward`), else a dq kernel and a dk/dv kernel."""
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
        block_q_dq=None if fused_backward else bq,
        block_kv_dq=None if fused_backward else bk,
        use_fused_bwd_kernel=fused_backward,
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


def splash_dq_partial_bytes(batch: int, heads: int, q_len: int, kv_len: int, qk_dim: int, dtype) -> int:
    """What splash's fused backward writes beyond the one dq it returns: a partial dq of every query
    row per block of keys (`_splash_block(kv_len)`), in the queries' dtype, the head dim in whole
    lanes of 128, for `batch` rows of `heads` heads (the kernel's call, as traced)."""
    partials = kv_len // _splash_block(kv_len)
    lanes = -(-qk_dim // 128) * 128
    return (partials - 1) * batch * heads * q_len * lanes * np.dtype(dtype).itemsize


def splash_fused_backward(batch: int, heads: int, q_len: int, kv_len: int, qk_dim: int, dtype) -> bool:
    """Whether splash's backward runs as one fused kernel: while its extra dq partials
    (`splash_dq_partial_bytes`) stay within the TPU's `splash_fused_backward_max_bytes` (zoo.backend)."""
    limit = backend_choices("tpu").splash_fused_backward_max_bytes
    return limit is None or splash_dq_partial_bytes(batch, heads, q_len, kv_len, qk_dim, dtype) <= limit


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
    one multi-query kernel per kv head and row, its own backward (the fused dq/dk/dv kernel, or a dq
    kernel and a dk/dv kernel where the fused one's dq partials would be large:
    `splash_fused_backward`). The sequence lengths must be multiples of 128 (`resolve_impl` says
    which cases run). The queries are
    scaled before the kernel, in their own dtype. `residual_tag` names the residuals its backward
    reads (its output and logsumexp), for checkpoint policies."""
    batch, q_len, heads, qk_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    reason = _splash_refusal(target_platform(), q_len, kv_len)
    if reason:
        raise _bad(f"splash {reason}")
    group = heads // kv_heads
    fused = splash_fused_backward(batch, heads, q_len, kv_len, qk_dim, q.dtype)
    kernel = _splash_kernel(q_len, kv_len, group, causal, window, residual_tag, bool(pallas_interpret()), fused)
    qh = (q * jnp.asarray(scale, q.dtype)).reshape(batch, q_len, kv_heads, group, qk_dim).transpose(0, 2, 3, 1, 4)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [batch, kv_heads, kv_len, dim]
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(kv_heads, group)
    kv_segment_ids = kv_segments(segment_ids, kv_segment_ids, q_len, kv_len)

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
    kv_segment_ids = kv_segments(segment_ids, kv_segment_ids, q.shape[1], k.shape[1])
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
