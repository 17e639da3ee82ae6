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
import sys
import time

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
    mark_unfinished,  # noqa: F401 - bench/tpu.py's parent marks a stopped child's unfinished compiles
    parser,
    past,
    pyplot,
    render,
    round_order,
    save_figure,
    timed_steps,
    workdir_for,
)

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
# The setups run after the step model's fit (conf/hardware/tpu_v5e.yaml: step_efficiency, recompute_cost,
# activation_passes, recompute_passes), to test it out of sample: `--fit` leaves them out.
OUT_OF_SAMPLE = ("moe_none_2048", "dense_none_4096", "mixtral_none", "qwen3_moe_none")
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


def parse_policy(label: str):
    """`presets[+preset][:tag=action,...][@moe_impl]` -> (OffloadConfig, moe impl or None)."""
    from zoo.offload import policy_from_label

    label, _, moe = label.partition("@")
    return policy_from_label(label), (moe or None)


def recompute_only(o) -> bool:
    from zoo.train.run import uses_host_memory

    return not uses_host_memory(o)


def build(setup: dict, label: str, devices, hardware, toy: bool):
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
                row["ms"][impl] = first_line(e)
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
                row["ms"][impl] = first_line(e_)
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


def _state_key(trainer) -> tuple:
    c = trainer.cfg
    return (c.offload.params, c.offload.opt_state, c.model.moe.impl if c.model.moe else None)


def child_setups(spec: dict, result_path: pathlib.Path) -> dict:
    """One XLA group's setups, each: every policy traced and compiled (threads), then run in alternation
    (`_alternate`); the record rewritten to `result_path` after every compile and round."""
    import jax

    aot = spec.get("aot", False)
    devices = _v5e_devices() if aot else jax.devices()[:1]
    hardware = _hardware(spec)
    res = {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
        "env": C.env_info(None if aot else devices),
        "setups": {},
    }
    for name in spec["setup_names"]:
        setup = spec["setups"][name]
        if past(spec["deadline"], 45):
            res["setups"][name] = {"status": "skipped", "reason": "budget"}
            continue
        runs, trainers, compiled = _compile_setup(name, setup, spec, devices, hardware, res, result_path)
        res["setups"][name] = {"setup": setup, "runs": runs}
        C.write_json(result_path, res)
        if aot:
            continue
        times = _alternate(res["setups"][name], spec, trainers, compiled, res, result_path)
        _record_times(name, res["setups"][name], trainers, times, devices)
        C.write_json(result_path, res)
    return res


def _trace_policies(setup: dict, spec: dict, devices, hardware) -> tuple[dict, dict, dict]:
    """Every policy of `setup` traced and lowered: (runs, trainers, lowered), a failed one recorded."""
    from zoo.offload import resolve

    runs, trainers, lowered = {}, {}, {}
    for label in setup["policies"]:
        run = runs[label] = {"policy": label}
        try:
            c, tr = build(setup, label, devices, hardware, spec.get("toy", False))
            low, kept, secs = C.trace_lower(tr)
        except Exception as e:  # noqa: BLE001 - recorded; the other policies go on
            run.update(status="error", error=f"trace: {first_line(e)}")
            continue
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
    return runs, trainers, lowered


def _compiled_run(run: dict, exe, live: list, trainer, hardware) -> None:
    """A compiled policy's record: XLA's memory and FLOPs, what it rematerialized and holds at its peak,
    and the planner's estimate of it."""
    from zoo.hlo import rematerialized

    run.update(
        status="compiled",
        compiled_memory=C.compiled_memory(exe),
        xla_flops_per_step=C.compiled_flops(exe),
        xla_rematerialized_bytes=sum(v.bytes for v in rematerialized(exe.as_text())),
        # What XLA holds together at its peak, besides the state (zoo.hlo.live_at_peak; unpadded sizes).
        xla_live_at_peak_bytes=sum(v.bytes for v in live) or None,
        xla_live_at_peak=[
            {"name": v.name, "bytes": v.bytes, "op_name": v.op_name} for v in [v for v in live if not v.argument][:12]
        ],
    )
    try:
        run["planner"] = C.planner_estimate(trainer.cfg, trainer, hardware.hbm_bytes)
    except Exception as e:  # noqa: BLE001
        run["planner"] = {"error": first_line(e)}


def _compile_setup(name, setup, spec, devices, hardware, res, result_path) -> tuple[dict, dict, dict]:
    """Trace and compile `setup`'s policies (for a v5e here with --aot). Returns (runs, trainers, compiled)."""
    import contextlib

    from zoo.backend import lowering_for

    t0 = time.perf_counter()
    with lowering_for("tpu") if spec.get("aot", False) else contextlib.nullcontext():
        runs, trainers, lowered = _trace_policies(setup, spec, devices, hardware)
        t = time.perf_counter()
        live: dict = {}
        res["setups"][name] = {"setup": setup, "runs": runs}

        def record(label, exe, secs):
            # Written as each compile finishes: a process stopped at --budget-s keeps the finished ones.
            run = runs[label]
            run["compile_s"] = secs
            if isinstance(exe, Exception):
                run.update(status="oom" if is_oom(exe) else "error", error=first_line(exe))
            else:
                _compiled_run(run, exe, live.get(label, []), trainers[label], hardware)
            C.write_json(result_path, res)

        items = [(k, low, trainers[k].compiler_options) for k, low in lowered.items()]
        compiled = C.compile_many(items, spec["workers"], live, record)
        log(
            f"{name}: traced and compiled {len(lowered)} steps in {time.perf_counter() - t0:.1f}s "
            f"({time.perf_counter() - t:.1f}s compiling)"
        )
    return runs, trainers, compiled


def _init_states(trainers: dict, labels) -> tuple[dict, dict]:
    """One initial state per state layout (parameters, optimizer state, experts' kernel), its lowering,
    compile and run timed: (states, seconds)."""
    import jax

    states, init_s = {}, {}
    for label in labels:
        key = _state_key(trainers[label])
        if key in states:
            continue
        tr = trainers[label]
        t = time.perf_counter()
        init_key = tr.init_key(0)  # the backend's generator, as Trainer.init uses
        low = jax.jit(tr._init, out_shardings=tr.state_shardings).lower(init_key)
        t1 = time.perf_counter()
        exe = low.compile()
        t2 = time.perf_counter()
        states[key] = jax.block_until_ready(exe(init_key))
        init_s[str(key)] = {"lower_s": t1 - t, "compile_s": t2 - t1, "run_s": time.perf_counter() - t2}
    return states, init_s


def _alternate(entry: dict, spec: dict, trainers: dict, compiled: dict, res: dict, result_path) -> dict:
    """The compiled policies in alternation: `spec["rounds"]` rounds of a warm-up and `spec["steps"]` timed
    steps each, up to the deadline. Returns {label: step seconds}; a run that fails is recorded."""

    runs = entry["runs"]
    ready = [k for k, r in runs.items() if r["status"] == "compiled"]
    times = {k: [] for k in ready}
    try:
        states, entry["init"] = _init_states(trainers, ready)
        tokens = C.tokens_for(trainers[ready[0]]) if ready else None
        for rnd in range(spec["rounds"]):
            for label in round_order(ready, rnd, rotate=False):
                if past(spec["deadline"]):
                    break
                key, exe = _state_key(trainers[label]), compiled[label][0]
                state = states[key]
                try:
                    state, m, ts = timed_steps(exe, state, tokens, warmup=1, steps=spec["steps"], block_state=False)
                    times[label] += ts
                    runs[label]["loss"] = float(m["loss"])
                except Exception as e:  # noqa: BLE001
                    runs[label].update(status="oom" if is_oom(e) else "error", error=f"run: {first_line(e)}")
                    ready = [k for k in ready if k != label]
                states[key] = state
            C.write_json(result_path, res)
    except Exception as e:  # noqa: BLE001 - the setup's runs so far are kept
        entry["error"] = first_line(e)
    return times


def _record_times(name: str, entry: dict, trainers: dict, times: dict, devices) -> None:
    """Per policy that ran: its median step, throughput and MFU, and the process's memory high-water mark."""
    from zoo.counts import flops_per_token
    from zoo.train.metrics import device_memory

    setup, runs = entry["setup"], entry["runs"]
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
        planned = (run.get("planner") or {}).get("time_s")
        log(
            f"{name} {label}: {1e3 * step:.1f} ms/step, {fl / step / 1e12:.1f} TFLOP/s (MFU "
            f"{100 * fl / step / PEAK_FLOPS:.1f}%)" + (f", planner {1e3 * planned:.1f} ms" if planned else "")
        )


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


def as_record(rec: dict, stem: str = "") -> dict:
    """A record this script reads: its own, or bench/peer_maxtext.py's (its Zoo runs, each shape a setup
    marked `peer`, out of the step model's fit; `as_tpu_record`), its setups named after the file's
    `stem` beyond the first (bench_maxtext), so that two records of one shape both count."""
    if rec.get("schema") == "zoo.bench.maxtext/1":
        from bench.maxtext_shapes import as_tpu_record

        out = as_tpu_record(rec)
        if stem and stem != "bench_maxtext":
            out["setups"] = {f"{n}_{stem.removeprefix('bench_maxtext_')}": s for n, s in out["setups"].items()}
        return out
    return rec


def load_profile(profile: str):
    """conf/hardware/<profile>.yaml as the planner reads it."""
    from omegaconf import OmegaConf

    from zoo.train.run_config import load_group

    return load_group("hardware", OmegaConf.load(ROOT / "conf" / "hardware" / f"{profile}.yaml"))


def traced_runs(res: dict, hw):
    """(setup name, label, run, config, trainer) of each compiled run of the record, its step built again
    here for the profile `hw` (traced for a TPU: its kernels in Pallas' interpret mode; nothing compiles)."""
    import jax

    from zoo.backend import lowering_for, pallas_interpreted

    for name, s in (res.get("setups") or {}).items():
        for label, r in (s.get("runs") or {}).items():
            if r.get("status") not in ("ok", "compiled"):
                continue
            with lowering_for(hw.platform or jax.default_backend()), pallas_interpreted():
                c, tr = build(s["setup"], label, jax.devices()[:1], hw, False)
                yield name, label, r, c, tr


def replan(res: dict, profile: str) -> None:
    """Replace each compiled run's planner estimate with zoo.tools.plan's from the hardware profile
    `profile` (traced here; nothing compiles)."""
    hw = load_profile(profile)
    for _, _, r, c, tr in traced_runs(res, hw):
        r["planner"] = C.planner_estimate(c, tr, hw.hbm_bytes)
        r["planner"]["profile"] = profile


def _within(errors: list, bound: float) -> int:
    return sum(abs(e) <= bound + 1e-12 for e in errors)


def planner_counts(res: dict) -> str:
    """How many of the record's runs (derived: `planner_time_error`, `planner_hbm_error`) the planner's
    estimate puts within 10% and 15% of the chip: the counts docs/benchmarks.md, docs/offload.md, the
    README and conf/hardware/tpu_v5e.yaml quote (tests/test_bench.py checks them against this)."""
    ok = [
        r for s in (res.get("setups") or {}).values() for r in (s.get("runs") or {}).values() if r.get("status") == "ok"
    ]
    step = [r["planner_time_error"] for r in ok if "planner_time_error" in r]
    dense = [
        r["planner_time_error"] for r in ok if "planner_time_error" in r and not (r.get("kernels") or {}).get("moe")
    ]
    moe = [r["planner_time_error"] for r in ok if "planner_time_error" in r and (r.get("kernels") or {}).get("moe")]
    hbm = [r["planner_hbm_error"] for r in ok if "planner_hbm_error" in r]
    remat = []  # against XLA's peak plus what it rematerialized: the program as written
    for r in ok:
        peak = (r.get("compiled_memory") or {}).get("estimated_peak_bytes")
        if peak and (r.get("planner") or {}).get("peak_bytes"):
            remat.append(r["planner"]["peak_bytes"] / (peak + (r.get("xla_rematerialized_bytes") or 0)) - 1)
    return "\n".join(
        [
            f"the planner against the chip, {len(ok)} runs:",
            f"- step: {_within(step, 0.15)} of {len(step)} within 15%, {_within(step, 0.10)} within 10%; "
            f"dense {_within(dense, 0.15)} of {len(dense)}, MoE {_within(moe, 0.15)} of {len(moe)} within 15%",
            f"- HBM: {_within(hbm, 0.10)} of {len(hbm)} within 10%, {_within(hbm, 0.15)} within 15%; "
            f"against XLA's peak plus what it rematerialized {_within(remat, 0.10)} of {len(remat)} within 10%",
        ]
    )


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
    plt = pyplot()
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
    save_figure(fig, path)


def _parser() -> argparse.ArgumentParser:
    ap = parser(__doc__, "bench_tpu.json")
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
            "on this machine, and how many are within 10% and 15% of the chip"
        ),
    )
    ap.add_argument(
        "--fit",
        default=None,
        metavar="RECORD",
        help=(
            "refit the step model (step_efficiency, recompute_cost, activation_passes, recompute_passes) over "
            "RECORD's runs and rewrite them in conf/hardware/<--profile>.yaml (bench/step_fit.py); nothing runs"
        ),
    )
    ap.add_argument("--profile", default="tpu_v5e", help="with --fit: the hardware profile (default tpu_v5e)")
    ap.add_argument("--dry-run", action="store_true", help="with --fit: print the fitted values, write nothing")
    ap.add_argument(
        "--fit-tolerance",
        type=float,
        default=0.005,
        help="with --fit: keep the profile's values where their squared error is within this fraction of the "
        "best fit's (default 0.005; 0 always refits)",
    )
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        children = {"hw": lambda s, _: child_hw(s), "kernels": lambda s, _: child_kernels(s), "setups": child_setups}
        return child_main(args, children)
    if args.render:
        return _render(args)
    if args.fit:
        from bench import step_fit

        return step_fit.main(
            args.fit,
            args.profile,
            sys.modules[__name__],
            dry_run=args.dry_run,
            out_of_sample=OUT_OF_SAMPLE,
            tolerance=args.fit_tolerance,
        )

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
    res = {"schema": SCHEMA, "command": command_line("bench/tpu.py", argv), "toy": args.toy, "aot": args.aot}
    runner = Runner(pathlib.Path(__file__).resolve(), workdir_for(out), out, {**res, "setups": {}}, derive)
    _run_children(runner, args, spec, kernels, t_start)
    runner.res["wall_s"] = time.time() - t_start
    runner.save()
    finish(runner.res, args, markdown, plot)
    return 0


def _run_children(runner: Runner, args, spec: dict, kernels: bool, t_start: float) -> None:
    """The hardware child, the kernels' child, then one child per XLA group of the setups."""
    res, setups = runner.res, spec["setups"]
    env = {"PYTHONUNBUFFERED": "1"}
    if args.aot:
        env["JAX_PLATFORMS"] = "cpu"  # the TPU is a topology here: nothing runs
    if not (args.no_hw or args.aot):
        res["hw"] = runner.child("hw", spec, env, args.budget_s)
        spec["hw"] = res["hw"]
        spec["limit_bytes"] = res["hw"].get("bytes_limit")
        runner.save()
    if kernels and not args.aot:
        res["kernels"] = runner.child("kernels", spec, env, t_start + args.budget_s - time.time())
        runner.save()
    for g in dict.fromkeys(s["group"] for s in setups.values()):
        mine = [n for n, s in setups.items() if s["group"] == g]
        extra = dict(env, XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), *C.xla_group_flags(g)]).strip())
        tpu_flags = _tpu_flags(g)
        if tpu_flags and not args.toy:
            extra["LIBTPU_INIT_ARGS"] = " ".join([os.environ.get("LIBTPU_INIT_ARGS", ""), *tpu_flags]).strip()
        timeout = t_start + args.budget_s + 60 - time.time()
        got = runner.child("setups", dict(spec, setup_names=mine), extra, timeout, name=f"setups_{g}")
        for n in mine:
            mark_unfinished((got.get("setups") or {}).get(n), args.budget_s)
            res["setups"][n] = (got.get("setups") or {}).get(n) or {
                "status": "lost",
                "reason": f"process {got.get('process')}",
            }
        res.setdefault("processes", {})[g] = {
            k: got.get(k) for k in ("process", "xla_flags", "libtpu_init_args", "env")
        }
        runner.save()


def _render(args) -> int:
    res = merge([json.loads(pathlib.Path(f).read_text()) for f in args.render.split(",")])
    if args.merged:
        pathlib.Path(args.merged).write_text(json.dumps(res, indent=1) + "\n")
    if args.replan:
        replan(res, args.replan)
    derive(res)
    return render(res, args, (lambda r: markdown(r) + "\n" + planner_counts(r)) if args.replan else markdown, plot)


def _tpu_flags(group: str) -> list[str]:
    import yaml

    return list(yaml.safe_load((ROOT / "conf" / "xla" / f"{group}.yaml").read_text()).get("tpu_flags") or [])


if __name__ == "__main__":
    raise SystemExit(main())
