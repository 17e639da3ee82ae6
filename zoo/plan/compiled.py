"""The planner's candidates compiled by XLA for the target (plan.compile) and timed on it
(plan.measure): `checked_search` picks candidates by the estimate and XLA's compiled peak,
`Compiler` builds and compiles the step as train.py would."""

import contextlib
import dataclasses
import math
import re
import time
from typing import Callable, Optional


from zoo.backend import libtpu_installed
from zoo.offload import policy_from_label
from zoo.plan.cost import evaluate
from zoo.plan.options import PlanConfig
from zoo.plan.policies import preset_assignment, to_offload_config
from zoo.plan.problem import Estimate, Infeasible, PlanError, Problem, fmt_bytes
from zoo.plan.search import describe, search, state_hint

# The planner's candidates compiled by XLA for the target (`python -m zoo.tools.plan plan.compile=N`).
#
# The planner's HBM model is a sum of holders; the compiler's peak is a schedule with reuse and padding.
# On a TPU v5e the two differ by -34..+35% over 48 runs (docs/benchmarks.md, "TPU v5e"), so an estimate
# alone can refuse a batch that runs or pick a policy that does not fit. With `plan.compile=N` the
# planner compiles (never runs) up to N candidates for the target and keeps the fastest whose compiled
# peak fits:
#
# 1. search with the HBM budget; compile the pick and read XLA's peak (`estimated_peak_bytes`: on a
#    TPU the compiler's simulated heap, which is what decides an out-of-memory there);
# 2. the ratio compiled / estimated is the model's error near that policy: search again with the budget
#    divided by it (a model that overstates gets room, one that understates loses it), and compile
#    that pick, until a pick repeats or N are compiled.
#
# Where a compile is possible: on the target itself (a TPU on a TPU, the CPU for `hardware=cpu`), and for
# a TPU on any machine with libtpu installed (ahead of time, for the chip's topology; the same compiler,
# so the same figures). A GPU target needs its GPU.

# The chip grid jax.experimental.topologies is asked for, by the number of devices planned for.
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
    # Bytes of the values XLA rematerialized to stay within its memory limit (zoo.hlo.rematerialized):
    # its peak is then that of a program holding less than the one the estimate counts.
    rematerialized_bytes: Optional[float] = None

    def fits(self, budget: float) -> bool:
        """Within the budget as compiled, and as written within REMAT_SLACK of it: XLA's rematerializing
        a little near its limit is cheap, a lot is not."""
        written = self.compiled_peak + (self.rematerialized_bytes or 0.0)
        return self.compiled_peak <= budget and written <= REMAT_SLACK * budget


# How far over the budget a compiled program may be as written (XLA's peak plus what it rematerialized
# to fit) and still count as fitting. On a TPU v5e, dsv3_100m: within 1.1 and timed, `minimal` at
# 28 x 4096 (1.47 GB rematerialized, +1.5%), `full:context=device` at 84 x 4096 (2.14 GB, +7.6%; the
# fastest there), `full:context=offload` at 90 x 4096 (0.64 GB, +0.2%; the fastest there); beyond it,
# five tags offloaded at 90 x 4096 (4.18 GB, +19%), 1.44x the fastest (docs/benchmarks.md).
REMAT_SLACK = 1.1


def candidate_key(e: Estimate) -> tuple:
    return tuple(sorted(e.assignment.items()))


def checked_search(p: Problem, compile_peak: Callable[[Estimate], tuple[float, float]], n: int) -> list[Checked]:
    """Up to `n` candidates compiled (`compile_peak(estimate) -> (peak bytes, seconds)`), in the order tried.

    When the search has nothing new to offer (its pick at the scaled budget was compiled already)
    and that pick offloads, it searches on among the policies that recompute in place of offloading:
    offloads can hold more device memory than the estimate's one layer in flight (on a TPU v5e,
    dsv3_100m at 84 x 4096 compiled to 16.65 GB as written with its attention output sent to host and
    to 12.84 GB with it recomputed; the estimate's smallest there once, offloading seven tags,
    compiled to 18.78 GB: docs/benchmarks.md), so where the estimate's smallest offloads, a policy
    without offloads may fit where it did not.

    Last, from the fastest candidate that fits, it offloads one of the tags that candidate recomputes,
    the estimate's fastest first, until one fits: an offload in place of a recompute adds no kept
    bytes, only in-flight ones (on the same chip and batch, `full` with the attention output
    offloaded compiled within the budget and ran 3.0% faster than `full`)."""
    tried: list[Checked] = []
    budget = p.budget
    space = p
    while len(tried) < n:
        try:
            e = search(dataclasses.replace(space, budget=budget))
        except Infeasible as why:  # the smallest the model knows: compile it, XLA may disagree
            e = why.best
        if any(candidate_key(c.estimate) == candidate_key(e) for c in tried):
            if space is not p or not any(a == "offload" for a in e.assignment.values()):
                break
            space = _without_offload(p)
            continue
        peak, secs = compile_peak(e)
        tried.append(Checked(e, peak, secs, rematerialized_bytes=_rematerialized(compile_peak, e)))
        if not math.isfinite(peak):
            budget = min(budget, e.peak_bytes) * 0.9  # out of memory without a figure: ask for less
        else:
            # Against the program as written: XLA's peak after it rematerialized values to fit is not
            # what the estimate counts (TPU v5e, llama_1b's layers at 12 x 2048: a candidate estimated at
            # 15.99 GB compiled to 16.43 with 3.15 GB rematerialized; scaled by the peak alone, the next
            # three candidates kept as much and none fitted).
            budget = p.budget * e.peak_bytes / (peak + (tried[-1].rematerialized_bytes or 0.0))
    base = chosen(tried, p.budget)
    if base is None:
        return tried
    done = {candidate_key(c.estimate) for c in tried}
    offloading_one = [
        evaluate(p, {**base.estimate.assignment, t.tag: "offload"})
        for t in p.tags
        if base.estimate.assignment.get(t.tag) == "remat" and "offload" in t.choices
    ]
    for e in sorted(offloading_one, key=lambda e: e.time_s):
        if len(tried) >= n or e.time_s >= base.estimate.time_s:
            break
        if candidate_key(e) in done:
            continue
        tried.append(Checked(e, *compile_peak(e)))
        tried[-1].rematerialized_bytes = _rematerialized(compile_peak, e)
        if tried[-1].fits(p.budget):  # the fastest of the rest by the estimate: none after it would be picked
            break
    return tried


def _rematerialized(compile_peak, e: Estimate) -> Optional[float]:
    """What XLA rematerialized in `e`'s compiled program, where the compiler records it (`Compiler`)."""
    return getattr(compile_peak, "rematerialized", {}).get(candidate_key(e))


def _without_offload(p: Problem) -> Problem:
    """`p` with no tag offloaded (those that cannot be recomputed stay on device)."""
    return dataclasses.replace(
        p, tags=[dataclasses.replace(t, choices=tuple(c for c in t.choices if c != "offload")) for t in p.tags]
    )


def chosen(tried: list[Checked], budget: float) -> Optional[Checked]:
    """The fastest candidate whose compiled peak fits (measured where they were, else by the
    estimate); None if none fits."""
    fits = [c for c in tried if c.fits(budget)]
    if any(c.measured_s is not None for c in fits):
        return min((c for c in fits if c.measured_s is not None), key=lambda c: c.measured_s)
    return min(fits, key=lambda c: (c.estimate.time_s, c.compiled_peak)) if fits else None


def checked_table(tried: list[Checked], budget: float, where: str) -> str:
    measured = any(c.measured_s is not None for c in tried)
    remat = any(c.rematerialized_bytes for c in tried)
    rows = [
        (
            "",
            "estimated step",
            *(["measured step"] if measured else []),
            "estimated HBM",
            "XLA's HBM",
            *(["XLA rematerialized"] if remat else []),
            "fits",
            "policy",
        )
    ]
    pick = chosen(tried, budget)
    for c in tried:
        step = [f"{1e3 * c.measured_s:.1f} ms" if c.measured_s is not None else "-"] if measured else []
        rematerialized = [fmt_bytes(c.rematerialized_bytes) if c.rematerialized_bytes else "-"] if remat else []
        rows.append(
            (
                "*" if c is pick else "",
                f"{1e3 * c.estimate.time_s:.1f} ms",
                *step,
                fmt_bytes(c.estimate.peak_bytes),
                fmt_bytes(c.compiled_peak) if math.isfinite(c.compiled_peak) else "out of memory",
                *rematerialized,
                "yes" if c.fits(budget) else "no",
                (f"{c.label} = " if c.label else "") + describe(c.estimate.assignment),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    note = (
        "\nXLA rematerialized values to fit its memory limit where a size is given: its HBM is that of a "
        "program holding less than the one estimated (and recomputing more); one that needed more than "
        f"{REMAT_SLACK:g}x the budget as written does not count as fitting"
        if remat
        else ""
    )
    return f"compiled by XLA ({where}; HBM budget {fmt_bytes(budget)}):\n" + "\n".join(lines) + note


_OOM = re.compile(r"Used ([\d.]+)([KMGT]?) of [\d.]+[KMGT]? hbm|\(([\d.]+)([KMGT]?)i?B?\) exceeds available HBM")
_SCALE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def oom_bytes(error: BaseException) -> Optional[float]:
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


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


@contextlib.contextmanager
def compile_target(c, platform: str, devices):
    """(devices, description) to compile for `platform` on this machine; PlanError (one line) where it
    cannot. A TPU off a TPU: the chip's topology from libtpu."""
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
    if not libtpu_installed():
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

    # The xla group's TPU flags reach this compile only if they were set before JAX started (libtpu reads
    # them once, then): zoo.train.run.apply_xla_flags, which main's start_jax calls, does so.
    chip = c.hardware.name.removeprefix("tpu_")
    shape = _TOPOLOGY_SHAPES[n]
    bounds = (1, 1, 1) if n == 1 else (2, 2, 1)
    try:
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{chip}:{shape}", chips_per_host_bounds=bounds
        )
    except Exception as e:  # noqa: BLE001 - a libtpu that does not start: one line, not its traceback
        raise PlanError(
            f"plan.compile: libtpu could not describe a {chip} {shape} ({type(e).__name__}: {_first_line(e)[:160]}); "
            "reinstall libtpu (pip install libtpu), plan on the TPU, or drop plan.compile"
        ) from e
    with lowering_for("tpu"):
        yield list(topo.devices)[:n], f"ahead of time for a {chip} {shape} on this {here}, libtpu"


class Compiler:
    """Candidates' steps as train.py builds them (the run's config with the candidate's policy),
    lowered on abstract inputs and compiled; the executables are kept for `measure`."""

    def __init__(self, c, plan, devices, name: str, platform: str):
        self.c, self.plan, self.devices, self.name, self.platform = c, plan, devices, name, platform
        self.compiled: dict[tuple, tuple] = {}  # candidate key -> (trainer, executable)
        self.rematerialized: dict[tuple, float] = {}  # candidate key -> bytes XLA rematerialized

    def __call__(self, e: Estimate, policy=None) -> tuple[float, float]:
        """(XLA's peak bytes per device, seconds to compile) of the estimate's assignment, or of the
        OffloadConfig `policy` given (`none`, which no assignment is)."""
        from zoo.hlo import rematerialized
        from zoo.train.metrics import compiled_memory
        from zoo.train.step import Trainer

        c = self.c
        if policy is None:
            policy = to_offload_config(e, self.name, c.offload.params, c.offload.opt_state)
            policy = dataclasses.replace(policy, ranges=c.offload.ranges)
        trainer = Trainer(dataclasses.replace(c, offload=policy), self.plan, self.devices)
        t = time.perf_counter()
        try:
            exe = trainer.lower().compile(trainer.compiler_options)
        except Exception as why:  # noqa: BLE001 - XLA's out-of-memory is an answer; anything else is not
            got = oom_bytes(why)
            if got is None:
                raise
            return got, time.perf_counter() - t
        mem = compiled_memory(exe, self.platform) or {}
        got = mem.get("estimated_peak_bytes")
        if got is None:
            raise PlanError(f"plan.compile: XLA for {self.platform} reports no memory analysis here; drop plan.compile")
        self.compiled[candidate_key(e)] = (trainer, exe)
        self.rematerialized[candidate_key(e)] = float(sum(v.bytes for v in rematerialized(exe.as_text())))
        return float(got), time.perf_counter() - t

    def measure(self, tried: list[Checked], budget: float, steps: int, rounds: int = 2, echo=print) -> None:
        """Run every candidate that fits for `steps` timed steps (after one warm-up) per round, the
        candidates in alternation (a drift of the machine falls on all alike), on one state and one
        batch of random tokens; sets each one's median `measured_s`."""
        import statistics

        import jax
        import numpy as np

        runs = [
            (t, *self.compiled[candidate_key(t.estimate)])
            for t in tried
            if t.fits(budget) and candidate_key(t.estimate) in self.compiled
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


def compile_hint(c) -> str:
    """The refusal's pointer to `plan.compile` where the target's compiler can run here: the estimate
    counts the program as written, and near its memory limit XLA rematerializes values to fit (on a
    v5e dsv3_100m's `full:context=device` at 84 x 4096: 19.15 GB estimated, 16.05 GB compiled, 2.14 GB
    rematerialized)."""
    import jax

    platform = c.hardware.platform or jax.default_backend()
    if platform != jax.default_backend() and platform != "tpu":
        return ""  # a GPU's program compiles on its GPU only
    needs = " (with libtpu installed: pip install libtpu)" if platform == "tpu" and not libtpu_installed() else ""
    return (
        "; that is the program as written, and XLA may rematerialize values to fit it: plan.compile=4 asks the "
        f"compiler{needs}"
    )


def compile_count(opts: PlanConfig, c) -> int:
    """`plan.compile`, its default (null) resolved: 4 for a TPU target whose compiler is on this
    machine (the estimate alone is -17..+11% off XLA's peak on a v5e, and misses what offloading
    several tags costs: docs/benchmarks.md), else 0."""
    import jax

    if opts.compile is not None:
        return opts.compile
    if c.hardware.platform != "tpu":
        return 0
    return 4 if jax.default_backend() == "tpu" or libtpu_installed() else 0


# The recompute-only presets, and the attention output's offload on top of two of them, that
# `plan.measure` times beside the planner's own candidates (labels of `policy_from_label`). On a
# v5e the context's offload won where keeping it did not fit (llama_1b's layers at long rows:
# minimal_context_offloaded) and beat recomputing it (dsv3_100m at 68 and 84 x 4096:
# full:context=offload, 0.96-0.97x full; docs/benchmarks.md, "TPU v5e").
MEASURED_PRESETS = ("full", "save_qkv_proj", "minimal", "minimal_context_offloaded", "full:context=offload")


def none_candidate(p: Problem, compiler, tried: list[Checked], none: Optional[Estimate], c) -> None:
    """`none` (nothing checkpointed; its estimate `none`) compiled beside the candidates where it is
    estimated more than 1% faster than the fastest that fits: the search assigns tags under a
    checkpoint, and a checkpointed layer runs its forward again in the backward. Its HBM is XLA's to
    say: on a TPU v5e, DeepSeek-V3's layer (MLA at 7168 wide, four experts of 2048) at 2 x 4096, `none`
    compiled to 14.70 GB where the estimate counted 18.24, and ran 0.76x `full`'s step
    (docs/bench_maxtext.json)."""
    base = chosen(tried, p.budget)
    if none is None or (base is not None and none.time_s >= 0.99 * base.estimate.time_s):
        return
    policy = dataclasses.replace(policy_from_label("none"), params=c.offload.params, opt_state=c.offload.opt_state)
    peak, secs = compiler(none, policy)
    tried.append(Checked(none, peak, secs, label="none", rematerialized_bytes=_rematerialized(compiler, none)))


def compile_checked(p: Problem, c, step_plan, devices, opts: PlanConfig, echo=print, none: Optional[Estimate] = None):
    """(estimate, `Checked`, every candidate tried) of the fastest of up to `plan.compile` candidates
    whose compiled peak fits, and `none` where its estimate `none` is faster (`none_candidate`);
    PlanError (one line) when none does. Its progress and the candidates' table go to `echo` (print's
    signature)."""
    import jax

    platform = c.hardware.platform or jax.default_backend()
    if opts.measure and platform != jax.default_backend():
        raise PlanError(
            f"plan.measure: it runs the candidates, so it needs the target ({platform}) here, not "
            f"{jax.default_backend()}; drop plan.measure to compile only"
        )
    with compile_target(c, platform, devices) as (target, where):
        echo(f"compiling up to {opts.compile} candidate policies ({where}) ...", flush=True)
        compiler = Compiler(c, step_plan, target, opts.name, platform)
        tried = checked_search(p, compiler, opts.compile)
        none_candidate(p, compiler, tried, none, c)
        if opts.measure:
            seen = {candidate_key(t.estimate) for t in tried}
            for name in MEASURED_PRESETS:
                e = evaluate(p, preset_assignment(p, policy_from_label(name), c.model))
                if candidate_key(e) not in seen:
                    seen.add(candidate_key(e))
                    peak, secs = compiler(e)
                    tried.append(Checked(e, peak, secs, label=name, rematerialized_bytes=_rematerialized(compiler, e)))
            echo(f"measuring {opts.measure} steps per round of each that fits ...", flush=True)
            compiler.measure(tried, p.budget, opts.measure, echo=echo)
    echo(checked_table(tried, p.budget, where))
    pick = chosen(tried, p.budget)
    if pick is None:
        least = min(tried, key=lambda t: t.compiled_peak)
        raise PlanError(
            f"plan.compile: none of the {len(tried)} policies compiled fits {fmt_bytes(p.budget)} per device; the "
            f"smallest, {describe(least.estimate.assignment)}, compiled to {fmt_bytes(least.compiled_peak)}; "
            f"{state_hint(p).removeprefix(', or ')}"
        )
    note = unmeasured_offload_note(pick, on_target=platform == jax.default_backend(), measured=bool(opts.measure))
    if note:
        echo(note)
    return pick.estimate, pick, tried


def unmeasured_offload_note(pick: Checked, *, on_target: bool, measured: bool) -> Optional[str]:
    """A line for a compiled pick that sends several tags to host and was not timed: on a TPU v5e
    (dsv3_100m at 90 x 4096) such a pick, compiled ahead of time to 15.90 GB with nothing
    rematerialized, compiled on the chip with 4.18 GB rematerialized and ran 1.44x the fastest policy
    there (docs/benchmarks.md, "The planner's candidates compiled and timed on the chip")."""
    offloaded = [t for t, a in pick.estimate.assignment.items() if a == "offload"]
    if measured or len(offloaded) < 2:
        return None
    where = "compiled ahead of time, not on the target, and " if not on_target else ""
    return (
        f"note: the pick sends {len(offloaded)} tags to host ({', '.join(offloaded)}), {where}not timed: the estimate "
        "and the compile can miss what several offloads cost; on the target, plan.measure=2 times it beside the presets"
    )
