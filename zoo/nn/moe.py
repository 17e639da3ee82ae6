"""DeepSeek-V3 mixture of experts: sigmoid router with a load-balancing bias, group-limited top-k,
routed experts through `zoo.nn.moe_dispatch.routed_experts`, and always-on shared experts.

The routed experts never run every expert on every token; `config.impl` picks the kernel:
- `ragged` (dropless, exact): assignments sorted by expert, three `lax.ragged_dot`s. Note XLA:CPU
  (and XLA:GPU today) lower ragged_dot to a dense padded product whose cost grows with the expert count.
- `capacity`: assignments scattered into per-expert buffers of `moe_capacity(tokens)` rows and
  multiplied as one batched matmul, so FLOPs grow with top_k * capacity_factor, not with the expert
  count. Assignments beyond an expert's capacity are dropped (earlier tokens win) and counted.
  Under an active layout whose expert axis is > 1, this is the expert-parallel kernel (capacity per
  device, from its own tokens).
"""

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo.config import MoEConfig
from zoo.nn._init import normal
from zoo.nn.mlp import SwiGLU
from zoo.nn.moe_dispatch import ExpertWeights, routed_experts


class MoEAux(eqx.Module):
    """Routing statistics of one MoE layer (stacked over layers by the scan)."""

    tokens_per_expert: Int[Array, "*layers experts"]  # assignments routed to each expert, before any drop
    dropped: Int[Array, "*layers"]  # assignments dropped by the capacity path (0 for ragged)


def route(
    x: Float[Array, "tokens embed"],
    router: Float[Array, "embed experts"],
    bias: Float[Array, " experts"],
    c: MoEConfig,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
    """Expert ids and combine weights per token, in float32.

    Selection ranks sigmoid scores plus the correction bias within the `topk_group` best groups (a
    group scores the sum of its two best biased scores); the weights are the unbiased scores of the
    chosen experts, renormalised when norm_topk_prob, times routed_scaling_factor.
    """
    logits = jnp.einsum("ND,DE->NE", x.astype(jnp.float32), router.astype(jnp.float32))
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
        # 0.0 (not -inf) for masked experts, as transformers does, so selections agree exactly.
        biased = jnp.where(expert_mask, biased, 0.0)
    _, expert_ids = jax.lax.top_k(biased, c.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return expert_ids, weights * c.routed_scaling_factor


class MoE(eqx.Module):
    router: Float[Array, "embed experts"]
    e_score_correction_bias: Float[Array, " experts"]  # a buffer: stop_gradient, excluded from the optimizer
    w_gate: Float[Array, "experts embed moe_mlp"]
    w_up: Float[Array, "experts embed moe_mlp"]
    w_down: Float[Array, "experts moe_mlp embed"]
    shared: Optional[SwiGLU]
    config: MoEConfig = eqx.field(static=True)
    compute_dtype: str = eqx.field(static=True)

    def __init__(self, embed: int, c: MoEConfig, *, param_dtype: str = "float32", compute_dtype: str = "float32", key: PRNGKeyArray):
        kr, kg, ku, kd, ks = jax.random.split(key, 5)
        e, i = c.n_routed_experts, c.moe_intermediate_size
        self.router = normal(kr, (embed, e), embed, param_dtype)
        self.e_score_correction_bias = jnp.zeros((e,), jnp.float32)
        self.w_gate = normal(kg, (e, embed, i), embed, param_dtype)
        self.w_up = normal(ku, (e, embed, i), embed, param_dtype)
        self.w_down = normal(kd, (e, i, embed), i, param_dtype)
        self.shared = (
            SwiGLU(embed, i * c.n_shared_experts, param_dtype=param_dtype, compute_dtype=compute_dtype, key=ks)
            if c.n_shared_experts
            else None
        )
        self.config = c
        self.compute_dtype = compute_dtype

    def __call__(self, x: Float[Array, "batch seq embed"]) -> tuple[Float[Array, "batch seq embed"], MoEAux]:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        expert_ids, weights = route(flat, self.router, self.e_score_correction_bias, self.config)
        routed, counts, dropped = routed_experts(
            flat, expert_ids, weights, ExpertWeights(self.w_gate, self.w_up, self.w_down),
            impl=self.config.impl, capacity_factor=self.config.capacity_factor, compute_dtype=self.compute_dtype,
        )
        aux = MoEAux(counts, dropped)
        y = routed.reshape(b, t, d)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, aux
