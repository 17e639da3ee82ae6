"""A/B of the CPU hot-path fixes in zoo/model.py and zoo/nn/mlp.py (docs/benchmarks.md, "Two fixes").

    python bench/ab_hotpath.py [--preset none] [--rounds 5] [--profile]
    python bench/ab_hotpath.py --part head [--rounds 15]


Compiles four variants of train.py's step for llama_100m (batch 1 x 512) in one process and times
them alternately (median over rounds):

0. before: the loss slices the logits to [:, :-1]; SwiGLU's matmuls are plain einsums
1. the loss scores every position and drops the last loss (zoo/model.py today); SwiGLU as before
2. the code as it is (1 + SwiGLU's custom VJP on CPU, zoo/nn/mlp.py)
3. 2 + the same custom VJP for the attention projections (tried, not kept)

Since `zoo.nn.mlp.dense` became a plain einsum (10% faster under train.py's current CPU defaults,
docs/benchmarks.md "Against PyTorch eager"), variants 2 and 3 are the same programs as 1: this script
records the measurement that introduced the custom VJP, under the defaults of that time.

The variants are swapped in by patching the functions before each trace; the code is left as it is.
`--profile` also prints, for variants 0 and 2, the costliest non-matmul ops of one step.
`--part head` times only the output head and the loss (forward + backward, jitted), old loss against
new, at llama_100m's sizes (512 tokens, hidden 512, vocabulary 32000).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402


def _old_loss(logits, tokens, mask=None):
    import jax
    import jax.numpy as jnp

    logits = logits[:, :-1].astype(jnp.float32)
    targets = tokens[:, 1:]
    logz = jax.nn.logsumexp(logits, axis=-1)
    nll = logz - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    if mask is None:
        return nll.mean()
    weights = mask[:, 1:].astype(jnp.float32)
    return (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def _einsum_swiglu(self, x):
    import jax
    import jax.numpy as jnp

    from zoo import tags

    cdt = self.compute_dtype
    gate = tags.tag(jnp.einsum("BTD,DF->BTF", x, self.w_gate.astype(cdt)), tags.MLPWI_0)
    up = tags.tag(jnp.einsum("BTD,DF->BTF", x, self.w_up.astype(cdt)), tags.MLPWI_1)
    return tags.tag(jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, self.w_down.astype(cdt)), tags.MLPWO)


def _dense_attention(self, x, positions, segment_ids=None):
    from zoo import tags
    from zoo.nn.attention_kernels import attend
    from zoo.nn.mlp import dense

    cdt = self.compute_dtype
    d = x.shape[-1]
    q = tags.tag(dense(x, self.wq.astype(cdt).reshape(d, -1)).reshape(*x.shape[:-1], *self.wq.shape[1:]), tags.QUERY_PROJ)
    k = tags.tag(dense(x, self.wk.astype(cdt).reshape(d, -1)).reshape(*x.shape[:-1], *self.wk.shape[1:]), tags.KEY_PROJ)
    v = tags.tag(dense(x, self.wv.astype(cdt).reshape(d, -1)).reshape(*x.shape[:-1], *self.wv.shape[1:]), tags.VALUE_PROJ)
    q, k = self.rope(q, positions), self.rope(k, positions)
    context = tags.tag(attend(q, k, v, scale=self.scale, impl=self.impl, window=self.window, sinks=self.sinks, segment_ids=segment_ids), tags.CONTEXT)
    flat = context.reshape(*context.shape[:-2], -1)
    return tags.tag(dense(flat, self.wo.astype(cdt).reshape(flat.shape[-1], -1)), tags.OUT_PROJ)


def head_only(rounds: int) -> int:
    import jax
    import jax.numpy as jnp

    from zoo.model import next_token_loss

    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (1, 512, 512))
    head = jax.random.normal(k[1], (512, 32000)) / 512**0.5
    tokens = jax.random.randint(k[2], (1, 512), 0, 32000)
    fns = {}
    for name, loss in (("old loss (slices the logits)", _old_loss), ("new loss (zoo.model.next_token_loss)", next_token_loss)):
        def f(x, head, loss=loss):
            return loss(jnp.einsum("BTD,DV->BTV", x, head, preferred_element_type=jnp.float32), tokens)

        fns[name] = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        jax.block_until_ready(fns[name](x, head))
    outs = [fns[n](x, head) for n in fns]
    diff = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(outs[0]), jax.tree_util.tree_leaves(outs[1])))
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, g in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(g(x, head))
            times[n].append(time.perf_counter() - t)
    for n, ts in times.items():
        print(f"{n}: median {1e3 * statistics.median(ts):.1f} ms over {rounds}")
    print(f"largest difference in loss and gradients: {diff}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="none")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--part", choices=("step", "head"), default="step")
    args = ap.parse_args(argv)
    if args.part == "head":
        return head_only(args.rounds if args.rounds != 5 else 15)

    import jax

    import zoo.model as zm
    import zoo.nn.attention as za
    import zoo.nn.mlp as zmlp
    from zoo.config import flops_per_token

    original = (zm.next_token_loss, zmlp.SwiGLU.__call__, za.GQAttention.__call__)

    def use(v):
        zm.next_token_loss = _old_loss if v == 0 else original[0]
        zmlp.SwiGLU.__call__ = _einsum_swiglu if v <= 1 else original[1]
        za.GQAttention.__call__ = _dense_attention if v == 3 else original[2]

    model = C.bench_model("llama_100m")
    env = C.env_info(jax.devices()[:1])
    print(f"{env['date_utc']}, {env['host_cpu']}, load {env['load_average']}, jax {env['versions']['jax']}; llama_100m, {args.preset}, batch 1 x 512")
    exes, trainers = {}, {}
    for v in range(4):
        use(v)
        tr = C.make_trainer(C.train_config(model, [args.preset], 1, 512))
        exes[v], kept, _ = C.trace_and_compile(tr)
        trainers[v] = tr
        print(f"variant {v}: tags on device {kept['device_bytes'] / 1e6:.1f} MB, untagged residuals {kept['untagged_device_bytes'] / 1e6:.1f} MB")
    use(2)
    state = trainers[0].init()
    tokens = C.tokens_for(trainers[0])
    for v, exe in exes.items():
        _, m = exe(jax.tree.map(lambda a: a.copy(), state), tokens)
        print(f"variant {v}: loss {float(m['loss']):.6f}, grad norm {float(m['grad_norm']):.6f}")
    times = {v: [] for v in exes}
    for _ in range(args.rounds):
        for v, exe in exes.items():
            t = time.perf_counter()
            state, m = exe(state, tokens)
            jax.block_until_ready((state, m))
            times[v].append(time.perf_counter() - t)
    flops = flops_per_token(model, 512) * 512
    for v, ts in times.items():
        med = statistics.median(ts)
        print(f"variant {v}: median {med:.3f} s ({flops / med / 1e9:.1f} GFLOP/s); steps {', '.join(f'{t:.2f}' for t in ts)}")
    if args.profile:
        for v in (0, 2):
            prof, state = C.profile_step(exes[v], state, tokens)
            top = [o for o in prof["top_ops"] if o["category"] != "matmul"][:3]
            print(f"variant {v} profile: step {prof['step_wall_s']:.3f} s; " + "; ".join(f"{o['op']} ({o['source']}, {o['shape']}) {o['s']:.3f} s" for o in top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
