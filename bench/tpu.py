"""TPU benchmark: the host link and matmul rate as a step uses them, then per setup (a model at a batch)
every policy of interest compiled, run in alternation in one process, and set against the planner.

    python bench/tpu.py --out bench_tpu.json --plot bench_tpu.png          # one TPU v5e (see --budget-s)
    python bench/tpu.py --setups dense,moe --out bench_tpu.json            # some setups
    python bench/tpu.py --toy --out /tmp/t.json --plot /tmp/t.png          # any CPU: tiny sizes (tests)
    python bench/tpu.py --aot --setups dense --out /tmp/aot.json           # compile for a v5e here (libtpu): memory

What it runs, each XLA group in a process of its own (libtpu reads its flags once):

1. `hw`: the matmul rate (8192^3 bf16 chains), the host link inside a program, each direction and
   under matmuls, and plain `device_put` (zoo.tools.measure_hardware's functions).
2. per setup (`SETUPS`: model, batch, sequence, policies, XLA group): every policy's step traced,
   lowered and compiled (threads); one that does not fit is recorded as XLA's out-of-memory (the
   proof that it does not fit this chip). The parameters are initialised once per state layout
   (timed: lowering, compile, run), then the policies run in alternation: `rounds` rounds of one
   warm-up and `steps` timed steps each, so a slow drift of the machine falls on every policy alike.
   Per policy: median step time, model TFLOP/s (zoo.counts.flops_per_token) and MFU against the
   datasheet peak (hardware=tpu_v5e), XLA's compiled memory (the TPU compiler's simulated peak and
   host temporaries), the runtime's high-water mark, bytes offloaded per step (read from the traced
   program), and zoo.tools.plan's estimate of the same policy (HBM peak and step time, at the link
   and matmul rate of step 1): each against its measurement.

Derived per setup: the fastest policy that fit, the fastest recompute-only one (no tag, parameter or
state on host), their ratio, and for each offloading policy the exposed transfer time: its step time
minus that of the same placement kept on device, where that variant ran; for each `X+optimizer_host`,
its step time over X's.

3. `kernels` (in --setups; in the default set): attention (xla, blockwise, splash) and the routed
   experts' grouped matmul (tile loop, ragged_dot, megablox, the capacity einsum), value and gradient,
   at the setups' shapes (`KERNEL_CASES`).

`--aot` compiles the setups' steps for a TPU v5e topology on this machine (libtpu installed, no TPU:
jax.experimental.topologies) and records only the memory figures, which equal the chip's (the same
compiler): how the setups' batches were chosen without spending device time.

Everything is written to --out after every compile and step (partial results survive a timeout); a
setup that would not finish before --budget-s is skipped and recorded as skipped, and a compile still
running when the budget (plus a minute) runs out is recorded as `timeout`. No Hydra (bench/common.py).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = "zoo.bench.tpu/1"
PEAK_FLOPS = 1.97e14  # v5e bf16 datasheet (conf/hardware/tpu_v5e.yaml)

# A policy: presets merged in order ("+"), then tag actions (":tag=action,..."), e.g. "minimal:context=device".
# Recompute-only: no tag offloaded, parameters and optimizer state on device.
SETUPS = {
    # llama_1b's layers at a long sequence, where recomputing attention costs more per byte than moving its
    # output over the link; at this batch `none` and `minimal` with the attention output kept do not fit.
    "dense": {
        "model": ["llama_1b", {"num_layers": 4}],
        "batch": 3,
        "seq": 8192,
        "group": "tpu_host_offload",
        "policies": [
            "none",
            "minimal:context=device",
            "minimal_context_offloaded",
            "minimal",
            "save_qkv_proj",
            "full",
            "llama_qkv_offload",
            "qkv_proj_offloaded",
        ],
    },
    # The same layers at 32768 positions in one row, where attention's share of the recompute is larger:
    # on the v5e none of these fits (XLA's temporaries 17.6 GB for `full`, 23.1 GB with the context offloaded).
    "dense_32k": {
        "model": ["llama_1b", {"num_layers": 4}],
        "batch": 1,
        "seq": 32768,
        "group": "tpu_host_offload",
        "policies": ["minimal:context=device", "minimal_context_offloaded", "minimal", "save_qkv_proj", "full"],
    },
    # A DeepSeek-V3-shaped MoE (MLA, 16 routed experts, dropless) at the batch where keeping the attention
    # output no longer fits (XLA for a v5e, `--aot`: `minimal:context=device` 15.86 G of temporaries,
    # `minimal_context_offloaded` 15.80 GB peak). `planned` is zoo.tools.plan's choice here with the
    # tpu_v5e profile; `planned_remat` the same with nothing offloaded (a custom recompute-only policy).
    "moe": {
        "model": ["dsv3_100m", {}],
        "batch": 28,
        "seq": 4096,
        "group": "tpu_host_offload",
        "policies": [
            "none",
            "minimal:context=device",
            "minimal_context_offloaded",
            "minimal",
            "save_qkv_proj",
            "full",
            "minimal:context=device,key_proj=remat,value_proj=remat,out_proj=offload",
            "minimal:context=device,key_proj=remat,value_proj=remat,out_proj=remat",
            "minimal_context_offloaded:key_proj=remat,value_proj=remat",
        ],
    },
    # The same MoE at larger batches, everything recomputed but the layer input and perhaps the attention
    # output: is keeping that output off the device (its recompute is splash's forward) faster than
    # recomputing it, and where does keeping it on the device stop fitting?
    "moe_full": {
        "model": ["dsv3_100m", {}],
        "batch": 68,
        "seq": 4096,
        "group": "tpu_host_offload",
        "policies": [
            "none",
            "full:context=device",
            "full",
            "full:context=offload",
            "full:kv_wa_proj=device,mla_kv=device",
            "full:context=offload,decoder_layer_input=offload",
        ],
    },
    # The MoE with nothing recomputed at a batch that fills most of the chip: the planner's `none`
    # against the recompute-only presets where all three fit.
    "moe_none": {
        "model": ["dsv3_100m", {}],
        "batch": 10,
        "seq": 4096,
        "group": "tpu_host_offload",
        "policies": ["none", "minimal", "full"],
    },
    # Out of sample for the step model fitted on the setups above (hardware.activation_passes): the
    # same two models at another sequence length, run after the fit.
    "moe_none_2048": {
        "model": ["dsv3_100m", {}],
        "batch": 16,
        "seq": 2048,
        "group": "tpu_host_offload",
        "policies": ["none", "minimal", "full"],
    },
    "dense_none_4096": {
        "model": ["llama_1b", {"num_layers": 4}],
        "batch": 3,
        "seq": 4096,
        "group": "tpu_host_offload",
        "policies": ["none", "minimal", "full"],
    },
    # Out of sample for the step model in another family each, run after the fit: Mixtral's top-2
    # routing over 8 experts with grouped-query attention, Qwen3-MoE's top-4 over 16 with norms on
    # the queries and keys (docs/benchmarks.md: the checkpoint's re-run is priced too dear there).
    "mixtral_none": {
        "model": ["mixtral_100m", {}],
        "batch": 4,
        "seq": 4096,
        "group": "tpu_host_offload",
        "policies": ["none", "minimal", "full"],
    },
    "qwen3_moe_none": {
        "model": ["qwen3_moe_100m", {}],
        "batch": 4,
        "seq": 4096,
        "group": "tpu_host_offload",
        "policies": ["none", "minimal", "full"],
    },
    # Larger, where keeping the attention output with everything else recomputed runs out of memory.
    "moe_full_84": {
        "model": ["dsv3_100m", {}],
        "batch": 84,
        "seq": 4096,
        "group": "tpu_host_offload",
        "policies": ["full:context=device", "full", "full:context=offload"],
    },
    # Larger still, where (compiled for a v5e here) keeping the attention output no longer fits and
    # offloading it still does: an offload policy against every recompute-only policy that fits.
    "moe_full_90": {
        "model": ["dsv3_100m", {}],
        "batch": 90,
        "seq": 4096,
        "group": "tpu_host_offload",
        "policies": [
            "full:context=device",
            "full",
            "full:context=offload",
            "full:kv_wa_proj=device,mla_kv=device",
        ],
    },
    # zoo.tools.plan's choices for `dense` (tpu_v5e profile) against the measured best there: today's
    # (plan.compile, its default for a TPU: Q/K/V/O to host, the attention output and MLP kept) and an
    # earlier cost model's (Q and O to host).
    "dense_planned": {
        "model": ["llama_1b", {"num_layers": 4}],
        "batch": 3,
        "seq": 8192,
        "group": "tpu_host_offload",
        "policies": [
            "minimal:context=device,query_proj=offload,key_proj=offload,value_proj=offload,out_proj=offload",
            "minimal:context=device,query_proj=offload,out_proj=offload",
            "minimal_context_offloaded",
            "minimal",
        ],
    },
    # zoo.tools.plan's pick with `plan.compile=4` (its candidates compiled for the chip) against the
    # presets, at batches where the earlier estimate (three float32 loss chunks) found nothing that fits:
    # at 12 x 2048 `mlpwi_1=offload` is today's pick, `value_proj,out_proj=offload` the earlier model's.
    "compiled_plan_8": {
        "model": ["llama_1b", {"num_layers": 4}],
        "batch": 8,
        "seq": 2048,
        "group": "tpu_host_offload",
        "policies": ["none", "minimal:context=device", "minimal", "full"],
    },
    "compiled_plan_12": {
        "model": ["llama_1b", {"num_layers": 4}],
        "batch": 12,
        "seq": 2048,
        "group": "tpu_host_offload",
        "policies": [
            "none",
            "minimal:context=device",
            "minimal:context=device,mlpwi_1=offload",
            "minimal:context=device,value_proj=offload,out_proj=offload",
            "minimal_context_offloaded",
            "minimal",
            "save_qkv_proj",
            "full",
        ],
    },
    # llama_1b's layers at 2048 where `none` fits: MFU of the unconstrained step with splash.
    "mfu": {
        "model": ["llama_1b", {"num_layers": 4}],
        "batch": 6,
        "seq": 2048,
        "group": "tpu_host_offload",
        "policies": ["none", "minimal", "full"],
    },
    # The optimizer state on host against on device, where both fit. Each update moves the AdamW moments
    # (8 bytes a parameter) to the device and back: over a 14 GB/s link that is ~0.6 s for these 506M
    # parameters, more than a step of 8 x 2048 computes, so per step it cannot cost < 1.3x (measured
    # below as the crossover); with 8 microbatches per update (how a run that offloads its state trains)
    # the same transfer is spread over 8x the compute.
    "optimizer_host": {
        "model": ["llama_1b", {"num_layers": 4}],
        "batch": 64,
        "grad_accum": 8,
        "seq": 2048,
        "group": "tpu_host_offload",
        "policies": ["full", "full+optimizer_host"],
    },
    "optimizer_host_every_step": {
        "model": ["llama_1b", {"num_layers": 4}],
        "batch": 8,
        "seq": 2048,
        "group": "tpu_host_offload",
        "policies": ["minimal", "minimal+optimizer_host"],
    },
    # dropless (the TPU's grouped matmul) against the capacity kernel.
    "dropless": {
        "model": ["dsv3_100m", {}],
        "batch": 8,
        "seq": 2048,
        "group": "tpu_host_offload",
        "policies": ["none", "none@capacity", "minimal", "minimal@capacity"],
    },
}
TOY_SETUPS = {
    "dense": {
        "model": ["llama_tiny_a", {}],
        "batch": 2,
        "seq": 128,
        "group": "default",
        "grad_accum": 2,
        "policies": ["none", "minimal:context=device", "minimal_context_offloaded", "full", "full+optimizer_host"],
    },
    "moe": {
        "model": ["dsv3_tiny_a", {}],
        "batch": 2,
        "seq": 128,
        "group": "default",
        "policies": ["minimal", "none@capacity"],
    },
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_policy(label: str):
    """`presets[+preset][:tag=action,...][@moe_impl]` -> (OffloadConfig, moe impl or None)."""
    from zoo.offload import policy_from_label

    label, _, moe = label.partition("@")
    return policy_from_label(label), (moe or None)


def recompute_only(o) -> bool:
    from zoo.train.run import uses_host_memory

    return not uses_host_memory(o)


def build(setup: dict, label: str, devices, hardware, toy: bool):
    from bench import common as C

    o, moe = parse_policy(label)
    name, changes = setup["model"]
    model = C.bench_model(name, **changes, **({"moe_impl": moe} if moe else {}))
    c = C.train_config(
        model, ["none"], setup["batch"], setup["seq"], hardware=hardware, xla_name=setup["group"], fast_compile=toy
    )
    c = dataclasses.replace(c, offload=o)
    if setup.get("grad_accum", 1) > 1:  # the update runs once per `grad_accum` microbatches
        c = dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, grad_accum=setup["grad_accum"]))
    if "loss_chunk" in setup:  # trainer.loss_chunk_size (0: whole logits)
        c = dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, loss_chunk_size=setup["loss_chunk"]))
    return c, C.make_trainer(c, devices)


def _v5e_devices():
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        platform="tpu", topology_name="v5e:1x1", chips_per_host_bounds=(1, 1, 1)
    ).devices


# --- child: hardware -----------------------------------------------------------------------------


def child_hw(spec: dict) -> dict:
    import jax

    from bench import common as C
    from zoo.tools.measure_hardware import measure_link, measure_matmul, measure_program_link

    dev = jax.devices()[0]
    out = {"env": C.env_info(jax.devices()[:1])}
    n, dtype, mb = spec["matmul_n"], spec["matmul_dtype"], spec["transfer_mb"]
    out["matmul"] = {"n": n, "dtype": dtype, "flops_per_s": measure_matmul(n, dtype, repeats=5, chain=8, device=dev)}
    log(f"hw: matmul {n}^3 {dtype} {out['matmul']['flops_per_s'] / 1e12:.1f} TFLOP/s")
    out["program_link"] = measure_program_link(mb, repeats=5, device=dev, matmul_n=n, dtype=dtype)
    h2d, d2h = measure_link(mb, repeats=3, device=dev)
    out["plain_link"] = {"h2d_gbps": h2d, "d2h_gbps": d2h}
    pl = out["program_link"]
    log(
        f"hw: inside a program host->device {pl['to_device_gbps']:.2f} GB/s, device->host {pl['to_host_gbps']:.2f} "
        "GB/s, "
        f"{100 * pl['overlap']['hidden_fraction']:.0f}% of a round trip hidden under matmuls; plain device_put "
        f"{h2d:.2f} / {d2h:.2f} GB/s"
    )
    stats = dev.memory_stats() or {}
    out["bytes_limit"] = int(stats["bytes_limit"]) if stats.get("bytes_limit") else None
    return out


# --- child: kernels ------------------------------------------------------------------------------

# Attention (value and gradient) per impl, and the routed experts' grouped matmul per impl against the
# capacity einsum (every expert given rows / experts rows), at the shapes the setups' models run.
KERNEL_CASES = {
    "attention": [
        # name, batch, seq, heads, kv_heads, qk dim, v dim, impls
        ("llama_1b heads (32 over 8, dim 64)", 8, 2048, 32, 8, 64, 64, ["xla", "blockwise", "splash"]),
        ("llama_1b heads, long rows", 2, 8192, 32, 8, 64, 64, ["blockwise", "splash"]),
        ("MLA-shaped heads (16, qk 96, v 64)", 8, 2048, 16, 16, 96, 64, ["blockwise", "splash"]),
    ],
    "experts": [
        # name, rows, experts, d_in, d_out, impls
        ("dsv3_100m's routed experts", 32768, 16, 512, 512, ["tiles", "ragged_dot", "megablox", "capacity"]),
        ("8 wide experts", 8192, 8, 4096, 8192, ["ragged_dot", "megablox", "capacity"]),
    ],
}
TOY_KERNEL_CASES = {
    "attention": [("toy heads", 2, 256, 4, 2, 32, 32, ["xla", "blockwise"])],
    "experts": [("toy experts", 512, 4, 64, 64, ["tiles", "ragged_dot", "capacity"])],
}


def _time_grad(fn, args, repeats: int) -> float:
    """Median seconds of fn's value and its inputs' cotangents for a fixed output cotangent, made once
    outside the timing (as zoo.tools.measure_hardware's op rates are timed). The records up to
    commit 3474cbb timed the gradient of a loss that built its cotangent (a cosine per output
    element) inside the timed program."""
    import jax

    from zoo.tools.measure_hardware import median_time, value_and_grad_call

    out = jax.eval_shape(fn, *args)
    ct = jax.random.normal(jax.random.key(1), out.shape, out.dtype)
    step = jax.jit(value_and_grad_call(fn))
    return median_time(lambda: jax.block_until_ready(step(ct, *args)), repeats)


def child_kernels(spec: dict) -> dict:
    import jax
    import jax.numpy as jnp

    from zoo.nn.attention_kernels import attend
    from zoo.nn.grouped_matmul import grouped_matmul

    cases = TOY_KERNEL_CASES if spec.get("toy") else KERNEL_CASES
    repeats = 3 if spec.get("toy") else 10
    keys = iter(jax.random.split(jax.random.key(0), 64))
    out = {"attention": [], "experts": [], "repeats": repeats, "dtype": "bfloat16"}
    for name, b, t, h, kvh, dqk, dv, impls in cases["attention"]:
        q = jax.random.normal(next(keys), (b, t, h, dqk), jnp.bfloat16)
        k = jax.random.normal(next(keys), (b, t, kvh, dqk), jnp.bfloat16)
        v = jax.random.normal(next(keys), (b, t, kvh, dv), jnp.bfloat16)
        row = {"case": name, "shape": f"{b} x {t}", "ms": {}}
        for impl in impls:
            try:
                fn = lambda q, k, v, impl=impl: attend(q, k, v, scale=dqk**-0.5, impl=impl)  # noqa: E731
                row["ms"][impl] = 1e3 * _time_grad(fn, (q, k, v), repeats)
            except Exception as e:  # noqa: BLE001 - recorded (an impl this backend lacks, or out of memory)
                row["ms"][impl] = _first_line(e)
        log(f"kernels: attention {name} {row['shape']}: {row['ms']}")
        out["attention"].append(row)
    for name, rows, e, d_in, d_out, impls in cases["experts"]:
        x = jax.random.normal(next(keys), (rows, d_in), jnp.bfloat16)
        w = jax.random.normal(next(keys), (e, d_in, d_out), jnp.bfloat16) * d_in**-0.5
        # Uneven groups (dropless routing is never balanced), summing to all rows.
        shares = jnp.linspace(0.5, 1.5, e)
        sizes = jnp.floor(rows * shares / shares.sum()).astype(jnp.int32)
        sizes = sizes.at[-1].add(rows - sizes.sum())
        row = {"case": name, "shape": f"{rows} rows, {e} experts, {d_in} -> {d_out}", "ms": {}}
        for impl in impls:
            try:
                if impl == "capacity":
                    fn = lambda x, w: jnp.einsum("ecd,edf->ecf", x.reshape(e, rows // e, d_in), w)  # noqa: E731
                else:
                    fn = lambda x, w, impl=impl: grouped_matmul(x, w, sizes, impl=impl)  # noqa: E731
                row["ms"][impl] = 1e3 * _time_grad(fn, (x, w), repeats)
            except Exception as e_:  # noqa: BLE001
                row["ms"][impl] = _first_line(e_)
        log(f"kernels: experts {name}: {row['ms']}")
        out["experts"].append(row)
    return out


# --- child: setups -------------------------------------------------------------------------------


def _hardware(spec: dict):
    """The planner's hardware: conf/hardware/tpu_v5e.yaml (its step efficiency included, as
    `--replan tpu_v5e` uses it), with the matmul rate and the link this run measured in its `hw` step
    when it ran one; for `--toy`, a CPU stand-in."""
    from omegaconf import OmegaConf

    from zoo.train.run_config import HardwareConfig, load_group

    hw = spec.get("hw") or {}
    limit = int(spec.get("limit_bytes") or 16909336064)
    if spec.get("toy"):
        return HardwareConfig(
            name="measured",
            peak_flops=PEAK_FLOPS,
            matmul_flops=(hw.get("matmul") or {}).get("flops_per_s") or PEAK_FLOPS * 0.9,
            hbm_bytes=limit,
            host_link_gbps=13.9,
            platform="cpu",
            note="bench/tpu.py --toy: a CPU stand-in",
        )
    profile = load_group("hardware", OmegaConf.load(ROOT / "conf" / "hardware" / "tpu_v5e.yaml"))
    link = hw.get("program_link") or {}
    if not (hw.get("matmul") and link):
        return dataclasses.replace(profile, hbm_bytes=limit)
    to_dev, to_host = link["to_device_gbps"], link["to_host_gbps"]
    return dataclasses.replace(
        profile,
        name="measured",
        matmul_flops=hw["matmul"]["flops_per_s"],
        hbm_bytes=limit,
        host_link_gbps=min(to_dev, to_host),
        host_to_device_gbps=to_dev,
        device_to_host_gbps=to_host,
        note="bench/tpu.py: tpu_v5e's profile with the matmul rate and link measured in the hw step of the same run",
    )


def _oom(e: BaseException) -> bool:
    s = str(e)
    return "RESOURCE_EXHAUSTED" in s or "Ran out of memory" in s or "out of memory" in s.lower()


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}"


def _state_key(trainer) -> tuple:
    c = trainer.cfg
    return (c.offload.params, c.offload.opt_state, c.model.moe.impl if c.model.moe else None)


def child_setups(spec: dict, result_path: pathlib.Path) -> dict:
    import contextlib

    import jax

    from bench import common as C
    from zoo.backend import lowering_for
    from zoo.counts import flops_per_token
    from zoo.hlo import rematerialized
    from zoo.train.metrics import device_memory

    aot = spec.get("aot", False)
    devices = _v5e_devices() if aot else jax.devices()[:1]
    target = (lambda: lowering_for("tpu")) if aot else contextlib.nullcontext
    hardware = _hardware(spec)
    res = {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
        "env": C.env_info(None if aot else devices),
        "setups": {},
    }
    for name in spec["setup_names"]:
        setup = spec["setups"][name]
        if time.time() > spec["deadline"] - 45:
            res["setups"][name] = {"status": "skipped", "reason": "budget"}
            continue
        runs, trainers, lowered = {}, {}, {}
        t0 = time.perf_counter()
        with target():
            for label in setup["policies"]:
                run = runs[label] = {"policy": label}
                try:
                    c, tr = build(setup, label, devices, hardware, spec.get("toy", False))
                    low, kept, secs = C.trace_lower(tr)
                except Exception as e:  # noqa: BLE001 - recorded; the other policies go on
                    run.update(status="error", error=f"trace: {_first_line(e)}")
                    continue
                from zoo.offload import resolve

                run.update(
                    actions=resolve(c.offload, c.model),
                    state=[c.offload.params, c.offload.opt_state],
                    kept_device_bytes=kept["device_bytes"],
                    offloaded_bytes=kept["host_bytes"] + kept["untagged_host_bytes"],
                    recompute_only=recompute_only(c.offload),
                    trace_s=secs["trace_s"] + secs["lower_s"],
                    kernels={"attention": tr.plan.attention_impl, "moe": tr.plan.moe_impl},
                )
                trainers[label], lowered[label] = tr, low
            t = time.perf_counter()
            live: dict = {}
            res["setups"][name] = {"setup": setup, "runs": runs}

            def record(label, exe, secs, runs=runs, live=live):
                # Written as each compile finishes: a process stopped at --budget-s keeps the finished ones.
                run = runs[label]
                run["compile_s"] = secs
                if isinstance(exe, Exception):
                    run.update(status="oom" if _oom(exe) else "error", error=_first_line(exe))
                else:
                    run.update(
                        status="compiled",
                        compiled_memory=C.compiled_memory(exe),
                        xla_flops_per_step=C.compiled_flops(exe),
                        xla_rematerialized_bytes=sum(v.bytes for v in rematerialized(exe.as_text())),
                        # What XLA holds together at its peak, besides the state (zoo.hlo.live_at_peak; unpadded sizes).
                        xla_live_at_peak_bytes=sum(v.bytes for v in live.get(label, [])) or None,
                        xla_live_at_peak=[
                            {"name": v.name, "bytes": v.bytes, "op_name": v.op_name}
                            for v in [v for v in live.get(label, []) if not v.argument][:12]
                        ],
                    )
                    try:
                        run["planner"] = C.planner_estimate(trainers[label].cfg, trainers[label], hardware.hbm_bytes)
                    except Exception as e:  # noqa: BLE001
                        run["planner"] = {"error": _first_line(e)}
                C.write_json(result_path, res)

            compiled = C.compile_many(
                [(k, low, trainers[k].compiler_options) for k, low in lowered.items()], spec["workers"], live, record
            )
            log(
                f"{name}: traced and compiled {len(lowered)} steps in {time.perf_counter() - t0:.1f}s "
                f"({time.perf_counter() - t:.1f}s compiling)"
            )
        res["setups"][name] = {"setup": setup, "runs": runs}
        C.write_json(result_path, res)
        if aot:
            continue

        # Run: one state per layout, the policies in alternation.
        ready = [k for k, r in runs.items() if r["status"] == "compiled"]
        states, init_s = {}, {}
        tokens = None
        times = {k: [] for k in ready}
        try:
            for label in ready:
                key = _state_key(trainers[label])
                if key not in states:
                    tr = trainers[label]
                    t = time.perf_counter()
                    init_key = tr.init_key(0)  # the backend's generator, as Trainer.init uses
                    low = jax.jit(tr._init, out_shardings=tr.state_shardings).lower(init_key)
                    t1 = time.perf_counter()
                    exe = low.compile()
                    t2 = time.perf_counter()
                    states[key] = jax.block_until_ready(exe(init_key))
                    init_s[str(key)] = {"lower_s": t1 - t, "compile_s": t2 - t1, "run_s": time.perf_counter() - t2}
                    tokens = tokens if tokens is not None else C.tokens_for(tr)
            res["setups"][name]["init"] = init_s
            for rnd in range(spec["rounds"]):
                for label in ready:
                    if time.time() > spec["deadline"]:
                        break
                    key, exe = _state_key(trainers[label]), compiled[label][0]
                    state = states[key]
                    try:
                        for i in range(1 + spec["steps"]):
                            t = time.perf_counter()
                            state, m = exe(state, tokens)
                            jax.block_until_ready(m)
                            if i:
                                times[label].append(time.perf_counter() - t)
                        runs[label]["loss"] = float(m["loss"])
                    except Exception as e:  # noqa: BLE001
                        runs[label].update(status="oom" if _oom(e) else "error", error=f"run: {_first_line(e)}")
                        ready = [k for k in ready if k != label]
                    states[key] = state
                C.write_json(result_path, res)
        except Exception as e:  # noqa: BLE001 - the setup's runs so far are kept
            res["setups"][name]["error"] = _first_line(e)
        mem = device_memory(devices)
        tokens_per_step = setup["batch"] * setup["seq"]
        for label, ts in times.items():
            if not ts:
                continue
            run = runs[label]
            step = statistics.median(ts)
            fl = flops_per_token(trainers[label].cfg.model, setup["seq"]) * tokens_per_step
            run.update(
                status="ok",
                step_times_s=ts,
                median_step_s=step,
                tokens_per_s=tokens_per_step / step,
                tflops=fl / step / 1e12,
                mfu=fl / step / PEAK_FLOPS,
                process_peak_bytes=(mem or {}).get("peak_bytes_in_use"),
            )
            log(
                f"{name} {label}: {1e3 * step:.1f} ms/step, {fl / step / 1e12:.1f} TFLOP/s (MFU "
                f"{100 * fl / step / PEAK_FLOPS:.1f}%)"
                + (
                    f", planner {1e3 * run['planner']['time_s']:.1f} ms"
                    if "time_s" in (run.get("planner") or {})
                    else ""
                )
            )
        del states
        C.write_json(result_path, res)
    return res


# --- parent --------------------------------------------------------------------------------------


def derive(res: dict) -> None:
    """Per setup: the fastest policy, the fastest recompute-only one, their ratio; exposed transfer
    against the on-device twin; the planner's errors."""
    for s in res.get("setups", {}).values():
        runs = s.get("runs") or {}
        ok = {k: r for k, r in runs.items() if r.get("status") == "ok"}
        for r in runs.values():
            peak = (r.get("compiled_memory") or {}).get("estimated_peak_bytes")
            p = r.get("planner") or {}
            if peak and p.get("peak_bytes"):
                r["planner_hbm_error"] = p["peak_bytes"] / peak - 1
            if r.get("median_step_s") and p.get("time_s"):
                r["planner_time_error"] = p["time_s"] / r["median_step_s"] - 1
        if not ok:
            continue
        best = min(ok, key=lambda k: ok[k]["median_step_s"])
        rec = {k: r for k, r in ok.items() if r.get("recompute_only")}
        s["fastest"] = best
        if rec:
            best_rec = min(rec, key=lambda k: rec[k]["median_step_s"])
            s["fastest_recompute_only"] = best_rec
            s["fastest_over_recompute_only"] = ok[best]["median_step_s"] / rec[best_rec]["median_step_s"]
        for k, r in ok.items():
            base = k.replace("+optimizer_host", "")
            if base != k and base in ok:
                r["over_state_on_device"] = r["median_step_s"] / ok[base]["median_step_s"]
        # Exposed transfer: an offloading run against the run that keeps the same tags on device (same state).
        for k, r in ok.items():
            if r.get("recompute_only") or "actions" not in r:
                continue
            kept = {t: ("device" if a == "offload" else a) for t, a in r["actions"].items()}
            twin = next(
                (j for j, q in runs.items() if q.get("actions") == kept and q.get("state") == ["device", "device"]),
                None,
            )
            if twin is not None:
                r["on_device_twin"] = twin
                if runs[twin].get("median_step_s"):
                    r["exposed_transfer_s"] = r["median_step_s"] - runs[twin]["median_step_s"]


def merge(records: list[dict]) -> dict:
    """Several runs' records as one (the chip's commands are limited in time, so a session is several):
    each setup keeps the command that measured it; a later record's setups, hardware figures and
    kernels replace an earlier one's."""
    out = {k: v for k, v in records[0].items() if k != "setups"}
    out["setups"] = {}
    for rec in records:
        for name, setup in (rec.get("setups") or {}).items():
            out["setups"][name] = {**setup, "command": setup.get("command") or rec.get("command")}
        for key in ("hw", "kernels"):
            if rec.get(key):
                out[key] = rec[key]
    if len(records) > 1:
        out["command"] = "; ".join(dict.fromkeys(r.get("command", "") for r in records))
    return out


def replan(res: dict, profile: str) -> None:
    """Replace each compiled run's planner estimate with zoo.tools.plan's from the hardware profile
    `profile` (traced here for a TPU: its kernels in Pallas' interpret mode; nothing compiles)."""
    import jax
    from omegaconf import OmegaConf

    from bench import common as C
    from zoo.backend import lowering_for, pallas_interpreted
    from zoo.train.run_config import load_group

    hw = load_group("hardware", OmegaConf.load(ROOT / "conf" / "hardware" / f"{profile}.yaml"))
    for s in (res.get("setups") or {}).values():
        for label, r in (s.get("runs") or {}).items():
            if r.get("status") not in ("ok", "compiled"):
                continue
            with lowering_for(hw.platform or jax.default_backend()), pallas_interpreted():
                c, tr = build(s["setup"], label, jax.devices()[:1], hw, False)
                r["planner"] = C.planner_estimate(c, tr, hw.hbm_bytes)
            r["planner"]["profile"] = profile


def mark_unfinished(setup: Optional[dict], budget_s: float) -> None:
    """A setup's runs that were traced and whose compile had not finished when the child process was
    stopped (each finished compile is recorded as it comes) become `timeout`, the others stay."""
    for run in ((setup or {}).get("runs") or {}).values():
        if "status" not in run:
            run.update(status="timeout", error=f"compile unfinished at --budget-s ({budget_s:.0f} s)")


def run_child(kind: str, spec: dict, workdir: pathlib.Path, env_extra: dict, timeout: float) -> dict:
    spec_path, result_path = workdir / f"{kind}_spec.json", workdir / f"{kind}_result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        "--child",
        kind,
        "--spec",
        str(spec_path),
        "--result",
        str(result_path),
    ]
    t = time.perf_counter()
    try:
        rc = subprocess.run(cmd, env={**os.environ, **env_extra}, timeout=max(30.0, timeout)).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    out = json.loads(result_path.read_text()) if result_path.exists() else {}
    out["process"] = {"returncode": rc, "wall_s": time.perf_counter() - t}
    return out


def _gb(b):
    return f"{b / 1e9:.2f}" if b else "-"


def markdown(res: dict) -> str:
    lines = []
    hw = res.get("hw") or {}
    if hw.get("program_link"):
        pl = hw["program_link"]
        lines.append(
            f"matmul {hw['matmul']['flops_per_s'] / 1e12:.1f} TFLOP/s; link inside a program: host->device "
            f"{pl['to_device_gbps']:.2f} GB/s, device->host {pl['to_host_gbps']:.2f} GB/s, "
            f"{100 * pl['overlap']['hidden_fraction']:.0f}% of a round trip hidden under matmuls; plain device_put "
            f"{hw['plain_link']['h2d_gbps']:.2f} / {hw['plain_link']['d2h_gbps']:.2f} GB/s\n"
        )
    kern = res.get("kernels") or {}
    if kern.get("attention") or kern.get("experts"):
        lines.append(
            f"Kernels, value and gradient ({kern.get('dtype')}, median of {kern.get('repeats')}), ms:\n\n"
            "| kernel | case | shape | per impl (ms) |\n|---|---|---|---|"
        )
        for kind in ("attention", "experts"):
            for row in kern.get(kind) or []:
                cells = ", ".join(
                    f"{impl} {ms:.2f}" if isinstance(ms, float) else f"{impl}: {ms.split(':')[0]}"
                    for impl, ms in row["ms"].items()
                )
                lines.append(f"| {kind} | {row['case']} | {row['shape']} | {cells} |")
        lines.append("")
    for name, s in (res.get("setups") or {}).items():
        if "runs" not in s:
            lines.append(f"**{name}**: {s.get('status')} ({s.get('reason', '')})\n")
            continue
        st = s["setup"]
        lines.append(
            f"**{name}**: {st['model'][0]} {st['model'][1] or ''}, batch {st['batch']} x {st['seq']}"
            + (f" in {st['grad_accum']} microbatches" if st.get("grad_accum", 1) > 1 else "")
            + f", xla={st['group']}"
            + (f"; fastest {s['fastest']}" if s.get("fastest") else "")
            + (
                f", fastest recompute-only {s['fastest_recompute_only']}, ratio "
                f"{s.get('fastest_over_recompute_only', float('nan')):.3f}"
                if s.get("fastest") and s.get("fastest_recompute_only")
                else ""
            )
        )
        if s.get("command"):
            lines.append(f"`{s['command']}`")
        lines.append("")
        lines.append(
            "| policy | status | step (ms) | TFLOP/s | MFU | XLA peak (GB) | offloaded (GB) | planner peak (GB) | "
            "planner step (ms) | compile (s) |"
        )
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for label, r in s["runs"].items():
            p = r.get("planner") or {}
            lines.append(
                f"| {label} | {r.get('status')} | {1e3 * r['median_step_s']:.1f}"
                + (f" ({r['over_state_on_device']:.2f}x on device)" if r.get("over_state_on_device") else "")
                + f" | {r['tflops']:.1f} | {100 * r['mfu']:.1f}% | "
                if r.get("median_step_s")
                else f"| {label} | {r.get('status')} | - | - | - | "
            )
            xla = _gb((r.get("compiled_memory") or {}).get("estimated_peak_bytes"))
            if r.get("xla_rematerialized_bytes"):  # XLA fitted it by recomputing values (zoo.hlo.rematerialized)
                xla += f" ({_gb(r['xla_rematerialized_bytes'])} rematerialized)"
            lines[-1] += (
                f"{xla} | {_gb(r.get('offloaded_bytes'))} | {_gb(p.get('peak_bytes'))} | {1e3 * p['time_s']:.1f} | "
                if p.get("time_s")
                else f"{xla} | {_gb(r.get('offloaded_bytes'))} | - | - | "
            )
            lines[-1] += f"{r.get('compile_s', 0):.1f} |"
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The setups where something ran (a setup where nothing fit is in the tables).
    setups = [
        (n, s)
        for n, s in (res.get("setups") or {}).items()
        if any(r.get("status") == "ok" for r in (s.get("runs") or {}).values())
    ]
    if not setups:
        return
    cols = min(4, len(setups))
    rows = -(-len(setups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 5.2 * rows), squeeze=False)
    for ax in axes.flat[len(setups) :]:
        ax.axis("off")
    for ax, (name, s) in zip(axes.flat, setups):
        labels = list(s["runs"])
        steps = [1e3 * (s["runs"][k].get("median_step_s") or 0) for k in labels]
        colors = [
            "tab:gray"
            if s["runs"][k].get("status") != "ok"
            else ("tab:blue" if s["runs"][k].get("recompute_only") else "tab:orange")
            for k in labels
        ]
        ax.bar(range(len(labels)), steps, color=colors)
        for x, k in enumerate(labels):
            r = s["runs"][k]
            peak = (r.get("compiled_memory") or {}).get("estimated_peak_bytes")
            text = f"{peak / 1e9:.1f} GB" if r.get("status") == "ok" and peak else r.get("status", "")
            ax.annotate(text, (x, steps[x]), ha="center", fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([k.replace(",", ",\n") for k in labels], rotation=30, ha="right", fontsize=6)
        ax.set_ylabel("step (ms); blue recompute-only, orange offload, gray did not run", fontsize=7)
        st = s["setup"]
        ax.set_title(f"{name}: {st['model'][0]} {st['batch']}x{st['seq']}", fontsize=9)
    env = (res.get("hw") or {}).get("env") or {}
    fig.suptitle(
        f"bench/tpu.py{' --toy' if res.get('toy') else ''} {env.get('date_utc', '')} "
        f"{(env.get('device') or {}).get('kind', '')}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toy", action="store_true", help="tiny models on any backend: a smoke test of the whole pipeline")
    ap.add_argument(
        "--aot",
        action="store_true",
        help="compile the setups for a TPU v5e on this machine (libtpu, no TPU): memory only",
    )
    ap.add_argument(
        "--setups",
        default=None,
        help=f"comma list of {', '.join(SETUPS)}, and `kernels` (the attention and grouped-matmul kernels timed)",
    )
    ap.add_argument("--batch", type=int, default=None, help="override every chosen setup's batch")
    ap.add_argument(
        "--policies",
        default=None,
        help="override every chosen setup's policies, separated by ';' (a policy's tag actions use commas)",
    )
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=500.0)
    ap.add_argument("--no-hw", action="store_true")
    ap.add_argument("--out", default="bench_tpu.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument(
        "--render",
        default=None,
        help="print the tables of recorded --out JSONs (comma list: later setups replace earlier); nothing runs",
    )
    ap.add_argument("--merged", default=None, help="with --render: write the records merged into one JSON here")
    ap.add_argument(
        "--replan",
        default=None,
        metavar="PROFILE",
        help=(
            "with --render: the planner's estimates again, from conf/hardware/PROFILE.yaml (e.g. tpu_v5e), "
            "on this machine"
        ),
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        from bench import common as C

        spec = json.loads(pathlib.Path(args.spec).read_text())
        children = {"hw": child_hw, "kernels": child_kernels}
        out = children[args.child](spec) if args.child in children else child_setups(spec, pathlib.Path(args.result))
        C.write_json(pathlib.Path(args.result), out)
        return 0
    if args.render:
        res = merge([json.loads(pathlib.Path(f).read_text()) for f in args.render.split(",")])
        if args.merged:
            pathlib.Path(args.merged).write_text(json.dumps(res, indent=1) + "\n")
        if args.replan:
            replan(res, args.replan)
        derive(res)
        print(markdown(res))
        if args.plot:
            plot(res, pathlib.Path(args.plot))
        return 0

    from bench import common as C

    t_start = time.time()
    table = TOY_SETUPS if args.toy else SETUPS
    names = args.setups.split(",") if args.setups else [*table, "kernels"]
    kernels = "kernels" in names
    names = [n for n in names if n != "kernels"]
    for n in names:
        if n not in table:
            print(f"error: --setups: unknown setup {n!r}; choose from {', '.join(table)}", file=sys.stderr)
            return 2
    setups = {n: dict(table[n]) for n in names}
    for s in setups.values():
        if args.batch:
            s["batch"] = args.batch
        if args.policies:
            s["policies"] = [x for x in args.policies.split(";") if x]
    spec = {
        "setups": setups,
        "toy": args.toy,
        "aot": args.aot,
        "rounds": args.rounds or (1 if args.toy else 3),
        "steps": args.steps or 2,
        "workers": min(8, os.cpu_count() or 1),
        "deadline": t_start + args.budget_s,
        "matmul_n": 256 if args.toy else 8192,
        "matmul_dtype": "bfloat16",
        "transfer_mb": 16.0 if args.toy else 512.0,
    }
    out = pathlib.Path(args.out)
    workdir = out.parent / (out.stem + "_work")
    workdir.mkdir(parents=True, exist_ok=True)
    res = {
        "schema": SCHEMA,
        "command": " ".join(["python", "bench/tpu.py", *(argv if argv is not None else sys.argv[1:])]),
        "toy": args.toy,
        "aot": args.aot,
        "setups": {},
    }
    env = {"PYTHONUNBUFFERED": "1"}
    if args.aot:
        env["JAX_PLATFORMS"] = "cpu"  # the TPU is a topology here: nothing runs
    if not (args.no_hw or args.aot):
        res["hw"] = run_child("hw", spec, workdir, env, args.budget_s)
        spec["hw"] = res["hw"]
        spec["limit_bytes"] = res["hw"].get("bytes_limit")
        C.write_json(out, res)
    if kernels and not args.aot:
        res["kernels"] = run_child("kernels", spec, workdir, env, t_start + args.budget_s - time.time())
        C.write_json(out, res)
    groups = dict.fromkeys(s["group"] for s in setups.values())
    for g in groups:
        mine = [n for n, s in setups.items() if s["group"] == g]
        flags = C.xla_group_flags(g)
        tpu_flags = _tpu_flags(g)
        extra = dict(env, XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip())
        if tpu_flags and not args.toy:
            extra["LIBTPU_INIT_ARGS"] = " ".join([os.environ.get("LIBTPU_INIT_ARGS", ""), *tpu_flags]).strip()
        got = run_child(
            f"setups_{g}", dict(spec, setup_names=mine), workdir, extra, t_start + args.budget_s + 60 - time.time()
        )
        for n in mine:
            mark_unfinished((got.get("setups") or {}).get(n), args.budget_s)
            res["setups"][n] = (got.get("setups") or {}).get(n) or {
                "status": "lost",
                "reason": f"process {got.get('process')}",
            }
        res.setdefault("processes", {})[g] = {
            k: got.get(k) for k in ("process", "xla_flags", "libtpu_init_args", "env")
        }
        derive(res)
        C.write_json(out, res)
    res["wall_s"] = time.time() - t_start
    derive(res)
    C.write_json(out, res)
    md = markdown(res)
    print(md)
    if args.md:
        pathlib.Path(args.md).write_text(md + "\n")
    if args.plot:
        plot(res, pathlib.Path(args.plot))
    log(f"wrote {out}" + (f" and {args.plot}" if args.plot else "") + f"; {res['wall_s']:.0f}s in all")
    return 0


def _tpu_flags(group: str) -> list[str]:
    import yaml

    return list(yaml.safe_load((ROOT / "conf" / "xla" / f"{group}.yaml").read_text()).get("tpu_flags") or [])


if __name__ == "__main__":
    raise SystemExit(main())
