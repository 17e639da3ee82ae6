"""The weight a LoRA-adapted projection holds (`LoRAWeight`: a frozen base and its adapter) and the
projection every block runs through (`project`), for a plain weight or an adapted one. The blocks
use them; attaching, merging and initialising the adapters is `zoo.lora`'s business."""

from typing import ClassVar, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key

from zoo import sharding as zs


class LoRAWeight(eqx.Module):
    """A frozen base weight and its adapter; `merge()` is the weight the projection uses. With a
    dropout `key` (one per layer while stacked), the projection applies the parts apart (`project`)."""

    base: Union[Float[Array, "..."], jax.ShapeDtypeStruct]  # abstract: an adapters-only restore (shapes, no base read)
    a: Float[Array, "*layers fan_in rank"]
    b: Float[Array, "*layers rank fan_out"]
    key: Optional[Key[Array, "*layers"]] = None
    scale: float = eqx.field(static=True, default=1.0)
    fan_in_axes: int = eqx.field(static=True, default=1)  # how many input axes the base weight has
    dropout: float = eqx.field(static=True, default=0.0)

    # zoo.sharding: none is cast where it lies (the projection casts the merged weight, `project`),
    # and none is sharded by its field: the adapters are replicated and the base is sharded as the
    # plain model's weight, before `attach`.
    PARAMS: ClassVar[dict[str, zs.Leaf]] = {f: zs.Leaf(None, False) for f in ("base", "a", "b", "key")}

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dropping(self) -> bool:
        return self.key is not None and self.dropout > 0.0

    def merge(self) -> Array:
        # The base gets no gradient: only the adapters train, and no [in, out] cotangent is built for it.
        base = jax.lax.stop_gradient(self.base)
        delta = jnp.matmul(self.a.astype(jnp.float32), self.b.astype(jnp.float32)) * self.scale
        return (base.astype(jnp.float32) + delta.reshape(base.shape)).astype(base.dtype)


def _is_lora(x) -> bool:
    return isinstance(x, LoRAWeight)


def project(spec: str, x: Array, w, dtype) -> Array:
    """`einsum(spec, x, w)` in `dtype`, for a plain weight or a `LoRAWeight`. Every projection of the
    blocks goes through here; for a plain weight it is exactly `jnp.einsum(spec, x, w.astype(dtype))`.

    Training with dropout: `x @ base + scale * dropout(x) @ A @ B`, the adapter reading `x`'s
    `fan_in_axes` trailing axes flattened and its output reshaped to the projection's (every spec
    here puts `x`'s other axes first and the weight's output axes last)."""
    if not _is_lora(w):
        return jnp.einsum(spec, x, w.astype(dtype))
    if not w.dropping:
        return jnp.einsum(spec, x, w.merge().astype(dtype))
    y = jnp.einsum(spec, x, jax.lax.stop_gradient(w.base).astype(dtype))
    rows = x.reshape(*x.shape[: x.ndim - w.fan_in_axes], -1)
    keep = jax.random.bernoulli(w.key, 1.0 - w.dropout, rows.shape)
    rows = jnp.where(keep, rows / (1.0 - w.dropout), 0).astype(dtype)
    delta = (rows @ w.a.astype(dtype)) @ w.b.astype(dtype)
    return y + (w.scale * delta).reshape(y.shape).astype(y.dtype)
