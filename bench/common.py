"""What bench/cpu.py and bench/gpu.py share: configs built from the dataclasses (no Hydra), the
project's own train step (`zoo.train.step.Trainer`), what each tag costs the backward pass, the
machine's description, and a per-op profile of one compiled step.

Nothing here imports Hydra, so the GPU image (which has no hydra-core) only needs omegaconf and its
antlr4 runtime carried as wheels (zoo.train.run_config reads configs through omegaconf); see
bench/gpu_wheels.sh.
"""

import contextlib
import dataclasses
import datetime
import gzip
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Callable, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/cpu.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(ROOT))


def xla_group_flags(name: str) -> list[str]:
    """The flags of conf/xla/<name>.yaml (read with PyYAML: no omegaconf needed before JAX starts)."""
    import yaml

    path = ROOT / "conf" / "xla" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"xla group {name!r}: no {path}; choose one of {', '.join(known)}")
    return list(yaml.safe_load(path.read_text()).get("flags") or [])


def bench_model(name: str, **changes):
    """A zoo.families.SIZES entry with `changes` applied; `moe_impl=...` sets model.moe.impl and
    `moe_experts=...` model.moe.n_routed_experts (a model cut to fit one device)."""
    from zoo.families import SIZES

    moe = {k: changes.pop(f"moe_{k}") for k in ("impl", "experts") if f"moe_{k}" in changes}
    m = SIZES[name].replace(**changes)
    if moe and m.moe is not None:
        fields = {"impl": moe.get("impl", m.moe.impl), "n_routed_experts": moe.get("experts", m.moe.n_routed_experts)}
        m = m.replace(moe=dataclasses.replace(m.moe, **fields))
    return m


def train_config(
    model,
    presets: Sequence[str],
    batch: int,
    seq: int,
    *,
    steps: int = 100,
    hardware=None,
    xla_name: str = "default",
    fast_compile: bool = False,
):
    """train.py's TrainConfig for one run, built from the dataclasses directly.

    `presets`: conf/offload presets merged in order, as `offload=[a,b]` does. Uniform tokens (nothing
    to learn: throughput only), full LLVM optimisation on CPU unless `fast_compile` (smoke tests)."""
    from zoo.offload import load_preset
    from zoo.train.run_config import (
        DataConfig,
        HardwareConfig,
        MeshConfig,
        OptimizerConfig,
        TrainConfig,
        TrainerConfig,
        XlaConfig,
    )

    return TrainConfig(
        model=model,
        mesh=MeshConfig(),
        offload=load_preset(*presets),
        optimizer=OptimizerConfig(),
        data=DataConfig(name="uniform", batch_size=batch, seq_len=seq),
        xla=XlaConfig(name=xla_name, flags=xla_group_flags(xla_name), cpu_fast_compile=fast_compile),
        trainer=TrainerConfig(steps=steps, progress=False),
        hardware=hardware or HardwareConfig(),
    )


def make_trainer(c, devices=None):
    """Validate (the same cross-group checks as train.py) and build the project's Trainer."""
    import jax

    from zoo.model import abstract
    from zoo.offload import resolve
    from zoo.train.run_config import validate
    from zoo.train.step import Trainer

    devices = devices or jax.devices()[:1]
    plan = validate(c, len(devices), abstract(c.model))
    resolve(c.offload, c.model)
    return Trainer(c, plan, devices)


def tokens_for(trainer, seed: int = 0):
    """A uniform batch, sharded as the step wants it."""
    import numpy as np

    c = trainer.cfg
    rng = np.random.default_rng(seed)
    return trainer.shard_tokens(
        rng.integers(0, c.model.vocab_size, size=(c.data.batch_size, c.data.seq_len), dtype=np.int32)
    )


def trace_lower(trainer):
    """Trace the step on abstract inputs (nothing allocated), read where every tag went (`kept_by_tag`),
    and lower it. Returns (lowered, kept, seconds)."""
    from zoo import model as zoo_model
    from zoo.placement import placement_from_jaxpr, stack_names

    t0 = time.perf_counter()
    traced = trainer.jitted_step().trace(trainer.abstract_state(), trainer.abstract_tokens())
    placement = placement_from_jaxpr(traced.jaxpr, stack_names(zoo_model.abstract(trainer.cfg.model)))
    t1 = time.perf_counter()
    lowered = traced.lower()
    return lowered, kept_by_tag(placement), {"trace_s": t1 - t0, "lower_s": time.perf_counter() - t1}


def trace_and_compile(trainer):
    """`trace_lower`, then compile. Returns (compiled, kept, seconds: trace / lower / compile / total)."""
    lowered, kept, secs = trace_lower(trainer)
    t = time.perf_counter()
    compiled = lowered.compile(trainer.compiler_options)
    secs["compile_s"] = time.perf_counter() - t
    secs["total_s"] = secs["trace_s"] + secs["lower_s"] + secs["compile_s"]
    return compiled, kept, secs


def compile_many(items, workers: int, live: Optional[dict] = None, done: Optional[Callable] = None) -> dict:
    """items: (key, lowered, compiler options) -> {key: (compiled or the exception, seconds)}, compiled
    in `workers` threads (XLA compiles without holding the GIL). With a dict `live`, each program is
    compiled dumping its live ranges, and `live[key]` gets the values live at XLA's peak
    (`zoo.hlo.live_at_peak`; [] where XLA wrote none). `done(key, compiled or exception, seconds)` is
    called as each one finishes, one call at a time: a caller that records each as it comes keeps the
    finished ones when the process is stopped before the rest."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from zoo import hlo

    lock = threading.Lock()

    def one(item):
        key, out = compile_one(item)
        if done is not None:
            with lock:
                done(key, *out)
        return key, out

    def compile_one(item):
        key, lowered, options = item
        t = time.perf_counter()
        try:
            if live is None:
                return key, (lowered.compile(options), time.perf_counter() - t)
            dumps = hlo.compile_with_dumps(lowered, options, partitioned=False)
            secs = time.perf_counter() - t
            text = dumps.live_range
            live[key] = [] if text is None else hlo.live_at_peak(text, dumps.compiled.as_text())
            return key, (dumps.compiled, secs)
        except Exception as e:  # noqa: BLE001 - recorded per item by the caller
            return key, (e, time.perf_counter() - t)

    from zoo._compat import persistent_cache_bypassed

    # Held around the pool: each compile's own bypass (compile_with_dumps) then saves and restores the
    # same state, however the threads interleave.
    with persistent_cache_bypassed() if live is not None else contextlib.nullcontext():
        with ThreadPoolExecutor(max(1, workers)) as ex:
            return dict(ex.map(one, items))


def kept_by_tag(placement) -> dict:
    """What the backward pass holds, per tag (summed over layer stacks), read from the traced program:
    `{"tags": {tag: {"placement", "bytes"}}, "device_bytes", "host_bytes", "recomputed_bytes",
    "untagged_device_bytes", "untagged_host_bytes"}`. `bytes` is the tag's size over all layers."""
    tags: dict = {}
    for r in placement.records:
        t = tags.setdefault(r.tag, {"placement": r.placement, "bytes": 0})
        t["bytes"] += r.total_bytes
        if t["placement"] != r.placement:
            t["placement"] = "mixed"
    return {
        "tags": tags,
        "device_bytes": placement.bytes_on("device"),
        "host_bytes": placement.bytes_on("host"),
        "recomputed_bytes": placement.bytes_on("recomputed"),
        "untagged_device_bytes": placement.other_bytes("device"),
        "untagged_host_bytes": placement.other_bytes("host"),
    }


def compiled_memory(compiled) -> Optional[dict]:
    from zoo.train.metrics import compiled_memory as cm

    return cm(compiled)


def compiled_flops(compiled) -> Optional[float]:
    from zoo.train.metrics import compiled_flops as cf

    return cf(compiled)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def _version(pkg: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def env_info(devices=None) -> dict:
    """Date, machine, load and versions: what every benchmark table is stamped with."""
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host_cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "versions": {
            p: _version(p)
            for p in ("jax", "jaxlib", "equinox", "optax", "numpy", "jax-cuda13-plugin", "jax-cuda12-plugin")
        },
        "git_commit": git_commit(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    if devices:
        d = devices[0]
        info["device"] = {"platform": d.platform, "kind": getattr(d, "device_kind", d.platform), "count": len(devices)}
    return info


def write_json(path, obj) -> None:
    """Atomically (a partial file is never left half-written): write to a temp file, then rename."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, default=float)
        f.write("\n")
    os.replace(tmp, path)


# --- where the time goes: a per-op profile of one compiled step --------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\(")


def _source(op_name: str) -> str:
    """A short form of JAX's op_name metadata: `fwd:`/`bwd:` plus the innermost named scopes."""
    bwd = "transpose(" in op_name
    parts = [
        p
        for p in op_name.split("/")
        if p
        and not p.startswith(("jit(train_step)", "while", "body", "closed_call", "checkpoint", "rematted_computation"))
    ]
    parts = [re.sub(r"^(transpose|jvp)\((.*)\)$", r"\2", p) for p in parts]
    parts = [re.sub(r"^(transpose|jvp)\((.*)\)$", r"\2", p) for p in parts]
    return ("bwd: " if bwd else "fwd: ") + "/".join(parts[-2:])


def _hlo_ops(hlo_text: str) -> dict[str, dict]:
    """Instruction name -> {"opcode", "shape", "calls"} for every instruction of the HLO text, plus
    the opcodes inside each fused computation (so a fusion that wraps a dot counts as a matmul)."""
    comps: dict[str, list[str]] = {}
    ops: dict[str, dict] = {}
    current = None
    for line in hlo_text.splitlines():
        s = line.strip()
        if s.endswith("{") and ("(" in s) and "=" not in s.split("(")[0]:
            current = s.split()[0] if not s.startswith("ENTRY") else s.split()[1]
            current = current.lstrip("%")
            comps[current] = []
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
        src = re.search(r'op_name="([^"]*)"', line)
        ops[name] = {"opcode": opcode, "shape": shape, "calls": calls, "source": _source(src.group(1)) if src else ""}
        if current is not None:
            comps[current].append(opcode)

    def inner(op, seen=()) -> set:
        found = set()
        for c in op["calls"]:
            if c in seen:
                continue
            found.update(comps.get(c, []))
        return found

    for op in ops.values():
        op["inner"] = inner(op)
    return ops


def categorize(op: Optional[dict], name: str) -> str:
    """matmul (a dot or a fusion/custom kernel around one), attention-softmax-free categories:
    elementwise/reduce fusions, data movement (copy, transpose, gather/scatter, pad, concat, slice,
    dynamic-update-slice), control (while, call, conditional), other."""
    if op is None:
        lowered = name.lower()
        if "dot" in lowered or "ynn" in lowered or "onednn" in lowered or "gemm" in lowered:
            return "matmul"
        return "other (unnamed)"
    kinds = {op["opcode"]} | op["inner"]
    if kinds & {"dot", "convolution"} or "gemm" in name or op["opcode"] == "custom-call" and "matmul" in name:
        return "matmul"
    if kinds & {"scatter", "gather", "sort"}:
        return "gather/scatter/sort"
    if op["opcode"] in ("copy", "transpose") or (
        op["opcode"] == "fusion" and op["inner"] <= {"copy", "transpose", "parameter", "bitcast", "reshape"}
    ):
        return "copy/transpose"
    if kinds & {"dynamic-update-slice", "dynamic-slice", "concatenate", "pad", "slice"} and not kinds & {
        "exponential",
        "reduce",
        "multiply",
        "add",
    }:
        return "slice/concat/pad"
    if kinds & {"reduce", "reduce-window"}:
        return "reduce fusion"
    if op["opcode"] in ("while", "call", "conditional"):
        return "control"
    if op["opcode"] == "fusion" or kinds & {
        "add",
        "multiply",
        "exponential",
        "convert",
        "select",
        "divide",
        "tanh",
        "logistic",
    }:
        return "elementwise fusion"
    return "other"


def gaps_between(spans) -> float:
    """The time between the first start and the last end of (start, end) spans that none covers."""
    spans = sorted(spans)
    idle, reach = 0.0, spans[0][0] if spans else 0.0
    for start, end in spans:
        idle += max(0.0, start - reach)
        reach = max(reach, end)
    return idle


def profile_step(compiled, state, tokens, steps: int = 2, trace_dir: Optional[str] = None, top_n: int = 15):
    """Run `steps` steps under jax.profiler and attribute the XLA:CPU runtime's per-op events
    (`hlo_op` of each thunk) to categories of `categorize`. Returns (profile dict, state).

    The per-op events come from XLA:CPU's thunk executor; on GPU use the device trace instead."""
    import jax

    hlo = _hlo_ops(compiled.as_text())
    trace_dir = trace_dir or tempfile.mkdtemp(prefix="zoo_profile_")
    state, m = compiled(state, tokens)  # warm
    jax.block_until_ready((state, m))
    t0 = time.perf_counter()
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
        for _ in range(steps):
            state, m = compiled(state, tokens)
            jax.block_until_ready((state, m))
    finally:
        jax.profiler.stop_trace()
    wall = (time.perf_counter() - t0) / steps
    files = sorted(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not files:
        return {"error": "no perfetto trace written"}, state
    data = json.load(gzip.open(files[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    by_cat: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    by_source: dict[str, float] = defaultdict(float)
    threads = set()
    spans = []  # (start, end) in microseconds of every op counted
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args or e["name"].startswith("end:"):
            continue
        name = args["hlo_op"]
        op = hlo.get(name)
        # Thunks inside a while loop (the layer scan) are reported individually; the loop itself is
        # a control thunk whose span covers its body, so it is left out to avoid counting twice.
        if op is not None and op["opcode"] in ("while", "call", "conditional"):
            continue
        dur = e.get("dur", 0.0) * 1e-6 / steps
        by_cat[categorize(op, name)] += dur
        by_op[name] += dur
        by_source[(op or {}).get("source") or "?"] += dur
        threads.add(e.get("tid"))
        spans.append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    busy = sum(by_cat.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:top_n]
    return {
        "step_wall_s": wall,
        "op_seconds_per_step": busy,
        # XLA's own dots (those YNNPACK does not take, e.g. a product whose left operand contracts its
        # major axis) run on Eigen's threads after their thunk has returned: their work shows as
        # time in which no traced op runs, not as op time (with the host's dispatch)
        "no_op_running_s": gaps_between(spans) * 1e-6 / steps,
        "threads_with_ops": len(threads),
        "by_category_s": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "by_source_s": dict(sorted(by_source.items(), key=lambda kv: -kv[1])[:25]),
        "top_ops": [
            {
                "op": n,
                "category": categorize(hlo.get(n), n),
                "s": s,
                "shape": (hlo.get(n) or {}).get("shape"),
                "source": (hlo.get(n) or {}).get("source"),
            }
            for n, s in top
        ],
    }, state


# --- the planner's view of a policy ---------------------------------------------------------------


def planner_estimate(c, trainer, budget_bytes: float) -> dict:
    """zoo.tools.plan's estimate for the policy of `c` (its hardware profile gives the matmul rate and the
    link): step time split into compute / recompute / exposed transfers / state transfers, and the
    HBM peak. A tag the planner cannot recompute (the checkpointed layer's input) counts as kept."""
    from zoo.plan.options import PlanConfig
    from zoo.plan.traced import policy_estimate

    p, e, info = policy_estimate(c, trainer, PlanConfig(hbm_budget_gb=budget_bytes / 1e9))
    out = e.as_dict()
    out["hides"] = bool(e.host_tag_bytes > 0 and e.exposed_transfer_s <= 1e-3 * e.compute_s)
    out["rate_flops"] = info["rate_flops"]
    out["link_gbps"] = info["link_gbps_per_direction"]
    return out
