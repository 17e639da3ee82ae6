"""The output head and the next-token loss, chunked over the sequence so that the float32 logits exist
only [batch, chunk, vocab] at a time, in the forward and in the backward. A chunk takes `chunk`
positions of every row, so under data parallelism each device works on its own rows in every chunk.

`chunked_next_token_loss(hidden, head, tokens, mask)` equals
`zoo.model.next_token_loss(einsum("BTD,DV->BTV", hidden, head) [softcapped], tokens, mask)`.

Packed documents (`zoo.data`): `target_weights(loss_mask, segment_ids)` is the mask to give it. Token
t is a target (predicted from the tokens before it) when `loss_mask[t]` says it counts and token t-1
is in the same segment: the first token of a document is never predicted from the document before
it, so the prediction made at a document's last token (its EOS, where the tokenizer has one) counts
for nothing, and the EOS itself is the last target of its document.
"""

import functools
import math
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from zoo import backend
from zoo import sharding as zs

# Sequence positions per chunk (of every row). Any size works (it need not divide the sequence).
# On the 2-core CPU machine (bench/attention_kernels.py loss at 6966f25, value and gradient) chunks of 512 to
# 2048 tokens ran within noise of each other and at 0.62-0.70x of the whole-logits loss's time;
# 512 positions keep a GPU microbatch of 2 x 4096 at 1024 tokens per chunk.
DEFAULT_CHUNK = 512
METHODS = ("fused", "recompute")

DType = Union[str, jnp.dtype, type, None]


def target_weights(
    loss_mask: Int[Array, "*batch seq"], segment_ids: Int[Array, "*batch seq"]
) -> Float[Array, "*batch seq"]:
    """1.0 where token t counts as a target: `loss_mask[t]` is set and token t-1 is in t's segment
    (so never at t = 0, nor at the first token of a document); else 0.0. The `mask` of the losses here."""
    same = jnp.concatenate(
        [jnp.zeros_like(segment_ids[..., :1], dtype=bool), segment_ids[..., 1:] == segment_ids[..., :-1]], axis=-1
    )
    return jnp.where(same & (loss_mask != 0), 1.0, 0.0).astype(jnp.float32)


def _targets_and_weights(tokens, mask, denominator=None):
    """Per position ([batch, seq]): the next token (0 past the end) and its weight in the mean, so
    that sum(weight * nll) is next_token_loss (or, with `denominator`, the weighted sum over it)."""
    batch, seq = tokens.shape
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    if mask is None:
        weights = jnp.ones((batch, seq - 1), jnp.float32)
        denom = jnp.float32(batch * (seq - 1))
    else:
        weights = mask[:, 1:].astype(jnp.float32)
        denom = jnp.maximum(weights.sum(), 1.0)
    if denominator is not None:
        denom = jnp.asarray(denominator, jnp.float32)
    weights = jnp.concatenate([weights / denom, jnp.zeros((batch, 1), jnp.float32)], axis=1)
    return targets, weights


def _chunked(x, chunk: int):
    """[batch, seq, ...] -> [ceil(seq / chunk), batch * chunk, ...]: chunk c holds positions
    [c*chunk, (c+1)*chunk) of every row, zero-padded (padded positions get weight 0). The batch stays
    the major part of each chunk's rows, so a batch-sharded input gives batch-sharded chunks."""
    batch, seq = x.shape[:2]
    pad = -seq % chunk
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(batch, -1, chunk, *x.shape[2:])
    x = jnp.moveaxis(x, 1, 0)
    return x.reshape(x.shape[0], batch * chunk, *x.shape[3:])


def _context_axes(seq: int) -> tuple[str, ...]:
    """The active layout's context axes (`zoo.sharding.context_axes`) when they divide `seq`, else ()."""
    axes = zs.context_axes()
    return axes if axes and seq % zs.context_shards() == 0 else ()


def _fold_context(x, context: tuple[str, ...]):
    """[batch, seq, ...] split along seq over the context axes -> [shards * batch, seq / shards, ...],
    sequence chunk major: each device's own chunk of the sequence becomes rows of its own, split over
    the context axes and then the batch axes, so the fold moves no data. Under context parallelism the
    loss then works on the chunks each device holds; chunked as they came, the whole sequence was
    all-gathered on every device and its loss computed once per context rank."""
    layout = zs.active()
    shards = zs.context_shards()
    batch, seq = x.shape[:2]
    x = jnp.moveaxis(x.reshape(batch, shards, seq // shards, *x.shape[2:]), 1, 0)
    x = x.reshape(shards * batch, seq // shards, *x.shape[3:])
    rows = context + tuple(a for a in layout.mesh_axes("batch") if a not in context)
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(layout.mesh, P(rows, *[None] * (x.ndim - 1))))


def _unchunked(x, batch: int, seq: int):
    """The inverse of `_chunked` (padding dropped)."""
    chunks, rows = x.shape[:2]
    x = x.reshape(chunks, batch, rows // batch, *x.shape[2:])
    x = jnp.moveaxis(x, 0, 1).reshape(batch, chunks * (rows // batch), *x.shape[3:])
    return x[:, :seq]


def _logits(h, head, softcap):
    """[rows, vocab] float32 logits (softcapped) and, for the backward, d softcapped / d raw."""
    logits = jnp.einsum("CD,DV->CV", h, head, preferred_element_type=jnp.float32)
    if softcap is None:
        return logits, None
    capped = softcap * jnp.tanh(logits / softcap)
    return capped, 1.0 - jnp.square(capped / softcap)


def head_gradient(h: Float[Array, "rows embed"], d_logits: Float[Array, "rows vocab"]) -> Float[Array, "embed vocab"]:
    """`einsum("CD,CV->DV", h, d_logits)` accumulated in float32: one chunk's share of the head's gradient.

    On CPU it is a product over a copy of `h` transposed to [embed, rows]. XLA:CPU gives a dot whose
    left operand contracts its major (row) axis to its own Eigen kernel instead of YNNPACK (train.py's
    `xla.cpu_ynn_fusions: dot`): alone, the [512, 512] x [512, 32000] product ran at 165 against 177
    GFLOP/s on the 2-core machine (bench/weight_grad_dot.py, in git at 6966f25), and in the step, where Eigen's dot
    shares the cores, the whole step took 1-3% less; the barrier keeps XLA from folding the
    transpose back into the dot. The copy is [rows, embed], small beside the [embed, rows, vocab]
    product. Other backends take the transposed operand as it is, and so does a bfloat16 model on CPU:
    for bfloat16 operands XLA:CPU first writes the [rows, vocab] gradient out in float32 for YNNPACK
    (33 MB more temp in bench/cpu.py's MoE step, for 0-3% of its time). docs/benchmarks.md, "The
    head's gradient through YNNPACK", has the step-level A/B."""
    if backend.choices().head_grad_rows_last and h.dtype == d_logits.dtype == jnp.float32:
        rows_last = jax.lax.optimization_barrier(h.T)
        return jnp.einsum("DC,CV->DV", rows_last, d_logits, preferred_element_type=jnp.float32)
    return jnp.einsum("CD,CV->DV", h, d_logits, preferred_element_type=jnp.float32)


def _nll(logits, targets):
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0], lse


def _check(chunk_size: int, method: str) -> None:
    if chunk_size < 1:
        raise ValueError(f"loss.chunk_size must be a positive number of positions, got {chunk_size}")
    if method not in METHODS:
        raise ValueError(f"loss.method: got {method!r}; choose one of {', '.join(METHODS)}")


def chunked_next_token_loss(
    hidden: Float[Array, "batch seq embed"],
    head: Float[Array, "embed vocab"],
    tokens: Int[Array, "batch seq"],
    mask: Optional[Float[Array, "batch seq"]] = None,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    final_softcap: Optional[float] = None,
    compute_dtype: DType = None,
    method: str = "fused",
    denominator: Union[float, Float[Array, ""], None] = None,
    context_order: bool = False,
) -> Float[Array, ""]:
    """Mean cross-entropy of predicting tokens[:, t+1] from `hidden[:, t] @ head`, in float32.

    The logits are `einsum(hidden, head)` in `compute_dtype` (default: hidden's) with float32
    accumulation, then `c * tanh(logits / c)` for `final_softcap` c. `mask` (1 = count) weights the
    target positions as in next_token_loss; no gradient flows to it. `denominator` replaces the
    mean's (the mask's sum): the weighted sum over a count taken elsewhere (all of a step's
    microbatches), or with 1.0 the plain sum. `context_order`: under balanced context parallelism,
    `hidden` comes in the balanced order (`zoo.model.run_layers(..., context_order=True)`); the
    targets and weights are taken into it (the loss is a sum over positions, whatever their order).

    `method`: "fused" computes each chunk's gradients (wrt hidden and head) in the forward pass, while
    its logits exist, and the backward only scales them; "recompute" checkpoints each chunk and
    recomputes its logits in the backward (one more [chunk, embed] x [embed, vocab] matmul per chunk).
    "fused" was faster on CPU (bench/attention_kernels.py loss at 6966f25, at every chunk size from 256 to
    2048 but one noisy sample: 0.63-0.70x of the whole-logits time at V=32000 against 0.72-0.86x for
    "recompute"). When only the value is asked for (no differentiation) it computes no gradients.
    """
    _check(chunk_size, method)
    cdt = hidden.dtype if compute_dtype is None else jnp.dtype(compute_dtype)
    targets, weights = _targets_and_weights(tokens, mask, denominator)
    shards = zs.context_balanced() if context_order else 0
    if shards:
        targets, weights = (zs.to_context_order(x, shards) for x in (targets, weights))
    context = _context_axes(hidden.shape[1])
    if context:
        hidden, targets, weights = (_fold_context(x, context) for x in (hidden, targets, weights))
    batch, seq, embed = hidden.shape
    chunk = min(chunk_size, seq)
    h = _chunked(hidden, chunk)
    targets, weights = _chunked(targets, chunk), _chunked(weights, chunk)
    softcap = None if final_softcap is None else float(final_softcap)
    plan = _vocab_parallel_plan(head.shape, batch * chunk, context) if method == "fused" else None
    if plan is not None:
        return _vp_loss(softcap, cdt, plan, h, head, targets, weights)
    if method == "fused":
        return _fused_loss(softcap, cdt, head.dtype, h, head, targets, weights)
    return _recompute_loss(h, head, targets, weights, softcap, cdt)


def _recompute_loss(h, head, targets, weights, softcap, cdt):
    w = head.astype(cdt)

    @jax.checkpoint
    def chunk_loss(h_c, t_c, w_c):
        logits, _ = _logits(h_c.astype(cdt), w, softcap)
        return (_nll(logits, t_c)[0] * w_c).sum()

    def step(total, xs):
        return total + chunk_loss(*xs), None

    return jax.lax.scan(step, jnp.float32(0), (h, targets, weights))[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _fused_loss(softcap, cdt, head_dtype, h, head, targets, weights):
    w = head.astype(cdt)

    def step(total, xs):
        h_c, t_c, w_c = xs
        logits, _ = _logits(h_c.astype(cdt), w, softcap)
        return total + (_nll(logits, t_c)[0] * w_c).sum(), None

    return jax.lax.scan(step, jnp.float32(0), (h, targets, weights))[0]


def _fused_loss_and_grads(softcap, cdt, head, h, targets, weights):
    """The loss and its gradients wrt h (chunked like h) and head (float32), in one pass over the chunks."""
    w = head.astype(cdt)
    vocab = head.shape[1]

    def step(carry, xs):
        total, d_head = carry
        h_c, t_c, w_c = xs
        h_c = h_c.astype(cdt)
        logits, d_cap = _logits(h_c, w, softcap)
        nll, lse = _nll(logits, t_c)
        # d(w * nll) / d logits = w * (softmax - onehot(target))
        d_logits = jnp.exp(logits - lse[:, None]) - (jnp.arange(vocab)[None, :] == t_c[:, None])
        d_logits = d_logits * w_c[:, None]
        if d_cap is not None:
            d_logits = d_logits * d_cap
        d_logits = d_logits.astype(cdt)
        d_h = jnp.einsum("CV,DV->CD", d_logits, w, preferred_element_type=jnp.float32)
        d_head = d_head + head_gradient(h_c, d_logits)
        return (total + (nll * w_c).sum(), d_head), d_h.astype(h.dtype)

    init = (jnp.float32(0), jnp.zeros(head.shape, jnp.float32))
    (total, d_head), d_h = jax.lax.scan(step, init, (h, targets, weights))
    return total, d_h, d_head


@_fused_loss.defjvp
def _fused_loss_jvp(softcap, cdt, head_dtype, primals, tangents):
    # The loss is a scalar, so its tangent is <dL/dh, dh> + <dL/dhead, dhead>: linear in the tangents,
    # with the gradients computed in the forward pass while each chunk's logits exist. Reverse mode
    # transposes this into g * dL/dh and g * dL/dhead (only scaling, as a custom VJP would), and
    # forward mode (jax.jvp, jax.linearize) works too. The mask `weights` gets no tangent: no gradient
    # flows to it.
    h, head, targets, weights = primals
    dh, dhead = tangents[0], tangents[1]
    total, d_h, d_head = _fused_loss_and_grads(softcap, cdt, head, h, targets, weights)
    # (elementwise products and sums, not vdot: transposed, they are scalings, not more matmuls)
    tangent = (d_h.astype(jnp.float32) * dh.astype(jnp.float32)).sum() + (d_head * dhead.astype(jnp.float32)).sum()
    return total, tangent


def chunked_next_token_nll(
    hidden: Float[Array, "batch seq embed"],
    head: Float[Array, "embed vocab"],
    tokens: Int[Array, "batch seq"],
    *,
    chunk_size: int = DEFAULT_CHUNK,
    final_softcap: Optional[float] = None,
    compute_dtype: DType = None,
) -> Float[Array, "batch seq_minus_one"]:
    """The per-prediction losses: [b, t] is -log p(tokens[b, t+1] | hidden[b, t]), float32, chunked
    like `chunked_next_token_loss` (checkpointed chunks: differentiable without whole logits)."""
    _check(chunk_size, "recompute")
    batch, seq, embed = hidden.shape
    cdt = hidden.dtype if compute_dtype is None else jnp.dtype(compute_dtype)
    chunk = min(chunk_size, seq)
    targets, _ = _targets_and_weights(tokens, None)
    h = _chunked(hidden, chunk)
    w = head.astype(cdt)
    softcap = None if final_softcap is None else float(final_softcap)

    @jax.checkpoint
    def chunk_nll(h_c, t_c):
        return _nll(_logits(h_c.astype(cdt), w, softcap)[0], t_c)[0]

    nll = jax.lax.map(lambda xs: chunk_nll(*xs), (h, _chunked(targets, chunk)))
    return _unchunked(nll, batch, seq)[:, :-1]


# ---- vocabulary-parallel fused loss ------------------------------------------------------------------
# Under a mesh, the fused loss runs as one shard_map over the whole mesh: each device takes its own rows
# (split over the batch axes) and its own columns of the head (split over the vocab axes, those that do
# not also split the batch), and the logsumexp is combined across the vocab shards (a max and a sum of
# [rows] per chunk). The head's gradient stays per device, unreduced, in float32 across the chunks and
# is summed over the batch axes once, after the last chunk, in the compute dtype: a reduce-scatter onto
# the head's own embed shards (a psum over any batch axis that does not shard the embed dim). Without
# this the partitioner gathered the head whole and all-reduced a float32 [embed, vocab] partial
# gradient in every chunk (44 GB of float32 all-reduces per step at 671B).
# A vocab axis that also splits the batch ("shared": DeepSeek-V3 671B's preset splits the vocabulary
# over `expert`, whose devices hold different rows) gathers the chunk's rows of its group first, so
# each device holds 1/n of the head and of its gradient instead of all of it; the rows' hidden-state
# gradients are reduce-scattered back to their devices.


class VocabPlan(NamedTuple):
    """How the vocabulary-parallel loss and lookup split their work over the mesh (mesh axis names)."""

    mesh: Any
    batch: tuple  # split the rows
    vocab: tuple  # split the head's columns (own axes first, then the shared ones)
    scatter: tuple  # batch axes the head's gradient is reduce-scattered over (its embed shards)
    shared: tuple  # split both the rows and the vocabulary: each group's rows are gathered
    embed: tuple  # the head's embed axes left when the vocabulary takes its own


@functools.lru_cache(maxsize=None)
def _plan_for(mesh, rules_items, head_shape, rows, context):
    rules = dict(rules_items)
    sizes = dict(mesh.shape)

    def axes(name, exclude=()):
        return tuple(a for a in rules.get(name, ()) if a in sizes and sizes[a] > 1 and a not in exclude)

    batch = context + axes("batch", exclude=context)  # folded sequence chunks are rows too, major (_fold_context)
    shared = tuple(a for a in axes("vocab") if a in batch)
    vocab = axes("vocab", exclude=batch) + shared
    # The head's embed dim splits over these (the param's spec); only those that also split the rows can
    # take a reduce-scatter of the gradient.
    embed = axes("embed", exclude=vocab)
    scatter = tuple(a for a in embed if a in batch)
    if not batch and not vocab:
        return None
    n_batch, n_vocab, n_scatter = (math.prod(sizes[a] for a in t) for t in (batch, vocab, scatter))
    if rows % n_batch or head_shape[1] % n_vocab:
        return None  # (the config check names the key: a vocabulary must divide its shards)
    if head_shape[0] % n_scatter:
        scatter = ()
    return VocabPlan(mesh, batch, vocab, scatter, shared, embed)


def _vocab_parallel_plan(head_shape, rows, context=()):
    """The `VocabPlan` of the active layout, or None (no mesh: the single-device path, unchanged).
    `context`: the context axes whose sequence chunks are folded into the rows (`_fold_context`)."""
    layout = zs.active()
    if layout is None:
        return None
    rules = tuple((k, tuple(v)) for k, v in sorted(layout.rules.items()))
    return _plan_for(layout.mesh, rules, tuple(head_shape), rows, tuple(context))


def vocab_parallel_lookup(
    table: Float[Array, "vocab embed"], tokens: Int[Array, "batch seq"]
) -> Optional[Float[Array, "batch seq embed"]]:
    """The embedding lookup split over the vocabulary where a vocab axis also splits the batch (a
    shared axis, as the loss's): each device gathers its group's tokens, looks up those in its
    `[vocab / n, embed]` rows (zeros elsewhere), and the rows are summed across the vocab shards and
    reduce-scattered back to their devices; the gradient lands in each device's own rows, never a
    whole `[vocab, embed]` table. Under context parallelism (tokens split along the sequence over the
    context axes) each device looks up its own chunk in its vocabulary rows the same way; left to the
    partitioner, that lookup gathered the whole table on every device. None where neither applies
    (the partitioner's own lookup, over a table constrained to its vocab shards, is then the caller's)."""
    vocab_size, embed = table.shape
    batch_size, seq = tokens.shape
    context = _context_axes(seq)
    plan = _vocab_parallel_plan((embed, vocab_size), batch_size * (zs.context_shards() if context else 1), context)
    if plan is None or not (plan.shared or context) or set(plan.shared) & set(context):
        return None
    mesh, vocab, shared, embed_axes = plan.mesh, plan.vocab, plan.shared, plan.embed
    batch = tuple(a for a in plan.batch if a not in context)
    own = tuple(a for a in vocab if a not in shared)

    def body(rows, tok):
        # The table's embed shards gathered here: the gradient's way back is then one reduce-scatter onto
        # them, not an all-reduce of the device's whole vocabulary rows.
        rows = jax.lax.all_gather(rows, embed_axes, axis=1, tiled=True) if embed_axes else rows
        tok = jax.lax.all_gather(tok, shared, axis=0, tiled=True) if shared else tok
        v_local = rows.shape[0]
        idx = tok - jax.lax.axis_index(vocab) * v_local if vocab else tok
        hit = (idx >= 0) & (idx < v_local)
        x = jnp.where(hit[..., None], jnp.take(rows, jnp.clip(idx, 0, v_local - 1), axis=0), jnp.zeros((), rows.dtype))
        x = jax.lax.psum(x, own) if own else x
        return jax.lax.psum_scatter(x, shared, scatter_dimension=0, tiled=True) if shared else x

    seq_spec = context or None
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(vocab or None, embed_axes or None), P(batch or None, seq_spec)),
        out_specs=P(batch or None, seq_spec, None),
        check_vma=False,
    )(table, tokens)


def _vp_body(softcap, cdt, vocab_axes, batch_axes, scatter_axes, shared_axes, grads, h, w, targets, weights):
    """One device's chunks: `w` is its [embed, vocab / shards] columns, `h` its rows (with shared
    axes, the rows of its group are gathered chunk by chunk)."""
    v_local = w.shape[1]
    offset = jax.lax.axis_index(vocab_axes) * v_local if vocab_axes else 0
    cols = jnp.arange(v_local)[None, :]
    own_vocab = tuple(a for a in vocab_axes if a not in shared_axes)
    group = math.prod(jax.lax.axis_size(a) for a in shared_axes) if shared_axes else 1

    def vsum(x):
        return jax.lax.psum(x, vocab_axes) if vocab_axes else x

    def gather(x):
        return jax.lax.all_gather(x, shared_axes, axis=0, tiled=True) if shared_axes else x

    def step(carry, xs):
        total, d_head = carry
        h_c, t_c, w_c = (gather(x) for x in xs)
        h_c = h_c.astype(cdt)
        logits, d_cap = _logits(h_c, w, softcap)
        m = jax.lax.stop_gradient(logits.max(axis=-1))
        if vocab_axes:
            m = jax.lax.pmax(m, vocab_axes)
        lse = m + jnp.log(vsum(jnp.exp(logits - m[:, None]).sum(axis=-1)))
        t_local = t_c - offset
        hit = cols == t_local[:, None]
        nll = lse - vsum(jnp.where(hit, logits, 0.0).sum(axis=-1))
        total = total + (nll * w_c).sum()
        if not grads:
            return (total, d_head), None
        d_logits = (jnp.exp(logits - lse[:, None]) - hit) * w_c[:, None]
        if d_cap is not None:
            d_logits = d_logits * d_cap
        d_logits = d_logits.astype(cdt)
        d_h = jnp.einsum("CV,DV->CD", d_logits, w, preferred_element_type=jnp.float32).astype(h.dtype)
        d_head = d_head + head_gradient(h_c, d_logits)
        d_h = jax.lax.psum(d_h, own_vocab) if own_vocab else d_h
        if shared_axes:  # the group's rows: summed over the shared vocab shards, each device its own rows
            d_h = jax.lax.psum_scatter(d_h, shared_axes, scatter_dimension=0, tiled=True)
        return (total, d_head), d_h

    init = (jnp.float32(0), jnp.zeros(w.shape if grads else (0,), jnp.float32))
    (total, d_head), d_h = jax.lax.scan(step, init, (h, targets, weights))
    total = jax.lax.psum(total, batch_axes) if batch_axes else total
    total = total / group  # each member of a shared group counted the group's rows
    if not grads:
        return total
    # Once per step, in the compute dtype: the rows' partial gradients summed onto the head's shards.
    d_head = d_head.astype(cdt)
    rest = tuple(a for a in batch_axes if a not in scatter_axes and a not in shared_axes)
    if rest:
        d_head = jax.lax.psum(d_head, rest)
    if scatter_axes:
        d_head = jax.lax.psum_scatter(d_head, scatter_axes, scatter_dimension=0, tiled=True)
    return total, d_h, d_head


def _head_for_loss(plan, head, cdt):
    """The head in the compute dtype, moved to its loss layout in two steps where a shared axis splits
    both its embed dim (the parameter's spec) and its vocab dim (the loss's): first the vocab dim onto
    the shared axes (an all-to-all), then the embed dim gathered. In one step the partitioner gathered
    the whole [embed, vocab] head on every device."""
    mesh, vocab, shared, embed = plan.mesh, plan.vocab, plan.shared, plan.embed
    head = head.astype(cdt)
    if shared:
        head = jax.lax.with_sharding_constraint(head, jax.sharding.NamedSharding(mesh, P(embed or None, vocab)))
    return head


def _vp_specs(plan):
    mesh, batch, vocab, scatter = plan.mesh, plan.batch, plan.vocab, plan.scatter
    rows = P(None, batch or None)
    return mesh, (P(None, batch or None, None), P(None, vocab or None), rows, rows), P(scatter or None, vocab or None)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _vp_loss(softcap, cdt, plan, h, head, targets, weights):
    mesh, in_specs, _ = _vp_specs(plan)
    body = functools.partial(_vp_body, softcap, cdt, plan.vocab, plan.batch, plan.scatter, plan.shared, False)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)(
        h, _head_for_loss(plan, head, cdt), targets, weights
    )


@_vp_loss.defjvp
def _vp_loss_jvp(softcap, cdt, plan, primals, tangents):
    # As _fused_loss_jvp: the gradients come out of the forward pass, the tangent is linear in them.
    h, head, targets, weights = primals
    dh, dhead = tangents[0], tangents[1]
    mesh, in_specs, head_spec = _vp_specs(plan)
    body = functools.partial(_vp_body, softcap, cdt, plan.vocab, plan.batch, plan.scatter, plan.shared, True)
    total, d_h, d_head = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(P(), in_specs[0], head_spec), check_vma=False
    )(h, _head_for_loss(plan, head, cdt), targets, weights)
    tangent = (d_h.astype(jnp.float32) * dh.astype(jnp.float32)).sum() + (
        d_head.astype(jnp.float32) * dhead.astype(jnp.float32)
    ).sum()
    return total, tangent
