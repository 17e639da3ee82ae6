"""Greedy sampling speed, Zoo (`zoo.sampling.generate`) against transformers' `generate` (eager,
float32, greedy, use_cache=True) on the same Qwen2.5-0.5B-sized checkpoint and prompt, on CPU: each
run in its own process pinned to the same `--threads` cores (torch.set_num_threads for torch), the
two alternated over rounds (the machine is shared and its speed drifts: compare within a round).

    python bench/sampling.py --cache-dir /tmp/qwen05 --rounds 3 --json sampling.json
    python bench/sampling.py --small            # a tiny config, ~30 s: what the test suite smoke-runs

The checkpoint is Qwen2.5-0.5B's shape with random weights (hidden 896, 24 layers, 14 q / 2 kv heads,
MLP 4864, vocab 151936, tied embeddings, rope theta 1e6, q/k/v biases; float32, about 2 GB), written
by transformers into `--cache-dir` once and reused from there. The prompt is "The capital of France
is" as Qwen2.5's tokenizer encodes it (the ids, so no tokenizer is needed). Each run compiles / warms
up with one full call, then times `--reps` calls of `--tokens` new tokens (prefill included, as a
user's call has it) and reports the median seconds per new token; both must produce the same token
ids (greedy, the same weights), which the script checks.

torch and transformers are not Zoo dependencies: `--torch-python` names an interpreter that has them
(default: this one).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

QWEN05 = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    rope_theta=1e6,
)
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1024,
    rope_theta=1e6,
)
PROMPT = [785, 6722, 315, 9625, 374]  # "The capital of France is" in Qwen2.5's tokenizer


def _pin(threads: int) -> None:
    """Run on the first `threads` cores this process may use: XLA:CPU sizes its thread pool by them."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:threads])


def build(directory: Path, small: bool) -> None:
    """Write the random-weight checkpoint with transformers (run under --torch-python)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    sizes = SMALL if small else QWEN05
    config = Qwen2Config(
        **{k: v for k, v in sizes.items() if k != "rope_theta"},
        rope_parameters={"rope_type": "default", "rope_theta": sizes["rope_theta"]},
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=0,
    )
    Qwen2ForCausalLM(config).float().save_pretrained(directory)


def run_zoo(directory: Path, tokens: int, reps: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from zoo import sampling as gen
    from zoo import hf

    model = hf.from_pretrained(directory)
    prompt = [t % model.config.vocab_size for t in PROMPT]
    compiled = []
    start = time.perf_counter()
    gen.generate(model, [prompt], tokens, stop_tokens=[], on_compile=lambda *a: compiled.append(a[-1]))
    warm = time.perf_counter() - start
    times, out = [], None
    for _ in range(reps):
        start = time.perf_counter()
        out = gen.generate(model, [prompt], tokens, stop_tokens=[])[0].tokens
        times.append(time.perf_counter() - start)
    return {"times": times, "tokens": out, "compile_s": sum(compiled), "first_call_s": warm}


def run_torch(directory: Path, tokens: int, reps: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = torch.tensor([[t % model.config.vocab_size for t in PROMPT]])
    kw = dict(
        max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None
    )
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(prompt, **kw)
        warm = time.perf_counter() - start
        times, out = [], None
        for _ in range(reps):
            start = time.perf_counter()
            out = model.generate(prompt, **kw)[0, prompt.shape[1] :].tolist()
            times.append(time.perf_counter() - start)
    return {"times": times, "tokens": out, "first_call_s": warm, "torch": torch.__version__}


def _worker(args) -> int:
    _pin(args.threads)
    if args.worker == "build":
        build(Path(args.model), args.small)
        return 0
    if args.worker == "zoo":
        result = run_zoo(Path(args.model), args.tokens, args.reps)
    else:
        result = run_torch(Path(args.model), args.tokens, args.reps, args.threads)
    result["s_per_token"] = statistics.median(result["times"]) / args.tokens
    Path(args.json).write_text(json.dumps(result))
    return 0


def _spawn(python: str, args: list, log) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [python, str(Path(__file__).resolve()), *args, "--json", f.name]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            log(p.stdout[-2000:] + p.stderr[-3000:])
            raise SystemExit(f"error: {' '.join(args[:2])} failed (exit {p.returncode})")
        return json.loads(Path(f.name).read_text()) if args[1] != "build" else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cache-dir", help="where the checkpoint is written once and reused (default: a temporary directory)"
    )
    ap.add_argument(
        "--small", action="store_true", help="a tiny config (hidden 64, 2 layers, vocab 1024): a ~30 s smoke run"
    )
    ap.add_argument("--rounds", type=int, default=None, help="alternated Zoo / torch pairs (default 3, 1 with --small)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per call")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per run (default 3, 2 with --small)")
    ap.add_argument("--threads", type=int, default=2, help="cores each run is pinned to (and torch's thread count)")
    ap.add_argument("--torch-python", default=sys.executable, help="an interpreter with torch and transformers")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", choices=["build", "zoo", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    for key in ("rounds", "reps", "tokens", "threads"):
        value = getattr(args, key)
        if value is not None and value < 1:
            print(f"error: --{key}: must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.threads > len(os.sched_getaffinity(0)):
        print(
            f"error: --threads: {args.threads} cores asked for, {len(os.sched_getaffinity(0))} available; give fewer",
            file=sys.stderr,
        )
        return 2
    rounds = args.rounds or (1 if args.small else 3)
    reps = args.reps or (2 if args.small else 3)

    def log(message):
        print(message, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.cache_dir or tmp).expanduser() / (
            "qwen2.5-0.5b-shape-small" if args.small else "qwen2.5-0.5b-shape"
        )
        common = ["--model", str(directory), "--threads", str(args.threads)]
        if not (directory / "config.json").is_file():
            log(f"writing the checkpoint to {directory}")
            _spawn(args.torch_python, ["--worker", "build", *common] + (["--small"] if args.small else []), log)
        run = ["--tokens", str(args.tokens), "--reps", str(reps), *common]
        results = []
        for r in range(rounds):
            order = ("zoo", "torch") if r % 2 == 0 else ("torch", "zoo")
            got = {
                name: _spawn(sys.executable if name == "zoo" else args.torch_python, ["--worker", name, *run], log)
                for name in order
            }
            same = got["zoo"]["tokens"] == got["torch"]["tokens"]
            ratio = got["zoo"]["s_per_token"] / got["torch"]["s_per_token"]
            results.append(
                {"round": r + 1, "zoo": got["zoo"], "torch": got["torch"], "ratio": ratio, "same_tokens": same}
            )
            log(
                f"round {r + 1}: zoo {got['zoo']['s_per_token']:.4f} s/token, torch {got['torch']['s_per_token']:.4f} "
                "s/token, "
                f"zoo/torch {ratio:.2f}, same tokens: {same}"
            )
    ratios = [x["ratio"] for x in results]
    summary = {
        "model": "small" if args.small else "qwen2.5-0.5b-shape",
        "tokens": args.tokens,
        "reps": reps,
        "rounds": rounds,
        "threads": args.threads,
        "zoo_s_per_token": [x["zoo"]["s_per_token"] for x in results],
        "torch_s_per_token": [x["torch"]["s_per_token"] for x in results],
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "same_tokens": all(x["same_tokens"] for x in results),
        "runs": results,
    }
    print(
        f"zoo/torch seconds per token, median of {rounds} round(s): {summary['median_ratio']:.2f} "
        f"(zoo {statistics.median(summary['zoo_s_per_token']):.4f}, torch "
        f"{statistics.median(summary['torch_s_per_token']):.4f}); "
        f"same tokens: {summary['same_tokens']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if not summary["same_tokens"]:
        print("error: Zoo's and transformers' greedy tokens differ on the same weights", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
