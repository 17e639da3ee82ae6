"""A/B of how SwiGLU's matmuls pick their weight-gradient transposition on CPU (zoo/nn/mlp.py).

    XLA_FLAGS= python bench/ab_swiglu_ad.py [--rounds 7] [--layers 8]

A scan over `--layers` stacked SwiGLU MLPs at llama_100m's sizes (batch 1 x 512 tokens, embed 512,
mlp 2048, float32), forward + backward, jitted, in one process, the variants timed alternately
(median of `--rounds`):

- einsum: plain `jnp.einsum` (what GPUs run);
- custom_vjp: the weight gradient `x^T g` from a materialised `x^T` (zoo/nn/mlp.py today; `jax.jvp`
  through it raises);
- custom_jvp: the same choice written into a JVP rule (`dx @ w + barrier(x^T)^T @ dw`), which
  forward-mode AD goes through; XLA folds the transposes back, and the compiled weight gradients
  contract dim 0 of both operands, as plain einsum's do;
- xt_forward: no custom rule: the forward multiplies a materialised `barrier(x^T)` (contracting its
  dim 0), so JAX's own transpose gives the weight gradient `x^T g` with x^T as the row-major lhs, as
  custom_vjp does, and forward mode works; the forward pays a transpose per matmul.

Prints each variant's median step and its ratio to einsum; all variants give the same loss and
gradient (checked). `--hlo` prints instead the contracting dims of every dot in each compiled step.
"""

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


@jax.custom_vjp
def _vjp_matmul(x, w):
    return x @ w


def _vjp_fwd(x, w):
    return x @ w, (x, w)


def _vjp_bwd(res, g):
    x, w = res
    xt = jax.lax.optimization_barrier(x.T)
    return g @ w.T, xt @ g


_vjp_matmul.defvjp(_vjp_fwd, _vjp_bwd)


@jax.custom_jvp
def _jvp_matmul(x, w):
    return x @ w


@_jvp_matmul.defjvp
def _jvp_rule(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    xt = jax.lax.optimization_barrier(x.T)
    return x @ w, dx @ w + xt.T @ dw


def _xt_forward(x, w):
    xt = jax.lax.optimization_barrier(x.T)
    return jax.lax.dot_general(xt, w, (((0,), (0,)), ((), ())))


def variants():
    return {
        "einsum": lambda x, w: jnp.einsum("TD,DF->TF", x, w),
        "custom_vjp": _vjp_matmul,
        "custom_jvp": _jvp_matmul,
        "xt_forward": _xt_forward,
    }


def make_step(matmul, layers):
    def mlp_layer(x, p):
        gate, up = matmul(x, p["w_gate"]), matmul(x, p["w_up"])
        return x + matmul(jax.nn.silu(gate) * up, p["w_down"]), None

    def loss(params, x):
        y, _ = jax.lax.scan(mlp_layer, x, params)
        return jnp.mean(y * y)

    return jax.jit(jax.value_and_grad(loss))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hlo", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    d, f, t, n = 512, 2048, 512, args.layers
    params = {
        "w_gate": jnp.asarray(rng.normal(size=(n, d, f)) / d, jnp.float32),
        "w_up": jnp.asarray(rng.normal(size=(n, d, f)) / d, jnp.float32),
        "w_down": jnp.asarray(rng.normal(size=(n, f, d)) / f, jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    steps = {name: make_step(mm, n) for name, mm in variants().items()}
    if args.hlo:
        for name, step in steps.items():
            text = step.lower(params, x).compile().as_text()
            dims = re.findall(r"= (f32\[[\d,]+\])\S* dot\(.*?(lhs_contracting_dims=\{\d*\}, rhs_contracting_dims=\{\d*\})", text)
            print(name, f"{text.count(' transpose(')} transposes;", "; ".join(f"{shape} {c}" for shape, c in dims))
        return
    results = {name: jax.block_until_ready(step(params, x)) for name, step in steps.items()}  # compile
    ref_loss, ref_grads = results["einsum"]
    for name, (loss, grads) in results.items():
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, err_msg=name)
        for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            assert np.abs(np.asarray(g) - np.asarray(g0)).max() <= 1e-4 * np.abs(np.asarray(g0)).max(), name
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():  # alternating
            start = time.perf_counter()
            jax.block_until_ready(step(params, x))
            times[name].append(time.perf_counter() - start)
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    print(f"{n} SwiGLU layers, {t} tokens x {d} -> {f}, forward + backward, median of {args.rounds}; load {' '.join(load)}")
    base = statistics.median(times["einsum"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:>10}: {1000 * med:8.1f} ms  einsum / this = {base / med:.2f}x")


if __name__ == "__main__":
    main()
