"""How long `zoo.model.build`'s initialiser takes to compile on CPU, at XLA's default optimisation
level and with LLVM's optimisations off (what build uses), alternated in one process.

    python bench/init_compile.py [--rounds 2]

Each build gets a fresh vocabulary size, so no compile is reused.
"""

import argparse
import time

import equinox as eqx
import jax

from zoo.config import SIZES
from zoo.model import CausalLM


def compile_and_build(config, key, level):
    fn = lambda k: eqx.filter(CausalLM(config, key=k), eqx.is_array)  # noqa: E731
    options = {"xla_backend_optimization_level": level} if level is not None else None
    return jax.block_until_ready(jax.jit(fn).lower(key).compile(options)(key))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    fresh = 0
    for _ in range(a.rounds):
        for name in ("llama_tiny_a", "dsv3_tiny_a"):
            for level in (None, 0):
                fresh += 8
                config = SIZES[name].replace(vocab_size=SIZES[name].vocab_size + fresh)
                t0 = time.perf_counter()
                compile_and_build(config, jax.random.key(0), level)
                print(f"{name} {'default' if level is None else 'level 0'}: {time.perf_counter() - t0:.2f}s", flush=True)


if __name__ == "__main__":
    main()
