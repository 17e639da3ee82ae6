"""Hugging Face checkpoints in and out: `from_pretrained`, `to_hf_state_dict`, `save_pretrained`.

Reads a directory with `config.json` (transformers-5 `rope_parameters` or the hub's legacy
`rope_theta` + `rope_scaling`) and one or many `*.safetensors` files (with the index json of a
sharded checkpoint). Tensors are memory-mapped and copied once, leaf by leaf, into the stacked
layout of the zoo model, so a checkpoint is never held twice.

Hub linear weights are `[out, in]`; zoo weights are einsum layouts `[in, ..., out]`. Each `Rule`
below pairs hub tensors with zoo leaves and converts both ways.
"""

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from zoo.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from zoo.model import CausalLM, abstract
from zoo.tags import DEEPSEEK_V3, LLAMA


class CheckpointError(ValueError):
    """A checkpoint directory, config or tensor that cannot be used; the message names it."""


# --- safetensors, read through a memory map and written without torch ----------------------------

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


class SafetensorsFile:
    """One `.safetensors` file: the header is parsed and checked against the file size up front."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: truncated or not a safetensors file (shorter than its 8-byte header length)")
            header_len = int.from_bytes(raw_len, "little")
            if 8 + header_len > size:
                raise CheckpointError(f"{path}: truncated: the header claims {header_len} bytes, the file has {size}")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
        header.pop("__metadata__", None)
        self.header = header
        self.data_start = 8 + header_len
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if self.data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensors need {self.data_start + end} bytes, the file has {size}; download or copy it again"
            )

    def names(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        """A read-only view through a memory map; nothing is read until it is used."""
        info = self.header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        count = math.prod(info["shape"])
        if count == 0:
            return np.zeros(info["shape"], dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + start, shape=tuple(info["shape"]))


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray], metadata: Optional[dict] = None) -> None:
    """Write `tensors` in the safetensors layout (to a temporary name, then renamed into place)."""
    header, offset = {}, 0
    for name, arr in tensors.items():
        header[name] = {"dtype": _ST_NAMES[np.dtype(arr.dtype)], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
    os.replace(tmp, path)


class CheckpointReader:
    """All tensors of a checkpoint directory, by hub name, across its shards."""

    def __init__(self, directory: pathlib.Path):
        index_path = directory / "model.safetensors.index.json"
        self.files: dict[str, SafetensorsFile] = {}
        self.location: dict[str, str] = {}
        if index_path.exists():
            weight_map = json.loads(index_path.read_text())["weight_map"]
            for name, file in weight_map.items():
                if file not in self.files:
                    if not (directory / file).exists():
                        raise CheckpointError(f"{index_path}: names shard {file!r}, which is missing from {directory}")
                    self.files[file] = SafetensorsFile(directory / file)
                if name not in self.files[file].header:
                    raise CheckpointError(f"{index_path}: tensor {name!r} is mapped to {file}, which does not contain it")
                self.location[name] = file
        else:
            paths = sorted(directory.glob("*.safetensors"))
            if not paths:
                raise CheckpointError(f"{directory}: no *.safetensors files; a Hugging Face checkpoint directory is needed")
            for p in paths:
                self.files[p.name] = SafetensorsFile(p)
                for name in self.files[p.name].names():
                    self.location[name] = p.name

    def get(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.location:
            raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {list(expected_shape)})")
        arr = self.files[self.location[name]].get(name)
        if tuple(arr.shape) != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} in {self.location[name]} has shape {list(arr.shape)}, the config implies {list(expected_shape)}"
            )
        return arr


# --- config.json <-> ModelConfig --------------------------------------------------------------

SUPPORTED_MODEL_TYPES = (LLAMA, DEEPSEEK_V3)


def _rope_from_hf(cfg: dict, interleaved: bool) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    if not params:  # the hub's legacy style
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "llama3", "yarn"):
        raise CheckpointError(f"config.json: rope type {rope_type!r} is not supported; supported: default, llama3, yarn")
    # JSON writes 32.0 as 32: cast each value to its field's type.
    casts = {f.name: (float if f.type in (float, Optional[float]) else int if f.type in (int, Optional[int]) else bool)
             for f in dataclasses.fields(RopeConfig) if f.name not in ("type", "theta", "interleaved")}
    kept = {k: casts[k](v) for k, v in params.items() if k in casts and v is not None}
    return RopeConfig(type=rope_type, theta=float(params.get("rope_theta", 10000.0)), interleaved=interleaved, **kept)


def config_from_hf(cfg: dict, **overrides) -> ModelConfig:
    """A ModelConfig from a parsed Hugging Face `config.json`; `overrides` replace ModelConfig fields."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"config.json: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise CheckpointError(f"config.json: {flag}=true is not supported (zoo models have no biases)")
    heads = cfg["num_attention_heads"]
    common = dict(
        family=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    if model_type == LLAMA:
        fields = dict(
            common,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope=_rope_from_hf(cfg, interleaved=False),
        )
    else:
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise CheckpointError(f"config.json: scoring_func {cfg['scoring_func']!r} is not supported (DeepSeek-V3 uses sigmoid)")
        fields = dict(
            common,
            num_kv_heads=heads,  # in a DeepSeek-V3 config, head_dim is the rope dim; MLA dims live in `mla`
            first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
            rope=_rope_from_hf(cfg, interleaved=cfg.get("rope_interleave", True)),
            mla=MLAConfig(
                q_lora_rank=cfg.get("q_lora_rank"),
                kv_lora_rank=cfg["kv_lora_rank"],
                qk_nope_head_dim=cfg["qk_nope_head_dim"],
                qk_rope_head_dim=cfg["qk_rope_head_dim"],
                v_head_dim=cfg["v_head_dim"],
            ),
            moe=MoEConfig(
                n_routed_experts=cfg["n_routed_experts"],
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                n_shared_experts=cfg.get("n_shared_experts") or 0,
                n_group=cfg.get("n_group") or 1,
                topk_group=cfg.get("topk_group") or 1,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                impl="ragged",  # a loaded checkpoint computes what it was trained to: dropless, exact
            ),
        )
    moe_overrides = {k[4:]: overrides.pop(k) for k in list(overrides) if k.startswith("moe_")}
    if moe_overrides and fields.get("moe") is not None:
        fields["moe"] = dataclasses.replace(fields["moe"], **moe_overrides)
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise CheckpointError(f"config.json: {e}") from None


def config_to_hf(c: ModelConfig) -> dict:
    """config.json for `c`, with both rope styles so transformers 4 and 5 read it."""
    rope = {"rope_type": c.rope.type, "rope_theta": c.rope.theta}
    if c.rope.type == "llama3":
        rope.update(factor=c.rope.factor, low_freq_factor=c.rope.low_freq_factor, high_freq_factor=c.rope.high_freq_factor,
                    original_max_position_embeddings=c.rope.original_max_position_embeddings)
    elif c.rope.type == "yarn":
        rope.update(factor=c.rope.factor, original_max_position_embeddings=c.rope.original_max_position_embeddings,
                    beta_fast=c.rope.beta_fast, beta_slow=c.rope.beta_slow, mscale=c.rope.mscale,
                    mscale_all_dim=c.rope.mscale_all_dim, attention_factor=c.rope.attention_factor)
        rope = {k: v for k, v in rope.items() if v is not None}
    out = {
        "model_type": c.family,
        "architectures": ["LlamaForCausalLM" if c.family == LLAMA else "DeepseekV3ForCausalLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_parameters": rope,
        "rope_theta": c.rope.theta,
        "rope_scaling": None if c.rope.type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
        "dtype": c.param_dtype,
    }
    if c.family == LLAMA:
        out.update(head_dim=c.head_dim, mlp_bias=False)
    else:
        m, e = c.mla, c.moe
        out.update(
            head_dim=m.qk_rope_head_dim, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
            rope_interleave=c.rope.interleaved, first_k_dense_replace=c.first_k_dense_replace,
            n_routed_experts=e.n_routed_experts, num_experts_per_tok=e.num_experts_per_tok,
            moe_intermediate_size=e.moe_intermediate_size, n_shared_experts=e.n_shared_experts, n_group=e.n_group,
            topk_group=e.topk_group, norm_topk_prob=e.norm_topk_prob, routed_scaling_factor=e.routed_scaling_factor,
            scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=0,
        )
    return out


# --- the name and layout map -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """Hub tensors <-> zoo leaves of one layer (or of the top level).

    `hub`: hub names relative to the layer prefix; `zoo`: attribute paths inside a block (or the
    model). `to_zoo` maps the hub arrays to the zoo arrays, `to_hub` back; both only transpose,
    reshape, split or stack, so a round trip is exact.
    """

    hub: tuple[str, ...]
    zoo: tuple[str, ...]
    to_zoo: Callable[..., tuple]
    to_hub: Callable[..., tuple]


def _linear(hub: str, zoo: str, in_axes: int = 1) -> Rule:
    """`[out, in]` hub matrix <-> zoo `[in..., out...]` whose first `in_axes` axes are the input."""

    def to_zoo(w, shape):
        return (w.T.reshape(shape),)

    def to_hub(w):
        n_in = math.prod(w.shape[:in_axes])
        return (w.reshape(n_in, -1).T,)

    return Rule((hub,), (zoo,), to_zoo, to_hub)


def _same(hub: str, zoo: str) -> Rule:
    return Rule((hub,), (zoo,), lambda w, shape: (w,), lambda w: (w,))


def _experts(hub_template: str, zoo: str, experts: int) -> Rule:
    """Per-expert hub matrices `[out, in]` <-> one zoo leaf `[experts, in, out]`."""
    names = tuple(hub_template.format(e=e) for e in range(experts))
    return Rule(
        names,
        (zoo,),
        lambda *ws_and_shape: (np.stack([w.T for w in ws_and_shape[:-1]]),),
        lambda w: tuple(w[e].T for e in range(w.shape[0])),
    )


def _kv_b(heads: int, nope: int, v: int) -> Rule:
    """kv_b_proj `[heads*(nope+v), kv_lora]`, rows per head `[k_nope | v]` <-> wk_b, wv_b `[kv_lora, heads, .]`."""

    def to_zoo(w, shape_k, shape_v):
        per_head = w.reshape(heads, nope + v, -1)
        return per_head[:, :nope].transpose(2, 0, 1), per_head[:, nope:].transpose(2, 0, 1)

    def to_hub(wk, wv):
        both = np.concatenate([np.asarray(wk).transpose(1, 2, 0), np.asarray(wv).transpose(1, 2, 0)], axis=1)
        return (both.reshape(heads * (nope + v), -1),)

    return Rule(("self_attn.kv_b_proj.weight",), ("attn.wk_b", "attn.wv_b"), to_zoo, to_hub)


def _mlp_rules(hub: str, zoo: str) -> list[Rule]:
    return [
        _linear(f"{hub}.gate_proj.weight", f"{zoo}.w_gate"),
        _linear(f"{hub}.up_proj.weight", f"{zoo}.w_up"),
        _linear(f"{hub}.down_proj.weight", f"{zoo}.w_down"),
    ]


def block_rules(c: ModelConfig, moe: bool) -> list[Rule]:
    rules = [_same("input_layernorm.weight", "attn_norm.weight"), _same("post_attention_layernorm.weight", "ffn_norm.weight")]
    if c.family == LLAMA:
        rules += [
            _linear("self_attn.q_proj.weight", "attn.wq"),
            _linear("self_attn.k_proj.weight", "attn.wk"),
            _linear("self_attn.v_proj.weight", "attn.wv"),
            _linear("self_attn.o_proj.weight", "attn.wo", in_axes=2),
        ]
    else:
        m = c.mla
        if m.q_lora_rank is None:
            rules.append(_linear("self_attn.q_proj.weight", "attn.wq_b"))
        else:
            rules += [
                _linear("self_attn.q_a_proj.weight", "attn.wq_a"),
                _same("self_attn.q_a_layernorm.weight", "attn.q_norm.weight"),
                _linear("self_attn.q_b_proj.weight", "attn.wq_b"),
            ]
        rules += [
            _linear("self_attn.kv_a_proj_with_mqa.weight", "attn.wkv_a"),
            _same("self_attn.kv_a_layernorm.weight", "attn.kv_norm.weight"),
            _kv_b(c.num_heads, m.qk_nope_head_dim, m.v_head_dim),
            _linear("self_attn.o_proj.weight", "attn.wo", in_axes=2),
        ]
    if not moe:
        return rules + _mlp_rules("mlp", "ffn")
    e = c.moe.n_routed_experts
    rules += [
        _linear("mlp.gate.weight", "ffn.router"),
        _same("mlp.gate.e_score_correction_bias", "ffn.e_score_correction_bias"),
        _experts("mlp.experts.{e}.gate_proj.weight", "ffn.w_gate", e),
        _experts("mlp.experts.{e}.up_proj.weight", "ffn.w_up", e),
        _experts("mlp.experts.{e}.down_proj.weight", "ffn.w_down", e),
    ]
    if c.moe.n_shared_experts:
        rules += _mlp_rules("mlp.shared_experts", "ffn.shared")
    return rules


def top_rules(c: ModelConfig) -> list[Rule]:
    rules = [_same("model.embed_tokens.weight", "embed"), _same("model.norm.weight", "final_norm.weight")]
    if not c.tie_word_embeddings:
        rules.append(_linear("lm_head.weight", "lm_head"))
    return rules


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
    return [tuple(a.shape) for a in rule.to_hub(*[_shape_only(s, np.float32) for s in zoo_shapes])]


# --- load ------------------------------------------------------------------------------------


def load_config(path) -> dict:
    directory = pathlib.Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory; pass a Hugging Face checkpoint directory (config.json + *.safetensors)")
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{config_path}: missing; a Hugging Face checkpoint directory needs its config.json")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None


def from_pretrained(path, dtype: str = "float32", compute_dtype: Optional[str] = None, **config_overrides) -> CausalLM:
    """Load a Hugging Face Llama or DeepSeek-V3 checkpoint directory as a zoo CausalLM.

    `dtype`: the parameter dtype (float32 master weights by default, whatever the file holds);
    `compute_dtype`: the matmul dtype (default: `dtype`); other keywords override ModelConfig fields
    (`moe_impl="capacity"` sets `moe.impl`). Multi-token-prediction layers past num_hidden_layers are ignored.
    """
    directory = pathlib.Path(path)
    config = config_from_hf(load_config(directory), param_dtype=dtype, compute_dtype=compute_dtype or dtype, **config_overrides)
    reader = CheckpointReader(directory)
    skeleton = abstract(config)
    np_dtype = jnp.dtype(dtype)

    paths, values = [], []

    def place(getter_path, value):
        paths.append(getter_path)
        values.append(jnp.asarray(value))

    for rule in top_rules(config):
        zoo_shapes = [_get(skeleton, z).shape for z in rule.zoo]
        hub = [reader.get(n, s) for n, s in zip(rule.hub, _hub_shapes(rule, zoo_shapes))]
        for z, arr, shape in zip(rule.zoo, rule.to_zoo(*hub, *zoo_shapes), zoo_shapes):
            place(z, np.asarray(arr, dtype=np_dtype).reshape(shape))

    for attr, layers, moe in _positions(skeleton):
        block = _get(skeleton, attr)
        for rule in block_rules(config, moe):
            stacked_shapes = [_get(block, z).shape for z in rule.zoo]
            layer_shapes = [s[1:] for s in stacked_shapes]
            hub_shapes = _hub_shapes(rule, layer_shapes)
            # One host buffer per leaf, filled layer by layer from the memory map, then moved once.
            buffers = [np.empty(s, _get(block, z).dtype) for s, z in zip(stacked_shapes, rule.zoo)]  # the skeleton's dtype: param_dtype, float32 buffers
            for j, layer in enumerate(layers):
                prefix = f"model.layers.{layer}."
                hub = [reader.get(prefix + n, s) for n, s in zip(rule.hub, hub_shapes)]
                for buf, arr in zip(buffers, rule.to_zoo(*hub, *layer_shapes)):
                    buf[j] = arr
            for z, buf in zip(rule.zoo, buffers):
                place(f"{attr}.{z}", buf)
            del buffers

    return eqx.tree_at(lambda m: [_get(m, p) for p in paths], skeleton, values)


# --- save ------------------------------------------------------------------------------------


def to_hf_state_dict(tree: CausalLM) -> dict[str, np.ndarray]:
    """Hub names -> numpy arrays for a model, or a gradient of one (same structure; None leaves are skipped)."""
    c = tree.config
    out: dict[str, np.ndarray] = {}

    def emit(rule: Rule, leaves, prefix: str = ""):
        if any(leaf is None for leaf in leaves):
            return
        for name, arr in zip(rule.hub, rule.to_hub(*[np.asarray(leaf) for leaf in leaves])):
            out[prefix + name] = np.ascontiguousarray(arr)

    for rule in top_rules(c):
        emit(rule, [_get(tree, z) for z in rule.zoo])
    for attr, layers, moe in _positions(tree):
        block = _get(tree, attr)
        for rule in block_rules(c, moe):
            stacked = [_get(block, z) for z in rule.zoo]
            for j, layer in enumerate(layers):
                emit(rule, [None if s is None else np.asarray(s[j]) for s in stacked], f"model.layers.{layer}.")
    return out


def save_pretrained(model: CausalLM, path, dtype: Optional[str] = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `config.json` and safetensors shards (with an index when there are several).

    Files are written under temporary names and renamed into place, so an interrupted save leaves
    no half-written file under a final name.
    """
    directory = pathlib.Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    state = to_hf_state_dict(model)
    if dtype is not None:
        state = {k: v.astype(jnp.dtype(dtype)) for k, v in state.items()}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in state.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    config = config_to_hf(model.config)
    if dtype is not None:
        config["dtype"] = dtype
    if len(shards) == 1:
        write_safetensors(directory / "model.safetensors", shards[0], {"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(directory / file, shard, {"format": "pt"})
            weight_map.update({name: file for name in shard})
        index = {"metadata": {"total_size": sum(a.nbytes for a in state.values())}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
