"""A train.py checkpoint as a Hugging Face directory: `python -m zoo.tools.export <checkpoint dir> <out dir>`.

    python -m zoo.tools.export checkpoints/run1 exported/ [--step N] [--dtype bfloat16] [--tokenizer DIR]
    python -m zoo.tools.export checkpoints/lora_run adapters/ --adapters-only [--step N] [--dtype bfloat16]

Writes `config.json` (what `zoo.hf.config_to_hf` writes for the family, plus the source config's
`bos_token_id` / `eos_token_id`, else its tokenizer's or null), the safetensors (sharded with an index past
`--max-shard-gb`) and, for a run that started from a Hugging Face checkpoint (`model=hf`), that
checkpoint's tokenizer and generation files, which must still be where training read them, unchanged
(their sha256 is in the checkpoint's metadata); `--tokenizer DIR` takes them from DIR instead, and a
run trained on `data.tokenizer` carries that tokenizer.json. `zoo.hf.from_pretrained` (and
transformers) load the result. The weights keep the checkpoint's dtype unless `--dtype` is given.
The parameters are restored split over the process's devices and written leaf by leaf, so neither a
device nor the host ever holds the whole model (`zoo.train.hf_export`, which this command line calls).

A LoRA run exports as its merged model, or with `--adapters-only` as the adapters alone in the `peft`
library's layout; the output directory is written under a temporary name and renamed when complete,
never over files (`zoo.train.hf_export` says how). Bad input: one line, exit code 2; Ctrl-C: one line, exit
code 130, and no partial directory left.
"""

import math
import pathlib

from zoo.errors import ConfigError
from zoo.tools.cli import ArgumentParser, run_tool
from zoo.train.hf_export import hf_export
from zoo.train.machine_fit import started_devices


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="python -m zoo.tools.export", description="Write a train.py checkpoint as a Hugging Face directory."
    )
    p.add_argument("checkpoint_dir", help="the checkpoint.dir of a train.py run")
    p.add_argument("out_dir", help="the Hugging Face directory to write (new, or empty)")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the latest complete one)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument(
        "--tokenizer", default=None, help="a folder of tokenizer files to include (default: the source checkpoint's)"
    )
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="split the weights into files of at most this size")
    p.add_argument(
        "--adapters-only",
        action="store_true",
        help="a LoRA run: write its adapters alone in the peft layout (adapter_config.json, "
        "adapter_model.safetensors), for peft.PeftModel.from_pretrained over the base; default: the merged model",
    )
    args = p.parse_args(argv)
    return run_tool(lambda: _export(args), p.prog)  # bad input: one line, exit code 2; Ctrl-C: one line, 130


def _export(args) -> int:
    if not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):
        raise ConfigError(
            f"--max-shard-gb: must be a positive number of GB, got {args.max_shard_gb}; e.g. --max-shard-gb 5"
        )
    if args.max_shard_gb * 2**30 < 1:
        raise ConfigError(f"--max-shard-gb: {args.max_shard_gb} GB is less than a byte; e.g. --max-shard-gb 5")
    if args.max_shard_gb * 2**30 >= 2**63:  # a file's size in bytes is a 64-bit integer
        raise ConfigError(
            f"--max-shard-gb: must be below {2**33} GB (2**63 bytes, a file's largest size), got "
            f"{args.max_shard_gb:g}; "
            "e.g. --max-shard-gb 5"
        )
    started_devices()  # a JAX_PLATFORMS this machine cannot start: one line, not JAX's traceback
    done = hf_export(
        args.checkpoint_dir,
        args.out_dir,
        args.step,
        args.dtype,
        args.tokenizer,
        int(args.max_shard_gb * 2**30),
        adapters_only=args.adapters_only,
    )
    what = "the LoRA adapters (peft layout) of step" if args.adapters_only else "step"
    print(
        f"exported {what} {done['step']} of {pathlib.Path(args.checkpoint_dir)} as {done['dtype']} to {done['out']}: "
        f"{', '.join(done['files'])}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
