"""The masks every attention path shares (zoo.nn.attention_kernels' semantics): causality and the
window from query and key positions, and the keys' segment ids of packed rows."""

import jax.numpy as jnp


def positions_mask(q_pos, k_pos, causal, window):
    """[..., q, k] booleans from query and key positions (broadcastable)."""
    q_pos, k_pos = q_pos[..., :, None], k_pos[..., None, :]
    keep = jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
    if causal:
        keep &= k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    return keep


def kv_segments(segment_ids, kv_segment_ids, q_len: int, kv_len: int):
    """The keys' segment ids: `kv_segment_ids`, or the queries' when they align with the keys."""
    if segment_ids is not None and kv_segment_ids is None:
        if kv_len != q_len:
            raise ValueError(f"attention: kv_segment_ids is needed when kv_len ({kv_len}) != q_len ({q_len})")
        return segment_ids
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("attention: segment_ids and kv_segment_ids come together")
    return kv_segment_ids
