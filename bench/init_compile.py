"""How long `zoo.model.build`'s initialiser takes on CPU (compile and one run: what a user waits for)
at XLA's default optimisation level, with LLVM's optimisations off (level 0) and at level 1,
alternated in one process. `zoo.model.init_compile_options` picks the level from the size.

    python bench/init_compile.py [--rounds 2] [--models llama_tiny_a,dsv3_tiny_a,qwen2_100m]

Each build gets a fresh vocabulary size, so no compile is reused.
"""

import argparse
import time

import equinox as eqx
import jax

from zoo.config import SIZES, count_params
from zoo.model import CausalLM

LEVELS = {"default": None, "level 0": 0, "level 1": 1}


def compile_and_build(config, key, level) -> tuple[float, float]:
    """(compile seconds, run seconds) of the initialiser at `level` (None: XLA's default)."""
    fn = lambda k: eqx.filter(CausalLM(config, key=k), eqx.is_array)  # noqa: E731
    options = {"xla_backend_optimization_level": level} if level is not None else None
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(key).compile(options)
    t1 = time.perf_counter()
    jax.block_until_ready(compiled(key))
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--models", default="llama_tiny_a,dsv3_tiny_a,qwen2_100m")
    a = p.parse_args()
    fresh = 0
    for _ in range(a.rounds):
        for name in a.models.split(","):
            for label, level in LEVELS.items():
                fresh += 8
                config = SIZES[name].replace(vocab_size=SIZES[name].vocab_size + fresh)
                compile_s, run_s = compile_and_build(config, jax.random.key(0), level)
                print(f"{name} ({count_params(config) / 1e6:.1f}M params) {label}: compile {compile_s:.2f}s + run {run_s:.2f}s "
                      f"= {compile_s + run_s:.2f}s", flush=True)


if __name__ == "__main__":
    main()
