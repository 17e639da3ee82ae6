"""What running the layers under `lax.scan` costs on CPU, against the same layers without it: bench/peer.py's
Llama step taken apart, in one process, each variant compiled first and then timed in alternation
(order reversed every round; medians). docs/benchmarks.md, "What the layer scan costs".

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python bench/scan_cost.py 100m 4

Variants, each the gradient of the sum of the last hidden state (wrt the weights and the input)
unless it says otherwise:

- `one_layer`: one decoder layer (printed with its time x the layer count);
- `scan`: the model's stack as it runs in train.py: stacked weights, one `lax.scan`;
- `static_slices`: the same stacked weights, a Python loop taking layer i's slice of each;
- `separate_weights`: a Python loop over the layers' weights as separate arrays (no stacking);
- `loss`: train.py's loss (embedding, the stack, the fused chunked loss), gradient wrt all weights;
- `step`: train.py's compiled step (the loss's gradient plus clipping and AdamW).
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peer import CONFIGS, zoo_train_config  # noqa: E402
from zoo.train.config import XlaConfig  # noqa: E402
from zoo.train.run import apply_xla_flags  # noqa: E402


def main(argv) -> int:
    if len(argv) != 2 or argv[0] not in CONFIGS or not argv[1].isdigit():
        print(f"usage: python bench/scan_cost.py {{{','.join(CONFIGS)}}} ROUNDS", file=sys.stderr)
        return 2
    apply_xla_flags(XlaConfig())  # train.py's XLA defaults, before JAX starts
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from bench import common as C

    d, rounds = CONFIGS[argv[0]], int(argv[1])
    trainer = C.make_trainer(zoo_train_config(d, "none", cpu_fast_compile=False))
    step = trainer.compile()
    state, tokens = trainer.init(), C.tokens_for(trainer)
    params = state["params"]
    x = jax.random.normal(jax.random.key(1), (d["batch"], d["seq"], d["hidden"]))
    positions = jnp.arange(d["seq"])
    stack = eqx.combine(params, trainer.static).stacks[0]
    stack_params, stack_static = eqx.partition(stack, eqx.is_array)
    stacked, layer_static = eqx.partition(stack.layers, eqx.is_array)  # one period position: Llama's one block
    layer_static, n = layer_static[0], d["layers"]
    layer_i = lambda weights, i: jax.tree.map(lambda a: a[i], weights)  # noqa: E731
    separate = [layer_i(stacked[0], i) for i in range(n)]

    def run_layers(layers, h):
        for w in layers:
            h = eqx.combine(w, layer_static)(h, positions)[0]
        return h

    def grad_of_sum(f):
        return jax.jit(jax.grad(lambda w, h: f(w, h).sum(), argnums=(0, 1)))

    variants = {
        "one_layer": (grad_of_sum(lambda w, h: run_layers([w], h)), (separate[0], x)),
        "scan": (grad_of_sum(lambda w, h: eqx.combine(w, stack_static)(h, positions)[0]), (stack_params, x)),
        "static_slices": (grad_of_sum(lambda w, h: run_layers([layer_i(w, i) for i in range(n)], h)), (stacked[0], x)),
        "separate_weights": (grad_of_sum(run_layers), (separate, x)),
        "loss": (jax.jit(jax.grad(lambda p, t: trainer.loss_and_aux(p, t)[0])), (params, tokens[0] if tokens.ndim == 3 else tokens)),
        # the step donates its state: each call gets a copy, made before the clock starts
        "step": (lambda s, t: step(s, t), (state, tokens)),
    }
    for name, (f, args) in variants.items():
        for _ in range(2):
            jax.block_until_ready(f(*(jax.tree.map(jnp.copy, args) if name == "step" else args)))
    times = {name: [] for name in variants}
    for r in range(rounds):
        for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            f, args = variants[name]
            args = jax.tree.map(jnp.copy, args) if name == "step" else args
            jax.block_until_ready(args)
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"{argv[0]} ({n} layers), medians of {rounds} rounds:")
    print(f"  one_layer x {n}: {med['one_layer'] * n * 1e3:.1f} ms")
    for name, t in med.items():
        print(f"  {name}: {t * 1e3:.1f} ms" + (f" ({t / med['scan']:.3f} of scan)" if name in ("static_slices", "separate_weights") else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
