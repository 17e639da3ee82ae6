"""In-process A/B of the MoE step's per-parameter work (docs/benchmarks.md, "The MoE's per-parameter work").

    python bench/ab_moe.py ROUNDS VARIANT [VARIANT ...]
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=dot python bench/ab_moe.py 5 base einsum_experts keep_weight_casts

The step is bench/cpu.py's `dsv3_100m` (bfloat16 compute over float32 weights, capacity experts, batch
1 x 512) under a preset (`--preset`, default `none`). A variant is `+`-joined parts: `base` (the code as
it is), `einsum_experts` (the routed experts' matmul as the plain einsum, whose weight gradient jax
writes transposed: the code before `zoo.nn.moe_dispatch.expert_matmul`), `keep_weight_casts` (no
checkpoint for `checkpoint: false`, so the backward keeps the bfloat16 casts of every layer's weights:
the code before `zoo.offload.keep_all_but_weight_casts`), `transposed_head` (the LM head's weight gradient in
the fused loss as a product over the transposed hidden states, which `zoo.loss.head_gradient` does for
float32 models only), `plain_glu` (the gated activations, of the experts and of the dense MLPs, with JAX's own
derivative instead of `zoo.nn.mlp.gated`'s). Each variant patches before its own trace and
compile; the variants' steps then alternate (order reversed every round) from copies of one initial
state. Prints each one's loss and gradient norm after one step, its median step, its per-round ratio to
the first variant, and the compiled temp bytes.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common as C  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", type=int)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--preset", default="none")
    ap.add_argument("--model", default="dsv3_100m")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from zoo import loss
    from zoo.nn import mlp, moe_dispatch

    original, original_head, original_gated = moe_dispatch._buffer_matmul, loss.head_gradient, moe_dispatch.gated

    def transposed_head(h, d_logits):
        return jnp.einsum("DC,CV->DV", jax.lax.optimization_barrier(h.T), d_logits, preferred_element_type=jnp.float32)
    model = C.bench_model(args.model, moe_impl="capacity")
    compiled, trainers = {}, {}
    for v in args.variants:
        parts = set(v.split("+"))
        unknown = parts - {"base", "einsum_experts", "keep_weight_casts", "transposed_head", "plain_glu"}
        if unknown:
            sys.exit(f"bench/ab_moe.py: unknown variant part(s) {sorted(unknown)}; the parts are base, einsum_experts, keep_weight_casts, transposed_head, plain_glu")
        moe_dispatch._buffer_matmul = (lambda h, w: jnp.einsum("ECD,EDF->ECF", h, w)) if "einsum_experts" in parts else original
        loss.head_gradient = transposed_head if "transposed_head" in parts else original_head
        moe_dispatch.gated = mlp.gated = (lambda fn, gate, up: fn(gate, up)) if "plain_glu" in parts else original_gated
        tr = C.make_trainer(C.train_config(model, [args.preset], 1, 512))
        if "keep_weight_casts" in parts:
            tr.policy = None
        t0 = time.perf_counter()
        compiled[v], _, _ = C.trace_and_compile(tr)
        trainers[v] = tr
        mem = C.compiled_memory(compiled[v])
        print(f"{v}: compiled in {time.perf_counter() - t0:.1f}s, temp {mem['temp_size_in_bytes'] / 1e6:.1f} MB", flush=True)
    moe_dispatch._buffer_matmul, loss.head_gradient = original, original_head
    moe_dispatch.gated = mlp.gated = original_gated

    state0 = trainers[args.variants[0]].init()
    tokens = C.tokens_for(trainers[args.variants[0]])
    states = {}
    for v in args.variants:  # one warm-up step each, from the same state
        s, m = compiled[v](jax.tree.map(jnp.copy, state0), tokens)
        jax.block_until_ready(m)
        states[v] = s
        print(f"{v}: loss {float(m['loss']):.6f}, grad norm {float(m['grad_norm']):.6f}", flush=True)
    times = {v: [] for v in args.variants}
    for r in range(args.rounds):
        order = args.variants if r % 2 == 0 else args.variants[::-1]
        for v in order:
            t = time.perf_counter()
            states[v], m = compiled[v](states[v], tokens)
            jax.block_until_ready(m)
            times[v].append(time.perf_counter() - t)
        print(f"round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.3f}s" for v in args.variants), flush=True)
    first = args.variants[0]
    print("| variant | median step | per-round ratio to " + first + " |\n|---|---:|---|")
    for v in args.variants:
        ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(times[v], times[first]))
        print(f"| {v} | {statistics.median(times[v]):.3f} s | {ratios} |")


if __name__ == "__main__":
    main()
