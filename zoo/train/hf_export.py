"""A train.py checkpoint as a Hugging Face directory (`hf_export`); `python -m zoo.tools.export` is its
command line (zoo/tools/export.py).

Writes `config.json` (what `zoo.hf.config_to_hf` writes for the family, plus the source config's
`bos_token_id` / `eos_token_id`, else its tokenizer's or null), the safetensors (sharded with an index past
`max_shard_bytes`, `--max-shard-gb`) and, for a run that started from a Hugging Face checkpoint (`model=hf`), that
checkpoint's tokenizer and generation files, which must still be where training read them, unchanged
(their sha256 is in the checkpoint's metadata); `--tokenizer DIR` takes them from DIR instead, and a
run trained on `data.tokenizer` carries that tokenizer.json (`tokenizer=`: `--tokenizer` on the command
line). `zoo.hf.from_pretrained` (and transformers) load the result. The weights keep the checkpoint's dtype unless
`--dtype` is given. The parameters are restored split over the process's devices and written leaf by leaf, so neither a
device nor the host ever holds the whole model (`hf_export`).

A LoRA run (train.py `lora=default`) exports as its merged model: base + alpha/r A@B in every adapted
weight. `--adapters-only` writes the adapters alone, in the layout of the `peft` library
(`adapters_only=True`; `adapter_config.json`, `adapter_model.safetensors`; `zoo.hf.adapters`), without reading the base:
`peft.PeftModel.from_pretrained(<the base in transformers>, <out dir>)` then computes what the merged
export computes. `base_model_name_or_path` is the run's `model.path` (model=hf), else null (a base
built from the run's seed: export one with `zoo.hf.save_pretrained`). A checkpoint without adapters
is refused ("not a LoRA run").

The directory is written under a temporary name and renamed when complete; an existing non-empty
`<out dir>` is refused (an export never writes over files). Bad input: one line, exit code 2.
"""

import contextlib
import pathlib
import shutil
from typing import Optional

import jax

from zoo.errors import ConfigError
from zoo.hf import CheckpointError, save_pretrained
from zoo.hf.adapters import save_adapters
from zoo.hf.convert import dtype_name
from zoo.hf.pretrained import CARRIED_FILES, sha256, tokenizer_token_ids
from zoo.lora import LoRAWeight
from zoo.train.checkpoint import restore_model
from zoo.train.run_dir import checkpoint_around
from zoo.train.stop import raise_if_interrupted, set_phase


def _carried(meta: dict, tokenizer: Optional[str]) -> dict[str, pathlib.Path]:
    """name -> file to copy into the export, checked before anything is written."""
    if tokenizer is not None:
        d = pathlib.Path(tokenizer).expanduser()
        d = d.parent if d.is_file() else d
        found = {n: d / n for n in CARRIED_FILES if (d / n).is_file()}
        if "tokenizer.json" not in found and "tokenizer.model" not in found:
            raise ConfigError(
                f"--tokenizer: {d} holds no tokenizer.json or tokenizer.model; give the folder of the tokenizer files"
            )
        return found
    source = meta.get("pretrained")
    if source:
        d = pathlib.Path(source["path"])
        out = {}
        for name, digest in source["files"].items():
            p = d / name
            if not p.is_file() or sha256(p) != digest:
                what = "is gone" if not p.is_file() else "changed since training"
                raise ConfigError(
                    f"{p}: the source checkpoint's {name} {what}; pass --tokenizer <dir> with the files the model was "
                    "trained with"
                )
            out[name] = p
        return out
    tok = (meta.get("data") or {}).get("tokenizer")
    if tok:
        p = pathlib.Path(tok).expanduser()
        p = p / "tokenizer.json" if p.is_dir() else p
        if p.is_file():
            return {"tokenizer.json": p}
    return {}


def hf_export(
    checkpoint_dir,
    out_dir,
    step: Optional[int] = None,
    dtype=None,
    tokenizer: Optional[str] = None,
    max_shard_bytes: int = 5 * 2**30,
    devices=None,
    adapters_only: bool = False,
) -> dict:
    """Write the train.py checkpoint `checkpoint_dir` (a `checkpoint.dir`; `step`: default the latest)
    as a Hugging Face directory `out_dir`; returns what was written (`step`, `files`, `dtype`). Bad input
    raises ConfigError (one line) before anything is written.

    The parameters are restored split over `devices` (default: this process's devices), never whole
    on one, and written leaf by leaf: each leaf is gathered to the host on its own, converted and
    written (`save_pretrained`), so the host holds about one leaf at a time."""
    out = pathlib.Path(out_dir).expanduser().absolute()
    held = checkpoint_around(out / "config.json")
    if held is not None:
        where = "the train.py checkpoint.dir itself" if held == out else f"inside the train.py checkpoint {held}"
        raise ConfigError(f"{out}: {where}, which this would change; choose a directory outside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"{out}: exists and is not an empty directory; choose a new one (an export never writes over files)"
        )
    try:
        target = None if dtype is None else dtype_name(dtype, "--dtype")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if adapters_only and tokenizer is not None:
        raise ConfigError(
            "--tokenizer: an adapters-only export carries no tokenizer (the base model's directory has it); drop "
            "--tokenizer"
        )
    devices = jax.local_devices() if devices is None else devices
    set_phase(
        f"reading the checkpoint {pathlib.Path(checkpoint_dir)}",
        f"nothing was written to {out}; run the same command again",
    )
    if adapters_only:
        return _export_adapters(checkpoint_dir, out, step, target, devices)
    model, meta = restore_model(checkpoint_dir, step, devices=devices)
    carried = _carried(meta, tokenizer)
    extras = (meta.get("pretrained") or {}).get("config_extras") or tokenizer_token_ids(
        meta.get("data") or {}, tokenizer
    )
    with _staged(out) as tmp:
        save_pretrained(model, tmp, dtype=target, max_shard_bytes=max_shard_bytes, extra_config=extras)
        for name, src in carried.items():
            shutil.copyfile(src, tmp / name)
    written_dtype = target or model.config.param_dtype
    return {
        "step": meta["step"],
        "files": sorted(p.name for p in out.iterdir()),
        "dtype": written_dtype,
        "out": str(out),
    }


def _export_adapters(checkpoint_dir, out: pathlib.Path, step: Optional[int], dtype: Optional[str], devices) -> dict:
    """The adapters of a LoRA run's checkpoint in the PEFT layout; the base is never read."""
    model, meta = restore_model(checkpoint_dir, step, devices=devices, lora_form="adapters")
    cfg = meta.get("lora")
    if not cfg or not cfg.get("rank"):
        raise ConfigError(
            f"{pathlib.Path(checkpoint_dir)}: not a LoRA run (its checkpoint holds the whole model, no adapters); "
            "export it without --adapters-only"
        )
    source = (meta.get("pretrained") or {}).get("path")
    with _staged(out) as tmp:
        files = save_adapters(
            model,
            tmp,
            rank=int(cfg["rank"]),
            alpha=float(cfg.get("alpha", 16.0)),
            dropout=float(cfg.get("dropout", 0.0)),
            base_model=source,
            dtype=dtype,
        )
    dtypes = {str(leaf.a.dtype) for leaf in _lora_leaves(model)}
    return {"step": meta["step"], "files": sorted(files), "dtype": dtype or ", ".join(sorted(dtypes)), "out": str(out)}


@contextlib.contextmanager
def _staged(out: pathlib.Path):
    """The export is written into the yielded `<out>.export-tmp` and renamed `out` once complete; on a
    failure or a Ctrl-C the partial directory is removed, so nothing is left looking like an export.
    A model the family's config.json cannot express, or adapters on a tensor PEFT cannot adapt
    (CheckpointError), and a directory that cannot be written are ConfigError (one line)."""
    tmp = out.with_name(out.name + ".export-tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # an earlier export that did not finish
    set_phase(
        f"writing {out}", f"nothing was written to {out} (the partial export was removed); run the same command again"
    )
    try:
        yield tmp
        raise_if_interrupted()  # a Ctrl-C Python swallowed while writing: not committed either
        if out.exists():
            out.rmdir()  # empty (checked by the caller)
        tmp.rename(out)
    except CheckpointError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(str(e)) from None
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"{out}: cannot write the export ({e.strerror or e}); choose a writable directory") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _lora_leaves(model) -> list:
    is_lora = lambda x: isinstance(x, LoRAWeight)  # noqa: E731
    return [x for x in jax.tree.leaves(model, is_leaf=is_lora) if is_lora(x)]
