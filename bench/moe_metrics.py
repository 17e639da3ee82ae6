"""The cost of the MoE metrics (`trainer.moe_metrics`: router entropy and correction-bias range per layer)
as a ratio of step time: the same train step compiled with them on and off, steps alternated in one
process from copies of one state, so a busy machine slows both alike.

    python bench/moe_metrics.py                                  # train.py's default run: dsv3_tiny_a, 16 x 64
    python bench/moe_metrics.py --rounds 60 model=dsv3_100m data.batch_size=2 data.seq_len=256

Overrides are train.py's (Hydra); `mesh=single` and `trainer.moe_metrics` are set here. Compiled as
train.py compiles (`xla.cpu_fast_compile`, default auto: set `xla.cpu_fast_compile=false` for the
optimised program of a long run). Prints XLA's FLOP count of each program, each side's median step,
the ratio of the medians, and the median and quartiles of the per-round ratios (on / off; each round
runs both, the order alternating).
The step's own timing here includes neither the TensorBoard histograms (host side, only with
trainer.tensorboard=true) nor the progress line's check (a max over a list, per logged step).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds, each one step of each side (default 40)")
    ap.add_argument("overrides", nargs="*", help="train.py overrides, e.g. model=dsv3_tiny_a data.batch_size=16")
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from zoo.tools.kit import compose
    from zoo.train.run_config import load

    compiled, trainers, compile_s = {}, {}, {}
    for on in (True, False):
        c = load(compose([*a.overrides, "mesh=single", f"trainer.moe_metrics={str(on).lower()}"]))
        tr = C.make_trainer(c)
        t = time.perf_counter()
        compiled[on] = tr.lower().compile(tr.compiler_options)
        compile_s[on] = time.perf_counter() - t
        trainers[on] = tr
    c = trainers[True].cfg
    state0 = trainers[True].init()
    tokens = C.tokens_for(trainers[True])
    states, times, keys = {}, {True: [], False: []}, {}
    for on in (True, False):  # a warm-up step each, from the same state
        s, m = compiled[on](jax.tree.map(jnp.copy, state0), tokens)
        jax.block_until_ready(m)
        states[on], keys[on] = s, set(m)
    ratios = []
    for r in range(a.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            t = time.perf_counter()
            states[on], m = compiled[on](states[on], tokens)
            jax.block_until_ready((states[on], m))
            times[on].append(time.perf_counter() - t)
        ratios.append(times[True][-1] / times[False][-1])
    on_s, off_s = statistics.median(times[True]), statistics.median(times[False])
    q = statistics.quantiles(ratios, n=4)
    print(
        f"model {c.model.family} ({c.model.num_moe_layers} MoE layers x {c.model.moe.n_routed_experts} experts), "
        f"batch {c.data.batch_size} x {c.data.seq_len}, {a.rounds} rounds, compile {compile_s[True]:.1f}s on / "
        f"{compile_s[False]:.1f}s off"
    )
    print(f"metrics only with moe_metrics on: {', '.join(sorted(keys[True] - keys[False]))}")
    cost = {on: C.compiled_flops(compiled[on]) for on in (True, False)}
    if cost[True] and cost[False]:
        print(
            f"XLA cost analysis FLOPs per step: on {cost[True]:.6g}, off {cost[False]:.6g}, ratio "
            f"{cost[True] / cost[False]:.6f}"
        )
    print(f"median step: moe_metrics on {1e3 * on_s:.2f} ms, off {1e3 * off_s:.2f} ms, ratio {on_s / off_s:.3f}")
    print(f"per-round ratio on/off: median {statistics.median(ratios):.3f} (p25 {q[0]:.3f}, p75 {q[2]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
