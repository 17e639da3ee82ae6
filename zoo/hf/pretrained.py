"""train.py's `model=hf`: a Hugging Face checkpoint directory as the model group.

`python train.py model=hf model.path=<dir>` takes the architecture from `<dir>/config.json` and the
weights from its safetensors. The option (`hf_option`, registered in Hydra's ConfigStore by
zoo.train.run_config) lists `path`, the fields that say how zoo runs the model (`RUNTIME`: dtypes, kernels) and every
other ModelConfig field as null: null is config.json's value, and a value given on the command line must
agree with it, so an override cannot contradict the weights. `model_from_node` resolves the group
into the full ModelConfig and a `PretrainedSource` (what train.py records in summary.json and in its
checkpoints' metadata); `check_weights` then checks every tensor's name, shape and dtype from the
safetensors headers (in `validate`, before anything compiles) and `fit_tokenizer` the data's
tokenizer. Bad input raises ValueError: one line naming the key or file and the fix.
"""

import dataclasses
import hashlib
import pathlib
from typing import Any, Optional

from zoo.config import ModelConfig
from zoo.errors import CheckpointError
from zoo.hf.convert import TOKEN_ID_KEYS, config_from_hf, fp8_block
from zoo.hf.files import CheckpointReader
from zoo.hf.weights import capacity_note, load_config, open_checkpoint

# ModelConfig fields that model=hf sets (with these defaults); the rest come from config.json. A MoE
# model's moe.impl (null: ragged, dropless like transformers) and moe.capacity_factor too.
RUNTIME = {"param_dtype": "float32", "compute_dtype": "float32", "attention_impl": "auto"}
RUNTIME_MOE = ("impl", "capacity_factor")
# Files of a Hugging Face directory besides its config and weights that an export carries over.
CARRIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
# config.json keys zoo does not model that an export writes back (generation reads them).
CONFIG_EXTRAS = TOKEN_ID_KEYS
_SETTABLE = ", ".join([*RUNTIME, *(f"moe.{k}" for k in RUNTIME_MOE)])


@dataclasses.dataclass(frozen=True)
class PretrainedSource:
    """Where a run's initial weights came from: the directory, its model_type and weight files, the
    FP8 block size if its weights were dequantised, the sha256 of each carried file (tokenizer, ...)
    and the config.json keys an export writes back."""

    path: str
    model_type: str
    weight_files: list[str]
    fp8_block: Optional[list[int]] = None
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    config_extras: dict[str, Any] = dataclasses.field(default_factory=dict)


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _nulls(cls) -> dict:
    """Every field of the dataclass `cls` as null, nested dataclasses as nested dicts of nulls."""
    out = {}
    for f in dataclasses.fields(cls):
        nested = [a for a in (f.type, *getattr(f.type, "__args__", ())) if dataclasses.is_dataclass(a)]
        out[f.name] = _nulls(nested[0]) if nested else None
    return out


def hf_option() -> dict:
    """The `model=hf` option: the checkpoint directory (required) and every ModelConfig field null, which
    config.json fills; only the RUNTIME fields have values of their own."""
    return {"path": "???", **_nulls(ModelConfig), **RUNTIME}


def _contradiction(key: str, given, actual, directory: pathlib.Path) -> ValueError:
    return ValueError(
        f"model.{key}: {given} contradicts {directory / 'config.json'} ({actual}); with model.path the architecture "
        f"comes from the checkpoint: drop model.{key} (model=hf sets only {_SETTABLE})"
    )


def _check_agrees(given: dict, config, directory: pathlib.Path, prefix: str = "") -> None:
    """Every non-null value of `given` equals the field of `config` (a ModelConfig or a nested section)."""
    fields = {f.name for f in dataclasses.fields(config)} if config is not None else set()
    for key, value in given.items():
        if value is None or (isinstance(value, dict) and all(v is None for v in value.values())):
            continue
        if config is None:
            raise _contradiction(
                f"{prefix}{key}", value, f"the checkpoint's model has no {prefix[:-1]} section", directory
            )
        if key not in fields:
            raise ValueError(f"model.{prefix}{key}: unknown key; known keys here: {', '.join(sorted(fields))}")
        actual = getattr(config, key)
        if isinstance(value, dict):
            _check_agrees(value, actual, directory, f"{prefix}{key}.")
        elif (list(actual) if isinstance(actual, (list, tuple)) else actual) != value:
            raise _contradiction(f"{prefix}{key}", value, f"which gives {actual}", directory)


def model_from_node(node: dict) -> tuple[ModelConfig, PretrainedSource]:
    """The `model` group of train.py when it names a `path` -> (ModelConfig, PretrainedSource)."""
    values = dict(node)
    path = values.pop("path", None)
    if path in (None, "", "???"):
        raise ValueError(
            "model.path: missing; give the Hugging Face checkpoint directory, e.g. model.path=/models/Llama-3.2-1B"
        )
    directory = pathlib.Path(str(path)).expanduser().absolute()
    try:
        cfg = load_config(directory)
        runtime = {k: values.pop(k, None) for k in RUNTIME}
        moe = dict(values.pop("moe", None) or {})
        moe_runtime = {f"moe_{k}": moe.pop(k) for k in RUNTIME_MOE if moe.get(k) is not None}
        config = config_from_hf(
            cfg,
            source=str(directory / "config.json"),
            **{k: v for k, v in runtime.items() if v is not None},
            **moe_runtime,
        )
        if moe_runtime and config.moe is None:
            key = next(iter(moe_runtime)).replace("moe_", "moe.")
            raise ValueError(
                f"model.{key}: {directory / 'config.json'} describes a dense {config.family} model (no experts); drop "
                f"model.{key}"
            )
        _check_agrees({**values, "moe": moe}, config, directory)
        reader = CheckpointReader(directory, fp8_block(cfg, str(directory / "config.json")))  # headers only
    except CheckpointError as e:
        raise ValueError(f"model.path: {e}") from None
    block = fp8_block(cfg)
    source = PretrainedSource(
        path=str(directory),
        model_type=cfg["model_type"],
        weight_files=sorted(reader.files),
        fp8_block=list(block) if block else None,
        files={name: sha256(directory / name) for name in CARRIED_FILES if (directory / name).is_file()},
        config_extras={k: cfg[k] for k in CONFIG_EXTRAS if cfg.get(k) is not None},
    )
    return config, source


def tokenizer_token_ids(data: dict, tokenizer: Optional[str] = None) -> dict[str, int]:
    """The config.json token ids of a model trained from scratch: `bos_token_id` / `eos_token_id` of the
    tokenizer it read (`tokenizer`, else the run's `data.tokenizer`; byte-level text: eos 0, the
    document separator). Synthetic data has no tokenizer, and a tokenizer that no longer loads gives
    nothing: save_pretrained then writes them null rather than guess."""
    if tokenizer is None and data.get("name") != "text":
        return {}
    from zoo.data import DataError, load_tokenizer  # not at the top: zoo.data imports grain (about 1.1 s)

    try:
        tok = load_tokenizer(tokenizer if tokenizer is not None else data.get("tokenizer"))
    except (DataError, OSError):
        return {}
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    return {k: int(v) for k, v in ids.items() if v is not None}


def check_weights(source: PretrainedSource, skeleton) -> None:
    """Every tensor of the source directory against the (abstract) model: names, shapes, dtypes, nothing
    left over, from the safetensors headers. Needs the model's skeleton, so JAX has started: train.py
    runs it in `validate`, after the XLA flags are set and before anything compiles."""
    directory = pathlib.Path(source.path)
    try:
        open_checkpoint(directory, skeleton.config, load_config(directory), skeleton)
    except CheckpointError as e:
        raise ValueError(f"model.path: {e}") from None


def fit_tokenizer(data, source: PretrainedSource, config: ModelConfig) -> None:
    """Text data for a pretrained model: `data.tokenizer` null takes the checkpoint's own tokenizer.json
    (set on `data`); a given one must fit the embedding and, where the checkpoint has its own, map
    every token to the same id. ValueError (one line, `data.tokenizer: ...`) otherwise."""
    if data.name != "text":
        return
    directory = pathlib.Path(source.path)
    own = directory / "tokenizer.json" if "tokenizer.json" in source.files else None
    if data.tokenizer is None:
        if own is not None:
            data.tokenizer = str(directory)
        return
    from zoo.data import load_tokenizer  # not at the top: zoo.data imports grain (about 1.1 s)

    given = load_tokenizer(data.tokenizer)
    fix = (
        f"leave data.tokenizer null to use the checkpoint's own ({own})"
        if own
        else "give the tokenizer the checkpoint was trained with"
    )
    if given.vocab_size > config.vocab_size:
        raise ValueError(
            f"data.tokenizer: {given.name} has {given.vocab_size} token ids but {directory / 'config.json'} has "
            f"vocab_size={config.vocab_size}, so its ids would index past the embedding; {fix}"
        )
    if own is None or given.path.resolve() == own.resolve():
        return
    theirs = load_tokenizer(own)._tok.get_vocab(with_added_tokens=True)
    mine = given._tok.get_vocab(with_added_tokens=True)
    differ = sum(theirs.get(t) != i for t, i in mine.items()) + len(set(theirs) - set(mine))
    if differ:
        raise ValueError(
            f"data.tokenizer: {given.name} disagrees with the checkpoint's vocabulary ({own}): {differ} tokens are "
            f"missing or have other ids; {fix}"
        )


def describe(source: PretrainedSource, config: ModelConfig) -> list[str]:
    """train.py's lines about the weights it starts from."""
    n = len(source.weight_files)
    fp8 = f", FP8 blocks {source.fp8_block[0]}x{source.fp8_block[1]} dequantised" if source.fp8_block else ""
    lines = [
        f"weights: {source.path} ({source.model_type}, {n} safetensors file{'s' * (n != 1)}{fp8}) as "
        f"{config.param_dtype}"
    ]
    note = capacity_note(config, "model.moe.impl", "model.moe.capacity_factor")
    if note:
        lines.append(f"note: {note}")
    return lines
