"""Mixture of experts: a router, routed experts through one of two kernels, optional shared experts.

Routers (`MoEConfig.router`), all in float32 with the router matmul at HIGHEST precision (a TF32
router can pick other experts than the reference):
- `sigmoid_grouped` (DeepSeek-V3, Kimi K2): sigmoid scores plus a load-balancing correction bias
  (a float32 buffer moved by the balancing rule, never by gradients) select the top-k experts within
  the `topk_group` best groups; the weights are the unbiased scores, renormalised, scaled.
- `softmax` (Mixtral, Qwen3-MoE): softmax over all experts, top-k, renormalised when norm_topk_prob.
- `topk_softmax` (GPT-OSS): top-k of the raw logits (plus a router bias), softmax over those k.

The routed experts never run every expert on every token:
- `ragged` (dropless, exact): assignments sorted by expert, three `lax.ragged_dot`s. Note XLA:CPU
  (and XLA:GPU today) lower ragged_dot to a dense padded product whose cost grows with the expert count.
- `capacity`: assignments scattered into per-expert buffers of `moe_capacity(tokens)` rows and
  multiplied as one batched matmul, so FLOPs grow with top_k * capacity_factor, not with the expert
  count. Assignments beyond an expert's capacity are dropped (earlier tokens win) and counted.
- `auto`: `capacity` on every backend today (see `resolve_moe_impl`).
"""

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo import tags
from zoo.config import MoEConfig, moe_capacity
from zoo.nn._init import normal
from zoo.nn.mlp import GatedMLP


def resolve_moe_impl(impl: str) -> str:
    """`auto` -> the kernel whose FLOPs grow with top-k: `capacity`. `lax.ragged_dot` is lowered to a
    dense product over every expert by XLA:CPU and by XLA:GPU in the jax versions this runs on
    (`cost_analysis` counts all experts), so it is chosen only on request (exact, dropless)."""
    return "capacity" if impl == "auto" else impl


class MoEAux(eqx.Module):
    """Routing statistics of one MoE layer (stacked over layers by the scan)."""

    tokens_per_expert: Int[Array, "*layers experts"]  # assignments routed to each expert, before any drop
    dropped: Int[Array, "*layers"]  # assignments dropped by the capacity path (0 for ragged)


def router_logits(x: Float[Array, "tokens embed"], router: Float[Array, "embed experts"]) -> Float[Array, "tokens experts"]:
    return jnp.einsum("ND,DE->NE", x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def route(
    x: Float[Array, "tokens embed"],
    router: Float[Array, "embed experts"],
    bias: Optional[Float[Array, " experts"]],
    c: MoEConfig,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
    """Expert ids and combine weights per token, in float32 (see the module docstring for the rules).

    `bias` is the correction bias of `sigmoid_grouped` and the router bias of `topk_softmax`.
    """
    logits = router_logits(x, router)
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


def expert_activation(c: MoEConfig):
    """`(gate, up) -> hidden` of one expert."""
    if c.activation == "silu":
        return lambda gate, up: jax.nn.silu(gate) * up
    limit, alpha = c.swiglu_limit, c.swiglu_alpha

    def clamped_swiglu(gate, up):
        # GPT-OSS: the gate is clamped from above only, up on both sides, and up is shifted by one.
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(alpha * gate))

    return clamped_swiglu


class MoE(eqx.Module):
    router: Float[Array, "embed experts"]
    # sigmoid_grouped: the correction bias, a float32 buffer (no gradient, excluded from the optimizer);
    # topk_softmax with router_bias: a trained bias on the logits (`router_bias`).
    e_score_correction_bias: Optional[Float[Array, " experts"]]
    router_bias: Optional[Float[Array, " experts"]]
    w_gate: Float[Array, "experts embed moe_mlp"]
    w_up: Float[Array, "experts embed moe_mlp"]
    w_down: Float[Array, "experts moe_mlp embed"]
    b_gate: Optional[Float[Array, "experts moe_mlp"]]
    b_up: Optional[Float[Array, "experts moe_mlp"]]
    b_down: Optional[Float[Array, "experts embed"]]
    shared: Optional[GatedMLP]
    config: MoEConfig = eqx.field(static=True)
    compute_dtype: str = eqx.field(static=True)
    impl: str = eqx.field(static=True)

    def __init__(self, embed: int, c: MoEConfig, *, param_dtype: str = "float32", compute_dtype: str = "float32", key: PRNGKeyArray):
        kr, kg, ku, kd, ks = jax.random.split(key, 5)
        e, i = c.n_routed_experts, c.moe_intermediate_size
        self.router = normal(kr, (embed, e), embed, param_dtype)
        self.e_score_correction_bias = jnp.zeros((e,), jnp.float32) if c.router == "sigmoid_grouped" else None
        self.router_bias = jnp.zeros((e,), param_dtype) if c.router_bias else None
        self.w_gate = normal(kg, (e, embed, i), embed, param_dtype)
        self.w_up = normal(ku, (e, embed, i), embed, param_dtype)
        self.w_down = normal(kd, (e, i, embed), i, param_dtype)
        if c.expert_bias:
            self.b_gate, self.b_up, self.b_down = jnp.zeros((e, i), param_dtype), jnp.zeros((e, i), param_dtype), jnp.zeros((e, embed), param_dtype)
        else:
            self.b_gate = self.b_up = self.b_down = None
        self.shared = (
            GatedMLP(embed, i * c.n_shared_experts, param_dtype=param_dtype, compute_dtype=compute_dtype, key=ks)
            if c.n_shared_experts
            else None
        )
        self.config = c
        self.compute_dtype = compute_dtype
        self.impl = resolve_moe_impl(c.impl)

    def __call__(self, x: Float[Array, "batch seq embed"]) -> tuple[Float[Array, "batch seq embed"], MoEAux]:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        bias = self.e_score_correction_bias if self.config.router == "sigmoid_grouped" else self.router_bias
        expert_ids, weights = route(flat, self.router, bias, self.config)
        if self.impl == "ragged":
            routed, aux = self._ragged(flat, expert_ids, weights)
        else:
            routed, aux = self._capacity(flat, expert_ids, weights)
        y = routed.reshape(b, t, d)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, aux

    def _experts(self, h: Float[Array, "*rows embed"], matmul, bias_of) -> Float[Array, "*rows embed"]:
        """The routed experts on rows grouped by expert; `bias_of(b)` lays an `[experts, dim]` bias
        out like the rows (or is None when the experts have no biases)."""
        cdt = self.compute_dtype

        def proj(inp, w, b, name):
            y = matmul(inp, w.astype(cdt))
            if b is not None:
                y = y + bias_of(b.astype(cdt))
            return tags.tag(y, name)

        gate = proj(h, self.w_gate, self.b_gate, tags.MOE_MLPWI_0)
        up = proj(h, self.w_up, self.b_up, tags.MOE_MLPWI_1)
        return proj(expert_activation(self.config)(gate, up), self.w_down, self.b_down, tags.MOE_MLPWO)

    def _sorted_assignments(self, expert_ids: Int[Array, "tokens k"]):
        flat_experts = expert_ids.reshape(-1)  # assignment a = token * k + slot
        order = jnp.argsort(flat_experts, stable=True)  # stable: earlier tokens first within an expert
        counts = jnp.bincount(flat_experts, length=self.config.n_routed_experts).astype(jnp.int32)
        return flat_experts, order, counts

    def _combine(self, per_assignment: Float[Array, "assignments embed"], weights: Float[Array, "tokens k"]) -> Float[Array, "tokens embed"]:
        tokens, k = weights.shape
        out = per_assignment.reshape(tokens, k, -1)
        return jnp.einsum("NKD,NK->ND", out, weights.astype(out.dtype))

    def _ragged(self, x: Float[Array, "tokens embed"], expert_ids: Int[Array, "tokens k"], weights: Float[Array, "tokens k"]):
        k = expert_ids.shape[1]
        flat_experts, order, counts = self._sorted_assignments(expert_ids)
        sorted_x = x[order // k]  # [A D], grouped by expert
        sorted_experts = flat_experts[order]

        def matmul(h, w):
            return jax.lax.ragged_dot(h, w, counts)

        sorted_out = self._experts(sorted_x, matmul, lambda b: b[sorted_experts])
        unsorted = jnp.zeros_like(sorted_out).at[order].set(sorted_out, unique_indices=True)
        return self._combine(unsorted, weights), MoEAux(counts, jnp.zeros((), jnp.int32))

    def _capacity(self, x: Float[Array, "tokens embed"], expert_ids: Int[Array, "tokens k"], weights: Float[Array, "tokens k"]):
        tokens, k = expert_ids.shape
        experts = self.config.n_routed_experts
        capacity = moe_capacity(tokens, self.config)
        flat_experts, order, counts = self._sorted_assignments(expert_ids)
        # Slot of each assignment inside its expert's buffer: rank among that expert's assignments.
        group_start = jnp.cumsum(counts) - counts
        rank_sorted = jnp.arange(tokens * k, dtype=jnp.int32) - group_start[flat_experts[order]]
        slot = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted, unique_indices=True)
        kept = slot < capacity
        slot = jnp.where(kept, slot, capacity)  # out of bounds: dropped by the scatter, zero from the gather

        tokens_of_assignment = jnp.repeat(x, k, axis=0)  # [A D]
        buffers = jnp.zeros((experts, capacity, x.shape[-1]), x.dtype)
        buffers = buffers.at[flat_experts, slot].set(tokens_of_assignment, mode="drop")
        out = self._experts(buffers, lambda h, w: jnp.einsum("ECD,EDF->ECF", h, w), lambda b: b[:, None, :])
        per_assignment = out.at[flat_experts, slot].get(mode="fill", fill_value=0)
        dropped = (tokens * k - kept.sum()).astype(jnp.int32)
        return self._combine(per_assignment, weights), MoEAux(counts, dropped)
