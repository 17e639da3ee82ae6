"""A train.py checkpoint as a Hugging Face directory: `python -m zoo.export <checkpoint dir> <out dir>`.

    python -m zoo.export checkpoints/run1 exported/ [--step N] [--dtype bfloat16] [--tokenizer DIR]

Writes `config.json` (what `zoo.hf.config_to_hf` writes for the family, plus the source config's
`bos_token_id` / `eos_token_id`, else its tokenizer's or null), the safetensors (sharded with an index past
`--max-shard-gb`) and, for a run that started from a Hugging Face checkpoint (`model=hf`), that
checkpoint's tokenizer and generation files, which must still be where training read them, unchanged
(their sha256 is in the checkpoint's metadata); `--tokenizer DIR` takes them from DIR instead, and a
run trained on `data.tokenizer` carries that tokenizer.json. `zoo.hf.from_pretrained` (and
transformers) load the result. The weights keep the checkpoint's dtype unless `--dtype` is given.
The parameters are restored split over the process's devices and written leaf by leaf, so neither a
device nor the host ever holds the whole model (`hf_export`).

The directory is written under a temporary name and renamed when complete; an existing non-empty
`<out dir>` is refused (an export never writes over files). Bad input: one line, exit code 2.
"""

import argparse
import pathlib
import shutil
import sys
from typing import Optional

from zoo.hf.pretrained import CARRIED_FILES, sha256, tokenizer_token_ids

EXIT_BAD_INPUT = 2


def _carried(meta: dict, tokenizer: Optional[str]) -> dict[str, pathlib.Path]:
    """name -> file to copy into the export, checked before anything is written."""
    from zoo.train.config import ConfigError

    if tokenizer is not None:
        d = pathlib.Path(tokenizer).expanduser()
        d = d.parent if d.is_file() else d
        found = {n: d / n for n in CARRIED_FILES if (d / n).is_file()}
        if "tokenizer.json" not in found and "tokenizer.model" not in found:
            raise ConfigError(f"--tokenizer: {d} holds no tokenizer.json or tokenizer.model; give the folder of the tokenizer files")
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
                    f"{p}: the source checkpoint's {name} {what}; pass --tokenizer <dir> with the files the model was trained with"
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


def hf_export(checkpoint_dir, out_dir, step: Optional[int] = None, dtype=None, tokenizer: Optional[str] = None,
              max_shard_bytes: int = 5 * 2**30, devices=None) -> dict:
    """Write the train.py checkpoint `checkpoint_dir` (a `checkpoint.dir`; `step`: default the latest)
    as a Hugging Face directory `out_dir`; returns what was written (`step`, `files`, `dtype`). Bad input
    raises ConfigError (one line) before anything is written.

    The parameters are restored split over `devices` (default: this process's devices), never whole
    on one, and written leaf by leaf: each leaf is gathered to the host on its own, converted and
    written (`save_pretrained`), so the host holds about one leaf at a time."""
    import jax

    from zoo.hf import CheckpointError, save_pretrained
    from zoo.hf.convert import dtype_name
    from zoo.train.checkpoint import restore_model
    from zoo.train.config import ConfigError

    out = pathlib.Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory; choose a new one (an export never writes over files)")
    try:
        target = None if dtype is None else dtype_name(dtype, "--dtype")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model, meta = restore_model(checkpoint_dir, step, devices=jax.local_devices() if devices is None else devices)
    carried = _carried(meta, tokenizer)
    extras = (meta.get("pretrained") or {}).get("config_extras") or tokenizer_token_ids(meta.get("data") or {}, tokenizer)
    tmp = out.with_name(out.name + ".export-tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # an earlier export that did not finish
    try:
        save_pretrained(model, tmp, dtype=target, max_shard_bytes=max_shard_bytes, extra_config=extras)
        for name, src in carried.items():
            shutil.copyfile(src, tmp / name)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except CheckpointError as e:  # a model its family's config.json cannot express
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(str(e)) from None
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"{out}: cannot write the export ({e.strerror or e}); choose a writable directory") from None
    written_dtype = target or model.config.param_dtype
    return {"step": meta["step"], "files": sorted(p.name for p in out.iterdir()), "dtype": written_dtype, "out": str(out)}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"error: command line: {message}; see python -m zoo.export --help", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def main(argv=None) -> int:
    p = _Parser(prog="python -m zoo.export", description="Write a train.py checkpoint as a Hugging Face directory.")
    p.add_argument("checkpoint_dir", help="the checkpoint.dir of a train.py run")
    p.add_argument("out_dir", help="the Hugging Face directory to write (new, or empty)")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the latest complete one)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--tokenizer", default=None, help="a folder of tokenizer files to include (default: the source checkpoint's)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="split the weights into files of at most this size")
    args = p.parse_args(argv)
    from zoo.train.config import ConfigError

    try:
        done = hf_export(args.checkpoint_dir, args.out_dir, args.step, args.dtype, args.tokenizer, int(args.max_shard_gb * 2**30))
    except ConfigError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"exported step {done['step']} of {pathlib.Path(args.checkpoint_dir)} as {done['dtype']} to {done['out']}: {', '.join(done['files'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
