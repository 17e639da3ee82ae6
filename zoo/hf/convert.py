"""Hugging Face interop over every family: which `Family` a config.json or a ModelConfig is,
config.json <-> ModelConfig, `to_hf_state_dict` and `save_pretrained` (reading the weights:
`zoo.hf.weights`).

A family's mapping (the `hf` of its `zoo/families/<name>.py`) is a `Family`:
its `model_type`, the defaults of its transformers config class, how its config.json keys become
ModelConfig fields and back, and the names of the tensors only it has; it is written with the kit in
`zoo/families/_hf.py`, where everything shared lives once.
"""

import dataclasses
import json
import math
import pathlib
from collections.abc import Iterator, Sequence
from typing import Optional

import jax.numpy as jnp
import numpy as np

from zoo import families as registry
from zoo.config import ModelConfig, dtype_name
from zoo.errors import CheckpointError
from zoo.families._hf import Family, Keys, Rule, common_hf, layer_types_of, top_rules
from zoo.hf.files import SafetensorsStream
from zoo.model import CausalLM


def families() -> tuple[Family, ...]:
    """The Hugging Face mapping of every family that has one (zoo/families/<name>.py's `hf`)."""
    return tuple(f.hf for f in registry.registered() if f.hf is not None)


def supported_model_types() -> tuple[str, ...]:
    return tuple(f.model_type for f in families())


def family_of(c: ModelConfig) -> Family:
    for f in families():
        if f.name == c.family:
            return f
    raise CheckpointError(f"family {c.family!r} has no Hugging Face mapping")


def block_rules(c: ModelConfig, moe: bool) -> list[Rule]:
    return family_of(c).block_rules(c, moe)


# --- config.json <-> ModelConfig ----------------------------------------------------------------

# ModelConfig fields that say how zoo runs a model, not what the model is: config.json does not hold them.
_RUNTIME_FIELDS = ("param_dtype", "compute_dtype", "attention_impl")
# config.json's special token ids that zoo does not model (generation reads them); pad_token_id it does.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id")
_RUNTIME_MOE_FIELDS = ("impl", "capacity_factor")


def fp8_block(cfg: dict, source: str = "config.json") -> Optional[tuple[int, int]]:
    """The `weight_block_size` of an FP8 block-quantised checkpoint (DeepSeek-V3's published weights:
    `quant_method: fp8`, `fmt: e4m3`), dequantised on load; None for a float checkpoint. Any other
    quantisation is refused."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
    if method != "fp8":
        raise CheckpointError(
            f"{source}: quantization_config ({method}) is not supported: zoo reads floating-point "
            "checkpoints and DeepSeek-V3's FP8 blocks (quant_method fp8); dequantise first"
        )
    block = q.get("weight_block_size")
    if q.get("fmt", "e4m3") != "e4m3" or not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"{source}: quantization_config {json.dumps(q)} is not supported: zoo dequantises fmt e4m3 "
            "with a weight_block_size of two positive ints (DeepSeek-V3: [128, 128])"
        )
    return (block[0], block[1])


def config_from_hf(cfg: dict, *, source: str = "config.json", **overrides) -> ModelConfig:
    """A ModelConfig from a parsed Hugging Face `config.json`; `overrides` replace ModelConfig fields
    (`moe_<field>` a MoEConfig field). MoE models load with `moe.impl = "ragged"`: a loaded
    checkpoint computes what it was trained to, dropless and exact."""
    model_type = cfg.get("model_type")
    by_type = {f.model_type: f for f in families()}
    if model_type not in by_type:
        hint = ""
        if model_type == "gemma3":
            hint = " (the multimodal Gemma 3; zoo reads the text model, model_type 'gemma3_text')"
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not supported{hint}; supported: {', '.join(by_type)}"
        )
    family = by_type[model_type]
    keys = Keys(cfg, family.defaults, source)
    fp8_block(cfg, source)  # refuses every quantisation but DeepSeek-V3's FP8 blocks
    try:
        fields = family.read(keys)
    except CheckpointError:
        raise
    except ValueError as e:  # a MoEConfig or RopeConfig that its own validation refuses
        raise keys.error(str(e)) from None
    fields["family"] = family.name
    if fields.get("moe") is not None:
        fields["moe"] = dataclasses.replace(fields["moe"], impl="ragged")
    moe_overrides = {key[4:]: overrides.pop(key) for key in list(overrides) if key.startswith("moe_")}
    if moe_overrides and fields.get("moe") is not None:
        fields["moe"] = dataclasses.replace(fields["moe"], **moe_overrides)
    fields.update(overrides)
    try:
        return registry.check(ModelConfig(**fields))
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def _architecture_only(c: ModelConfig) -> ModelConfig:
    """`c` without what config.json does not hold, and with equivalent spellings made equal: the window
    of a model without sliding layers, explicit layer types when all layers slide, a local rope equal to
    the global one."""
    c = c.replace(**{f: getattr(ModelConfig, f) for f in _RUNTIME_FIELDS})
    types = layer_types_of(c)
    if "sliding_attention" not in types:
        c = c.replace(sliding_window=None, layer_types=None)
    elif "full_attention" not in types:
        c = c.replace(layer_types=None)
    if c.rope_local is None or "sliding_attention" not in types:
        c = c.replace(rope_local=c.rope)
    if c.moe is not None:
        c = c.replace(moe=dataclasses.replace(c.moe, **{f: getattr(type(c.moe), f) for f in _RUNTIME_MOE_FIELDS}))
    return c


def config_to_hf(c: ModelConfig) -> dict:
    """config.json for `c`, as transformers writes it for the family (both rope styles where the family
    has both). A config the family's transformers code cannot express (a flag it fixes, a window
    pattern it cannot state) raises a CheckpointError naming the fields."""
    family = family_of(c)
    out = common_hf(c, family)
    out.update(family.write(c))
    back = config_from_hf(json.loads(json.dumps(out)), source=f"config_to_hf({family.model_type})")
    want, got = _architecture_only(c), _architecture_only(back)
    if want != got:
        diff = [f.name for f in dataclasses.fields(ModelConfig) if getattr(want, f.name) != getattr(got, f.name)]
        detail = "; ".join(f"{name}={getattr(want, name)!r} (reads back as {getattr(got, name)!r})" for name in diff)
        raise CheckpointError(f"a {family.model_type} config.json cannot express this model: {detail}")
    return out


# --- load ---------------------------------------------------------------------------------------


def _get(tree, path: str):
    for part in path.split("."):
        if tree is None:
            return None
        tree = tree[int(part)] if part.isdigit() else getattr(tree, part)
    return tree


def _positions(model: CausalLM):
    """(attribute path of the stacked block, its layer indices, is_moe) for every block position of every stack."""
    c = model.config
    out = []
    for s_idx, stack in enumerate(model.stacks):
        for j in range(stack.period):
            layers = [stack.layer_index(r, j) for r in range(stack.repeats)]
            out.append((f"stacks.{s_idx}.layers.{j}", layers, c.is_moe_layer(layers[0])))
    return out


def _shape_only(shape, dtype) -> np.ndarray:
    """An array of `shape` that takes no memory (zero strides), to run a Rule for its shapes."""
    return np.broadcast_to(np.zeros((), dtype), shape)


def _hub_shapes(rule: Rule, zoo_shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    if rule.hub_shapes is not None:
        return [tuple(s) for s in rule.hub_shapes(zoo_shapes)]
    return [tuple(a.shape) for a in rule.to_hub(*[_shape_only(s, np.float32) for s in zoo_shapes])]


def rules_and_shapes(skeleton: CausalLM):
    """(rule, prefix of its hub names, zoo attribute prefix, layer indices or None, zoo per-layer shapes,
    hub shapes) for every rule of the model: the top-level ones, then each stacked block position's."""
    config = skeleton.config
    family = family_of(config)
    for rule in top_rules(config):
        shapes = [_get(skeleton, z).shape for z in rule.zoo]
        yield rule, "", "", None, shapes, _hub_shapes(rule, shapes)
    for attr, layers, moe in _positions(skeleton):
        block = _get(skeleton, attr)
        for rule in family.block_rules(config, moe):
            shapes = [_get(block, z).shape[1:] for z in rule.zoo]
            yield rule, "model.layers.{layer}.", attr + ".", layers, shapes, _hub_shapes(rule, shapes)


# --- save ---------------------------------------------------------------------------------------


def _hf_tensors(tree: CausalLM) -> Iterator[tuple[str, np.ndarray]]:
    """(hub name, array) for each tensor of a model or a gradient of one (None leaves are skipped), one leaf
    on the host at a time."""
    c = tree.config
    family = family_of(c)

    def emit(rule: Rule, leaves, prefix: str = ""):
        if any(leaf is None for leaf in leaves):
            return
        for name, arr in zip(rule.hub, rule.to_hub(*leaves)):
            yield prefix + name, np.ascontiguousarray(arr)

    for rule in top_rules(c):
        yield from emit(rule, [None if (x := _get(tree, z)) is None else np.asarray(x) for z in rule.zoo])
    for attr, layers, moe in _positions(tree):
        block = _get(tree, attr)
        for rule in family.block_rules(c, moe):
            stacked = [None if (x := _get(block, z)) is None else np.asarray(x) for z in rule.zoo]
            for j, layer in enumerate(layers):
                yield from emit(rule, [None if s is None else s[j] for s in stacked], f"model.layers.{layer}.")


def to_hf_state_dict(tree: CausalLM) -> dict[str, np.ndarray]:
    """Hub names -> numpy arrays for a model, or a gradient of one (same structure; None leaves are skipped)."""
    return dict(_hf_tensors(tree))


def save_pretrained(
    model: CausalLM, path, dtype=None, max_shard_bytes: int = 5 * 2**30, extra_config: Optional[dict] = None
) -> None:
    """Write `config.json` and safetensors shards (with an index when there are several), under the hub's names.

    `dtype` (a string, jnp or numpy dtype; None: the model's) is the dtype of the tensors written.
    `extra_config`: config.json keys zoo does not model (`bos_token_id`, ...), written where
    `config_to_hf` writes nothing of its own; `TOKEN_ID_KEYS` it does not give are written null.

    Leaf by leaf: each zoo leaf comes to the host on its own (gathered from its shards when the model is
    sharded over devices), is converted and its hub tensors written into their files, which were laid
    out up front from the shapes alone; so the host holds about one leaf, never a shard file or the
    model. Files are written under temporary names and renamed into place, so an interrupted save
    leaves no half-written file under a final name.
    """
    directory = pathlib.Path(path)
    config = config_to_hf(model.config)  # refuses a model its family cannot express before writing anything
    target = None if dtype is None else np.dtype(jnp.dtype(dtype_name(dtype)))
    if target is not None:
        config["dtype"] = target.name
    for key, value in (extra_config or {}).items():
        config.setdefault(key, value)
    for key in TOKEN_ID_KEYS:
        # Absent, transformers would take its class default (Gemma 3: bos 2, Llama: 1), ids this model never saw.
        config.setdefault(key, None)
    # Every hub tensor's name, shape and dtype, in the order _hf_tensors gives them, split into files of at
    # most max_shard_bytes (a larger tensor gets a file of its own) as they come.
    files: list[list[tuple[str, tuple[int, ...], np.dtype]]] = [[]]
    size = total = 0
    for rule, prefix, attr, layers, _, hub_shapes in rules_and_shapes(model):
        dt = target or np.dtype(_get(model, attr + rule.zoo[0]).dtype)
        for layer in [None] if layers is None else layers:
            for name, shape in zip(rule.hub, hub_shapes):
                nbytes = math.prod(shape) * dt.itemsize
                if files[-1] and size + nbytes > max_shard_bytes:
                    files.append([])
                    size = 0
                files[-1].append((prefix.format(layer=layer) + name, tuple(shape), dt))
                size += nbytes
                total += nbytes
    directory.mkdir(parents=True, exist_ok=True)
    tmp = [directory / f".shard-{i + 1:05d}.safetensors" for i in range(len(files))]
    file_of = {name: i for i, specs in enumerate(files) for name, _, _ in specs}
    streams: dict[int, SafetensorsStream] = {}
    closed = 0
    for name, arr in _hf_tensors(model):
        i = file_of[name]
        if i not in streams:  # files fill in order, so about one is open at a time
            streams[i] = SafetensorsStream(tmp[i], files[i], {"format": "pt"})
        streams[i].write(name, arr if target is None else arr.astype(target))
        if streams[i].done:
            streams.pop(i).close()
            closed += 1
    if closed != len(files):  # a tensor of the plan that the conversion never gave: a bug, not bad input
        raise AssertionError(f"save_pretrained: {len(files) - closed} of {len(files)} files were not completed")
    if len(files) == 1:
        tmp[0].replace(directory / "model.safetensors")
    else:
        weight_map = {}
        for i, specs in enumerate(files):
            file = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            tmp[i].replace(directory / file)
            weight_map.update({name: file for name, _, _ in specs})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
