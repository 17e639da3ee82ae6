"""Parameter and training-FLOP counts, read from the model itself.

Both walk the abstract model (`zoo.model.abstract`: shapes only, any size) and each block's `PARAMS`
declaration (`zoo.sharding.Leaf`: a field's logical axes), so a new block is counted by what it
declares, with no formula here:

- a routed expert's leaf is one whose first logical axis is `experts`: one token uses `top_k` of them;
- a matmul weight is a leaf declared `matmul` (every projection, the routed experts' weights, a
  router); biases, norm scales, sinks and correction biases are not.

Only the attention products (scores and context, per attended key) come from the configuration, since
they are maths over the sequence, not weights.
"""

import dataclasses
import functools
from collections.abc import Iterator

import equinox as eqx
import jax

from zoo import sharding as zs
from zoo.config import ModelConfig, attended_keys
from zoo.model import abstract, count_leaves

__all__ = ["count_params", "flops_per_token", "declared_leaves"]


def declared_leaves(module) -> Iterator[tuple[jax.ShapeDtypeStruct, zs.Leaf]]:
    """Every array field of `module` and the modules under it that its class declares in `PARAMS`,
    with the declaration (stacked leaves carry their leading layer axis in the shape)."""
    if isinstance(module, (list, tuple)):
        for m in module:
            yield from declared_leaves(m)
        return
    if not isinstance(module, eqx.Module):
        return
    declared = getattr(type(module), "PARAMS", {})
    for f in dataclasses.fields(module):
        value = getattr(module, f.name, None)
        if f.name in declared and isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
            yield value, declared[f.name]
        elif isinstance(value, (eqx.Module, list, tuple)):
            yield from declared_leaves(value)


def _routed(leaf: zs.Leaf) -> bool:
    return bool(leaf.axes) and leaf.axes[0] == "experts"


def _active_share(c: ModelConfig) -> float:
    return c.moe.num_experts_per_tok / c.moe.n_routed_experts if c.moe is not None else 1.0


@functools.lru_cache(maxsize=256)
def count_params(c: ModelConfig, active: bool = False) -> int:
    """Parameters of the model (`active`: those one token uses, counting top_k routed experts)."""
    model = abstract(c)
    total = count_leaves(model)
    if not active:
        return int(total)
    routed = sum(x.size for x, leaf in declared_leaves(model) if _routed(leaf))
    return int(round(total - routed * (1.0 - _active_share(c))))


def flops_per_token(c: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs (forward + backward = 3x forward) per token.

    Matmuls: 6 per active matmul weight of the layers (see the module docstring), plus the output head
    (vocabulary x hidden, tied or not; the embedding lookup is no matmul). Attention: the score and
    context products, 6 * heads * (qk_dim + v_dim) per attended key, per layer; a causal layer attends
    T/2 keys on average, a sliding one the mean of min(i + 1, W)."""
    keys = sum(attended_keys(seq_len, c.layer_spec(i).window, causal) for i in range(c.num_layers))
    attention = 6 * keys * c.num_heads * (c.qk_head_dim + c.v_head_dim)
    return 6.0 * _matmul_weights(c) + attention


@functools.lru_cache(maxsize=256)
def _matmul_weights(c: ModelConfig) -> float:
    share = _active_share(c)
    layers = sum(
        x.size * (share if _routed(leaf) else 1.0) for x, leaf in declared_leaves(abstract(c).stacks) if leaf.matmul
    )
    return layers + c.vocab_size * c.hidden_size
