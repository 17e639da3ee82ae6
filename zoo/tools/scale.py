"""The scale report: what one device holds and moves in the compiled train step.

`python -m zoo.tools.inspect_step` adds it to its output and to inspect.json (key `scale`), at any size; at the
real sizes it is the point (`docs/scale.md`: DeepSeek-V3 671B and Llama 3.1 405B on 128 simulated
CPU devices). Per device:

- state: parameter, gradient and optimizer-state bytes, from the abstract state and the step's
  shardings (nothing allocated). Gradients mirror the parameters (same dtypes and shardings: the
  backward pass reduce-scatters them to the parameters' layout before the update).
- the kept layer inputs: the layer scans' `[layers, batch, positions, embed]` arrays as the
  partitioned program holds them (`kept_layer_inputs`; positions are seq_len / tensor under
  sequence parallelism), the figure the planner's `decoder_layer_input` models.
- the compiled memory analysis (`zoo.train.metrics.compiled_memory`, as inspect reports it).
- every collective of the step by kind, with its instructions, executions per step (loop trip
  counts multiplied in: a collective inside the layer scan runs once per layer) and bytes per
  step, split by element type (`zoo.hlo`). Bytes are the larger side of each collective per device
  and execution (an all-gather's gathered result, a reduce-scatter's input, an all-reduce's or
  all-to-all's buffer); a ring sends (g-1)/g of that for gathers, scatters and all-to-alls over g
  devices, 2(g-1)/g for all-reduces. Collectives over groups of one device move nothing and are
  left out.

Collectives are read twice: from the compiled executable (what runs on this backend) and from the
HLO right after SPMD partitioning (the same compile, dumped): XLA:CPU widens bf16 collectives to
float32 after partitioning, so on CPU the partitioned program holds the dtypes (and bytes) a GPU
would move, and the compiled one what XLA:CPU's combiners and rewrites made of them.
"""

import math
import re
from typing import Optional

import jax
import jax.numpy as jnp

from zoo import hlo
from zoo.model import stack_layout
from zoo.nn.moe_dispatch import expert_capacity
from zoo.sharding import logical_ways
from zoo.tools.kit import fmt_bytes, text_table
from zoo.plan.traced import per_device_bytes
from zoo.train.config_checks import exchange_rounds_block, routed_tokens_per_device

LARGEST = 12  # collectives listed one by one (by bytes per step)


def state_bytes(trainer) -> dict:
    """Per device: `params`, `grads`, `opt_state`, their `total`; and `global_params` (all devices)."""
    params, _ = per_device_bytes(trainer.abstract_params, trainer.param_shardings)
    abstract_opt = jax.eval_shape(trainer.tx.init, trainer.abstract_params)
    opt, _ = per_device_bytes(abstract_opt, trainer.opt_shardings)
    whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_params))
    out = {
        "params": int(params),
        "grads": int(params),
        "opt_state": int(opt),
        "total": int(2 * params + opt),
        "global_params": int(whole),
    }
    if getattr(trainer, "lora", None) is not None:
        # LoRA: `params` are the adapters; the frozen base has no gradient and no optimizer state.
        base, _ = per_device_bytes(trainer.abstract_base, trainer.base_shardings)
        kinds = sorted(
            {
                sh.memory_kind or "device"
                for sh in jax.tree.leaves(
                    trainer.base_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
                )
            }
        )
        out.update(frozen_base=int(base), frozen_base_memory="/".join(kinds), total=int(2 * params + opt + base))
    return out


def state_dtypes(trainer) -> dict:
    """Element types of the parameters and of the optimizer state (leaves with a shape)."""
    abstract_opt = jax.eval_shape(trainer.tx.init, trainer.abstract_params)

    def kinds(tree):
        return sorted({str(x.dtype) for x in jax.tree.leaves(tree) if getattr(x, "ndim", 0)})

    return {
        "params": kinds(trainer.abstract_params),
        "grads": kinds(trainer.abstract_params),
        "opt_state": kinds(abstract_opt),
        "compute": trainer.cfg.model.compute_dtype,
    }


def _largest(found: list) -> list[dict]:
    moving = sorted((c for c in found if not c.trivial), key=lambda c: -c.bytes * c.executions)
    return [
        {
            "kind": c.kind,
            "shape": " ".join(map(str, c.results or c.operands)),
            "dtypes": sorted(c.dtypes),
            "group_size": c.group_size,
            "executions": c.executions,
            "bytes_per_execution": c.bytes,
            "bytes": c.bytes * c.executions,
            "trip_count_known": c.trip_count_known,
            "op_name": c.op_name,
        }
        for c in moving[:LARGEST]
    ]


def collective_report(text: str) -> dict:
    """Collectives of one HLO module's text: totals by kind, by kind and dtype, the largest ones."""
    found = hlo.collectives(text)
    return {
        "by_kind": hlo.summarize(found),
        "by_kind_and_dtype": hlo.by_kind_and_dtype(found),
        "largest": _largest(found),
        "unknown_trip_counts": sum(1 for c in found if not c.trivial and not c.trip_count_known),
    }


def kept_layer_inputs(trainer, text: str, per_device_batch: int) -> Optional[dict]:
    """The layer inputs the step keeps for the backward, as one device holds them in `text` (an HLO
    module, per-device shapes): per stack, the largest array `[layers, batch, positions, embed]` of the
    layer scan, times the stack's period (one such array per position in the period). Its
    `positions` dim says whether sequence parallelism splits it (seq_len / tensor) or not (seq_len).
    None where the program holds no such array (nothing kept, or one device with the batch of 1
    folded away)."""
    embed = trainer.cfg.model.hidden_size
    stacks, total = [], 0
    for name, _, period, repeats in stack_layout(trainer.cfg.model):
        pattern = re.compile(rf"\b([a-z]+[0-9]*)\[{repeats},{per_device_batch},(\d+),{embed}\]")
        found = {(dtype, int(positions)) for dtype, positions in pattern.findall(text)}
        if not found:
            continue
        dtype, positions = max(found, key=lambda f: f[1] * hlo.dtype_bytes(f[0]))
        nbytes = period * repeats * per_device_batch * positions * embed * hlo.dtype_bytes(dtype)
        stacks.append(
            {
                "stack": name,
                "shape": f"{dtype}[{repeats},{per_device_batch},{positions},{embed}]",
                "arrays": period,
                "bytes": nbytes,
            }
        )
        total += nbytes
    return {"stacks": stacks, "bytes": total} if stacks else None


def whole_vocabulary_buffers(text: str, vocab_size: int) -> Optional[dict]:
    """The largest array of `text` (an HLO module, per-device shapes) that holds the whole vocabulary
    dim: the embedding, the head or a gradient of either not split over the vocabulary on this
    device. None where every vocabulary-sized dim is split."""
    found: dict[str, int] = {}
    for dtype, dims in re.findall(r"\b([a-z]+[0-9]*)\[([\d,]+)\]", text):
        shape = tuple(int(d) for d in dims.split(","))
        if vocab_size in shape:
            found[f"{dtype}[{dims}]"] = math.prod(shape) * hlo.dtype_bytes(dtype)
    if not found:
        return None
    shape, nbytes = max(found.items(), key=lambda kv: kv[1])
    return {"largest": shape, "bytes": nbytes, "shapes": len(found)}


def routed_experts(trainer) -> Optional[dict]:
    """The routed experts' kernel and, under expert parallelism, the bytes one device sends per
    exchange (per round, for the dropless kernel: zoo.nn.expert_rounds) against its assignments'
    (None for a dense model)."""
    cfg, c = trainer.cfg, trainer.cfg.model
    if not c.num_moe_layers:
        return None
    m, sizes = c.moe, trainer.plan.mesh.sizes
    ep = logical_ways(trainer.rules, sizes, "experts")
    tokens = routed_tokens_per_device(cfg, sizes, trainer.plan.microbatch)
    row = c.hidden_size * jnp.dtype(c.compute_dtype).itemsize
    k, experts, impl = m.num_experts_per_tok, m.n_routed_experts, trainer.plan.moe_impl
    block = exchange_rounds_block(cfg, sizes, trainer.plan.microbatch)
    if block is not None:
        sent = ep * block * row
    else:
        sent = experts * expert_capacity(tokens, k, experts, m.capacity_factor) * row
    return {
        "impl": impl,
        "expert_ways": ep,
        "assignment_bytes": tokens * k * row,
        "exchange_bytes": sent if ep > 1 else 0,
        "exchange": None if ep == 1 else ("rounds" if block is not None else "blocks"),
        "round_rows": block,
        "exchange_factor": m.exchange_factor if block is not None else None,
        "capacity_factor": m.capacity_factor if impl == "capacity" else None,
    }


def scale_report(trainer, compiled, partitioned_text: Optional[str]) -> dict:
    """inspect.json's `scale` (docs/offload.md, "The scale report")."""
    sizes = trainer.plan.mesh.sizes
    per_device_batch = trainer.plan.microbatch // max(1, logical_ways(trainer.rules, sizes, "batch"))
    return {
        "devices": int(trainer.mesh.devices.size),
        "mesh": dict(sizes),
        "sequence_parallel": bool(trainer.cfg.mesh.sequence_parallel),
        "context_parallel": trainer.cfg.mesh.context_parallel,  # its mesh axis, or None
        "per_device_batch": per_device_batch,
        # Read from the partitioned program: its dtypes are a GPU's (XLA:CPU widens bf16 later).
        "kept_layer_inputs": kept_layer_inputs(trainer, partitioned_text or compiled.as_text(), per_device_batch),
        "whole_vocabulary": whole_vocabulary_buffers(
            partitioned_text or compiled.as_text(), trainer.cfg.model.vocab_size
        ),
        "routed_experts": routed_experts(trainer),
        "state_bytes_per_device": state_bytes(trainer),
        "dtypes": state_dtypes(trainer),
        "collectives": {
            "compiled": collective_report(compiled.as_text()),
            "partitioned": None if partitioned_text is None else collective_report(partitioned_text),
        },
    }


def compile_step(trainer, lowered):
    """`(compiled, HLO text after SPMD partitioning)` from one compile; the text is None on one
    device (nothing is partitioned)."""
    if trainer.mesh.devices.size == 1:
        return lowered.compile(), None
    return hlo.compile_with_partitioned_hlo(lowered)


def _routed_experts_line(moe: dict) -> str:
    kernel = (
        "ragged (dropless)"
        if moe["impl"] == "ragged"
        else f"capacity (drops past {moe['capacity_factor']:g}x the mean load)"
    )
    line = f"routed experts: {kernel}"
    if not moe["exchange"]:
        return line + ", each device's own tokens on every expert"
    ratio = moe["exchange_bytes"] / moe["assignment_bytes"]
    if moe["exchange"] == "rounds":
        return line + (
            f", over {moe['expert_ways']} expert shards in rounds of {moe['round_rows']} rows per device and shard: "
            f"{fmt_bytes(moe['exchange_bytes'])} sent per device and round, {ratio:.2f}x its "
            f"{fmt_bytes(moe['assignment_bytes'])} "
            f"of assignments (one round while no device sends a shard more than {moe['exchange_factor']:g}x the mean)"
        )
    return line + (
        f", over {moe['expert_ways']} expert shards: {fmt_bytes(moe['exchange_bytes'])} sent per device "
        f"and exchange, {ratio:.2f}x its {fmt_bytes(moe['assignment_bytes'])} of assignments"
    )


def render(rep: dict) -> str:
    """The scale report as printed by `python -m zoo.tools.inspect_step`."""
    s = rep["state_bytes_per_device"]
    d = rep["dtypes"]
    mesh = " x ".join(f"{a} {n}" for a, n in rep["mesh"].items() if n > 1) or "one device"
    out = [
        f"scale: {rep['devices']} devices ({mesh}), {rep['per_device_batch']} sequences per device",
        f"per device: params {fmt_bytes(s['params'])} ({'/'.join(d['params'])}), grads {fmt_bytes(s['grads'])}, "
        f"optimizer state {fmt_bytes(s['opt_state'])} ({'/'.join(d['opt_state'])}), total {fmt_bytes(s['total'])}; "
        f"compute in {d['compute']}; all parameters {fmt_bytes(s['global_params'])}",
    ]
    if "frozen_base" in s:
        out[-1] = (
            out[-1]
            .replace("per device: params", "per device: LoRA adapters", 1)
            .replace("; all parameters", "; all adapters", 1)
        )
        out.append(
            f"frozen LoRA base per device: {fmt_bytes(s['frozen_base'])} in {s['frozen_base_memory']} (no gradient, "
            "no optimizer state; in the total)"
        )
    kept = rep.get("kept_layer_inputs")
    if kept:
        shapes = ", ".join(f"{k['arrays']} x {k['shape']}" if k["arrays"] > 1 else k["shape"] for k in kept["stacks"])
        how = [
            w
            for w, on in (
                ("context parallelism", rep.get("context_parallel")),
                ("sequence parallelism", rep.get("sequence_parallel")),
            )
            if on
        ]
        split = f", split along the sequence ({' and '.join(how)})" if how else ""
        out.append(f"kept layer inputs per device: {fmt_bytes(kept['bytes'])} ({shapes}){split}")
    if "whole_vocabulary" in rep and rep["devices"] > 1:
        v = rep["whole_vocabulary"]
        out.append(
            "whole vocabulary per device: none (every vocabulary-sized dim is split)"
            if v is None
            else (
                f"whole vocabulary per device: largest {v['largest']} {fmt_bytes(v['bytes'])} ({v['shapes']} "
                "such shapes)"
            )
        )
    moe = rep.get("routed_experts")
    if moe:
        out.append(_routed_experts_line(moe))
    for name, title in (("partitioned", "after SPMD partitioning"), ("compiled", "compiled")):
        section = rep["collectives"][name]
        if section is None:
            continue
        rows = [
            (kind, dtype, r["count"], r["executions"], fmt_bytes(r["bytes"]))
            for kind, by_dtype in section["by_kind_and_dtype"].items()
            for dtype, r in by_dtype.items()
        ]
        if not rows:
            out.append(f"collectives per step ({title}): none")
            continue
        total = sum(r["bytes"] for r in section["by_kind"].values())
        out.append(f"collectives per step ({title}), bytes per device, {fmt_bytes(total)} in all:")
        out.append(text_table([("kind", "dtype", "instructions", "executions", "bytes/step")] + rows))
        if section["unknown_trip_counts"]:
            out.append(
                f"note: {section['unknown_trip_counts']} collective(s) sit in loops of unknown trip count, counted once"
            )
    section = rep["collectives"]["partitioned"] or rep["collectives"]["compiled"]
    if section["largest"]:
        out.append(
            "largest collectives per step ("
            + ("after SPMD partitioning" if rep["collectives"]["partitioned"] else "compiled")
            + "):"
        )
        rows = [("kind", "shape", "group", "executions", "bytes/exec", "bytes/step")]
        rows += [
            (
                c["kind"],
                c["shape"],
                c["group_size"] or "?",
                c["executions"],
                fmt_bytes(c["bytes_per_execution"]),
                fmt_bytes(c["bytes"]),
            )
            for c in section["largest"]
        ]
        out.append(text_table(rows))
    return "\n".join(out)
