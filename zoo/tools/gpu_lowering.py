"""The train step lowered for a GPU on a machine without one: which host placements survive.

`jax.jit(step).trace(*abstract).lower(lowering_platforms=("cuda",))` lowers train.py's step for
XLA:GPU from abstract inputs (nothing is allocated, no GPU is needed; the shardings over the
simulated CPU devices carry over, since lowering needs only the mesh's shape). Host offload reaches
XLA as two things in the lowered StableHLO module:

- `annotate_device_placement` custom calls with `_xla_buffer_placement = "pinned_host"`: a value
  moved to host inside the step (an offloaded residual, a host-resident parameter or optimizer-state
  slice written back);
- `mhlo.memory_kind = "pinned_host"` attributes on the program's arguments and results (state that
  lives in host memory between steps).

The CPU lowering of the same traced step turns every offloaded residual's host placement into a
device one (XLA:CPU has one memory space): an offload test run on CPU proves what JAX traced
(`zoo.tools.inspect_step`), not what XLA:GPU receives. This module counts both lowerings, so that a policy whose
host placements vanish on the way to the GPU program is caught without a GPU. It stops at the lowered
module: XLA:GPU's own passes (host offloader, rematerialisation) need the CUDA backend to run.

`python -m zoo.tools.gpu_lowering <train.py overrides> [lower.presets=[a,b]]` prints one row per preset of
conf/offload (or those given).
"""

import dataclasses
import re
import sys
from typing import Optional, Sequence

from zoo import model as zoo_model
from zoo.offload import preset_names, resolve
from zoo.placement import placement_from_jaxpr, scan_names
from zoo.tools.kit import prepare_step, run_tool, split_tool_args, text_table

_PLACEMENT = re.compile(r'@annotate_device_placement\([^)]*\)\s*\{[^}]*_xla_buffer_placement = "(\w+)"')
_MEMORY_KIND = re.compile(r'mhlo\.memory_kind = "(\w+)"')
HOST = "pinned_host"


@dataclasses.dataclass(frozen=True)
class HostPlacements:
    """Placements in one lowered module: `annotations` (annotate_device_placement custom calls) by
    target memory, `memory_kinds` (argument / result attributes) by kind."""

    annotations: dict
    memory_kinds: dict

    @property
    def host_annotations(self) -> int:
        return self.annotations.get(HOST, 0)

    @property
    def host_memory_kinds(self) -> int:
        return self.memory_kinds.get(HOST, 0)


def host_placements(text: str) -> HostPlacements:
    """Count the placements of a lowered module's text (`Lowered.as_text()`, StableHLO)."""

    def count(pattern):
        out: dict = {}
        for m in pattern.finditer(text):
            out[m.group(1)] = out.get(m.group(1), 0) + 1
        return out

    return HostPlacements(count(_PLACEMENT), count(_MEMORY_KIND))


def trace_step(trainer):
    """train.py's step (the jitted one the trainer runs) traced from abstract inputs: nothing allocated."""
    return trainer.jitted_step().trace(trainer.abstract_state(), trainer.abstract_tokens())


_ALL_TO_ALL = re.compile(r'"stablehlo\.all_to_all"\(.*? : \(tensor<(\d+x\d+x[\dx]+)x(\w+)>\)')


def row_exchanges(text: str) -> dict:
    """`{(operand shape, dtype): count}` of the module's all_to_alls of rows (rank 3 or more: the
    expert exchange's blocks or capacity buffers; the per-expert counts are left out), each sending
    its whole operand."""
    out: dict = {}
    for m in _ALL_TO_ALL.finditer(text):
        key = (m.group(1), m.group(2))
        out[key] = out.get(key, 0) + 1
    return out


def lower_step(trainer, platforms: Sequence[str] = ("cuda",)):
    """train.py's step lowered for `platforms` (a `jax.stages.Lowered`); no device of them is needed."""
    return trace_step(trainer).lower(lowering_platforms=tuple(platforms))


def offloaded_tags(trainer) -> list[str]:
    """The tags the step's policy sends to host (`offload` actions for tags the model emits)."""
    return sorted(t for t, a in resolve(trainer.cfg.offload, trainer.cfg.model).items() if a == "offload")


def preset_row(overrides: Sequence[str], preset: str) -> dict:
    """One preset's step lowered for cpu and for cuda: the host placements of each, the offloaded tags
    and where the state lives. A preset the model cannot take (a tag it never emits) gives `error`."""
    try:
        trainer = prepare_step([*overrides, f"offload={preset}"])[3]
    except ValueError as e:
        return {"preset": preset, "error": str(e).splitlines()[0]}
    traced = trace_step(trainer)
    placement = placement_from_jaxpr(
        traced.jaxpr, scan_names(zoo_model.abstract(trainer.cfg.model), trainer.cfg.offload)
    )
    row = {
        "preset": preset,
        "offloaded_tags": offloaded_tags(trainer),
        # Residuals the traced program sends to host: one per tag site per forward scan (layer stack).
        "traced_host_residuals": sum(r.occurrences for r in placement.records if r.placement == "host"),
        "params": trainer.cfg.offload.params,
        "opt_state": trainer.cfg.offload.opt_state,
    }
    for platform in ("cpu", "cuda"):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        found = host_placements(text)
        row[platform] = {
            "host_annotations": found.host_annotations,
            "host_memory_kinds": found.host_memory_kinds,
            "annotations": found.annotations,
            "memory_kinds": found.memory_kinds,
            "row_exchanges": row_exchanges(text),
        }
    return row


@dataclasses.dataclass
class LowerOptions:
    """`lower.*` keys of `python -m zoo.tools.gpu_lowering` (the other arguments are train.py's overrides)."""

    presets: Optional[list] = None  # null: every preset of conf/offload


def render(rows: list[dict]) -> str:
    table = [
        (
            "preset",
            "offloaded tags",
            "traced host residuals",
            "state on host",
            "cpu: host annotations",
            "cuda: host annotations",
            "cpu: host memory kinds",
            "cuda: host memory kinds",
        )
    ]
    notes = []
    for r in rows:
        if "error" in r:
            notes.append(f"{r['preset']}: not lowered ({r['error']})")
            continue
        state = ", ".join(k for k in ("params", "opt_state") if r[k] == HOST) or "-"
        table.append(
            (
                r["preset"],
                len(r["offloaded_tags"]),
                r["traced_host_residuals"],
                state,
                r["cpu"]["host_annotations"],
                r["cuda"]["host_annotations"],
                r["cpu"]["host_memory_kinds"],
                r["cuda"]["host_memory_kinds"],
            )
        )
    # Presets whose cuda programs exchange the same rows share a line (a recomputed forward adds its own).
    by_exchange: dict = {}
    for r in rows:
        if "error" not in r:
            by_exchange.setdefault(tuple(sorted(r["cuda"].get("row_exchanges", {}).items())), []).append(r["preset"])
    for found, presets in by_exchange.items():
        who = "every preset" if len(by_exchange) == 1 and len(presets) > 1 else ", ".join(presets)
        for (operand, dtype), n in found:
            notes.append(f"{who}: cuda: {n} all_to_all of {dtype}[{operand.replace('x', ',')}]")
    return "\n".join([text_table(table), *notes])


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts, overrides = split_tool_args(argv, "lower", LowerOptions)
        presets = list(opts.presets) if opts.presets else preset_names()
        unknown = [p for p in presets if p not in preset_names()]
        if unknown:
            raise ValueError(
                f"lower.presets: {unknown[0]} is not a preset of conf/offload; choose from {', '.join(preset_names())}"
            )
        print(render([preset_row(overrides, p) for p in presets]))
        return 0

    return run_tool(body, "python -m zoo.tools.gpu_lowering", argv)


if __name__ == "__main__":
    raise SystemExit(main())
