"""The planner's candidates compiled by XLA for the target (`python -m zoo.tools.plan plan.compile=N`).

The planner's HBM model is a sum of holders; the compiler's peak is a schedule with reuse and padding.
On a TPU v5e the two differ by -12..+47% over 27 runs (docs/benchmarks.md, "TPU v5e"), so an estimate
alone can refuse a batch that runs or pick a policy that does not fit. With `plan.compile=N` the
planner compiles (never runs) up to N candidates for the target and keeps the fastest whose compiled
peak fits:

1. search with the HBM budget; compile the pick and read XLA's peak (`estimated_peak_bytes`: on a
   TPU the compiler's simulated heap, which is what decides an out-of-memory there);
2. the ratio compiled / estimated is the model's error near that policy: search again with the budget
   divided by it (a model that overstates gets room, one that understates loses it), and compile
   that pick, until a pick repeats or N are compiled.

Where a compile is possible: on the target itself (a TPU on a TPU, the CPU for `hardware=cpu`), and for
a TPU on any machine with libtpu installed (ahead of time, for the chip's topology; the same compiler,
so the same figures). A GPU target needs its GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import time
from typing import Callable, Optional

from zoo.tools.plan import Estimate, Infeasible, PlanError, Problem, _describe, _fmt_bytes, search, to_offload_config

# One chip's name in jax.experimental.topologies per hardware profile (tpu_<chip>).
_TOPOLOGY_SHAPES = {1: "1x1", 4: "2x2", 8: "2x4"}


@dataclasses.dataclass
class Checked:
    """One candidate: the planner's estimate and XLA's compiled peak (inf: XLA reported out of memory
    without a figure)."""

    estimate: Estimate
    compiled_peak: float
    compile_s: float
    label: str = ""  # a preset's name, for one compiled because `plan.measure` asked for the presets
    measured_s: Optional[float] = None  # the median step on the device (`plan.measure`)

    def fits(self, budget: float) -> bool:
        return self.compiled_peak <= budget


def _key(e: Estimate) -> tuple:
    return tuple(sorted(e.assignment.items()))


def checked_search(p: Problem, compile_peak: Callable[[Estimate], tuple[float, float]], n: int) -> list[Checked]:
    """Up to `n` candidates compiled (`compile_peak(estimate) -> (peak bytes, seconds)`), in the order tried."""
    tried: list[Checked] = []
    budget = p.budget
    for _ in range(n):
        try:
            e = search(dataclasses.replace(p, budget=budget))
        except Infeasible as why:  # the smallest the model knows: compile it, XLA may disagree
            e = why.best
        if any(_key(c.estimate) == _key(e) for c in tried):
            break
        peak, secs = compile_peak(e)
        tried.append(Checked(e, peak, secs))
        if not math.isfinite(peak):
            budget = min(budget, e.peak_bytes) * 0.9  # out of memory without a figure: ask for less
        else:
            budget = p.budget * e.peak_bytes / peak
    return tried


def chosen(tried: list[Checked], budget: float) -> Optional[Checked]:
    """The fastest candidate whose compiled peak fits (measured where they were, else by the
    estimate); None if none fits."""
    fits = [c for c in tried if c.fits(budget)]
    if any(c.measured_s is not None for c in fits):
        return min((c for c in fits if c.measured_s is not None), key=lambda c: c.measured_s)
    return min(fits, key=lambda c: (c.estimate.time_s, c.compiled_peak)) if fits else None


def table(tried: list[Checked], budget: float, where: str) -> str:
    measured = any(c.measured_s is not None for c in tried)
    rows = [
        ("", "estimated step", *(["measured step"] if measured else []), "estimated HBM", "XLA's HBM", "fits", "policy")
    ]
    pick = chosen(tried, budget)
    for c in tried:
        step = [f"{1e3 * c.measured_s:.1f} ms" if c.measured_s is not None else "-"] if measured else []
        rows.append(
            (
                "*" if c is pick else "",
                f"{1e3 * c.estimate.time_s:.1f} ms",
                *step,
                _fmt_bytes(c.estimate.peak_bytes),
                _fmt_bytes(c.compiled_peak) if math.isfinite(c.compiled_peak) else "out of memory",
                "yes" if c.fits(budget) else "no",
                (f"{c.label} = " if c.label else "") + _describe(c.estimate.assignment),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    return f"compiled by XLA ({where}; HBM budget {_fmt_bytes(budget)}):\n" + "\n".join(lines)


_OOM = re.compile(r"Used ([\d.]+)([KMGT]?) of [\d.]+[KMGT]? hbm|\(([\d.]+)([KMGT]?)i?B?\) exceeds available HBM")
_SCALE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _oom_bytes(error: BaseException) -> Optional[float]:
    """XLA's figure from its out-of-memory error at compile time (inf when it gives none); None when the
    error is something else."""
    s = str(error)
    if "RESOURCE_EXHAUSTED" not in s and "out of memory" not in s.lower():
        return None
    m = _OOM.search(s)
    if not m:
        return math.inf
    value, unit = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    return float(value) * _SCALE[unit]


@contextlib.contextmanager
def compile_target(c, platform: str, devices):
    """(devices, description) to compile for `platform` on this machine; PlanError (one line) where it
    cannot. A TPU off a TPU: the chip's topology from libtpu, with xla.tpu_flags set for its compiler."""
    import jax

    from zoo.backend import lowering_for

    here = jax.default_backend()
    if platform == here:
        yield devices, f"compiled on this {here}"
        return
    if platform != "tpu":
        raise PlanError(
            f"plan.compile: compiling for {platform} needs a {platform} here (this machine has {here}); "
            "run the plan there, or drop plan.compile"
        )
    if importlib.util.find_spec("libtpu") is None:
        raise PlanError(
            "plan.compile: compiling for a TPU off the chip needs libtpu (pip install libtpu); or plan on the TPU, "
            "or drop plan.compile"
        )
    n = len(devices)
    if n not in _TOPOLOGY_SHAPES:
        raise PlanError(
            f"plan.compile: ahead-of-time for {n} TPU chips is not set up here (1, 4 or 8 chips); plan on the TPU"
        )
    from jax.experimental import topologies

    from zoo.train.run import merged_tpu_flags

    if c.xla.tpu_flags and "LIBTPU_INIT_ARGS" not in os.environ:
        os.environ["LIBTPU_INIT_ARGS"] = merged_tpu_flags(c.xla, None)  # read once, when libtpu starts
    chip = c.hardware.name.removeprefix("tpu_")
    shape = _TOPOLOGY_SHAPES[n]
    bounds = (1, 1, 1) if n == 1 else (2, 2, 1)
    topo = topologies.get_topology_desc(platform="tpu", topology_name=f"{chip}:{shape}", chips_per_host_bounds=bounds)
    with lowering_for("tpu"):
        yield list(topo.devices)[:n], f"ahead of time for a {chip} {shape} on this {here}, libtpu"


class Compiler:
    """Candidates' steps as train.py builds them (the run's config with the candidate's policy),
    lowered on abstract inputs and compiled; the executables are kept for `measure`."""

    def __init__(self, c, plan, devices, name: str, platform: str):
        self.c, self.plan, self.devices, self.name, self.platform = c, plan, devices, name, platform
        self.compiled: dict[tuple, tuple] = {}  # candidate key -> (trainer, executable)

    def __call__(self, e: Estimate) -> tuple[float, float]:
        """(XLA's peak bytes per device, seconds to compile)."""
        from zoo.train.metrics import compiled_memory
        from zoo.train.step import Trainer

        c = self.c
        policy = to_offload_config(e, self.name, c.offload.params, c.offload.opt_state)
        policy = dataclasses.replace(policy, ranges=c.offload.ranges)
        trainer = Trainer(dataclasses.replace(c, offload=policy), self.plan, self.devices)
        t = time.perf_counter()
        try:
            exe = trainer.lower().compile(trainer.compiler_options)
        except Exception as why:  # noqa: BLE001 - XLA's out-of-memory is an answer; anything else is not
            got = _oom_bytes(why)
            if got is None:
                raise
            return got, time.perf_counter() - t
        mem = compiled_memory(exe, self.platform) or {}
        got = mem.get("estimated_peak_bytes")
        if got is None:
            raise PlanError(f"plan.compile: XLA for {self.platform} reports no memory analysis here; drop plan.compile")
        self.compiled[_key(e)] = (trainer, exe)
        return float(got), time.perf_counter() - t

    def measure(self, tried: list[Checked], budget: float, steps: int, rounds: int = 2, echo=print) -> None:
        """Run every candidate that fits for `steps` timed steps (after one warm-up) per round, the
        candidates in alternation (a drift of the machine falls on all alike), on one state and one
        batch of random tokens; sets each one's median `measured_s`."""
        import statistics

        import jax
        import numpy as np

        runs = [
            (t, *self.compiled[_key(t.estimate)]) for t in tried if t.fits(budget) and _key(t.estimate) in self.compiled
        ]
        if not runs:
            return
        first = runs[0][1]
        state = first.init()
        cfg = first.cfg
        rng = np.random.default_rng(0)
        tokens = first.shard_tokens(
            rng.integers(0, cfg.model.vocab_size, size=(cfg.data.batch_size, cfg.data.seq_len), dtype=np.int32)
        )
        times: dict[int, list[float]] = {id(t): [] for t, _, _ in runs}
        for r in range(rounds):
            for t, _, exe in runs:
                for i in range(1 + steps):
                    start = time.perf_counter()
                    state, metrics = exe(state, tokens)
                    jax.block_until_ready(metrics)
                    if i:
                        times[id(t)].append(time.perf_counter() - start)
            echo(f"measured round {r + 1}/{rounds} of {len(runs)} candidates")
        for t, _, _ in runs:
            t.measured_s = statistics.median(times[id(t)])
