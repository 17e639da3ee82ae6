"""Reading a Hugging Face checkpoint's weights into a zoo model: `from_pretrained` (every leaf on the
default device) and `load_sharded` (every leaf straight into its NamedSharding, for train.py).

Both go through `leaf_sources`: one `LeafSource` per parameter leaf that can read any slice of the
leaf, `[layers, ...]` for a scanned stack, from the memory-mapped hub tensors. A slice reads only
what it covers: the rules' views (transposes, reshapes, splits) of a memory map stay views until the
slice is copied out, and per-expert lists read only the experts in the slice. So in a sharded load
each process reads only the slices its devices hold, and no leaf is ever whole on one device unless
its sharding replicates it. FP8 tensors are dequantised one tensor (one expert's matrix) at a time.

`open_checkpoint` checks the whole directory against the config first, from the safetensors headers
alone: every tensor there, of the right shape and a float dtype, and none the config does not account
for; train.py runs it before anything compiles.
"""

import dataclasses
import json
import pathlib
import warnings
from collections.abc import Callable, Sequence
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from zoo.config import ModelConfig, dtype_name
from zoo.errors import CheckpointError
from zoo.families._hf import Family
from zoo.hf.convert import _get, config_from_hf, family_of, fp8_block, rules_and_shapes
from zoo.hf.files import CheckpointReader
from zoo.model import CausalLM, abstract


def load_config(path) -> dict:
    """The parsed config.json of a checkpoint directory; a CheckpointError naming the file otherwise."""
    directory = pathlib.Path(path)
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory}: not a directory; pass a Hugging Face checkpoint directory (config.json + *.safetensors)"
        )
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{config_path}: missing; a Hugging Face checkpoint directory needs its config.json")
    try:
        cfg = json.loads(config_path.read_bytes())
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{config_path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); download or copy it "
            "again"
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e}); download or copy it again") from None
    except OSError as e:
        raise CheckpointError(f"{config_path}: cannot read it ({e.strerror or e}); check its permissions") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{config_path}: not a JSON object; download or copy it again")
    return cfg


def _check_leftovers(reader: CheckpointReader, config: ModelConfig, cfg: dict, family: Family) -> None:
    """Tensors the model did not take mean the config and the file disagree (biases the config does not
    enable, experts it does not count, an untied head): refuse rather than drop them silently. Kept
    aside: rotary buffers old exports carry, layers transformers itself skips, and an lm_head that a
    tied config ties to the embedding anyway when it equals it."""
    extra_layers = int(cfg.get(family.extra_layers_key) or 0) if family.extra_layers_key else 0
    left = []
    for name in sorted(set(reader.location) - reader.used):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        parts = name.split(".")
        if (
            name.startswith("model.layers.")
            and parts[2].isdigit()
            and config.num_layers <= int(parts[2]) < config.num_layers + extra_layers
        ):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            head = reader.file_of(name).get(name)
            embed = reader.file_of("model.embed_tokens.weight").get("model.embed_tokens.weight")
            if head.shape == embed.shape and np.array_equal(head, embed):
                continue
            raise CheckpointError(
                f"{reader.directory}: tie_word_embeddings is true but the file's lm_head.weight differs from "
                "model.embed_tokens.weight; set tie_word_embeddings false to use the head, or drop it"
            )
        left.append(name)
    if left:
        shown = ", ".join(left[:6]) + (f", ... ({len(left)} in all)" if len(left) > 6 else "")
        raise CheckpointError(
            f"{reader.directory}: the checkpoint has tensors the config does not account for: {shown}; "
            "the config.json does not describe these weights (a flag such as attention_bias, the expert or layer count)"
        )


def open_checkpoint(directory, config: ModelConfig, cfg: dict, skeleton: Optional[CausalLM] = None) -> CheckpointReader:
    """A reader of `directory` whose every tensor has been checked against `config` (names, shapes, float
    or FP8 dtypes, nothing left over), from the headers alone; CheckpointError naming the file otherwise."""
    directory = pathlib.Path(directory)
    reader = CheckpointReader(directory, fp8_block(cfg, str(directory / "config.json")))
    skeleton = abstract(config) if skeleton is None else skeleton
    for rule, prefix, _, layers, _, hub_shapes in rules_and_shapes(skeleton):
        for layer in [None] if layers is None else layers:
            for name, shape in zip(rule.hub, hub_shapes):
                reader.check(prefix.format(layer=layer) + name, shape)
    _check_leftovers(reader, config, cfg, family_of(config))
    return reader


def _full(index, shape) -> tuple[slice, ...]:
    """`index` (slices, possibly fewer than dims) as one `slice(start, stop, 1)` per dim."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape))


@dataclasses.dataclass(frozen=True)
class LeafSource:
    """One parameter leaf of the zoo model (`path`: its attribute path, e.g. `stacks.0.layers.0.attn.wq`)
    and how to read any slice of it from the checkpoint, in the leaf's dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    _read: Callable[[tuple[slice, ...]], np.ndarray]
    # The checkpoint tensors this leaf (of one layer: an index into `layers`, None for unstacked) is read from.
    hub_names: Optional[Callable[[Optional[int]], list[str]]] = None
    layers: Optional[Sequence[int]] = None

    def read(self, index: Optional[Sequence[slice]] = None) -> np.ndarray:
        return self._read(_full(() if index is None else index, self.shape))


def leaf_sources(skeleton: CausalLM, reader: CheckpointReader) -> list[LeafSource]:
    """A LeafSource for every array leaf of `skeleton` (a model, abstract or not, whose dtypes are the
    ones to load into)."""
    sources = []
    for rule, prefix, attr, layers, shapes, hub_shapes in rules_and_shapes(skeleton):

        def layer_views(layer, rule=rule, prefix=prefix, shapes=shapes, hub_shapes=hub_shapes):
            names = [prefix.format(layer=layer) + n for n in rule.hub]
            if rule.lazy:
                hub = [lambda n=n, s=s: reader.get(n, s) for n, s in zip(names, hub_shapes)]
            else:
                hub = [reader.get(n, s) for n, s in zip(names, hub_shapes)]
            return rule.to_zoo(*hub, *shapes)

        for k, z in enumerate(rule.zoo):
            leaf = _get(skeleton, attr + z)
            dtype = np.dtype(leaf.dtype)
            if layers is None:

                def read(index, layer_views=layer_views, k=k, shape=leaf.shape, dtype=dtype):
                    view = layer_views(None)[k]
                    return np.asarray(
                        view.reshape(shape)[index] if isinstance(view, np.ndarray) else view[index], dtype
                    )

            else:

                def read(index, layer_views=layer_views, k=k, layers=layers, dtype=dtype, shape=leaf.shape):
                    chosen = layers[index[0]]
                    out = np.empty((len(chosen), *(len(range(n)[s]) for s, n in zip(index[1:], shape[1:]))), dtype)
                    for i, layer in enumerate(chosen):
                        view = layer_views(layer)[k]
                        out[i] = view.reshape(shape[1:])[index[1:]] if isinstance(view, np.ndarray) else view[index[1:]]
                    return out

            def hub_names(i, prefix=prefix, rule=rule, layers=layers):
                return [prefix.format(layer=None if layers is None else layers[i]) + n for n in rule.hub]

            sources.append(LeafSource(attr + z, tuple(leaf.shape), dtype, read, hub_names, layers))
    return sources


def _path_name(key_path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in key_path)


def _by_leaf(
    skeleton: CausalLM, sources: list[LeafSource]
) -> tuple[object, list[tuple[str, object]], dict[str, LeafSource]]:
    """The array half of `skeleton`, its leaves with their attribute paths, and the source of each
    (every leaf must have one: a family module that forgot a tensor is a bug, not a zero)."""
    params, _ = eqx.partition(skeleton, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    by_path = {s.path: s for s in sources}
    leaves = [(_path_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]]
    missing = [p for p, _ in leaves if p not in by_path]
    if missing:
        raise CheckpointError(
            f"zoo.hf: no rule reads the leaves {missing} of a {skeleton.config.family} model; a zoo.hf family module "
            "is incomplete"
        )
    return params, leaves, by_path


def capacity_note(c: ModelConfig, impl_key: str = "moe_impl", factor_key: str = "moe_capacity_factor") -> Optional[str]:
    """What a checkpoint loaded with the capacity MoE kernel computes differently (None: nothing): tokens
    routed to an expert past its capacity are dropped, which transformers never does."""
    m = c.moe
    # `auto` is the dropless kernel (zoo.nn.moe_dispatch.resolve_moe_impl): only an explicit capacity drops.
    if m is None or not c.num_moe_layers or m.impl != "capacity":
        return None
    dropless = m.n_routed_experts / m.num_experts_per_tok
    if m.capacity_factor >= dropless:
        return None
    return (
        f"{impl_key}={m.impl} with {factor_key}={m.capacity_factor:g} keeps ceil({m.capacity_factor:g} x tokens x "
        "top_k / experts) "
        f"tokens per expert and drops the rest, so the outputs differ from the checkpoint's (transformers drops none); "
        f"{factor_key}={dropless:g} (experts / top_k) drops nothing, {impl_key}=ragged is dropless at any size"
    )


def _resolve(path, overrides: dict) -> tuple[pathlib.Path, dict, ModelConfig]:
    directory = pathlib.Path(path)
    cfg = load_config(directory)
    return directory, cfg, config_from_hf(cfg, source=str(directory / "config.json"), **overrides)


def from_pretrained(path, dtype="float32", compute_dtype=None, **config_overrides) -> CausalLM:
    """Load a Hugging Face checkpoint directory (any family of `supported_model_types()`) as a zoo CausalLM.

    `dtype`: the parameter dtype (float32 master weights by default, whatever the file holds) and
    `compute_dtype`: the matmul dtype (default: `dtype`), each a string, a jnp or a numpy dtype;
    other keywords override ModelConfig fields (`moe_impl="capacity"` sets `moe.impl`; it drops
    tokens past each expert's capacity, with a warning). Layers transformers skips (DeepSeek-V3's
    multi-token-prediction layers past num_hidden_layers) are ignored; any other tensor the config
    does not account for is an error. FP8 block-quantised weights are dequantised.
    """
    param_dtype = dtype_name(dtype, "dtype")
    compute = param_dtype if compute_dtype is None else dtype_name(compute_dtype, "compute_dtype")
    directory, cfg, config = _resolve(path, dict(config_overrides, param_dtype=param_dtype, compute_dtype=compute))
    note = capacity_note(config)
    if note is not None:
        warnings.warn(f"{directory}: {note}", stacklevel=2)
    skeleton = abstract(config)
    reader = open_checkpoint(directory, config, cfg, skeleton)
    _, leaves, by_path = _by_leaf(skeleton, leaf_sources(skeleton, reader))
    # non-finite weights refused as train.py refuses them (load_sharded), naming the tensor
    values = [jnp.asarray(_finite(by_path[p].read(), by_path[p], (), directory)) for p, _ in leaves]
    return eqx.tree_at(lambda m: [_get(m, p) for p, _ in leaves], skeleton, values)


def _finite(x: np.ndarray, source: LeafSource, index, directory: pathlib.Path) -> np.ndarray:
    """`x` (a slice of `source` just read), or CheckpointError naming the checkpoint tensor that holds a
    NaN or an infinity: caught here, not as a "diverged" first step that blames the learning rate."""
    try:
        ok = bool(np.isfinite(x).all())
    except TypeError:  # not a float dtype
        return x
    if ok:
        return x
    bad = np.argwhere(~np.isfinite(x))[0]
    names = ""
    if source.hub_names is not None:
        start = _full(index, source.shape)[0].start if source.layers is not None else 0
        names = ", ".join(source.hub_names(start + int(bad[0]) if source.layers is not None else None))
    where = f"tensor {names}" if names else f"the tensor of zoo parameter {source.path}"
    raise CheckpointError(
        f"{directory}: {where} holds non-finite values (NaN or inf); the checkpoint is damaged or was saved from a "
        "diverged run: "
        "download it again or give another model.path"
    )


def load_sharded(path, config: ModelConfig, shardings):
    """The array half of the model `config` (as `eqx.partition(model, eqx.is_array)` gives it) read from
    the checkpoint directory `path`, each leaf built by `jax.make_array_from_callback` in its sharding
    of `shardings` (a matching tree of NamedShardings, memory kinds included): each process reads only
    the slices of its addressable devices, once per distinct slice. `config` must be the one
    `config_from_hf` reads from the directory (train.py checks the directory against it first)."""
    directory = pathlib.Path(path)
    skeleton = abstract(config)
    reader = open_checkpoint(directory, config, load_config(directory), skeleton)
    params, leaves, by_path = _by_leaf(skeleton, leaf_sources(skeleton, reader))
    flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(flat_shardings) != len(leaves):
        raise ValueError(f"load_sharded: {len(flat_shardings)} shardings for {len(leaves)} parameter leaves")
    arrays = []
    for (p, leaf), sharding in zip(leaves, flat_shardings):
        source, cache = by_path[p], {}

        def shard(index, source=source, cache=cache):
            key = tuple((s.start, s.stop) for s in _full(index, source.shape))
            if key not in cache:  # replicas of one slice are read once
                cache[key] = _finite(source.read(index), source, index, directory)
            return cache[key]

        arrays.append(jax.make_array_from_callback(tuple(leaf.shape), sharding, shard))
    return jax.tree.unflatten(jax.tree.structure(params), arrays)
