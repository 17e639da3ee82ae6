"""Low-rank adapters (LoRA) over a frozen base model.

A projection `W` (any shape; its input axes first, output axes last) becomes `W + (alpha / rank) * A @ B`
with `A: [in, rank]` drawn at random and `B: [rank, out]` zero, so an adapted model starts equal to
its base. The adapters are their own small pytree, mirroring the model's stacks: per stack, per
position of its period, a dict `{"attn.wq": {"a": [repeats, in, rank], "b": [repeats, rank, out]}}`,
every leaf with the stack's leading `repeats` axis, so the layer scan slices them with the base.

`attach(model, adapters, config)` puts a `LoRAWeight` (base, a, b) where each adapted projection was;
`Stack._block` merges it per layer inside the scan (`merge_block`), so training, prefill and decode all
see the adapted weights and the base is never merged whole. With `lora.dropout` and a key
(`attach(..., key=)`, the trainer's per step and microbatch), each weight also carries a per-layer
key and stays unmerged: its projection (`project`) runs the base and the adapter apart, the adapter
on a dropped-out copy of its input, as LoRA defines dropout. Evaluation and sampling attach no key. Only the adapters
are differentiated: callers take gradients with respect to `adapters` with the base closed over
(`zoo.loss_fn(attach(base, adapters, config), tokens)`).

Targets are the names of the projections the blocks declare (`zoo.sharding.projection` in their
`PARAMS`): `wq wk wv wo` (grouped-query attention), `wq_a wq_b wkv_a wk_b wv_b wo` (latent attention,
DeepSeek), `w_gate w_up w_down` (the gated MLP, and a MoE's shared experts). Routed experts are not
adapted (their stacked weights are no such projection).
"""

import dataclasses
import math
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from zoo import nn
from zoo.errors import ConfigError
from zoo.ranges import ranged

# The adapted weight and its projection live with the blocks that use them; re-exported here.
from zoo.nn.lora_weight import LoRAWeight, _is_lora, project  # noqa: F401


def _projections(block_class) -> dict[str, int]:
    """Field -> input axes, for the projections a block class declares (its PARAMS)."""
    return {field: leaf.inputs for field, leaf in getattr(block_class, "PARAMS", {}).items() if leaf.inputs}


# Every projection name a block of zoo.nn declares, in the order zoo.nn lists the blocks.
TARGETS = tuple(dict.fromkeys(f for name in nn.__all__ for f in _projections(getattr(nn, name))))
# A target that names every projection the model has (lora=default's): the same option adapts a Llama's
# wq, wk, wv, wo and a DeepSeek's wq_a ... wv_b, and their MLPs.
ALL = "all"


@ranged("lora", rank="[0, inf): 0 turns LoRA off", alpha="(0, inf)", dropout="[0, 1)")
@dataclasses.dataclass
class LoraConfig:
    """The `lora` group. `rank: 0` (lora=none) trains the whole model as before."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = dataclasses.field(default_factory=lambda: ["wq", "wv"])
    base_on_host: bool = False  # the frozen base in pinned host memory, brought to the device per layer

    def __post_init__(self):
        if self.rank and not self.targets:
            raise ConfigError("lora.targets: empty; name at least one projection, e.g. lora.targets=[wq,wv]")
        unknown = [t for t in self.targets if t not in TARGETS and t != ALL]
        if unknown:
            raise ConfigError(
                f"lora.targets: unknown projection {unknown[0]!r}; choose from {', '.join(TARGETS)}, or {ALL} (every "
                "projection the model has)"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def adapts(self, name: str) -> bool:
        """Whether a projection of this name gets an adapter."""
        return ALL in self.targets or name in self.targets

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def merge_block(tree: PyTree) -> PyTree:
    """Every `LoRAWeight` in `tree` replaced by its merged weight (a no-op without adapters), except
    those training with dropout, which their projections apply unmerged (`project`)."""
    return jax.tree.map(lambda x: x.merge() if _is_lora(x) and not x.dropping else x, tree, is_leaf=_is_lora)


def _sites(block) -> dict[str, tuple[str, ...]]:
    """Adapter name -> attribute path, for the projections this (stacked) block has: each present
    leaf that its module declares a projection, in whichever module it sits (`attn.wq`, `ffn.w_gate`,
    `ffn.shared.w_gate`)."""
    out = {}

    def visit(module, path):
        declared = _projections(type(module))
        for f in dataclasses.fields(module):
            value = getattr(module, f.name, None)
            if f.name in declared and value is not None:
                out[".".join((*path, f.name))] = (*path, f.name)
            elif isinstance(value, eqx.Module):
                visit(value, (*path, f.name))

    visit(block, ())
    return out


def _get(block, path):
    for p in path:
        block = getattr(block, p)
    return block


def _fan_in_axes(block, path) -> int:
    """The input axes of the projection at `path` in `block`, as its module declares them."""
    return _projections(type(_get(block, path[:-1])))[path[-1]]


def family_targets(model) -> set[str]:
    """The projection names any layer of `model` (concrete or abstract) can adapt."""
    return {key.rsplit(".", 1)[1] for stack in model.stacks for block in stack.layers for key in _sites(block)}


def resolved(model, config: LoraConfig) -> LoraConfig:
    """`config` with `all` replaced by the names of the projections `model` has (in TARGETS' order),
    so what a run records and prints (summary.json, its checkpoints, the startup line) names them."""
    if ALL not in config.targets:
        return config
    have = family_targets(model)
    return dataclasses.replace(config, targets=[t for t in TARGETS if t in have])


def projection_shapes(model, config: LoraConfig) -> list[list[dict[str, tuple[int, int, int]]]]:
    """Per stack, per period position: adapter key -> (repeats, fan_in, fan_out)."""
    out = []
    for stack in model.stacks:
        per_pos = []
        for block in stack.layers:
            sites = {}
            for key, path in _sites(block).items():
                name = path[-1]
                if not config.adapts(name):
                    continue
                shape = _get(block, path).shape  # [repeats, ...]
                fan_in = math.prod(shape[1:][: _fan_in_axes(block, path)])
                sites[key] = (shape[0], fan_in, math.prod(shape[1:]) // fan_in)
            per_pos.append(sites)
        out.append(per_pos)
    return out


def check(model, config: LoraConfig) -> Optional[str]:
    """The one-line problem with adapting `model` (concrete or abstract) this way, or None."""
    if not config.enabled:
        return None
    have = family_targets(model)
    for t in config.targets:
        if t not in have and t != ALL:
            return f"lora.targets: this model has no {t!r} projection; its projections are {', '.join(sorted(have))}"
    for per_pos in projection_shapes(model, config):
        for sites in per_pos:
            for key, (_, fan_in, fan_out) in sites.items():
                if config.rank > min(fan_in, fan_out):
                    return (
                        f"lora.rank: {config.rank} exceeds the {key} projection's smaller side "
                        f"({fan_in} -> {fan_out}); use lora.rank<={min(fan_in, fan_out)}"
                    )
    return None


def init(model, config: LoraConfig, *, key: PRNGKeyArray, dtype=jnp.float32) -> PyTree:
    """Adapters for `model`: A ~ N(0, 1/fan_in), B = 0 (the adapted model equals the base)."""
    shapes = projection_shapes(model, config)
    keys = iter(jax.random.split(key, max(1, sum(len(s) for p in shapes for s in p))))
    out = []
    for per_pos in shapes:
        pos_out = []
        for sites in per_pos:
            d = {}
            for name, (repeats, fan_in, fan_out) in sorted(sites.items()):
                a = jax.random.normal(next(keys), (repeats, fan_in, config.rank), dtype) / math.sqrt(fan_in)
                d[name] = {"a": a, "b": jnp.zeros((repeats, config.rank, fan_out), dtype)}
            pos_out.append(d)
        out.append(tuple(pos_out))
    return tuple(out)


def attach(model, adapters: PyTree, config: LoraConfig, *, key: Optional[PRNGKeyArray] = None):
    """`model` with each adapted projection a `LoRAWeight` (merged per layer inside the scan). With
    `key` and `config.dropout`, each weight gets a key per layer (split from `key`) and trains with
    dropout on its adapter's input; without, there is no dropout (evaluation, sampling)."""
    stacks = []
    site = 0
    for stack, per_pos in zip(model.stacks, adapters):
        layers = []
        for block, sites in zip(stack.layers, per_pos):
            for name, ab in sites.items():
                path = tuple(name.split("."))
                base = _get(block, path)
                layer_keys = None
                if key is not None and config.dropout > 0.0:
                    layer_keys = jax.random.split(jax.random.fold_in(key, site), ab["a"].shape[0])
                site += 1
                weight = LoRAWeight(
                    base, ab["a"], ab["b"], layer_keys, config.scale, _fan_in_axes(block, path), config.dropout
                )
                block = eqx.tree_at(lambda b, p=path: _get(b, p), block, weight)
            layers.append(block)
        stacks.append(eqx.tree_at(lambda s: s.layers, stack, tuple(layers)))
    return eqx.tree_at(lambda m: m.stacks, model, tuple(stacks))


def detach(model) -> tuple[Any, PyTree, LoraConfig]:
    """The inverse of `attach`: (the base model, its adapters, a LoraConfig with their rank, alpha and
    targets). A model without adapters raises ValueError."""
    stacks, adapters, targets, found = [], [], set(), None
    for stack in model.stacks:
        layers, per_pos = [], []
        for block in stack.layers:
            sites = {}
            for key, path in _sites(block).items():
                w = _get(block, path)
                if _is_lora(w):
                    sites[key] = {"a": w.a, "b": w.b}
                    targets.add(path[-1])
                    found = (w.a.shape[-1], w.scale)
                    block = eqx.tree_at(lambda b, p=path: _get(b, p), block, w.base)
            layers.append(block)
            per_pos.append(sites)
        stacks.append(eqx.tree_at(lambda s: s.layers, stack, tuple(layers)))
        adapters.append(tuple(per_pos))
    if found is None:
        raise ValueError("lora.detach: the model has no adapters attached")
    rank, scale = found
    config = LoraConfig(rank=rank, alpha=scale * rank, targets=sorted(targets))
    return eqx.tree_at(lambda m: m.stacks, model, tuple(stacks)), tuple(adapters), config


def has_adapters(model) -> bool:
    return any(_is_lora(x) for x in jax.tree.leaves(model, is_leaf=_is_lora))


def merge(model) -> Any:
    """An attached model with every adapter folded into its base weight: a plain model again."""
    return merge_block(model)


def count(adapters: PyTree) -> int:
    """Trainable parameters: the adapters' elements."""
    return int(sum(x.size for x in jax.tree.leaves(adapters)))


def check_family(adapters: PyTree, model, config: LoraConfig, family: Optional[str] = None) -> Optional[str]:
    """The one-line problem with putting saved `adapters` (made for a model of `family`, where known) on
    `model` (a model of another family or size, other targets or rank), or None."""
    if family is not None and family != model.config.family:
        return (
            f"lora: the saved adapters were made for a {family} model, not {model.config.family}; "
            "train new adapters or load the model they were made for"
        )
    want = jax.tree.map(lambda x: x.shape, init_shapes(model, config))
    got = jax.tree.map(lambda x: tuple(x.shape), adapters)
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        return (
            "lora: the saved adapters do not fit this model (another family, size, targets or rank); train new "
            "adapters or load the model they were made for"
        )
    return None


def init_shapes(model, config: LoraConfig) -> PyTree:
    return jax.eval_shape(lambda k: init(model, config, key=k), jax.random.key(0))
