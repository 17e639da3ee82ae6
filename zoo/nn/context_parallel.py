"""Context-parallel attention: the sequence split over a mesh axis through the whole layer, attention
included (zoo.train.run_config.MeshConfig.context_parallel).

Each device keeps the queries of its own chunk of the sequence and receives the keys and values of
the whole sequence, all-gathered over the context axes once per layer (as Llama 3's long-context
training did); the transpose of that gather reduce-scatters their gradients back to the chunks. The
kernel then runs on whole tiles of one device's data: no collective inside its tile loop (a sequence
left split for the partitioner to handle gathered q/k/v at every tile step). The causal mask, the
window and the segment ids use global positions: chunk r's queries sit at r * chunk.
"""

from typing import Optional

import jax
from jaxtyping import Array, Float, Int

from zoo import sharding as zs
from zoo.nn.attention_kernels import context_shard_attention


def context_attention(
    q: Float[Array, "batch seq heads qk"],
    k: Float[Array, "batch seq kv_heads qk"],
    v: Float[Array, "batch seq kv_heads v"],
    *,
    kv_logical: str,
    scale: float,
    impl: str,
    window: Optional[int] = None,
    sinks: Optional[Float[Array, " heads"]] = None,
    segment_ids: Optional[Int[Array, "batch seq"]] = None,
) -> Float[Array, "batch seq heads v"]:
    """Causal attention over the active layout's context axes (`zoo.sharding.context_axes`, not
    empty); `kv_logical` names the keys' head axis ("kv_heads" for GQA, "heads" for MLA, whose keys
    have one head per query head). The result is split as q: along the sequence over the context
    axes, along the heads as the rules say."""
    layout = zs.active()
    ctx = zs.context_axes()
    shards = zs.context_shards()
    balanced = zs.context_balanced() > 0  # the sequence in balanced order (zoo.sharding.to_context_order)
    q_spec = zs.context_spec(("batch", None, "heads", None))
    kv_spec = zs.context_spec(("batch", None, kv_logical, None))
    # The segment ids come whole (gathered once per step, zoo.model.run_layers): every chunk's keys
    # need them, and each device slices its queries' own.
    args, specs = [q, k, v], [q_spec, kv_spec, kv_spec]
    if segment_ids is not None:
        args.append(segment_ids)
        specs.append(layout.spec(("batch", None)))
    if sinks is not None:
        args.append(sinks)
        specs.append(layout.spec(("heads",)))

    def body(q, k, v, *rest):
        rest = list(rest)
        seg = rest.pop(0) if segment_ids is not None else None
        sink = rest.pop(0) if sinks is not None else None
        shard = jax.lax.axis_index(ctx)
        k = jax.lax.all_gather(k, ctx, axis=1, tiled=True)
        v = jax.lax.all_gather(v, ctx, axis=1, tiled=True)
        q_seg = None if seg is None else jax.lax.dynamic_slice_in_dim(seg, shard * q.shape[1], q.shape[1], axis=1)
        if balanced:  # the gathered keys back in sequence order (a local reshape), as the kernel reads them
            k, v = (zs.from_context_order(x, shards) for x in (k, v))
            seg = None if seg is None else zs.from_context_order(seg, shards)
        return context_shard_attention(
            q,
            k,
            v,
            shard=shard,
            shards=shards,
            scale=scale,
            impl=impl,
            window=window,
            sinks=sink,
            segment_ids=q_seg,
            kv_segment_ids=seg,
            balanced=balanced,
        )

    return jax.shard_map(body, mesh=layout.mesh, in_specs=tuple(specs), out_specs=q_spec, check_vma=False)(*args)


def context_parallel() -> bool:
    """Whether the active layout runs attention context-parallel."""
    return bool(zs.context_axes())
