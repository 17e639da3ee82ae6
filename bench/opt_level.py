"""XLA:CPU's LLVM optimisation level, both ways in one process: compile time and step time of the same
lowered train step compiled with `xla_backend_optimization_level=0` (`xla.cpu_fast_compile=true`) and with
XLA's default level (`false`), steps alternated between the two executables.

    python bench/opt_level.py                      # default run, the 20M and 64M Llamas (docs/benchmarks.md)
    python bench/opt_level.py --runs default --steps 4

Runs (`--runs`, comma list):
- `default`: `python train.py`'s own config (dsv3_tiny_a, markov data, batch 16 x 64);
- `llama20m`: bench/peer.py's `tiny` config (vocab 32000, hidden 256, 4 layers, batch 8 x 256);
- `llama64m`: bench/peer.py's `100m` config (vocab 32000, hidden 512, 8 layers, batch 4 x 512).

Prints, per run: compile seconds and median step seconds both ways, their ratios, and the number of
steps after which the optimised program has paid back its longer compile. One process, one device.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402

RUNS = ("default", "llama20m", "llama64m")


def run_config(name: str):
    """The TrainConfig of one run (compose train.py's config for `default`)."""
    if name == "default":
        from zoo.inspect import compose
        from zoo.train.config import load

        return load(compose(["mesh=single"]))
    from bench.peer import CONFIGS, zoo_train_config

    return zoo_train_config(CONFIGS[{"llama20m": "tiny", "llama64m": "100m"}[name]], "none")


def measure(name: str, steps: int) -> dict:
    import jax

    c = run_config(name)
    tr = C.make_trainer(c)
    fast, opt = {"xla_backend_optimization_level": 0}, None
    exe, compile_s = {}, {"fast": [], "opt": []}
    # Each compile after jax.clear_caches() (else a second compile of the same program comes from
    # JAX's in-memory cache), in the order fast, opt, opt, fast.
    for key in ("fast", "opt", "opt", "fast"):
        jax.clear_caches()
        lowered = tr.lower()
        t = time.perf_counter()
        exe[key] = lowered.compile(fast if key == "fast" else opt)
        compile_s[key].append(time.perf_counter() - t)
    state = tr.init()
    tokens = C.tokens_for(tr)
    times = {"fast": [], "opt": []}
    order = ["fast", "opt"]
    for i in range(steps + 1):  # the first step of each is a warm-up
        for k in order if i % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            state, m = exe[k](state, tokens)
            jax.block_until_ready((state, m))
            if i:
                times[k].append(time.perf_counter() - t)
    cf, co = statistics.median(compile_s["fast"]), statistics.median(compile_s["opt"])
    sf, so = statistics.median(times["fast"]), statistics.median(times["opt"])
    payback = (co - cf) / (sf - so) if sf > so else None
    return {
        "run": name,
        "model": c.model.family,
        "batch": c.data.batch_size,
        "seq": c.data.seq_len,
        "compile_s": {"fast": cf, "opt": co},
        "compile_times_s": compile_s,
        "step_s": {"fast": sf, "opt": so},
        "compile_ratio_opt_to_fast": co / cf,
        "step_ratio_opt_to_fast": so / sf,
        "payback_steps": payback,
        "step_times_s": times,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--steps", type=int, default=6, help="timed steps per executable (alternated)")
    ap.add_argument("--out", default=None, help="JSON results (optional)")
    a = ap.parse_args(argv)
    from zoo.train.config import XlaConfig
    from zoo.train.run import apply_xla_flags

    apply_xla_flags(XlaConfig())  # train.py's default XLA flags, before JAX starts
    import jax

    # Fresh compiles: nothing from or into the persistent cache.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    out = []
    for name in a.runs.split(","):
        r = measure(name, a.steps)
        out.append(r)
        pb = "never" if r["payback_steps"] is None else f"{r['payback_steps']:.1f} steps"
        print(f"{name}: compile {r['compile_s']['fast']:.1f}s -> {r['compile_s']['opt']:.1f}s (x{r['compile_ratio_opt_to_fast']:.2f}), "
              f"step {r['step_s']['fast'] * 1e3:.0f} -> {r['step_s']['opt'] * 1e3:.0f} ms (x{r['step_ratio_opt_to_fast']:.2f}); "
              f"the optimised program pays for its compile after {pb}", flush=True)
    if a.out:
        C.write_json(a.out, {"schema": "zoo.bench.opt_level/1", "env": C.env_info(), "runs": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
