"""The transient bytes on top of what a step keeps (`step_working_set`): a layer's intermediates, its
largest block's gradients and its attention backward by its implementation, or the head + loss
(whole logits or chunked), whichever is larger."""

import dataclasses
import math
from typing import Optional

import numpy as np


from zoo.backend import BackendChoices
from zoo.backend import choices as backend_choices
from zoo.nn.attention_kernels import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from zoo.offload import backward_never_reads
from zoo.plan.pricing import per_device_shape, tag_costs
from zoo.sharding import logical_ways
from zoo.tags import ATTENTION, MLA, MLP, MOE, TAGS


def largest_block(tags, stack: str) -> float:
    """Per layer of `stack`, the tags' bytes of its largest block: the attention (MLA's latents with
    it) or the feed-forward block (an MoE's routed and shared experts together)."""
    of = {ATTENTION: ATTENTION, MLA: ATTENTION, MLP: MLP, MOE: MLP}
    found: dict[str, float] = {}
    for t in tags:
        kind = of.get(TAGS[t.tag].block) if t.tag in TAGS else None
        if kind:
            found[kind] = found.get(kind, 0.0) + t.bytes_per_layer.get(stack, 0.0)
    return max(found.values(), default=0.0)


def attention_working_bytes(
    impl: str, *, batch: int, seq: int, heads: int, kv_heads: int, qk_dim: int, v_dim: int
) -> float:
    """The transient bytes of one layer's attention backward (its forward holds less), per device.

    - xla: the float32 scores and probabilities [batch, heads, T, T] (their gradients reuse them);
    - blockwise: four float32 tiles [batch, heads, block_q, block_k] (scores, probabilities and
      their gradients), the float32 dq / dk / dv accumulators and the per-row statistics;
    - cudnn, splash: the float32 dq accumulator and the softmax statistics (the tiles live in on-chip
      memory).
    """
    rows = 3.0 * batch * heads * seq * 4  # logsumexp, delta, running max
    if impl == "xla":
        return 2.0 * batch * heads * seq * seq * 4
    if impl == "blockwise":
        tiles = 4.0 * batch * heads * min(DEFAULT_BLOCK_Q, seq) * min(DEFAULT_BLOCK_K, seq) * 4
        accumulators = 4.0 * batch * seq * (heads * qk_dim + kv_heads * (qk_dim + v_dim))
        return tiles + accumulators + rows
    if impl in ("cudnn", "splash"):
        return 4.0 * batch * seq * heads * qk_dim + rows
    raise ValueError(f"attention_working_bytes: unknown implementation {impl!r}")


def loss_working_bytes(
    *,
    batch: int,
    seq: int,
    vocab: int,
    embed: int,
    chunk: int,
    compute_bytes: int,
    head_cast_bytes: float = 0.0,
    row_group: int = 1,
    backend: Optional[BackendChoices] = None,
) -> float:
    """The transient bytes of the head + loss, per device (`vocab` is the device's share; `row_group`
    devices share a vocab axis that also splits the batch, so each chunk's logits cover their rows).

    Whole logits (`chunk` 0): the float32 logits, their softmax and their gradient [batch, T, vocab].
    Chunked (zoo.loss, fused): float32 [batch, chunk, vocab] buffers of one chunk at a time, as many
    as the backend's compiler keeps (`BackendChoices.loss_chunk_buffers`), plus what the fused
    backward keeps through the chunks: the hidden states' gradient [batch, T, embed] in the compute
    dtype, and unless the backend accumulates the head's gradient in its own buffer
    (`BackendChoices.head_gradient_in_place`), the float32 accumulator [embed, vocab] and the head
    cast to the compute dtype (`head_cast_bytes`, 0 when the dtypes agree). `backend`: the planned
    platform's record (None: one chunk buffer, the accumulator and the cast counted)."""
    if not chunk:
        return 3.0 * batch * seq * vocab * 4
    buffers = backend.loss_chunk_buffers if backend else 1.0
    in_place = backend.head_gradient_in_place if backend else False
    rows = min(chunk, seq)
    gathered = float(batch * row_group * rows * embed * compute_bytes) if row_group > 1 else 0.0
    return (
        buffers * float(batch * row_group * rows * vocab * 4)
        + (0.0 if in_place else 4.0 * embed * vocab + head_cast_bytes)
        + float(batch * seq * embed * compute_bytes)
        + gathered
    )


@dataclasses.dataclass
class WorkingSet:
    """The step's working set per device (`bytes`, what sets it: `label`) and its two candidates' parts."""

    bytes: float
    label: str
    attention_impl: str
    attention: float  # one layer's attention backward
    loss: float  # the head + loss


def step_working_set(c, shape, placement, tags, stacks, attention_impl: str, tile: int) -> WorkingSet:
    """The working set of a traced step (`shape`: zoo.plan.traced.StepShape; `tags`: its kept tags as
    the target's compiler tiles them, `tile` elements).

    The layer in backward, its intermediates and the gradients of its largest block (about that
    block's intermediates again), with one layer's attention transient, or the head + loss, whichever
    is larger (they do not overlap). What XLA holds at a v5e's compiled peak: dsv3_100m under `full`
    one MoE layer's backward, 26-27 KB a token at 20 to 90 x 4096, its intermediates 16.5 KB, its MoE
    block's 8 (docs/benchmarks.md, "The planner against the chip")."""
    m, batch, seq, sizes, rules = shape.model, shape.batch, shape.seq, shape.sizes, c.mesh.rules
    # The intermediates as traced: the tiling is measured on the kept tags; inside a layer the
    # compiler fuses and lays out the rest its own way.
    as_traced = tag_costs(m, placement.records, batch, seq, rules=rules, sizes=sizes) if tile > 1 else tags
    per_layer = max((sum(t.bytes_per_layer.get(s, 0.0) for t in as_traced) for s in stacks), default=0.0)
    mlpwo_bytes = max(
        (
            r.bytes_per_layer * math.prod(per_device_shape(r.tag, r.shape, rules, sizes)) / max(1, math.prod(r.shape))
            for r in placement.records
            if r.tag in backward_never_reads(m)
        ),
        default=0,
    )
    heads_ways = logical_ways(rules, sizes, "heads")
    attention = attention_working_bytes(
        attention_impl,
        batch=batch,
        seq=seq,
        heads=max(1, m.num_heads // heads_ways),
        kv_heads=max(1, (m.num_kv_heads if not m.uses_mla else m.num_heads) // heads_ways),
        qk_dim=m.qk_head_dim,
        v_dim=m.v_head_dim,
    )
    vocab = -(-m.vocab_size // logical_ways(rules, sizes, "vocab"))
    compute_bytes = np.dtype(m.compute_dtype).itemsize
    head_cast = 0.0 if m.compute_dtype == m.param_dtype else float(m.hidden_size * vocab * compute_bytes)
    batch_axes = set(rules.get("batch", []))
    row_group = (
        math.prod(sizes[a] for a in dict.fromkeys(rules.get("vocab", [])) if a in sizes and a in batch_axes) or 1
    )
    hw = c.hardware
    loss = loss_working_bytes(
        batch=batch,
        seq=seq,
        vocab=vocab,
        embed=m.hidden_size,
        chunk=c.trainer.loss_chunk_size,
        compute_bytes=compute_bytes,
        head_cast_bytes=head_cast,
        row_group=row_group,
        # A profile for any platform (no hardware.platform) says nothing of its compiler: counted whole.
        backend=backend_choices(hw.platform) if hw.platform else None,
    )
    block = max((largest_block(as_traced, s) for s in stacks), default=0.0)
    layers_working = per_layer + mlpwo_bytes + block + attention
    label = (
        f"working set: a layer's intermediates + its largest block's gradients + its {attention_impl} attention"
        if layers_working >= loss
        else "working set: the head + loss"
        + (f" (chunks of {c.trainer.loss_chunk_size})" if c.trainer.loss_chunk_size else " (whole logits)")
    )
    return WorkingSet(max(layers_working, loss), label, attention_impl, attention, loss)
