"""LoRA adapters (zoo.lora) in the PEFT layout that the `peft` library and transformers load over the base.

`save_adapters(model, directory, ...)` writes `adapter_config.json` and `adapter_model.safetensors`
for a model whose adapted projections are `zoo.lora.LoRAWeight`s (what `restore_model(...,
lora_form="adapters")` or `zoo.lora.attach` give; the base may be abstract, only its shapes are read).

PEFT adapts a whole hub Linear `W [out, in]` as `W + (alpha / r) * B @ A` with `A = lora_A [r, in]` and
`B = lora_B [out, r]`. A zoo adapter `a [fan_in, rank]`, `b [rank, fan_out]` adds `a @ b` reshaped to
the zoo weight's einsum layout, which the family's conversion `Rule` turns into the hub matrix by
transposing, reshaping, splitting or stacking. Those moves are found by running the rule's `to_hub`
on arrays of element indices: each hub row is then one zoo output element and each hub column one zoo
input element, so `lora_B` is `b.T` with its rows put in the hub's row order and `lora_A` is `a.T`
with its columns in the hub's column order (any permutation a rule applies to q/k rows reaches lora_B
the same way), and `W_hub + scale * B @ A` is the merged export's weight.

A hub Linear built from several zoo leaves (DeepSeek's `kv_b_proj`: `wk_b` and `wv_b`, rows
interleaved per head) gets the adapters of those leaves side by side: rank `n * r` with `alpha` scaled
alike (`rank_pattern` / `alpha_pattern`), zero where a leaf's adapter does not reach, which is the
same sum exactly.
"""

import json
import math
import pathlib
from typing import Optional

import numpy as np

from zoo.errors import CheckpointError
from zoo.hf.convert import _get, _positions, dtype_name, family_of
from zoo.hf.files import SafetensorsStream
from zoo.lora import LoRAWeight

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel's path to the wrapped transformers model


def _shape(leaf) -> tuple[int, ...]:
    """One layer's shape of a stacked zoo leaf (an array, a ShapeDtypeStruct or a LoRAWeight's base)."""
    return tuple((leaf.base if isinstance(leaf, LoRAWeight) else leaf).shape[1:])


def _hub_maps(rule, shapes: list[tuple[int, ...]], adapted: list[int], fan_outs: list[int]):
    """For each adapted zoo leaf k: (hub rows, zoo output index per row, hub columns, zoo input index
    per column). CheckpointError when the rule mixes a leaf's elements so that no row/column split exists."""
    sizes = [math.prod(s) for s in shapes]
    offsets = np.cumsum([0] + sizes)
    index = [np.arange(offsets[k], offsets[k + 1], dtype=np.int64).reshape(s) for k, s in enumerate(shapes)]
    hub = rule.to_hub(*index)
    if len(hub) != 1 or np.asarray(hub[0]).ndim != 2:
        raise CheckpointError(f"{', '.join(rule.hub)}: not one [out, in] matrix; PEFT cannot adapt it")
    hub = np.asarray(hub[0])
    out = []
    for k in adapted:
        mine = (hub >= offsets[k]) & (hub < offsets[k + 1])
        rows, cols = np.nonzero(mine.any(axis=1))[0], np.nonzero(mine.any(axis=0))[0]
        block = hub[np.ix_(rows, cols)] - offsets[k]
        i_in, j_out = np.divmod(block, fan_outs[k])
        if not (mine[np.ix_(rows, cols)].all() and (i_in == i_in[:1]).all() and (j_out == j_out[:, :1]).all()):
            raise CheckpointError(
                f"{rule.hub[0]}: its rule mixes rows and columns of {rule.zoo[k]}; PEFT cannot express its adapter"
            )
        out.append((rows, j_out[:, 0], cols, i_in[0]))
    return hub.shape, out


def peft_state(model, dtype=None) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """(PEFT tensor name -> array, hub module path -> adapter rank) for every adapted projection of
    `model` (LoRAWeight leaves; the base may be abstract). Arrays in the adapters' dtype, or `dtype`."""
    c = model.config
    family = family_of(c)
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    for attr, layers, moe in _positions(model):
        block = _get(model, attr)
        for rule in family.block_rules(c, moe):
            leaves = [_get(block, z) for z in rule.zoo]
            adapted = [k for k, leaf in enumerate(leaves) if isinstance(leaf, LoRAWeight)]
            if not adapted:
                continue
            if rule.lazy or len(rule.hub) != 1 or not rule.hub[0].endswith(".weight"):
                raise CheckpointError(
                    f"{rule.hub[0]}: adapters on this tensor have no PEFT layout (only Linear weights adapt)"
                )
            fan_outs = [leaf.b.shape[-1] if isinstance(leaf, LoRAWeight) else 1 for leaf in leaves]
            (n_out, n_in), maps = _hub_maps(rule, [_shape(leaf) for leaf in leaves], adapted, fan_outs)
            a_all = [np.asarray(leaves[k].a) for k in adapted]  # [repeats, fan_in, rank]
            b_all = [np.asarray(leaves[k].b) for k in adapted]  # [repeats, rank, fan_out]
            rank = sum(a.shape[-1] for a in a_all)
            module = rule.hub[0][: -len(".weight")]
            for j, layer in enumerate(layers):
                lora_a = np.zeros((rank, n_in), a_all[0].dtype)
                lora_b = np.zeros((n_out, rank), b_all[0].dtype)
                r0 = 0
                for a, b, (rows, out_idx, cols, in_idx) in zip(a_all, b_all, maps):
                    r = a.shape[-1]
                    lora_a[r0 : r0 + r, cols] = a[j].T[:, in_idx]
                    lora_b[rows, r0 : r0 + r] = b[j].T[out_idx, :]
                    r0 += r
                path = f"model.layers.{layer}.{module}"
                target = None if dtype is None else np.dtype(dtype)
                tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = lora_a if target is None else lora_a.astype(target)
                tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = lora_b if target is None else lora_b.astype(target)
                ranks[path] = rank
    if not tensors:
        raise CheckpointError("the model has no adapters (no LoRAWeight); attach them first (zoo.lora.attach)")
    return tensors, ranks


def check_names(model, ranks: dict[str, int]) -> None:
    """PEFT picks modules by their last name (`target_modules`): refuse when another Linear of the model
    has the name of an adapted one (DeepSeek's and Qwen3-MoE's routed experts have `gate_proj`,
    `up_proj`, `down_proj` like the dense MLP; peft with transformers 5 even maps those names to the
    fused experts alone), since the adapters would then not land where they were trained."""
    c = model.config
    family = family_of(c)
    adapted = {path.rsplit(".", 1)[1] for path in ranks}
    zoo_names: dict[str, set[str]] = {}  # hub module name -> the zoo projections it holds
    clash = None
    for attr, layers, moe in _positions(model):
        for rule in family.block_rules(c, moe):
            for hub in rule.hub:
                module = hub[: -len(".weight")] if hub.endswith(".weight") else hub
                name = module.rsplit(".", 1)[-1]
                if f"model.layers.{layers[0]}.{module}" in ranks:
                    zoo_names.setdefault(name, set()).update(z.rsplit(".", 1)[-1] for z in rule.zoo)
                elif name in adapted and clash is None:
                    clash = (module, name)
    if clash is not None:
        module, name = clash
        raise CheckpointError(
            f"lora.targets: this {family.model_type} model's {module} shares the name {name} with adapted projections "
            "but is "
            "not adapted, and peft picks modules by name; export the merged model, or train without "
            f"{', '.join(sorted(zoo_names[name]))} in lora.targets"
        )


def adapter_config(ranks: dict[str, int], rank: int, alpha: float, dropout: float, base_model: Optional[str]) -> dict:
    """adapter_config.json: the projections by their hub module names; a module whose rank is a multiple
    of `rank` (several zoo leaves in one hub Linear) keeps `alpha / rank` through rank_pattern/alpha_pattern."""
    by_name: dict[str, set[int]] = {}
    for path, r in ranks.items():
        by_name.setdefault(path.rsplit(".", 1)[1], set()).add(r)
    rank_pattern = {}
    for name, rs in sorted(by_name.items()):
        if rs != {rank}:  # PEFT matches a pattern key against the end of a module's path
            rank_pattern.update(
                {name: next(iter(rs))}
                if len(rs) == 1
                else {p: r for p, r in sorted(ranks.items()) if p.endswith("." + name)}
            )
    alpha_pattern = {key: alpha * r / rank for key, r in rank_pattern.items()}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(by_name),
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
    }


def save_adapters(
    model, directory, *, rank: int, alpha: float, dropout: float = 0.0, base_model: Optional[str] = None, dtype=None
) -> list[str]:
    """Write `model`'s adapters (LoRAWeight leaves) to `directory` in the PEFT layout; returns the file names.
    `base_model`: adapter_config.json's base_model_name_or_path (a Hugging Face directory or hub id, or None)."""
    import jax.numpy as jnp

    target = None if dtype is None else np.dtype(jnp.dtype(dtype_name(dtype)))
    tensors, ranks = peft_state(model, target)
    check_names(model, ranks)
    config = adapter_config(ranks, rank, alpha, dropout, base_model)
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    stream = SafetensorsStream(
        d / ADAPTER_WEIGHTS, [(n, a.shape, a.dtype) for n, a in tensors.items()], {"format": "pt"}
    )
    for name, arr in tensors.items():
        stream.write(name, arr)
    stream.close()
    (d / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
