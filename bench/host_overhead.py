"""Per-step host overhead of train.py's loop: the synchronous loop (read each step's metrics before
building the next batch and dispatching the next step) against the pipelined one (zoo.train.run.StepLoop:
step k+1 dispatched, and batch k+2 built and put on the devices, before step k's metrics are read).

    python bench/host_overhead.py                      # llama_tiny_a, batch 8 x 64, 5 rounds of 30 steps
    python bench/host_overhead.py model=dsv3_tiny_a data.seq_len=128 --rounds 3 --steps 20

Both loops are the same code (`StepLoop(..., pipelined=False)` is the old order), with train.py's
own metrics.jsonl writing and progress bookkeeping. A third variant, `device`, dispatches the same
steps back to back on batches built beforehand and waits once at the end: the device-bound step time.
Each round runs all three in a rotated order on one compiled step, so load from other processes hits
them alike; per variant the median over rounds of the mean step time. Host overhead per step =
step time - the device-bound step time; and, robust to other processes' load, the loop thread's own
CPU time per step (building and placing batches, dispatching, reading and logging metrics): the
work the synchronous loop adds to every step and the pipelined one overlaps with the step.
Extra arguments are train.py overrides.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULTS = ["model=llama_tiny_a", "mesh=single", "xla.cpu_devices=1", "data.batch_size=8", "data.seq_len=64", "trainer.progress=false"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="steps per variant per round")
    args, overrides = ap.parse_known_args()

    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose("config", overrides=[*DEFAULTS, *overrides, f"trainer.steps={args.rounds * args.steps * 3 + 1}"])

    import jax

    from zoo.train.data import make_data
    from zoo.train.run import Batches, StepLog, StepLoop, prepare
    from zoo.train.step import Trainer
    from zoo.train.stop import StopSignals

    c, plan, devices, _ = prepare(cfg)
    trainer = Trainer(c, plan, devices)
    data = make_data(c)
    state = trainer.init()
    compiled = trainer.compile(state, trainer.shard_tokens(data.batch(0)))
    state, m = compiled(state, trainer.shard_tokens(data.batch(0)))  # warm up
    jax.block_until_ready(m)
    out = Path(tempfile.mkdtemp(prefix="host_overhead_"))
    log = StepLog(c, out, 0, len(devices[:1]), devices[:1], show=False)
    step = 1
    host_cpu = {False: [], True: []}  # this thread's CPU time per step: the host's own work

    def loop(pipelined: bool):
        nonlocal state, step
        run = StepLoop(compiled, Batches(data, trainer), log, None, StopSignals(), step + args.steps, every=1, pipelined=pipelined)
        t, cpu = time.perf_counter(), time.thread_time()
        state = run.run(state, step)
        step += args.steps
        host_cpu[pipelined].append((time.thread_time() - cpu) / args.steps)
        return (time.perf_counter() - t) / args.steps

    def device():
        nonlocal state, step
        tokens = [trainer.shard_tokens(data.batch(s)) for s in range(step, step + args.steps)]
        jax.block_until_ready(tokens)
        t = time.perf_counter()
        for tok in tokens:
            state, m = compiled(state, tok)
        jax.block_until_ready((state, m))
        step += args.steps
        return (time.perf_counter() - t) / args.steps

    variants = {"device": device, "sync": lambda: loop(False), "pipelined": lambda: loop(True)}
    names = list(variants)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names[r % 3 :] + names[: r % 3]:
            times[n].append(variants[n]())
    log.close()
    med = {n: statistics.median(t) for n, t in times.items()}
    over = {n: med[n] - med["device"] for n in ("sync", "pipelined")}
    print(f"{c.model.family} {c.data.batch_size}x{c.data.seq_len} on {devices[0].platform}, {args.rounds} rounds x {args.steps} steps")
    cpu = {"sync": statistics.median(host_cpu[False]), "pipelined": statistics.median(host_cpu[True])}
    print("| loop | step (ms) | step - device-bound step (ms) | step / device-bound step | host thread CPU per step (ms) |")
    print("|---|---|---|---|---|")
    for n in names:
        o = f"{1e3 * over[n]:.2f}" if n in over else "0 (by definition)"
        h = f"{1e3 * cpu[n]:.2f}" if n in cpu else "-"
        print(f"| {n} | {1e3 * med[n]:.2f} | {o} | {med[n] / med['device']:.3f} | {h} |")
    ratio = over["pipelined"] / over["sync"] if over["sync"] > 0 else float("nan")
    print(f"pipelined / sync: step {med['pipelined'] / med['sync']:.3f}, host overhead {ratio:.3f}")


if __name__ == "__main__":
    main()
