"""GPU benchmark: the host link and the bf16 matmul rate, then every policy of interest under every
XLA group, the largest batch each policy fits, and how much of the transfer time stays exposed.

    python bench/gpu.py --out bench_gpu.json --plot bench_gpu.png          # one H200: < 8 minutes (--budget-s 420)
    python bench/gpu.py --toy --out /tmp/g.json --plot /tmp/g.png          # any CPU: toy sizes (tests)
    python bench/gpu.py --scale --out bench_scale.json                     # the two scale runs, cut to one GPU

What it runs (each part in its own process: XLA reads its flags once per process):

1. `hw`: host<->device bandwidth of one large pinned-host array in each direction, and the dense
   matmul rate (bf16 8192^3 chains on a GPU), by zoo.tools.measure_hardware's functions.
2. one process per XLA group (conf/xla: `default`, `latency_hiding_pipelined_offload`,
   `latency_hiding`): for a ~1B Llama (`llama_1b`) and a ~1.7B DeepSeek-V3-shaped MoE (`dsv3_2b`,
   routed experts through the capacity kernel) at sequence 4096, the presets none, the family's offload
   preset (llama_qkv_offload / deepseek_mla_moe_offload), full, optimizer_host and minimal. All steps of
   a process are traced first, then compiled in parallel threads (XLA compiles without the GIL), then
   run one after another: warm-up, then timed steps (median). Per run: TFLOP/s per device (model FLOPs,
   zoo.counts.flops_per_token), MFU against the measured matmul rate, XLA's compiled memory (device
   and host temp), the process's device-memory high-water mark (runs go in ascending order of XLA's
   estimate, so it is the run's own peak unless an earlier run peaked higher), the bytes moved to and
   from the host per step (offloaded residuals read from the traced program, plus host-resident state),
   and the planner's estimate (zoo.tools.plan with the measured rate and link) for none and the offload
   presets in the default group.
3. `probe` (default flags): for each policy and model, XLA's estimated peak at two batch sizes gives
   bytes per sequence; the predicted largest batch under the device's limit is then run (it should fit)
   and one more (it should run out of memory). On a backend without memory statistics (CPU) only the
   prediction is made, against --memory-limit-gb.

4. `--scale` instead of 2 and 3: the seed's two runs at their real widths and sequence, cut to fit one
   device (`SCALE`: Llama 3.1 405B at one layer, DeepSeek-V3 671B at one dense and one MoE layer with
   32 of its 256 experts, both with a 32,768-token vocabulary, micro-batch 2 x 4096), under every
   preset of conf/offload but `custom` (which alone equals `full`), in the GPU recipe's XLA group
   (`gpu_overlap_pipelined_offload`); DeepSeek-V3 also dropless (`moe.impl=ragged`) under `none` and
   `full`.

Every group process also gets `--xla_gpu_enable_host_memory_offloading=true` (what train.py adds to a
run that keeps anything on host) and a 100 GiB pinned-host pool unless the environment sets one; a
flag the installed jaxlib does not know is dropped and recorded (XLA would refuse to start).

Derived: step time ratios to `none` and `full` in the same group, and the exposed part of the transfer
time: (t_policy - t_none) / (bytes to host / D2H bandwidth + bytes from host / H2D bandwidth).

Everything is written to --out after every run (partial results survive a timeout); a run that would
not finish before --budget-s is skipped and recorded as skipped. No Hydra: the GPU image lacks it; it
needs omegaconf and antlr4 carried as wheels (bench/gpu_wheels.sh, docs/benchmarks.md).
"""

import json
import math
import os
import pathlib
import sys
import time
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common as C  # noqa: E402
from bench.skeleton import (  # noqa: E402
    Runner,
    child_main,
    command_line,
    finish,
    first_line,
    is_oom,
    log,
    parser,
    past,
    pyplot,
    render,
    save_figure,
    state_ok,
    timed_steps,
    workdir_for,
)

SCHEMA = "zoo.bench.gpu/1"
GROUPS = ("default", "latency_hiding_pipelined_offload", "latency_hiding")
OFFLOAD_PRESET = {"llama": "llama_qkv_offload", "dsv3": "deepseek_mla_moe_offload"}
PRESETS = ("none", "offload", "full", "optimizer_host", "minimal")  # priority order; "offload": the family's

REAL = {
    "models": {"llama": ["llama_1b", {}], "dsv3": ["dsv3_2b", {"moe_impl": "capacity"}]},
    "batch": 4,
    "seq": 4096,
    "warmup": 2,
    "steps": 5,
    "transfer_mb": 1024.0,
    "matmul_n": 8192,
    "matmul_dtype": "bfloat16",
    "fast_compile": False,
    "budget_s": 420.0,
}
TOY = {
    "models": {"llama": ["llama_tiny_a", {}], "dsv3": ["dsv3_tiny_a", {"moe_impl": "capacity"}]},
    "batch": 2,
    "seq": 64,
    "warmup": 1,
    "steps": 2,
    "transfer_mb": 16.0,
    "matmul_n": 256,
    "matmul_dtype": "bfloat16",
    "fast_compile": True,
    "budget_s": 900.0,
}


# The two runs of the mission at their real widths and sequence length, cut to fit one H200 with float32
# parameters and AdamW on device (about 68 and 43 GB of state). A model's optional third element is the
# presets it runs (default: all of them).
SCALE = {
    "models": {
        "llama405b": ["llama3.1_405b", {"num_layers": 1, "vocab_size": 32768}],
        "dsv3_671b": [
            "deepseek_v3_671b",
            {
                "num_layers": 2,
                "first_k_dense_replace": 1,
                "vocab_size": 32768,
                "moe_experts": 32,
                "moe_impl": "capacity",
            },
        ],
        "dsv3_671b_dropless": [
            "deepseek_v3_671b",
            {"num_layers": 2, "first_k_dense_replace": 1, "vocab_size": 32768, "moe_experts": 32, "moe_impl": "ragged"},
            ["none", "full"],
        ],
    },
    "batch": 2,
    "seq": 4096,
    "warmup": 1,
    "steps": 3,
    "transfer_mb": 1024.0,
    "matmul_n": 8192,
    "matmul_dtype": "bfloat16",
    "fast_compile": False,
    "budget_s": 300.0,
    "groups": ["gpu_overlap_pipelined_offload"],
}
TOY_SCALE = {
    **SCALE,
    "models": {
        "llama405b": ["llama_tiny_a", {"num_layers": 1}],
        "dsv3_671b": ["dsv3_tiny_a", {"num_layers": 2, "first_k_dense_replace": 1, "moe_impl": "capacity"}],
        "dsv3_671b_dropless": [
            "dsv3_tiny_a",
            {"num_layers": 2, "first_k_dense_replace": 1, "moe_impl": "ragged"},
            ["none", "full"],
        ],
    },
    "batch": 2,
    "seq": 64,
    "warmup": 1,
    "steps": 2,
    "transfer_mb": 16.0,
    "matmul_n": 256,
    "fast_compile": True,
    "budget_s": 900.0,
}
HOST_POOL_GIB = "100"


def all_presets() -> list[str]:
    """conf/offload's presets but `custom`, which alone equals `full`."""
    from zoo.offload import preset_names

    return [p for p in preset_names() if p != "custom"]


def preset_name(model_key: str, p: str) -> str:
    return OFFLOAD_PRESET[model_key] if p == "offload" else p


def merged_flags(env_flags: str, ours: list[str], dropped: Optional[list] = None) -> str:
    """The environment's XLA_FLAGS plus the group's plus the host-offload flag, merged as train.py merges
    them (`zoo.train.run.merged_xla_flags`: the group wins where both set a flag, the environment's
    host-offload flag where it sets one) but without the latency hiding scheduler train.py adds to an
    offloading run: the default group is the baseline without it. Flags the installed jaxlib does not
    know are left out and appended to `dropped` (XLA aborts on an unknown flag)."""
    from zoo.train.run import merged_xla_flags
    from zoo.train.run_config import XlaConfig
    from zoo.train.xla_flags import GPU_HOST_OFFLOAD_FLAG, flag_name, unknown_flags

    names = {flag_name(f) for f in ours}
    env = [f for f in (env_flags or "").split() if flag_name(f) not in names]
    unknown = set(unknown_flags([*env, *ours, f"{GPU_HOST_OFFLOAD_FLAG}=true"]))
    if dropped is not None:
        dropped.extend(f for f in [*env, *ours, f"{GPU_HOST_OFFLOAD_FLAG}=true"] if f in unknown and f not in dropped)
    group = XlaConfig(
        flags=[f for f in ours if f not in unknown], cpu_ynn_fusions=None
    )  # a GPU run: no XLA:CPU default
    return merged_xla_flags(group, " ".join(f for f in env if f not in unknown), host_offload=True, scheduler=False)


# --- child: hardware -----------------------------------------------------------------------------


def child_hw(spec: dict) -> dict:
    import jax

    from zoo.tools.measure_hardware import measure_link, measure_matmul

    dev = jax.devices()[0]
    out = {"env": C.env_info(jax.devices()[:1])}
    t = time.perf_counter()
    h2d, d2h = measure_link(spec["transfer_mb"], repeats=5, device=dev)
    out["link"] = {"transfer_mb": spec["transfer_mb"], "h2d_gbps": h2d, "d2h_gbps": d2h, "repeats": 5}
    log(f"hw: host->device {h2d:.2f} GB/s, device->host {d2h:.2f} GB/s ({spec['transfer_mb']:g} MB, pinned host)")
    n, dtype = spec["matmul_n"], spec["matmul_dtype"]
    rate = measure_matmul(n, dtype, repeats=5, chain=8, device=dev)
    out["matmul"] = {"n": n, "dtype": dtype, "flops_per_s": rate, "chain": 8, "repeats": 5}
    log(f"hw: matmul {n}^3 {dtype} {rate / 1e12:.2f} TFLOP/s")
    stats = dev.memory_stats() or {}
    out["bytes_limit"] = int(stats["bytes_limit"]) if stats.get("bytes_limit") else None
    out["seconds"] = time.perf_counter() - t
    return out


# --- child: one XLA group ------------------------------------------------------------------------


def _hardware(spec: dict):
    from zoo.train.run_config import HardwareConfig

    hw = spec.get("hw") or {}
    rate = (hw.get("matmul") or {}).get("flops_per_s")
    link = hw.get("link") or {}
    gbps = min(link["h2d_gbps"], link["d2h_gbps"]) if link else 0.0
    return HardwareConfig(
        name="measured",
        peak_flops=rate or 1e12,
        matmul_flops=rate,
        hbm_bytes=int(spec.get("limit_bytes") or 0),
        host_link_gbps=float(gbps),
        note="bench/gpu.py: measured in the hw step of the same run",
    )


def _state_bytes(trainer) -> dict:
    """Bytes of parameters and optimizer state (one device), which host-resident state moves each step."""
    import numpy as np

    import jax

    def total(tree):
        return float(
            sum(
                math.prod(x.shape) * np.dtype(x.dtype).itemsize
                for x in jax.tree_util.tree_leaves(tree)
                if hasattr(x, "shape")
            )
        )

    st = trainer.abstract_state()
    return {"params": total(st["params"]), "opt_state": total(st["opt_state"])}


def transfer_bytes(trainer, kept: dict) -> dict:
    """Bytes moved each way per step: offloaded residuals (out in the forward pass, back in the
    backward pass) plus host-resident state (to the device for the update and back)."""
    c = trainer.cfg
    resid = float(kept["host_bytes"] + kept["untagged_host_bytes"]) * c.trainer.grad_accum
    sb = _state_bytes(trainer)
    state = (sb["opt_state"] if c.offload.opt_state == "pinned_host" else 0.0) + (
        sb["params"] if c.offload.params == "pinned_host" else 0.0
    )
    return {
        "residual_bytes": resid,
        "state_bytes": state,
        "to_host_bytes": resid + state,
        "from_host_bytes": resid + state,
    }


def child_group(spec: dict, result_path: pathlib.Path) -> dict:
    """One XLA group: every (model, preset) traced, compiled in threads, then run model by model in
    ascending order of XLA's estimated peak (warm-up, timed steps); the record rewritten after each run."""
    import jax

    group = spec["group"]
    devices = jax.devices()[:1]
    hardware = _hardware(spec)
    res = {"group": group, "xla_flags": os.environ.get("XLA_FLAGS", ""), "env": C.env_info(devices), "runs": []}
    runs, trainers, lowered = _trace_group(spec, devices, hardware)
    log(f"{group}: traced {len(lowered)} steps; compiling with {spec['workers']} threads")
    t = time.perf_counter()
    compiled = C.compile_many([(k, low, trainers[k].compiler_options) for k, low in lowered.items()], spec["workers"])
    log(f"{group}: compiled in {time.perf_counter() - t:.1f}s")
    res["compile_wall_s"] = time.perf_counter() - t
    res["runs"] = runs
    for run in runs:
        k = (run["model"], run["preset"])
        if k in compiled:
            _compiled_run(run, *compiled[k], trainers[k], spec)
    C.write_json(result_path, res)

    # Compiling real-width steps takes minutes on XLA:GPU (70-120 s each, 10 at once, on the H200 of
    # docs/benchmarks.md) while a run takes seconds: the runs get run_reserve_s past the budget.
    deadline = spec["deadline"]
    deadline = max(deadline, time.time() + spec.get("run_reserve_s", 0.0)) if spec.get("run_reserve_s") else deadline
    for key in spec["model_keys"]:
        mine = [r for r in runs if r["model"] == key and r.get("status") == "compiled"]
        mine.sort(key=lambda r: (r.get("compiled_memory") or {}).get("estimated_peak_bytes") or 0)
        state = None
        for run in mine:
            k = (key, run["preset"])
            spent = [r["wall_s"] for r in runs if r.get("wall_s")]
            if time.time() + (max(spent) if spent else 0.0) > deadline:
                run.update(status="skipped", reason="budget")
                continue
            t_run = time.perf_counter()
            state = _time_run(run, trainers[k], compiled[k][0], state, spec, devices)
            run["wall_s"] = time.perf_counter() - t_run
            C.write_json(result_path, res)
        del state
    for k in list(compiled):
        compiled[k] = None
    return res


def _trace_group(spec: dict, devices, hardware) -> tuple[list, dict, dict]:
    """Every model's presets traced and lowered in the group: (runs, trainers, lowered)."""
    group, deadline = spec["group"], spec["deadline"]
    runs, trainers, lowered = [], {}, {}
    for key in spec["model_keys"]:
        name, changes, *own = spec["models"][key]
        model = C.bench_model(name, **changes)
        for p in own[0] if own else spec["presets"]:
            preset = preset_name(key, p)
            if past(deadline, 30):
                runs.append({"model": key, "preset": preset, "status": "skipped", "reason": "budget"})
                continue
            c = C.train_config(
                model,
                [preset],
                spec["batch"],
                spec["seq"],
                hardware=hardware,
                xla_name=group,
                fast_compile=spec["fast_compile"],
            )
            try:
                tr = C.make_trainer(c, devices)
                low, kept, secs = C.trace_lower(tr)
            except Exception as e:  # noqa: BLE001 - recorded; the other runs go on
                error = f"trace: {first_line(e, 300)}"
                runs.append({"model": key, "size": name, "preset": preset, "status": "error", "error": error})
                log(f"{group} {key} {preset}: trace failed: {runs[-1]['error'][:200]}")
                continue
            run = {
                "model": key,
                "size": name,
                "preset": preset,
                "policy": c.offload.describe(),
                "batch": spec["batch"],
                "seq": spec["seq"],
                "kept": kept,
                "transfer": transfer_bytes(tr, kept),
                "trace_s": secs["trace_s"] + secs["lower_s"],
                "status": "compiling",
            }
            runs.append(run)
            trainers[(key, preset)], lowered[(key, preset)] = tr, low
    return runs, trainers, lowered


def _compiled_run(run: dict, exe, secs: float, trainer, spec: dict) -> None:
    """A compiled step's record: XLA's memory and FLOPs, and the planner's estimate where asked for."""
    run["compile_s"] = secs
    if isinstance(exe, Exception):
        run.update(status="error", error=f"compile: {first_line(exe, 300)}")
        return
    run["compiled_memory"] = C.compiled_memory(exe)
    run["xla_flops_per_step"] = C.compiled_flops(exe)
    run["status"] = "compiled"
    if spec.get("planner") and run["preset"] in spec.get("planner_presets", ("none", *OFFLOAD_PRESET.values())):
        try:
            run["planner"] = C.planner_estimate(trainer.cfg, trainer, float(spec.get("limit_bytes") or 1e12))
        except Exception as e:  # noqa: BLE001
            run["planner"] = {"error": first_line(e, 200)}


def _time_run(run: dict, tr, exe, state, spec: dict, devices):
    """Warm-up and timed steps of one compiled run, from `state` (the model's previous run's, moved to
    this run's layout, or a fresh one). Returns the state for the next run (None where it was lost)."""
    import jax

    from zoo.counts import flops_per_token
    from zoo.train.metrics import device_memory

    try:
        if not state_ok(state):
            state = tr.init()
        state = jax.device_put(state, tr.state_shardings)
        tokens = C.tokens_for(tr)
        jax.block_until_ready((state, tokens))
        before = device_memory(devices)
        state, m, times = timed_steps(exe, state, tokens, spec["warmup"], spec["steps"])
        after = device_memory(devices)
        step = C.median(times)
        tokens_per_step = spec["batch"] * spec["seq"]
        fl = flops_per_token(tr.cfg.model, spec["seq"]) * tokens_per_step / len(devices)
        run.update(
            status="ok",
            loss=float(m["loss"]),
            step_times_s=times,
            median_step_s=step,
            tokens_per_s=tokens_per_step / step,
            tflops_per_device=fl / step / 1e12,
            bytes_in_use_before=(before or {}).get("bytes_in_use"),
            process_peak_bytes=(after or {}).get("peak_bytes_in_use"),
            bytes_limit=(after or {}).get("bytes_limit"),
        )
        log(
            f"{spec['group']} {run['model']} {run['preset']}: {1e3 * step:.1f} ms/step, "
            f"{run['tflops_per_device']:.1f} TFLOP/s"
            + (f", peak {run['process_peak_bytes'] / 2**30:.1f} GiB" if run.get("process_peak_bytes") else "")
        )
    except Exception as e:  # noqa: BLE001 - one failed run is recorded; the others go on
        run.update(status="oom" if is_oom(e) else "error", error=first_line(e, 300))
        log(f"{spec['group']} {run['model']} {run['preset']}: {run['status']}: {run['error'][:120]}")
        if not state_ok(state):
            state = None
    return state


# --- child: largest batch ------------------------------------------------------------------------


def child_probe(spec: dict, result_path: pathlib.Path) -> dict:
    """Per model and preset: XLA's estimated peak at two batches gives bytes per sequence and the largest
    batch under the limit; where the backend can run out of memory (or --probe-runs), that batch and one
    more are run."""
    import jax

    devices = jax.devices()[:1]
    stats = devices[0].memory_stats() or {}
    measured_limit = int(stats["bytes_limit"]) if stats.get("bytes_limit") else None
    limit = spec.get("memory_limit_bytes") or measured_limit
    # Only a backend with a memory limit can run out of memory; --probe-runs runs the predicted
    # batches anyway (on CPU every one fits: it tests the code path, not the limit).
    can_run = measured_limit is not None or bool(spec.get("probe_runs"))
    res = {
        "limit_bytes": limit,
        "limit_source": "--memory-limit-gb"
        if spec.get("memory_limit_bytes")
        else ("device bytes_limit" if measured_limit else None),
        "verified_by_running": can_run,
        "probes": [],
    }
    hardware = _hardware(spec)

    def lower_at(model, preset, b):
        c = C.train_config(model, [preset], b, spec["seq"], hardware=hardware, fast_compile=spec["fast_compile"])
        tr = C.make_trainer(c, devices)
        return tr, tr.lower()

    probes = _probe_predict(spec, limit, lower_at)
    res["probes"] = [{k: v for k, v in p.items() if k != "model_obj"} for p in probes]
    C.write_json(result_path, res)
    if can_run:
        _probe_verify(spec, probes, res, lower_at, result_path)
    return res


def _probe_predict(spec: dict, limit, lower_at) -> list[dict]:
    """Wave 1: two batch sizes per policy, compiled together; the largest batch under `limit` predicted."""

    def estimate(exe):
        mem = C.compiled_memory(exe) if not isinstance(exe, Exception) else None
        return None if mem is None else mem["estimated_peak_bytes"]

    b0 = spec["batch"]
    b1 = 2 * b0
    items, probes = [], []
    for key in spec["model_keys"]:
        name, changes, *_ = spec["models"][key]
        model = C.bench_model(name, **changes)
        for p in spec["presets"]:
            preset = preset_name(key, p)
            probes.append({"model": key, "preset": preset, "seq": spec["seq"], "model_obj": model})
            for b in (b0, b1):
                tr, low = lower_at(model, preset, b)
                items.append(((key, preset, b), low, tr.compiler_options))
    t = time.perf_counter()
    wave1 = C.compile_many(items, spec["workers"])
    log(f"probe: compiled {len(items)} steps at batch {b0} and {b1} in {time.perf_counter() - t:.1f}s")
    for probe in probes:
        key, preset = probe["model"], probe["preset"]
        p0, p1 = estimate(wave1[(key, preset, b0)][0]), estimate(wave1[(key, preset, b1)][0])
        probe["estimated_peak_bytes"] = {str(b0): p0, str(b1): p1}
        if p0 is None or p1 is None or limit is None:
            probe["status"] = "no estimate" if limit is not None else "no memory limit (give --memory-limit-gb)"
            continue
        per_seq = (p1 - p0) / (b1 - b0)
        fixed = p0 - per_seq * b0
        probe["bytes_per_sequence"] = per_seq
        probe["fixed_bytes"] = fixed
        probe["predicted_max_batch"] = int((0.98 * limit - fixed) // per_seq) if per_seq > 0 else None
        probe["status"] = "predicted"
    return probes


def _probe_verify(spec: dict, probes: list[dict], res: dict, lower_at, result_path) -> None:
    """Wave 2: the predicted batch (should fit) and one more (should not), run for real."""
    import jax

    items, trainers = [], {}
    for probe in probes:
        bp = probe.get("predicted_max_batch")
        if not bp or bp < 1:
            continue
        for b in (bp, bp + 1):
            tr, low = lower_at(probe["model_obj"], probe["preset"], b)
            trainers[(probe["model"], probe["preset"], b)] = tr
            items.append(((probe["model"], probe["preset"], b), low, tr.compiler_options))
    if past(spec["deadline"], 60):
        res["note"] = "verification skipped: budget"
        return
    t = time.perf_counter()
    wave2 = C.compile_many(items, spec["workers"])
    log(f"probe: compiled {len(items)} steps at the predicted batches in {time.perf_counter() - t:.1f}s")
    for key in spec["model_keys"]:
        state = None
        for probe in [p for p in probes if p["model"] == key and p.get("predicted_max_batch")]:
            bp = probe["predicted_max_batch"]
            probe["runs"] = {}
            for b in (bp, bp + 1):
                if past(spec["deadline"], 20):
                    probe["runs"][str(b)] = "skipped (budget)"
                    continue
                tr = trainers[(key, probe["preset"], b)]
                exe = wave2[(key, probe["preset"], b)][0]
                if isinstance(exe, Exception):
                    probe["runs"][str(b)] = f"compile error: {str(exe).splitlines()[0][:200]}"
                    continue
                try:
                    if not state_ok(state):
                        state = tr.init()
                    state = jax.device_put(state, tr.state_shardings)
                    state, m = exe(state, C.tokens_for(tr))
                    jax.block_until_ready((state, m))
                    probe["runs"][str(b)] = "fits"
                except Exception as e:  # noqa: BLE001
                    probe["runs"][str(b)] = "oom" if is_oom(e) else f"error: {str(e).splitlines()[0][:200]}"
                    if not state_ok(state):
                        state = None
                log(f"probe {key} {probe['preset']} batch {b}: {probe['runs'][str(b)]}")
            fits = [int(b) for b, r in probe["runs"].items() if r == "fits"]
            probe["largest_batch_run"] = max(fits) if fits else None
            res["probes"] = [{k: v for k, v in p.items() if k != "model_obj"} for p in probes]
            C.write_json(result_path, res)
        del state


# --- the orchestrator ----------------------------------------------------------------------------


def derive(res: dict) -> None:
    """Ratios to none and full in the same group, exposed transfer time, MFU, and the targets."""
    hw = res.get("hw") or {}
    rate = (hw.get("matmul") or {}).get("flops_per_s")
    link = hw.get("link") or {}
    for g in res.get("groups", {}).values():
        runs = g.get("runs", [])
        for r in runs:
            if r.get("status") != "ok":
                continue
            if rate:
                r["mfu_vs_matmul"] = r["tflops_per_device"] * 1e12 / rate
            base = {
                p: next(
                    (x for x in runs if x["model"] == r["model"] and x["preset"] == p and x.get("status") == "ok"), None
                )
                for p in ("none", "full")
            }
            for p, b in base.items():
                if b:
                    r[f"ratio_to_{p}"] = r["median_step_s"] / b["median_step_s"]
            tb = r.get("transfer") or {}
            if link and tb.get("to_host_bytes"):
                t_xfer = tb["to_host_bytes"] / (link["d2h_gbps"] * 1e9) + tb["from_host_bytes"] / (
                    link["h2d_gbps"] * 1e9
                )
                r["transfer_time_s"] = t_xfer
                if base["none"]:
                    r["exposed_fraction_vs_none"] = (r["median_step_s"] - base["none"]["median_step_s"]) / t_xfer
    targets = {}
    dflt = res.get("groups", {}).get("default", {}).get("runs", [])
    llama_none = next(
        (r for r in dflt if r["model"] == "llama" and r["preset"] == "none" and r.get("status") == "ok"), None
    )
    if llama_none and "mfu_vs_matmul" in llama_none:
        targets["llama_none_mfu_vs_matmul"] = {
            "value": llama_none["mfu_vs_matmul"],
            "target": 0.5,
            "met": llama_none["mfu_vs_matmul"] >= 0.5,
        }
    checks = []
    for gname, g in res.get("groups", {}).items():
        for r in g.get("runs", []):
            if r.get("status") == "ok" and r["preset"] in OFFLOAD_PRESET.values() and "ratio_to_full" in r:
                planner = (
                    next(
                        (x.get("planner") for x in dflt if x["model"] == r["model"] and x["preset"] == r["preset"]),
                        None,
                    )
                    or {}
                )
                checks.append(
                    {
                        "group": gname,
                        "model": r["model"],
                        "preset": r["preset"],
                        "planner_hides": planner.get("hides"),
                        "ratio_to_full": r["ratio_to_full"],
                        "faster_than_full": r["ratio_to_full"] < 1.0,
                    }
                )
    targets["offload_vs_full"] = checks
    probes = (res.get("probe") or {}).get("probes", [])
    fit = []
    for key in {p["model"] for p in probes}:
        mine = {p["preset"]: p for p in probes if p["model"] == key}
        none = mine.get("none") or {}
        nb = none.get("largest_batch_run") or none.get("predicted_max_batch")
        for preset, p in mine.items():
            if preset == "none":
                continue
            b = p.get("largest_batch_run") or p.get("predicted_max_batch")
            if b and nb:
                fit.append(
                    {
                        "model": key,
                        "preset": preset,
                        "largest_batch": b,
                        "none_largest_batch": nb,
                        "fits_where_none_does_not": b > nb,
                        "verified": bool(
                            p.get("largest_batch_run")
                            and none.get("largest_batch_run")
                            and (none.get("runs") or {}).get(str(nb + 1)) == "oom"
                        ),
                    }
                )
    targets["fits_where_none_does_not"] = fit
    res["targets"] = targets


def markdown(res: dict) -> str:
    hw = res.get("hw") or {}
    lines = []
    if hw.get("link"):
        lines.append(
            f"host link (pinned, {hw['link']['transfer_mb']:g} MB): host->device {hw['link']['h2d_gbps']:.2f} GB/s, "
            f"device->host {hw['link']['d2h_gbps']:.2f} GB/s; matmul {hw['matmul']['n']}^3 {hw['matmul']['dtype']}: "
            f"{hw['matmul']['flops_per_s'] / 1e12:.2f} TFLOP/s"
        )
        lines.append("")
    lines += [
        "| group | model | preset | status | step (ms) | TFLOP/s/dev | MFU vs matmul | / none | / full | compiled "
        "peak (GiB) | host temp (GiB) | measured peak (GiB) | to host / step (GB) | exposed | planner step (ms) | "
        "planner peak (GiB) | planner hides |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def f(x, spec, scale=1.0):
        return "-" if x is None else format(x * scale, spec)

    for gname, g in res.get("groups", {}).items():
        for r in g.get("runs", []):
            mem = r.get("compiled_memory") or {}
            lines.append(
                f"| {gname} | {r['model']} | {r['preset']} | {r.get('status')} | "
                f"{f(r.get('median_step_s'), '.1f', 1e3)} | {f(r.get('tflops_per_device'), '.2f')} | "
                f"{f(r.get('mfu_vs_matmul'), '.1%')} | {f(r.get('ratio_to_none'), '.3f')} | "
                f"{f(r.get('ratio_to_full'), '.3f')} | "
                f"{f(mem.get('estimated_peak_bytes'), '.2f', 2**-30)} | "
                f"{f(mem.get('host_temp_size_in_bytes'), '.2f', 2**-30)} | "
                f"{f(r.get('process_peak_bytes'), '.2f', 2**-30)} | "
                f"{f((r.get('transfer') or {}).get('to_host_bytes'), '.3f', 1e-9)} | "
                f"{f(r.get('exposed_fraction_vs_none'), '.2f')} | "
                f"{f((r.get('planner') or {}).get('time_s'), '.1f', 1e3)} | "
                f"{f((r.get('planner') or {}).get('peak_bytes'), '.2f', 2**-30)} | "
                f"{(r.get('planner') or {}).get('hides', '-')} |"
            )
    probes = (res.get("probe") or {}).get("probes", [])
    if probes:
        lines += [
            "",
            "| model | preset | bytes/sequence (GiB) | predicted largest batch | runs | largest batch run |",
            "|---|---|---:|---:|---|---:|",
        ]
        for p in probes:
            runs = ", ".join(f"{b}: {v}" for b, v in (p.get("runs") or {}).items()) or "-"
            lines.append(
                f"| {p['model']} | {p['preset']} | {f(p.get('bytes_per_sequence'), '.3f', 2**-30)} | "
                f"{p.get('predicted_max_batch', '-')} | {runs} | {p.get('largest_batch_run', '-')} |"
            )
    return "\n".join(lines)


def plot(res: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    groups = list(res.get("groups", {}))
    models = list(dict.fromkeys(r["model"] for g in res.get("groups", {}).values() for r in g.get("runs", [])))
    if not models:
        return
    fig, axes = plt.subplots(2, len(models), figsize=(7 * len(models), 8), squeeze=False)
    for j, key in enumerate(models):
        presets = list(
            dict.fromkeys(r["preset"] for g in res["groups"].values() for r in g.get("runs", []) if r["model"] == key)
        )
        ax = axes[0][j]
        width = 0.8 / max(1, len(groups))
        for i, gname in enumerate(groups):
            runs = {r["preset"]: r for r in res["groups"][gname].get("runs", []) if r["model"] == key}
            vals = [(runs.get(p) or {}).get("tflops_per_device") or 0.0 for p in presets]
            ax.bar([x + i * width for x in range(len(presets))], vals, width, label=gname)
        ax.set_xticks([x + width * (len(groups) - 1) / 2 for x in range(len(presets))])
        ax.set_xticklabels(presets, rotation=20, fontsize=8)
        ax.set_ylabel("model TFLOP/s per device")
        rate = ((res.get("hw") or {}).get("matmul") or {}).get("flops_per_s")
        if rate:
            ax.axhline(rate / 1e12 * 0.5, color="gray", ls="--", lw=0.8, label="50% of measured matmul rate")
        ax.set_title(f"{key}: throughput by policy and XLA group", fontsize=9)
        ax.legend(fontsize=7)
        ax = axes[1][j]
        runs = {r["preset"]: r for r in res.get("groups", {}).get("default", {}).get("runs", []) if r["model"] == key}
        est = [((runs.get(p) or {}).get("compiled_memory") or {}).get("estimated_peak_bytes") or 0 for p in presets]
        meas = [(runs.get(p) or {}).get("process_peak_bytes") or 0 for p in presets]
        ax.bar([x - 0.2 for x in range(len(presets))], [e / 2**30 for e in est], 0.4, label="XLA estimated peak")
        ax.bar([x + 0.2 for x in range(len(presets))], [m / 2**30 for m in meas], 0.4, label="measured high-water mark")
        probes = {p["preset"]: p for p in (res.get("probe") or {}).get("probes", []) if p["model"] == key}
        for x, p in enumerate(presets):
            b = (probes.get(p) or {}).get("largest_batch_run") or (probes.get(p) or {}).get("predicted_max_batch")
            if b:
                ax.annotate(
                    f"max batch {b}",
                    (x, max(est[x], meas[x]) / 2**30),
                    ha="center",
                    fontsize=7,
                    xytext=(0, 3),
                    textcoords="offset points",
                )
        ax.set_xticks(range(len(presets)))
        ax.set_xticklabels(presets, rotation=20, fontsize=8)
        ax.set_ylabel("GiB (default group, timing batch)")
        ax.set_title(f"{key}: device memory; largest batch per policy", fontsize=9)
        ax.legend(fontsize=7)
    env = (res.get("hw") or {}).get("env") or {}
    fig.suptitle(
        f"bench/gpu.py{' --toy' if res.get('toy') else ''}, {env.get('date_utc', '')}, "
        f"{(env.get('device') or {}).get('kind', '')}",
        fontsize=9,
    )
    save_figure(fig, path)


def _parser():
    ap = parser(__doc__, "bench_gpu.json")
    ap.add_argument("--toy", action="store_true", help="tiny models: a CPU smoke test of the whole pipeline")
    ap.add_argument(
        "--scale", action="store_true", help="the 405B and 671B runs cut to one device, every preset (see SCALE)"
    )
    ap.add_argument(
        "--render",
        default=None,
        help=(
            "print the tables of recorded runs (a --out JSON, or a record of several: docs/gpu_h200.json); nothing runs"
        ),
    )
    ap.add_argument(
        "--run-reserve-s",
        type=float,
        default=None,
        help="seconds the runs of a group may take past the budget once its steps are compiled (default 60; toy 0)",
    )
    ap.add_argument(
        "--jax-config",
        action="append",
        default=[],
        metavar="NAME=true|false",
        help="a boolean jax.config option set in every child before anything traces (repeatable)",
    )
    ap.add_argument(
        "--hw-json", default=None, help="take the hw part from this earlier --out instead of measuring it again"
    )
    ap.add_argument("--workdir", default=None, help="the children's specs and results (default: beside --out)")
    ap.add_argument("--models", default=None, help="comma list of llama,dsv3")
    ap.add_argument(
        "--presets",
        default=None,
        help=f"comma list; 'offload' is the family's offload preset (default {','.join(PRESETS)})",
    )
    ap.add_argument("--groups", default=None, help=f"comma list of conf/xla groups (default {','.join(GROUPS)})")
    ap.add_argument("--probe-presets", default=None, help="presets whose largest batch is probed (default: --presets)")
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument(
        "--probe-runs",
        action="store_true",
        help="run the predicted batches even where the backend reports no memory limit (CPU: tests)",
    )
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument(
        "--budget-s", type=float, default=None, help="stop starting runs after this many seconds (default 420; toy 900)"
    )
    ap.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        help="the memory limit for the largest-batch prediction (default: the device's)",
    )
    ap.add_argument("--workers", type=int, default=None, help="compile threads (default min(8, cores))")
    ap.add_argument(
        "--plan-only",
        action="store_true",
        help=(
            "no runs: zoo.tools.plan's estimate of every (model, preset) at --link-gbps and --matmul-tflops, "
            "in this process (CPU is fine)"
        ),
    )
    ap.add_argument(
        "--link-gbps",
        type=float,
        default=64.0,
        help="with --plan-only: host link GB/s per direction (default 64, PCIe Gen5)",
    )
    ap.add_argument(
        "--matmul-tflops",
        type=float,
        default=None,
        help="with --plan-only: matmul rate (default: h200_pcie peak x 0.5)",
    )
    ap.add_argument(
        "--hbm-gb", type=float, default=139.0, help="with --plan-only: device memory (default 139, an H200's usable)"
    )
    return ap


def _set_jax_config(spec: dict) -> None:
    import jax

    for name, value in (spec.get("jax_config") or {}).items():  # e.g. jax_ragged_dot_use_gpu_pallas_triton_lowering
        jax.config.update(name, value)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        children = {"hw": lambda s, _: child_hw(s), "group": child_group, "probe": child_probe}
        return child_main(args, children, before=_set_jax_config)
    # No JAX import in this process: every backend starts in a child.
    if args.render:
        return render(json.loads(pathlib.Path(args.render).read_text()), args, render_record)
    if args.plan_only:
        return plan_only(args)

    t_start = time.time()
    if args.scale:
        base = dict(TOY_SCALE if args.toy else SCALE)
        args.no_probe = True
    else:
        base = dict(TOY if args.toy else REAL)
    budget = args.budget_s or base["budget_s"]
    groups = args.groups.split(",") if args.groups else list(base.get("groups", GROUPS))
    for g in groups:
        C.xla_group_flags(g)  # a bad group name fails here, before anything starts
    spec = _spec(args, base, t_start + budget)
    res = {
        "schema": SCHEMA,
        "command": command_line("bench/gpu.py", argv),
        "toy": args.toy,
        "scale": args.scale,
        "spec": {k: v for k, v in spec.items() if k != "deadline"},
        "budget_s": budget,
        "groups": {},
        "dropped_xla_flags": [],
    }
    out = pathlib.Path(args.out)
    runner = Runner(pathlib.Path(__file__).resolve(), workdir_for(out, args.workdir), out, res, derive)
    log(
        f"bench/gpu.py{' --toy' if args.toy else ''}{' --scale' if args.scale else ''}: models {spec['model_keys']}, "
        f"presets {spec['presets']}, groups {groups}, budget {budget:.0f}s"
    )
    _run_children(runner, args, spec, groups)
    res["wall_s"] = time.time() - t_start
    runner.save()
    finish(res, args, markdown, plot)
    return 0


def _spec(args, base: dict, deadline: float) -> dict:
    """What every child reads: the models, presets and sizes, the budget's deadline, the options."""
    spec = {
        "models": base["models"],
        "model_keys": args.models.split(",") if args.models else list(base["models"]),
        "presets": args.presets.split(",") if args.presets else (all_presets() if args.scale else list(PRESETS)),
        "batch": args.batch or base["batch"],
        "seq": args.seq or base["seq"],
        "steps": args.steps or base["steps"],
        "warmup": base["warmup"],
        "transfer_mb": base["transfer_mb"],
        "matmul_n": base["matmul_n"],
        "matmul_dtype": base["matmul_dtype"],
        "fast_compile": base["fast_compile"],
        "workers": args.workers or min(8, os.cpu_count() or 1),
        "deadline": deadline,
        "memory_limit_bytes": int(args.memory_limit_gb * 1e9) if args.memory_limit_gb else None,
        "probe_runs": args.probe_runs,
        "run_reserve_s": args.run_reserve_s if args.run_reserve_s is not None else (0.0 if args.toy else 60.0),
        "jax_config": _jax_config(args.jax_config),
    }
    if args.scale:
        spec["planner_presets"] = ["none", "full", *OFFLOAD_PRESET.values()]
    return spec


def _child_env() -> dict:
    return {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"),
        "PYTHONUNBUFFERED": "1",
        "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", HOST_POOL_GIB),
    }


def _group_child(runner: Runner, kind: str, spec: dict, group: str, flags: str) -> dict:
    """A child in `group`'s flags, stopped past the deadline plus its runs' reserve (what it wrote stays)."""
    timeout = spec["deadline"] - time.time() + 30 + spec.get("run_reserve_s", 0.0)
    env = {**_child_env(), "XLA_FLAGS": flags}
    return runner.child(kind, spec, env, timeout, name=f"{kind}_{group}", process={"xla_flags": flags})


def _run_children(runner: Runner, args, spec: dict, groups: list[str]) -> None:
    """The hardware child (or an earlier run's figures), then a child per XLA group, the probe after the
    default and pipelined groups."""
    res, env_flags = runner.res, os.environ.get("XLA_FLAGS", "")
    dropped = res["dropped_xla_flags"]
    earlier = (
        json.loads(pathlib.Path(args.hw_json).read_text()).get("hw")
        if args.hw_json and pathlib.Path(args.hw_json).exists()
        else None
    )
    if earlier and earlier.get("link"):
        res["hw"] = earlier
    else:
        res["hw"] = _group_child(runner, "hw", spec, "", env_flags)
    spec["hw"] = res["hw"]
    spec["limit_bytes"] = spec["memory_limit_bytes"] or res["hw"].get("bytes_limit")
    C.write_json(runner.out, res)

    probe_at = 2 if len(groups) >= 2 else len(groups)  # the probe runs after the default and pipelined groups
    for i, g in enumerate(groups):
        if i == probe_at and not args.no_probe:
            _probe(runner, args, spec, env_flags)
        if past(spec["deadline"], 30):
            res["groups"][g] = {"status": "skipped", "reason": "budget", "runs": []}
            continue
        gspec = dict(spec, group=g, planner=(g == "default" or (args.scale and i == 0)))
        res["groups"][g] = _group_child(
            runner, "group", gspec, g, merged_flags(env_flags, C.xla_group_flags(g), dropped)
        )
        if dropped:
            log(f"flags the installed jaxlib does not know, left out: {' '.join(dropped)}")
        runner.save()
    if probe_at >= len(groups) and not args.no_probe:
        _probe(runner, args, spec, env_flags)


def _jax_config(items: list[str]) -> dict:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if not name.startswith("jax_") or value not in ("true", "false"):
            print(
                f"error: --jax-config {item}: give NAME=true or NAME=false, NAME a jax.config option (jax_...)",
                file=sys.stderr,
            )
            raise SystemExit(2)
        out[name] = value == "true"
    return out


def render_record(record: dict) -> str:
    """The tables of one `--out` JSON, or of a record holding several (`{"calls": [{"command", "results": [...]}]}`,
    as docs/gpu_h200.json keeps the calls of one GPU session)."""
    if "calls" not in record:
        return markdown(record)
    parts = []
    for call in record["calls"]:
        parts.append(f"### {call['title']}\n\n`{call['command']}`")
        for res in call["results"]:
            derive(res)
            parts.append(markdown(res))
    return "\n\n".join(parts)


def plan_only(args) -> int:
    """zoo.tools.plan's estimate for each model and preset of the GPU benchmark (abstract: nothing runs)."""
    import jax

    from zoo.train.run_config import HardwareConfig

    base = TOY if args.toy else REAL
    rate = (args.matmul_tflops or 835.5 * 0.5) * 1e12
    hw = HardwareConfig(
        name="plan_only",
        peak_flops=rate,
        matmul_flops=rate,
        hbm_bytes=int(args.hbm_gb * 1e9),
        host_link_gbps=args.link_gbps,
    )
    batch, seq = args.batch or base["batch"], args.seq or base["seq"]
    print(
        f"zoo.tools.plan estimates at {rate / 1e12:.0f} TFLOP/s, host link {args.link_gbps:g} GB/s per direction, HBM "
        f"{args.hbm_gb:g} GB; batch {batch} x {seq}"
    )
    print(
        "| model | preset | estimated step (ms) | compute | recompute | exposed transfers | state transfers | HBM "
        "peak (GB) | on host (GB) | offload hides |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    keys = args.models.split(",") if args.models else list(base["models"])
    for key in keys:
        name, changes = base["models"][key]
        model = C.bench_model(name, **changes)
        for p in args.presets.split(",") if args.presets else PRESETS:
            preset = preset_name(key, p)
            c = C.train_config(model, [preset], batch, seq, hardware=hw)
            e = C.planner_estimate(c, C.make_trainer(c, jax.devices()[:1]), args.hbm_gb * 1e9)
            print(
                f"| {key} ({name}) | {preset} | {e['time_s'] * 1e3:.1f} | {e['compute_s'] * 1e3:.1f} | "
                f"{e['recompute_s'] * 1e3:.1f} | "
                f"{e['exposed_transfer_s'] * 1e3:.1f} | {e['state_transfer_s'] * 1e3:.1f} | "
                f"{e['peak_bytes'] / 1e9:.1f} | {e['host_tag_bytes'] / 1e9:.2f} | "
                f"{'yes' if e['hides'] else '-'} |",
                flush=True,
            )
    return 0


def _probe(runner: Runner, args, spec: dict, env_flags: str) -> None:
    res = runner.res
    if past(spec["deadline"], 120):
        res["probe"] = {"status": "skipped", "reason": "budget"}
        return
    presets = args.probe_presets.split(",") if args.probe_presets else spec["presets"]
    flags = merged_flags(env_flags, C.xla_group_flags("default"), res["dropped_xla_flags"])
    res["probe"] = _group_child(runner, "probe", dict(spec, presets=presets, group="default"), "default", flags)
    runner.save()


if __name__ == "__main__":
    raise SystemExit(main())
