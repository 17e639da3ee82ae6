"""Mixture of experts: a router, routed experts through one of two kernels, optional shared experts.

Routers (`MoEConfig.router`), all in float32 with the router matmul at HIGHEST precision (a TF32
router can pick other experts than the reference):
- `sigmoid_grouped` (DeepSeek-V3, Kimi K2): sigmoid scores plus a load-balancing correction bias
  (a float32 buffer moved by the balancing rule, never by gradients) select the top-k experts within
  the `topk_group` best groups; the weights are the unbiased scores, renormalised, scaled.
- `softmax` (Mixtral, Qwen3-MoE): softmax over all experts, top-k, renormalised when norm_topk_prob.
- `topk_softmax` (GPT-OSS): top-k of the raw logits (plus a router bias), softmax over those k.

Each layer also reports its router entropy (`MoEAux.router_entropy`, see `router_entropy`), computed
under stop_gradient from the logits the router already has, so nothing extra is kept for the
backward pass; `router_statistics(False)` leaves it out of the traced program.

The routed experts run in `zoo.nn.moe_dispatch.routed_experts` and never run every expert on every token:
- `ragged` (dropless, exact): assignments sorted by expert, three grouped matmuls
  (`zoo.nn.grouped_matmul`, `lax.ragged_dot`'s contract computed a tile of rows at a time: FLOPs and
  memory grow with the routed rows, not with the expert count, as XLA's lowering of ragged_dot does).
- `capacity`: assignments scattered into per-expert buffers of `moe_capacity(tokens)` rows and
  multiplied as one batched matmul, so FLOPs grow with top_k * capacity_factor, not with the expert
  count. Assignments beyond an expert's capacity are dropped (earlier tokens win) and counted. Under
  an active layout whose expert axis is > 1 this is the expert-parallel kernel (per-device capacity
  from its own tokens, all_to_all to the experts' devices and back).
- `auto`: `ragged`, on one device and under expert parallelism alike (there it exchanges in rounds,
  `zoo.nn.expert_rounds`).
"""

import contextlib
import contextvars
import math
from typing import ClassVar, Iterator, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo import sharding as zs
from zoo.config import DTypeLike, MoEConfig, dtype_name
from zoo.nn._init import normal
from zoo.nn.mlp import GatedMLP, swiglu
from zoo.nn.moe_dispatch import ExpertLeaves, ExpertWeights, resolve_moe_impl, routed_experts  # noqa: F401 - resolve_moe_impl: public here


class MoEAux(eqx.Module):
    """Routing statistics of one MoE layer (stacked over layers by the scan)."""

    tokens_per_expert: Int[Array, "*layers experts"]  # assignments routed to each expert, before any drop
    dropped: Int[Array, "*layers"]  # assignments dropped by the capacity path (0 for ragged)
    # Rounds the dropless expert-parallel exchange took (zoo.nn.expert_rounds; 1 on every other path).
    exchange_rounds: Int[Array, "*layers"]
    # Mean over tokens of the router's entropy (nats, float32; see `router_entropy`); 0 when
    # `router_statistics(False)` is active.
    router_entropy: Float[Array, "*layers"]


_ROUTER_STATISTICS = contextvars.ContextVar("zoo_router_statistics", default=True)


@contextlib.contextmanager
def router_statistics(enabled: bool) -> Iterator[None]:
    """Whether MoE layers traced inside compute their router entropy (the trainer's
    `trainer.moe_metrics`); off, `MoEAux.router_entropy` is a constant 0 and costs nothing."""
    token = _ROUTER_STATISTICS.set(bool(enabled))
    try:
        yield
    finally:
        _ROUTER_STATISTICS.reset(token)


def router_entropy(
    logits: Float[Array, "tokens experts"], bias: Optional[Float[Array, " experts"]], c: MoEConfig
) -> Float[Array, " tokens"]:
    """Per token, the entropy (nats, float32) of the router's probability distribution over ALL
    experts, as each router kind defines its probabilities:

    - `softmax`: softmax(logits), the distribution top-k is taken from.
    - `topk_softmax`: softmax(logits + router bias) over all experts; the combine weights are this
      distribution restricted to the top k and renormalised.
    - `sigmoid_grouped`: the unbiased sigmoid scores normalised to sum to one, s_e / sum(s); the
      combine weights are these restricted to the selected experts and renormalised. The correction
      bias only steers selection, so it is left out.

    Between 0 (one expert takes all) and log(experts) (uniform). Computed under stop_gradient: it is
    a metric, and no [tokens, experts] buffer of it is kept for the backward pass.
    """
    logits = jax.lax.stop_gradient(logits.astype(jnp.float32))
    if c.router == "sigmoid_grouped":
        log_s = jax.nn.log_sigmoid(logits)
        log_p = log_s - jax.nn.logsumexp(log_s, axis=-1, keepdims=True)
    else:
        if c.router == "topk_softmax" and bias is not None:
            logits = logits + jax.lax.stop_gradient(bias.astype(jnp.float32))
        log_p = jax.nn.log_softmax(logits, axis=-1)
    return -(jnp.exp(log_p) * log_p).sum(-1)


def router_logits(
    x: Float[Array, "tokens embed"], router: Float[Array, "embed experts"]
) -> Float[Array, "tokens experts"]:
    return jnp.einsum(
        "ND,DE->NE", x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )


def route(
    x: Float[Array, "tokens embed"],
    router: Float[Array, "embed experts"],
    bias: Optional[Float[Array, " experts"]],
    c: MoEConfig,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
    """Expert ids and combine weights per token, in float32 (see the module docstring for the rules).

    `bias` is the correction bias of `sigmoid_grouped` and the router bias of `topk_softmax`.
    """
    return route_logits(router_logits(x, router), bias, c)


def route_logits(
    logits: Float[Array, "tokens experts"], bias: Optional[Float[Array, " experts"]], c: MoEConfig
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
    """`route` from the router logits already computed."""
    k = c.num_experts_per_tok
    if c.router == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        weights, expert_ids = jax.lax.top_k(probs, k)
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        return expert_ids, weights
    if c.router == "topk_softmax":
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
        top, expert_ids = jax.lax.top_k(logits, k)
        return expert_ids, jax.nn.softmax(top, axis=-1)
    scores = jax.nn.sigmoid(logits)
    # The bias steers selection only; it is updated by a balancing rule, never by gradients.
    biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    tokens, experts = scores.shape
    per_group = experts // c.n_group
    if c.n_group > 1:
        grouped = biased.reshape(tokens, c.n_group, per_group)
        group_scores = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)
        _, best_groups = jax.lax.top_k(group_scores, c.topk_group)
        group_mask = jax.nn.one_hot(best_groups, c.n_group, dtype=jnp.bool_).any(axis=1)
        expert_mask = jnp.repeat(group_mask, per_group, axis=-1)
        # -inf, as DeepSeek's reference does: transformers writes 0.0, which lets an expert of an
        # unselected group win once correction biases push the kept experts' scores below zero
        # (the two agree while every biased score is positive, as in the reference fixtures).
        biased = jnp.where(expert_mask, biased, -jnp.inf)
    _, expert_ids = jax.lax.top_k(biased, k)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return expert_ids, weights * c.routed_scaling_factor


def _per_device(route_fn):
    """Run a per-token routing function (-> expert ids, weights, a per-token statistic) on each
    device's own tokens when the batch is sharded: left to the partitioner, the (grouped) top-k over
    experts gathers every device's router scores. The router weight and bias enter whole (they are
    small, and stay float32)."""
    layout = zs.active()
    batch_axes = zs.context_axes() + layout.mesh_axes("batch") if layout is not None else ()
    if layout is None or math.prod(layout.axis_size(a) for a in batch_axes) <= 1:
        return route_fn
    tokens = P(batch_axes, None)
    per_token = P(batch_axes)
    return jax.shard_map(route_fn, mesh=layout.mesh, in_specs=(tokens, P(), P()), out_specs=(tokens, tokens, per_token))


def clamp(x: Float[Array, "*shape"], lo: Optional[float], hi: Optional[float]) -> Float[Array, "*shape"]:
    """`x` clamped to [lo, hi] (None: no bound on that side), with torch.clamp's derivative: 1 where
    lo <= x <= hi, bounds included, 0 beyond.

    jnp.minimum / jnp.clip give the same values but split the derivative 0.5 / 0.5 when x equals the
    bound. bfloat16 pre-activations land exactly on GPT-OSS's swiglu_limit often, and there halving
    the gradient moved whole weight columns away from what transformers trains
    (tests/data/families/gpt_oss_tiny_hard plants such units). A select passes the derivative of the
    branch it takes, so the rule holds in forward mode and at any order, in every dtype."""
    if hi is not None:
        x = jnp.where(x > hi, jnp.asarray(hi, x.dtype), x)
    if lo is not None:
        x = jnp.where(x < lo, jnp.asarray(lo, x.dtype), x)
    return x


def expert_activation(c: MoEConfig):
    """`(gate, up) -> hidden` of one expert."""
    if c.activation == "silu":
        return swiglu
    limit, alpha = c.swiglu_limit, c.swiglu_alpha

    def clamped_swiglu(gate, up):
        # GPT-OSS: the gate is clamped from above only, up on both sides, and up is shifted by one.
        gate = clamp(gate, None, limit)
        up = clamp(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(alpha * gate))

    return clamped_swiglu


class RouterLeaves(eqx.Module):
    """The router's parameters, an abstract base of `MoE` (its first fields): the router matrix, and a
    bias by router kind."""

    router: Float[Array, "embed experts"]
    # sigmoid_grouped: the correction bias, a float32 buffer (no gradient, excluded from the optimizer);
    # topk_softmax with router_bias: a trained bias on the logits (`router_bias`).
    e_score_correction_bias: Optional[Float[Array, " experts"]]
    router_bias: Optional[Float[Array, " experts"]]

    # zoo.sharding: the router and its biases stay float32 where they are used.
    PARAMS: ClassVar[dict[str, zs.Leaf]] = {
        "router": zs.float32("embed", None, matmul=True),
        "e_score_correction_bias": zs.float32(None),
        "router_bias": zs.float32(None),
    }


class MoE(ExpertLeaves, RouterLeaves):
    """A router (`RouterLeaves`), the routed experts (`ExpertLeaves`, zoo.nn.moe_dispatch, which
    declares their six leaves, `w_gate` ... `b_down`, and the tags the kernel emits, `EMITS`) and
    optional shared experts (a GatedMLP, which declares its own). Its fields: the router's, the
    experts', then its own."""

    shared: Optional[GatedMLP]
    config: MoEConfig = eqx.field(static=True)
    compute_dtype: str = eqx.field(static=True)
    impl: str = eqx.field(static=True)

    # zoo.sharding: its leaves, as the router and the routed experts declare them.
    PARAMS: ClassVar[dict[str, zs.Leaf]] = {**RouterLeaves.PARAMS, **ExpertLeaves.PARAMS}

    def __init__(
        self,
        embed: int,
        c: MoEConfig,
        *,
        param_dtype: DTypeLike = "float32",
        compute_dtype: DTypeLike = "float32",
        key: PRNGKeyArray,
    ):
        kr, kg, ku, kd, ks = jax.random.split(key, 5)
        e, i = c.n_routed_experts, c.moe_intermediate_size
        param_dtype = dtype_name(param_dtype, "param_dtype")
        self.router = normal(kr, (embed, e), embed, param_dtype)
        self.e_score_correction_bias = jnp.zeros((e,), jnp.float32) if c.router == "sigmoid_grouped" else None
        self.router_bias = jnp.zeros((e,), param_dtype) if c.router_bias else None
        experts = ExpertWeights.init((kg, ku, kd), e, embed, i, bias=c.expert_bias, dtype=param_dtype)
        for name, leaf in experts.leaves().items():
            setattr(self, name, leaf)
        self.shared = (
            GatedMLP(embed, i * c.n_shared_experts, param_dtype=param_dtype, compute_dtype=compute_dtype, key=ks)
            if c.n_shared_experts
            else None
        )
        self.config = c
        self.compute_dtype = dtype_name(compute_dtype, "compute_dtype")
        # A training run builds it with the kernel it resolved (zoo.train.run_config.as_built); research
        # code may leave `auto`, which the kernel resolves (zoo.nn.moe_dispatch.routed_experts).
        self.impl = c.impl

    def __call__(self, x: Float[Array, "batch seq embed"]) -> tuple[Float[Array, "batch seq embed"], MoEAux]:
        b, t, d = x.shape
        # Under context parallelism (zoo.nn.context_parallel) each device holds a chunk of every
        # sequence of its batch shard: the tokens are flattened chunk-major, so that each device's
        # tokens are one contiguous block of them (the dispatch splits them over the context axes,
        # then the batch axes) and the flattening moves no data between devices.
        chunks = zs.context_shards()
        flat = (
            x.reshape(b * t, d)
            if chunks == 1
            else x.reshape(b, chunks, t // chunks, d).transpose(1, 0, 2, 3).reshape(b * t, d)
        )
        bias = self.e_score_correction_bias if self.config.router == "sigmoid_grouped" else self.router_bias
        stats = _ROUTER_STATISTICS.get()

        def route_fn(x, r, b):
            logits = router_logits(x, r)
            ids, w = route_logits(logits, b, self.config)
            entropy = router_entropy(logits, b, self.config) if stats else jnp.zeros(x.shape[:1], jnp.float32)
            return ids, w, entropy

        expert_ids, weights, entropy = _per_device(route_fn)(flat, self.router, bias)
        experts = ExpertWeights.of(self)
        routed, counts, dropped, rounds = routed_experts(
            flat,
            expert_ids,
            weights,
            experts,
            activation=expert_activation(self.config),
            impl=self.impl,
            capacity_factor=self.config.capacity_factor,
            exchange_factor=self.config.exchange_factor,
            compute_dtype=self.compute_dtype,
        )
        y = (
            routed.reshape(b, t, d)
            if chunks == 1
            else routed.reshape(chunks, b, t // chunks, d).transpose(1, 0, 2, 3).reshape(b, t, d)
        )
        if self.shared is not None:
            y = y + self.shared(x)
        return y, MoEAux(counts, dropped, rounds, entropy.mean() if stats else jnp.zeros((), jnp.float32))
