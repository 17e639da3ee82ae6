"""`zoo.counts.flops_per_token` against the matmuls the traced model actually runs, for every family
(MFU is this count divided by time, so a wrong count is a wrong MFU)."""

import dataclasses
import math
from unittest import mock

import equinox as eqx
import jax
import jax.extend.core as jex_core
import numpy as np
import pytest

from zoo.config import attended_keys
from zoo.counts import flops_per_token
from zoo.families import SIZES
from zoo.model import abstract
from zoo.nn import moe_dispatch

TINY = sorted(n for n in SIZES if n.endswith("_tiny_a"))


def matmul_flops(jaxpr) -> int:
    """Multiply-adds x 2 of every dot_general and ragged_dot in a jaxpr, scan bodies times their length.
    A ragged dot multiplies each row by one group's matrix: 2 * rows * contracted * out."""
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        elif name.startswith("ragged_dot"):
            rows, inner = eqn.invars[0].aval.shape
            total += 2 * rows * inner * eqn.outvars[0].aval.shape[-1]
        times = eqn.params["length"] if name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jex_core.Jaxpr):
                    assert name != "while", "a while loop's trip count is unknown here"
                    total += times * matmul_flops(sub)
    return total


@pytest.mark.parametrize("name", TINY)
def test_flop_count_equals_the_traced_forward_matmuls(name):
    """Every key attended (causal=False: the XLA attention path computes the whole score matrix, and a
    window or causal mask only masks it), ragged experts (exactly top-k rows per token): the forward's
    matmul FLOPs are a third of the training count, routers, biases, sinks and norms included."""
    c = SIZES[name].replace(attention_impl="xla")
    if c.moe is not None:
        c = c.replace(moe=dataclasses.replace(c.moe, impl="ragged"))
    batch, seq = 2, 16
    tokens = jax.ShapeDtypeStruct((batch, seq), np.int32)

    def ragged_dot(h, w, group_sizes, tile, impl):  # zoo.nn.grouped_matmul's contract, as one countable op
        return jax.lax.ragged_dot(h, w, group_sizes)

    with mock.patch.object(moe_dispatch, "grouped_matmul", ragged_dot):
        jaxpr = eqx.filter_make_jaxpr(lambda m, t: m(t))(abstract(c), tokens)[0]
    # The MoE combine (each token's top-k expert outputs weighted and summed) is written as a small
    # batched dot; it is k multiply-adds per hidden unit, no weight, and not in the model FLOP count.
    combine = 2 * batch * seq * c.moe.num_experts_per_tok * c.hidden_size * c.num_moe_layers if c.moe else 0
    counted = flops_per_token(c, seq, causal=False) * batch * seq / 3
    assert matmul_flops(jaxpr.jaxpr) - combine == pytest.approx(counted, rel=1e-9)


@pytest.mark.parametrize("seq, window", [(16, 4), (64, 7), (10, 9), (8, 1)])
def test_attended_keys_counts_the_causal_window_mask(seq, window):
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    allowed = (j <= i) & (j > i - window)
    assert attended_keys(seq, window) == pytest.approx(allowed.sum() / seq)
    # Without a window (or one as long as the sequence) the causal convention: half the keys.
    assert attended_keys(seq, None) == attended_keys(seq, seq) == seq / 2


@pytest.mark.parametrize("name", ["gemma3_tiny_a", "gpt_oss_tiny_a"])
def test_sliding_layers_cost_their_window(name):
    c, seq = SIZES[name], 256
    windows = [c.layer_spec(i).window for i in range(c.num_layers)]
    assert any(windows), f"{name} was expected to have sliding layers"
    per_key = 6 * c.num_heads * (c.qk_head_dim + c.v_head_dim)
    saved = sum(seq / 2 - attended_keys(seq, w) for w in windows if w is not None)
    assert saved > 0
    global_only = c.replace(sliding_window=None, layer_types=None)
    assert flops_per_token(global_only, seq) - flops_per_token(c, seq) == pytest.approx(per_key * saved)


def test_more_experts_cost_only_the_router():
    """Active compute does not grow with the expert count at a fixed top-k; only the router's matmul does."""
    c = SIZES["qwen3_moe_tiny_a"]
    more = c.replace(moe=dataclasses.replace(c.moe, n_routed_experts=2 * c.moe.n_routed_experts))
    router = 6 * c.hidden_size * c.moe.n_routed_experts * c.num_moe_layers
    assert flops_per_token(more, 64) - flops_per_token(c, 64) == pytest.approx(router)
