"""`zoo.capture`: the values of tagged intermediates, layer by layer, for research code.

    values = zoo.capture(model, tokens, tags=["query_proj", "mlpwi_0"])
    values["query_proj"].shape   # [layers, batch, seq, heads, head_dim]

Every value has a leading layer axis over the layers that emit its tag, in model order: the stacks
and the positions of a repeating period (Gemma 3's 5 sliding + 1 global, GPT-OSS's alternation) are
stitched back into layer order. `capture_layers(config, tag)` says which layers those are: every
layer for the `layer`, `attention` and `mla` tags, the layers with a dense MLP for the `mlp` tags
(with DeepSeek-style shared experts, the MoE layers too), the MoE layers for the `moe` tags. The
shapes are those of `zoo.tags.TAGS` after the layer axis; the routed-expert tags hold the MoE path's
own layout (sorted assignments on the ragged path, per-expert buffers on the capacity path).
Where the layers that emit a tag give it different shapes (DeepSeek-V3's dense MLPs and its shared
experts both emit `mlpwi_0`), stitching refuses; `stitch=False` gives each tag's pieces as they were
scanned: a list of `(layer indices, values with a leading axis over those layers)`, one per stack and
period position.

The capture runs the plain forward pass (no remat policy), jitted, and keeps only the tags asked for.
Under a mesh with an `expert` axis the routed experts run inside a shard_map, whose values cannot
leave it: capture the `moe` tags on a mesh without one.
"""

from typing import Optional, Sequence

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from zoo import sharding as zs
from zoo import tags as zoo_tags
from zoo.config import ModelConfig


def capture_layers(config: ModelConfig, tag: str) -> tuple[int, ...]:
    """The layers (in model order) that emit `tag`: the leading axis of `capture`'s value for it."""
    if tag not in zoo_tags.TAGS:
        raise ValueError(f"unknown tag {tag!r}; the vocabulary is {sorted(zoo_tags.TAGS)}")
    kind = zoo_tags.TAGS[tag].block
    layers = range(config.num_layers)
    if kind == zoo_tags.MLP:
        shared = config.moe is not None and config.moe.n_shared_experts > 0
        return tuple(i for i in layers if shared or not config.is_moe_layer(i))
    if kind == zoo_tags.MOE:
        return tuple(i for i in layers if config.is_moe_layer(i))
    return tuple(layers)


def capture(
    model,
    tokens: Int[Array, "batch seq"],
    tags: Sequence[str],
    *,
    positions: Optional[Int[Array, "*batch seq"]] = None,
    segment_ids: Optional[Int[Array, "batch seq"]] = None,
    stitch: bool = True,
) -> dict:
    """`{tag: value}` for each tag of `tags`, its leading axis the layers `capture_layers` names
    (`stitch=False`: the per-stack pieces, see the module docstring).

    `model` is a `zoo.CausalLM`; `positions` and `segment_ids` as for `model(tokens)`. A tag outside
    the vocabulary, or one this model never emits, is a ValueError naming it."""
    names = tuple(dict.fromkeys(tags))
    if not names:
        raise ValueError("capture: give at least one tag, e.g. tags=['query_proj']")
    emitted = zoo_tags.emitted_tags(model.config)
    for name in names:
        if name not in zoo_tags.TAGS:
            raise ValueError(f"unknown tag {name!r}; the vocabulary is {sorted(zoo_tags.TAGS)}")
        if name not in emitted:
            raise ValueError(
                f"tag {name!r}: this {model.config.family} model never emits it; it emits {', '.join(emitted)}"
            )
    pieces = _capture(model, tokens, names, positions, segment_ids, _layout_key())
    return pieces if not stitch else {name: _stitch(name, entries) for name, entries in pieces.items()}


def _layout_key():
    """The active layout (zoo.sharding.activate) as a hashable value: the traced program depends on it,
    so it is part of `_capture`'s cache key (a capture under a mesh is not the one traced without)."""
    layout = zs.active()
    return None if layout is None else (layout.mesh, tuple(sorted((k, tuple(v)) for k, v in layout.rules.items())))


@eqx.filter_jit
def _capture(model, tokens, names: tuple[str, ...], positions, segment_ids, layout) -> dict[str, list]:
    with zoo_tags.capturing(names) as record:
        model.features(tokens, positions=positions, segment_ids=segment_ids)  # XLA drops what no tag needs
    shards = zs.context_balanced()
    pieces = {
        name: [(layers, _in_sequence_order(name, values, shards)) for n, layers, values in record if n == name]
        for name in names
    }
    for name, entries in pieces.items():
        found = sorted(i for layers, _ in entries for i in layers)
        if tuple(found) != capture_layers(model.config, name):
            raise AssertionError(f"tag {name!r} came from layers {found}, not {capture_layers(model.config, name)}")
    return pieces


def _in_sequence_order(name: str, values, shards: int):
    """Under balanced context parallelism the layers run on the sequence in its balanced order
    (`zoo.model.run_layers`): a tag's `[layers, batch, seq, ...]` values are put back in sequence
    order. The routed experts' tags hold assignment rows, in no sequence order to restore."""
    if not shards or zoo_tags.TAGS[name].block == zoo_tags.MOE:
        return values
    return zs.from_context_order(values, shards, axis=2)


def _stitch(name: str, entries: list) -> Array:
    """One array in layer order from the pieces of `_capture`."""
    shapes = {values.shape[1:] for _, values in entries}
    if len(shapes) > 1:
        where = "; ".join(f"layers {list(layers)}: {tuple(values.shape[1:])}" for layers, values in entries)
        raise ValueError(
            f"tag {name!r} has different shapes in different layers ({where}); capture it with stitch=False"
        )
    layers = np.concatenate([np.asarray(layers) for layers, _ in entries])
    order = np.argsort(layers, kind="stable")
    values = jnp.concatenate([values for _, values in entries])
    return values if np.array_equal(order, np.arange(len(order))) else values[order]
