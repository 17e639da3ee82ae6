"""A/B of the issue-10 kernels on CPU: blockwise against XLA attention, chunked against whole-logits loss.

    python bench/attention_kernels.py attention [--seqs 256 1024 4096] [--blocks 256 512] [--rounds 5]
    python bench/attention_kernels.py loss [--vocabs 32000 128256] [--chunks 1024 2048 4096] [--rounds 5]

Every variant is compiled first, then all are timed in alternation, one call each per round, and the
median per variant is reported with its ratio to the first variant (the baseline) of its group. A
step is forward + backward (`jax.value_and_grad`) of a scalar of the kernel's output, jitted.

attention: batch 1, 8 query heads over 2 kv heads, head dim 64, causal, float32.
loss: 8 x 256 tokens, hidden 256, float32; "whole" is zoo.model.next_token_loss of the full logits.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _time(variants: dict, args: tuple, rounds: int) -> dict:
    import jax

    compiled = {}
    for name, fn in variants.items():
        compiled[name] = jax.jit(fn).lower(*args).compile()
        jax.block_until_ready(compiled[name](*args))  # warm
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, c in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(c(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _report(title: str, medians: dict) -> None:
    base = next(iter(medians.values()))
    print(title)
    for name, t in medians.items():
        print(f"  {name:28s} {t * 1e3:9.2f} ms  x{t / base:5.2f}")
    sys.stdout.flush()


def attention(seqs, blocks, rounds, batch=1, heads=8, kv_heads=2, dim=64, window=None, skip_xla=False):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zoo.nn.attention_kernels import attend

    for seq in seqs:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.normal(size=(batch, seq, heads, dim)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, dim)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, dim)), jnp.float32)

        def step(impl, block=512):
            def loss(q, k, v):
                return attend(q, k, v, scale=dim**-0.5, impl=impl, window=window, block_q=block, block_k=block).sum()

            return jax.value_and_grad(loss, argnums=(0, 1, 2))

        def jax_nn_loss(q, k, v):
            out = jax.nn.dot_product_attention(q, k, v, scale=dim**-0.5, is_causal=True, implementation="xla")
            return out.sum()

        variants = {} if skip_xla else {"xla": step("xla")}
        if window is None and not skip_xla:  # today's zoo.nn.attention path, for comparison
            variants["jax.nn xla"] = jax.value_and_grad(jax_nn_loss, argnums=(0, 1, 2))
        for b in blocks:
            if b <= seq:
                variants[f"blockwise {b}x{b}"] = step("blockwise", b)
        _report(f"attention T={seq} window={window}", _time(variants, (q, k, v), rounds))


def loss(vocabs, chunks, rounds, methods=("fused", "recompute"), batch=8, seq=256, dim=256):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zoo.loss import chunked_next_token_loss
    from zoo.model import next_token_loss

    for vocab in vocabs:
        rng = np.random.default_rng(0)
        hidden = jnp.asarray(rng.normal(size=(batch, seq, dim)), jnp.float32)
        head = jnp.asarray(rng.normal(size=(dim, vocab)) * dim**-0.5, jnp.float32)
        tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32)

        def whole(h, w, t):
            return next_token_loss(jnp.einsum("BTD,DV->BTV", h, w, preferred_element_type=jnp.float32), t)

        variants = {"whole": jax.value_and_grad(whole, argnums=(0, 1))}
        for c in chunks:
            for method in methods:
                variants[f"chunk {c} {method}"] = jax.value_and_grad(
                    lambda h, w, t, c=c, m=method: chunked_next_token_loss(h, w, t, chunk_size=c, method=m), argnums=(0, 1)
                )
        _report(f"loss V={vocab} tokens={batch}x{seq} D={dim}", _time(variants, (hidden, head, tokens), rounds))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=["attention", "loss"])
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--blocks", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--skip-xla", action="store_true", help="blockwise variants only (the first is the baseline)")
    p.add_argument("--methods", nargs="+", default=["fused", "recompute"], choices=["fused", "recompute"])
    p.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    if a.part == "attention":
        attention(a.seqs, a.blocks, a.rounds, window=a.window, skip_xla=a.skip_xla)
    else:
        loss(a.vocabs, a.chunks, a.rounds, a.methods)


if __name__ == "__main__":
    main()
