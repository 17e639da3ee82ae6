"""`python -m zoo.tools.generate model.path=<hf dir> prompt="..."` (or `checkpoint.dir=<train.py
checkpoint>`): the command line over zoo.sampling's `generate`. It loads the model and its tokenizer,
samples every `prompt=` with the keys below and prints each prompt followed by its continuation.

A LoRA run's checkpoint samples its merged model (`checkpoint.lora=merged`, the default: base +
alpha/r A@B folded into each weight once), or the base with the adapters attached
(`checkpoint.lora=attached`: `zoo.lora.attach`, each layer's weights merged inside the scan, the base
never merged whole); both give the same greedy tokens.
"""

import dataclasses
import functools
import json
import pathlib
import sys
import time
from typing import Any, Optional, Sequence

from zoo import hf
from zoo.config import DTYPES, dtype_name
from zoo.sampling import GenerationError, check_request, decode_compile_options, encode_prompts, generate
from zoo.tools.cli import run_tool
from zoo.train.checkpoint import restore_model
from zoo.train.machine_fit import started_devices
from zoo.train.stop import set_phase

LORA_FORMS = ("merged", "attached")  # checkpoint.lora: how a LoRA run's adapters meet the base


# --- the command line ----------------------------------------------------------------------------


@dataclasses.dataclass
class ModelSource:
    path: Optional[str] = None  # a Hugging Face checkpoint directory (config.json + *.safetensors)
    dtype: str = "float32"  # parameter dtype
    compute_dtype: Optional[str] = None  # matmul dtype (null: dtype)


@dataclasses.dataclass
class CheckpointSource:
    dir: Optional[str] = None  # a train.py checkpoint.dir
    step: Optional[int] = None  # null: the latest complete step
    # A LoRA run's checkpoint: `merged` samples base + alpha/r A@B folded into each weight once;
    # `attached` keeps the base and the adapters apart and merges them per layer inside the scan.
    lora: str = "merged"


@dataclasses.dataclass
class GenerateOptions:
    """The keys of `python -m zoo.tools.generate` (besides `prompt=`, taken verbatim and repeatable)."""

    model: ModelSource = dataclasses.field(default_factory=ModelSource)
    checkpoint: CheckpointSource = dataclasses.field(default_factory=CheckpointSource)
    # A tokenizer.json (or its folder), or `bytes` for UTF-8 byte ids; null: model.path's tokenizer.json,
    # or the tokenizer a checkpoint's text data used.
    tokenizer: Optional[str] = None
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: Optional[list[int]] = None  # null: config.json's eos_token_id, else the tokenizer's eos
    max_len: Optional[int] = None  # cache positions (null: the model's max_position_embeddings)
    # CPU only: true compiles with LLVM's optimisations off (faster compile, slower tokens), false on,
    # auto off below 20M parameters (zoo.backend)
    cpu_fast_compile: Any = "auto"


def parse_args(argv: Sequence[str]) -> tuple[GenerateOptions, list[str]]:
    """(options, prompts). `prompt=` takes the rest of its argument as it is (no YAML: a colon or a
    `#` stays text) and may be repeated; every other key goes through OmegaConf like a Hydra override."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    prompts, dotlist = [], []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise GenerationError(f'{arg}: not a key=value argument; e.g. prompt="Once upon a time" max_new_tokens=32')
        key = key.lstrip("+")
        if key == "prompt":
            prompts.append(value)
        elif not value.strip():  # OmegaConf reads `model.path=` as null: another message, or the default, silently
            raise GenerationError(
                f"{key}: empty (an unset shell variable?); give a value, or drop {key}= for its default"
            )
        else:
            dotlist.append(f"{key}={value}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(GenerateOptions), OmegaConf.from_dotlist(dotlist))
        return OmegaConf.to_object(merged), prompts
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        message = str(e).splitlines()[0]
        if "not in struct" in message or "Key '" in message:
            raise GenerationError(f"{key}: unknown key; the keys are {', '.join(_keys())}") from None
        raise GenerationError(f"{key}: {message}; give a value of the right type") from None


def _keys(schema=GenerateOptions, prefix: str = "") -> list[str]:
    out = ["prompt"] if not prefix else []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            out += _keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _load_tokenizer(spec: str, key: str = "tokenizer"):
    # Not at the top: zoo.data imports grain (about 1.1 s), which a bad command line need not wait for.
    from zoo.data.tokenizer import ByteTokenizer, HFTokenizer

    if spec == "bytes":
        return ByteTokenizer()
    path = pathlib.Path(spec).expanduser()
    if not path.exists():
        raise GenerationError(
            f"{key}: {path} does not exist; give a tokenizer.json (or its folder), or tokenizer=bytes for UTF-8 byte "
            "ids"
        )
    try:
        return HFTokenizer(path)
    except ValueError as e:  # zoo.data.DataError, keyed for train.py's data.tokenizer
        raise GenerationError(f"{key}: {str(e).split(': ', 1)[-1]}") from None


def _hf_stop_tokens(directory: pathlib.Path) -> Optional[list[int]]:
    """eos_token_id of generation_config.json, else config.json (an int or a list), if any; a file that
    does not read, or an id that is not a whole number, is a GenerationError naming the file."""
    for name in ("generation_config.json", "config.json"):
        f = directory / name
        if f.is_file():
            try:
                cfg = json.loads(f.read_bytes())
            except ValueError as e:  # not UTF-8, not JSON
                raise GenerationError(f"{f}: not a JSON file ({e}); download or copy it again") from None
            eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
            ids = [eos] if not isinstance(eos, list) else eos
            if eos is not None and not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
                raise GenerationError(
                    f"{f}: eos_token_id is {json.dumps(eos)[:40]}, not a token id or a list of them; fix it, or give "
                    "stop_tokens=[<ids>]"
                )
            if eos is not None:
                return list(ids)
    return None


def _hf_source(opts: GenerateOptions):
    """(config, load model, tokenizer, default stop tokens) of model.path; the weights load later."""
    directory = pathlib.Path(opts.model.path).expanduser()
    dtypes = {}
    for key in ("dtype", "compute_dtype"):  # named by the user's key, not by the ModelConfig field it sets
        value = getattr(opts.model, key)
        try:
            dtypes[key] = None if value is None else dtype_name(value, f"model.{key}")
        except ValueError:
            raise GenerationError(f"model.{key}: got {value!r}; choose one of {', '.join(DTYPES)}") from None
    compute = dtypes["compute_dtype"] or dtypes["dtype"]
    config = hf.config_from_hf(
        hf.load_config(directory),
        source=str(directory / "config.json"),
        param_dtype=dtypes["dtype"],
        compute_dtype=compute,
    )
    if opts.tokenizer is not None:
        tokenizer = _load_tokenizer(opts.tokenizer)
    elif (directory / "tokenizer.json").is_file():
        tokenizer = _load_tokenizer(str(directory / "tokenizer.json"))
    else:
        raise GenerationError(
            f"tokenizer: {directory} has no tokenizer.json; give tokenizer=<a tokenizer.json>, or tokenizer=bytes for "
            "UTF-8 byte ids"
        )
    load = functools.partial(hf.from_pretrained, directory, dtype=dtypes["dtype"], compute_dtype=compute)
    return config, load, tokenizer, _hf_stop_tokens(directory) if opts.stop_tokens is None else None


def _checkpoint_source(opts: GenerateOptions):
    """(config, load model, tokenizer, default stop tokens) of checkpoint.dir."""
    form = opts.checkpoint.lora
    if form not in LORA_FORMS:
        raise GenerationError(f"checkpoint.lora: got {form!r}; choose {' or '.join(LORA_FORMS)}")
    # reads the parameters: small next to compiling
    model, meta = restore_model(opts.checkpoint.dir, step=opts.checkpoint.step, lora_form=form)
    if form == "attached" and not (meta.get("lora") or {}).get("rank"):
        raise GenerationError(
            f"checkpoint.lora: {opts.checkpoint.dir} is not a LoRA run (no adapters to attach); drop "
            "checkpoint.lora=attached"
        )
    data = meta.get("data", {})
    if opts.tokenizer is not None:
        tokenizer = _load_tokenizer(opts.tokenizer)
    elif data.get("name") == "text":
        tokenizer = _load_tokenizer(data["tokenizer"] if data.get("tokenizer") else "bytes")
    else:
        raise GenerationError(
            f"tokenizer: the checkpoint was trained on data={data.get('name')} (token ids without text); "
            "give tokenizer=bytes to read ids as UTF-8 bytes, or tokenizer=<a tokenizer.json>"
        )
    return model.config, lambda: model, tokenizer, None


def greedy_note(opts: GenerateOptions) -> Optional[str]:
    """The line for top_k / top_p given with greedy decoding (temperature=0), which ignores them."""
    unused = [f"top_k={opts.top_k}"] * (opts.top_k != 0) + [f"top_p={opts.top_p}"] * (opts.top_p != 1)
    if opts.temperature != 0 or not unused:
        return None
    return (
        f"{' and '.join(unused)} shape sampling, and temperature=0 is greedy (the most likely token each step), so "
        f"{'they change' if len(unused) > 1 else 'it changes'} nothing; give a temperature (e.g. temperature=0.8) to "
        "sample"
    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(argv: Sequence[str]) -> int:
    opts, prompts = parse_args(argv)
    if (opts.model.path is None) == (opts.checkpoint.dir is None):
        raise GenerationError(
            "model.path: give exactly one of model.path=<Hugging Face directory> and checkpoint.dir=<train.py "
            "checkpoint>"
        )
    if opts.model.path is not None and opts.checkpoint.lora != "merged":
        raise GenerationError("checkpoint.lora: applies to a LoRA run's checkpoint.dir, not to model.path; drop it")
    if not prompts:
        raise GenerationError('prompt: no prompt given; add prompt="..." (repeat it for several prompts)')
    nothing = "nothing was generated; run the command again"
    platform = started_devices()[0].platform  # a JAX_PLATFORMS this machine cannot start: one line, not a traceback
    if opts.cpu_fast_compile != "auto" and platform != "cpu":
        _log(
            f"note: cpu_fast_compile={str(opts.cpu_fast_compile).lower()}: XLA:CPU's option, and this machine's "
            f"devices are {platform}s, so it changes nothing here; drop it"
        )
    set_phase(f"loading the model from {opts.model.path or opts.checkpoint.dir}", nothing)
    config, load, tokenizer, stop = _hf_source(opts) if opts.model.path is not None else _checkpoint_source(opts)
    from zoo.data.tokenizer import ByteTokenizer  # loaded by now (the tokenizer above)

    if tokenizer.vocab_size > config.vocab_size:
        what = (
            "UTF-8 bytes need 256 ids"
            if isinstance(tokenizer, ByteTokenizer)
            else f"{tokenizer.name} has {tokenizer.vocab_size} token ids"
        )
        raise GenerationError(
            f"tokenizer: {what} but the model's vocabulary has {config.vocab_size}; give the model's own tokenizer"
        )
    if opts.stop_tokens is not None:
        stop = opts.stop_tokens
    elif stop is None:
        stop = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    tokens = encode_prompts(prompts, tokenizer)
    check_request(
        config, tokens, opts.max_new_tokens, opts.temperature, opts.top_k, opts.top_p, stop, opts.max_len, opts.seed
    )
    note = greedy_note(opts)
    if note:
        _log(f"note: {note}")
    decode_compile_options("cpu", 0, opts.cpu_fast_compile)  # a bad value stops here, before loading

    t0 = time.perf_counter()
    model = load()
    _log(
        f"model {config.family} from {opts.model.path or opts.checkpoint.dir} in {time.perf_counter() - t0:.1f}s; "
        f"tokenizer {tokenizer!r}"
    )
    compile_s = []

    def on_compile(batch, seq, cache, seconds):
        _log(f"compiled for {batch} prompt(s) of up to {seq} tokens and a cache of {cache} positions in {seconds:.1f}s")
        compile_s.append(seconds)
        set_phase("generating", nothing)

    set_phase("compiling the sampler", nothing)
    _log(f"generating up to {opts.max_new_tokens} tokens for {len(tokens)} prompt(s)")
    t0 = time.perf_counter()
    results = generate(
        model,
        tokens,
        opts.max_new_tokens,
        tokenizer=tokenizer,
        temperature=opts.temperature,
        top_k=opts.top_k,
        top_p=opts.top_p,
        stop_tokens=stop,
        seed=opts.seed,
        max_len=opts.max_len,
        cpu_fast_compile=opts.cpu_fast_compile,
        on_compile=on_compile,
    )
    elapsed = time.perf_counter() - t0 - sum(compile_s)
    for prompt, r in zip(prompts, results):
        print(prompt + r.text, flush=True)
    new = sum(len(r.tokens) for r in results)
    ended = sum(r.stopped for r in results)
    _log(f"{new} new tokens in {elapsed:.2f}s; {ended} of {len(results)} prompt(s) ended by a stop token {stop}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return run_tool(lambda: run(args), "python -m zoo.tools.generate", args)


if __name__ == "__main__":
    raise SystemExit(main())
