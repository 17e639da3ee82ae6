"""Zoo's train step against PyTorch eager (bench/torch_llama_step.py) on the same Llama, the same batch,
optimizer and FLOP count, on this CPU: one process per run, the two systems alternated over rounds
(the machine is shared and its speed drifts, so compare within a round), with the jitted float32
matmul rate measured in its own process in every round.

    python bench/peer.py --torch-python /tmp/torchpeer/bin/python --md peer.md --out peer.json
    python bench/peer.py --zoo-one tiny none --steps 12       # one Zoo run (what the rounds start)

Configs: `tiny` = vocab 32000, hidden 256, 4 layers, 4 q / 2 kv heads, head_dim 64, MLP 1024, batch
8 x 256; `100m` = vocab 32000, hidden 512, 8 layers, 8 q / 4 kv heads, head_dim 64, MLP 2048, batch
4 x 512. Remat `none` or `full` (Zoo's offload=full: one checkpoint per decoder layer, as torch's
gradient checkpointing). Zoo runs with train.py's defaults (`XlaConfig()`, `TrainerConfig()`); a step's
time is from dispatch to its results being ready, steps 3..N, median, as the torch script does.

torch is not a Zoo dependency: give `--torch-python` an interpreter of an environment that has it
(`python3 -m venv /tmp/torchpeer && /tmp/torchpeer/bin/pip install torch==2.13.0 transformers==5.24.0`).
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
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "tiny": dict(vocab=32000, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, mlp=1024, batch=8, seq=256),
    "100m": dict(vocab=32000, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, mlp=2048, batch=4, seq=512),
}
REMATS = ("none", "full")


def zoo_model(d: dict):
    from bench.common import bench_model

    return bench_model(
        "llama_tiny_a",
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        num_layers=d["layers"],
        num_heads=d["heads"],
        num_kv_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        intermediate_size=d["mlp"],
        max_position_embeddings=max(512, d["seq"]),
    )


def zoo_train_config(d: dict, remat: str, **xla_changes):
    """train.py's config for one peer run: the defaults of every group but the model, data and offload."""
    import dataclasses

    from bench.common import train_config
    from zoo.train.run_config import XlaConfig

    c = train_config(zoo_model(d), [remat], d["batch"], d["seq"])
    return dataclasses.replace(c, xla=dataclasses.replace(XlaConfig(), **xla_changes))


def model_flops_per_step(d: dict) -> float:
    """6 x matmul weights (LM head included, embedding lookup not) x tokens + causal attention, as
    zoo.counts.flops_per_token counts them (152.2 / 613.6 GFLOP per step, the peer's own published count)."""
    from zoo.counts import flops_per_token

    return flops_per_token(zoo_model(d), d["seq"]) * d["batch"] * d["seq"]


def zoo_one(config: str, remat: str, steps: int, json_path=None) -> dict:
    from zoo.train import huge_pages

    d = CONFIGS[config]
    c = zoo_train_config(d, remat)
    from zoo.train.run import apply_xla_flags

    apply_xla_flags(c.xla)  # as train.py: before JAX starts
    import jax
    import numpy as np

    from bench import common as C

    tr = C.make_trainer(c)
    t0 = time.perf_counter()
    exe = tr.compile()
    compile_s = time.perf_counter() - t0
    state = tr.init()
    rng = np.random.default_rng(0)
    times, losses = [], []
    for i in range(steps):
        tokens = tr.shard_tokens(rng.integers(0, d["vocab"], size=(d["batch"], d["seq"]), dtype=np.int32))
        jax.block_until_ready(tokens)
        t = time.perf_counter()
        state, m = exe(state, tokens)
        loss = float(m["loss"])  # waits for the step, as torch's loss.item()
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
        losses.append(loss)
        print(f"step {i + 1}/{steps} loss {loss:.4f} {times[-1] * 1e3:.1f} ms", flush=True)
    timed = times[2:] if len(times) > 2 else times
    rec = {
        "system": "zoo",
        "config": config,
        "remat": remat,
        "steps": steps,
        "step_times_s": times,
        "losses": losses,
        "median_step_s_3_to_end": statistics.median(timed),
        "compile_s": compile_s,
        "cpu_fast_compile": tr.cfg.xla.cpu_fast_compile,
        "compiler_options": tr.compiler_options,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "host_memory": huge_pages.describe(),
    }
    print(
        f"zoo {remat}: median step (steps 3..{steps}) {rec['median_step_s_3_to_end'] * 1e3:.1f} ms, compile "
        f"{compile_s:.1f}s, "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}",
        flush=True,
    )
    if json_path:
        Path(json_path).write_text(json.dumps(rec, indent=1))
    return rec


def matmul_one(json_path) -> dict:
    from zoo.tools.measure_hardware import measure_matmul

    rate = max(measure_matmul(n, "float32", repeats=5, chain=4) for n in (1024, 2048))
    from zoo.train import huge_pages

    rec = {"system": "matmul", "flops_per_s": rate, "host_memory": huge_pages.describe()}
    Path(json_path).write_text(json.dumps(rec))
    return rec


def _run(cmd: list, log, env=None, name=None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    t = time.perf_counter()
    p = subprocess.run(cmd + ["--json", out], cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    rec = json.loads(Path(out).read_text())
    os.unlink(out)
    rec["process_s"] = time.perf_counter() - t
    log(
        f"    {name or rec['system']}: "
        + (
            f"{rec['flops_per_s'] / 1e9:.1f} GFLOP/s"
            if rec["system"] == "matmul"
            else f"{rec['median_step_s_3_to_end'] * 1e3:.0f} ms/step ({rec['process_s']:.0f}s process)"
        )
    )
    return rec


def table(results: dict) -> str:
    """The markdown table; two more columns where torch also ran with huge pages (--torch-huge-pages)."""
    thp = all("torch_huge_pages_ms" in r for r in results.values())
    extra_head, extra_rule = (" torch eager step, huge pages | Zoo / that |", "---:|---:|") if thp else ("", "")
    lines = [
        "| config | remat | Zoo step | torch eager step | Zoo / torch (median of rounds) | per round |"
        + extra_head
        + " Zoo of matmul rate | torch of matmul rate | matmul rate |",
        "|---|---|---:|---:|---:|---|" + extra_rule + "---:|---:|---:|",
    ]
    for key, r in results.items():
        config, remat = key.split("/")
        extra = f" {r['torch_huge_pages_ms']:.0f} ms | {r['ratio_torch_huge_pages']:.2f} |" if thp else ""
        lines.append(
            f"| `{config}` | {remat} | {r['zoo_ms']:.0f} ms | {r['torch_ms']:.0f} ms | **{r['ratio']:.2f}** | "
            f"{', '.join(f'{x:.2f}' for x in r['ratios'])} |{extra} {r['zoo_fraction']:.0%} | "
            f"{r['torch_fraction']:.0%} | "
            f"{r['matmul_gflops']:.0f} GFLOP/s |"
        )
    return "\n".join(lines)


def summarise(raw: dict) -> dict:
    """Per model and remat: the medians over rounds of each system's step, their ratio, and each
    system's model-FLOP rate as a fraction of the matmul rate measured in the same round."""
    results = {}
    for key, rec in raw.items():
        c = key.split("/")[0]
        flops = model_flops_per_step(CONFIGS[c])
        z = [x["median_step_s_3_to_end"] for x in rec["zoo"]]
        t = [x["median_step_s_3_to_end"] for x in rec["torch"]]
        mm = [x["flops_per_s"] for x in rec["matmul"]]
        ratios = [a_ / b_ for a_, b_ in zip(z, t)]
        results[key] = {
            "zoo_ms": statistics.median(z) * 1e3,
            "torch_ms": statistics.median(t) * 1e3,
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "matmul_gflops": statistics.median(mm) / 1e9,
            "model_gflop_per_step": flops / 1e9,
            "zoo_fraction": statistics.median([flops / s / m for s, m in zip(z, mm)]),
            "torch_fraction": statistics.median([flops / s / m for s, m in zip(t, mm)]),
            "zoo_compile_s": statistics.median([x["compile_s"] for x in rec["zoo"]]),
            "zoo_cpu_fast_compile": rec["zoo"][0]["cpu_fast_compile"],
        }
        if "torch_huge_pages" in rec:
            th = [x["median_step_s_3_to_end"] for x in rec["torch_huge_pages"]]
            results[key]["torch_huge_pages_ms"] = statistics.median(th) * 1e3
            results[key]["ratio_torch_huge_pages"] = statistics.median([a_ / b_ for a_, b_ in zip(z, th)])
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo-one", nargs=2, metavar=("CONFIG", "REMAT"), help="run one Zoo measurement in this process")
    ap.add_argument("--matmul-one", action="store_true", help="measure the matmul rate in this process")
    ap.add_argument("--json", default=None, help="(with --zoo-one / --matmul-one) write the record here")
    ap.add_argument("--torch-python", default=None, help="python of an environment with torch and transformers")
    ap.add_argument("--configs", default="tiny,100m")
    ap.add_argument("--remats", default="none,full")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--md", default=None, help="the markdown table")
    ap.add_argument(
        "--torch-huge-pages",
        action="store_true",
        help="also run torch with Zoo's host-memory setting (GLIBC_TUNABLES=glibc.malloc.hugetlb=1), as a third system",
    )
    a = ap.parse_args(argv)
    if a.zoo_one or a.matmul_one:
        from zoo.train.huge_pages import reexec_with_huge_pages

        reexec_with_huge_pages()  # as train.py: the process Zoo's runs start in
    if a.zoo_one:
        zoo_one(*a.zoo_one, a.steps, a.json)
        return 0
    if a.matmul_one:
        matmul_one(a.json)
        return 0
    if not a.torch_python or not Path(a.torch_python).exists():
        print(
            "error: --torch-python: give the python of an environment with torch and transformers; "
            "python3 -m venv /tmp/torchpeer && /tmp/torchpeer/bin/pip install torch==2.13.0 transformers==5.24.0",
            file=sys.stderr,
        )
        return 2

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    keys = [(c, r) for c in a.configs.split(",") for r in a.remats.split(",")]
    for c, r in keys:
        if c not in CONFIGS or r not in REMATS:
            print(
                f"error: --configs/--remats: {c}/{r} unknown; choose configs from {','.join(CONFIGS)} and remats from "
                f"{','.join(REMATS)}",
                file=sys.stderr,
            )
            return 2
    from zoo.train.huge_pages import TUNABLE, child_environ

    zoo_env = child_environ()  # Zoo's processes start as train.py's do (zoo.train.huge_pages)
    torch_env = {**os.environ, "GLIBC_TUNABLES": f"{TUNABLE}=1"}
    systems = ["zoo", "torch"] + (["torch_huge_pages"] if a.torch_huge_pages else [])
    raw = {f"{c}/{r}": {**{s: [] for s in systems}, "matmul": []} for c, r in keys}
    for rnd in range(a.rounds):
        for c, r in keys:
            log(f"round {rnd + 1}/{a.rounds} {c} {r}")
            zoo = [sys.executable, "bench/peer.py", "--zoo-one", c, r, "--steps", str(a.steps)]
            torch = [a.torch_python, "bench/torch_llama_step.py", "--config", c, "--remat", r, "--steps", str(a.steps)]
            runs = [("zoo", zoo, zoo_env), ("torch", torch, None), ("torch_huge_pages", torch, torch_env)][
                : len(systems)
            ]
            rec = raw[f"{c}/{r}"]
            rec["matmul"].append(_run([sys.executable, "bench/peer.py", "--matmul-one"], log, zoo_env))
            for name, cmd, env in runs if rnd % 2 == 0 else runs[::-1]:
                rec[name].append(_run(cmd, log, env, name))
    results = summarise(raw)
    md = table(results)
    print(md)
    if a.md:
        Path(a.md).write_text(md + "\n")
    if a.out:
        from bench.common import env_info, write_json

        write_json(
            a.out,
            {
                "schema": "zoo.bench.peer/1",
                "env": env_info(),
                "rounds": a.rounds,
                "steps": a.steps,
                "results": results,
                "raw": raw,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
