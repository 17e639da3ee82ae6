"""A weight gradient's product, `einsum("CD,CF->DF", x, g)` (rows contracted), two ways on CPU: as the
einsum (XLA:CPU runs it as its own Eigen dot: the left operand contracts its major axis) and over a
transposed copy of x, `optimization_barrier(x.T) @ g` (YNNPACK takes it). docs/benchmarks.md, "The head's
gradient through YNNPACK"; `zoo.loss.head_gradient` is the second form.

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=dot python bench/weight_grad_dot.py

Prints ms and GFLOP/s (median of 15 calls after 3) for each [rows, in] x [rows, out] shape.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = ((512, 512, 2048), (512, 2048, 512), (2048, 512, 2048), (512, 512, 32000))  # (rows, in, out)
FORMS = {
    "einsum (XLA's dot)": lambda x, g: jnp.einsum("CD,CF->DF", x, g),
    "barrier(x.T) @ g (YNNPACK)": lambda x, g: jax.lax.optimization_barrier(x.T) @ g,
}


def median_s(f, *args, reps: int = 15) -> float:
    for _ in range(3):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    for rows, d_in, d_out in SHAPES:
        x = jax.random.normal(jax.random.key(0), (rows, d_in))
        g = jax.random.normal(jax.random.key(1), (rows, d_out))
        for name, form in FORMS.items():
            s = median_s(jax.jit(form), x, g)
            print(f"[{rows}, {d_in}] x [{rows}, {d_out}]  {name:28s} {s * 1e3:8.2f} ms {2 * rows * d_in * d_out / s / 1e9:6.1f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
