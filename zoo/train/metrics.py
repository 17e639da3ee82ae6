"""Throughput, model FLOPs, MFU, memory, and where metrics go (jsonl, summary, progress, TensorBoard).

Model FLOPs are counted analytically by `zoo.counts.flops_per_token` (forward + backward, attention
included, MoE counting the top-k routed experts only); MFU is those FLOPs per second per device over
the hardware profile's peak.
"""

import json
import math
import os
import pathlib
import sys
import time
from typing import Any, Optional

import jax
import numpy as np

from zoo.backend import target_platform
from zoo.config import ModelConfig
from zoo.counts import flops_per_token


def to_python(x: Any) -> Any:
    """Arrays and numpy scalars -> floats / lists, for JSON."""
    if isinstance(x, dict):
        return {k: to_python(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_python(v) for v in x]
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        a = np.asarray(x)
        return a.item() if a.ndim == 0 else a.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class Throughput:
    """Tokens/s, TFLOP/s per device and MFU from a step time."""

    def __init__(self, model: ModelConfig, seq_len: int, tokens_per_step: int, num_devices: int, peak_flops: float):
        self.flops_per_token = flops_per_token(model, seq_len)
        self.tokens_per_step = tokens_per_step
        self.num_devices = num_devices
        self.peak_flops = peak_flops

    def __call__(self, step_time: float) -> dict:
        tokens_per_s = self.tokens_per_step / step_time
        flops_per_device = self.flops_per_token * tokens_per_s / self.num_devices
        return {
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": flops_per_device / 1e12,
            "mfu": flops_per_device / self.peak_flops,
        }


def device_memory(devices) -> Optional[dict]:
    """Max over `devices` of bytes in use and peak bytes in use; None where the backend reports nothing (CPU)."""
    stats = [d.memory_stats() for d in devices]
    if not stats or any(s is None for s in stats):
        return None
    return {
        "bytes_in_use": max(int(s.get("bytes_in_use", 0)) for s in stats),
        "peak_bytes_in_use": max(int(s.get("peak_bytes_in_use", 0)) for s in stats),
        "bytes_limit": min(int(s.get("bytes_limit", 0)) for s in stats) or None,
    }


_MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
    "host_alias_size_in_bytes",
    "host_temp_size_in_bytes",
)


def compiled_memory(compiled, platform: Optional[str] = None) -> Optional[dict]:
    """The compiled step's memory analysis, per device, and XLA's estimate of its peak,
    `estimated_peak_bytes` (XLA's figure, not a measurement): on a TPU the compiler's own simulation of
    the program's heap (`peak_memory_in_bytes`) less the host-resident arguments and outputs it counts
    (`device_peak_of_simulation`); elsewhere arguments + outputs - aliased (donated) +
    temporaries (`summed_peak_bytes`), which the TPU's overstates: llama_1b at 4 layers, 8 x 2048
    under `minimal` sums to 18.26 GB and ran on a 15.75 GB v5e, whose compiler put its peak at 13.52
    GB; XLA:CPU's simulated peak leaves its temporaries out (`platform`: the one compiled for, default
    `zoo.backend.target_platform`)."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement it
        return None
    if ma is None:
        return None
    out = {f: int(getattr(ma, f)) for f in _MEMORY_FIELDS if hasattr(ma, f)}
    out["summed_peak_bytes"] = (
        out.get("argument_size_in_bytes", 0)
        + out.get("output_size_in_bytes", 0)
        - out.get("alias_size_in_bytes", 0)
        + out.get("temp_size_in_bytes", 0)
    )
    simulated = getattr(ma, "peak_memory_in_bytes", None)
    out["simulated_peak_bytes"] = int(simulated) if simulated is not None else None
    tpu = (platform or target_platform()) == "tpu"
    out["estimated_peak_bytes"] = device_peak_of_simulation(out) if tpu and simulated else out["summed_peak_bytes"]
    return out


def device_peak_of_simulation(memory: dict) -> int:
    """The HBM peak in XLA:TPU's heap simulation (`simulated_peak_bytes` of a `compiled_memory` dict),
    without the program's arguments and outputs that live in host memory, which the simulation counts
    as if they were on the device: compiled for a v5e, a step reading a pinned-host argument of 1 GiB
    into 1 GiB of device temporaries reports a peak of 2 GiB, one sending a 1 GiB device argument to a
    pinned-host output 2 GiB, and the AdamW state on host (`optimizer_host`, 4.05 GB on host) left
    llama_1b's layers at the same 13.26 GB as with the state on the device. Its offloaded temporaries
    (`host_temp_size_in_bytes`) are not counted there, and are not taken off."""
    host_entry = (
        memory.get("host_argument_size_in_bytes", 0)
        + memory.get("host_output_size_in_bytes", 0)
        - memory.get("host_alias_size_in_bytes", 0)
    )
    return int(memory["simulated_peak_bytes"]) - max(0, int(host_entry))


def compiled_flops(compiled) -> Optional[float]:
    """XLA's cost-analysis FLOPs of the compiled step (per device program), for comparison."""
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    return float(ca["flops"]) if ca and "flops" in ca else None


def most_imbalanced(m: dict, threshold: float, moe_layers: Optional[list[int]] = None) -> Optional[tuple[int, float]]:
    """`(model layer index, max/mean)` of the MoE layer whose expert load max/mean is highest, when
    it exceeds `threshold` (0 disables); None otherwise or for a dense model. `moe_layers[r]` is the
    model layer of row r of the per-MoE-layer metrics (None: the rows are the layers)."""
    loads = m.get("expert_load_max_over_mean")
    if not threshold or not loads:
        return None
    row = max(range(len(loads)), key=lambda r: loads[r])
    if not loads[row] > threshold:
        return None
    return (moe_layers[row] if moe_layers is not None else row), loads[row]


class Progress:
    """A one-line progress bar on a TTY; a plain line every `every` steps otherwise.

    While some MoE layer's expert load max/mean exceeds `moe_imbalance_warn` (0: never), the line
    ends with `moe: layer L max/mean X` naming the worst one; the step at which it first crosses is
    printed even off the `every` grid, so a drift is not missed between lines."""

    def __init__(
        self,
        total: int,
        every: int,
        enabled: bool = True,
        stream=None,
        *,
        moe_imbalance_warn: float = 0.0,
        moe_layers: Optional[list[int]] = None,
    ):
        self.total, self.every, self.enabled = total, every, enabled
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.moe_imbalance_warn, self.moe_layers = moe_imbalance_warn, moe_layers
        self._imbalanced = False

    def update(self, step: int, m: dict) -> None:
        if not self.enabled:
            return
        done = step + 1
        text = f"step {done}/{self.total} loss {m['loss']:.4f} gnorm {m['grad_norm']:.3f} lr {m['lr']:.2e}"
        if m.get("tokens_per_s") is not None:
            text += f" {m['tokens_per_s']:.0f} tok/s {m['tflops_per_device']:.3f} TFLOP/s/dev MFU {100 * m['mfu']:.2f}%"
        evaluated = m.get("eval_loss") is not None
        if evaluated:
            text += f" eval loss {m['eval_loss']:.4f} ppl {m['eval_perplexity']:.2f}"
        worst = most_imbalanced(m, self.moe_imbalance_warn, self.moe_layers)
        crossed = worst is not None and not self._imbalanced
        self._imbalanced = worst is not None
        if worst is not None:
            text += f" moe: layer {worst[0]} max/mean {worst[1]:.1f}"
        if self.tty:
            width = 24
            filled = int(width * done / self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\x1b[K")
            if done == self.total or evaluated:  # an eval result stays on screen
                self.stream.write("\n")
            self.stream.flush()
        elif done % self.every == 0 or done == self.total or step == 0 or evaluated or crossed:
            print(text, file=self.stream, flush=True)


class MetricsWriter:
    """`metrics.jsonl` (one JSON object per step) and, on request, TensorBoard scalars.

    A run that starts at step `start_step` (resumed from a checkpoint) into an output directory that
    already holds a `metrics.jsonl` keeps that file's records of the earlier steps and appends its
    own; records of `start_step` and later (an earlier attempt that got past its last checkpoint)
    are dropped, since this run computes those steps again. So the file holds each step once."""

    # Per-step arrays that go to TensorBoard only (too large for a line of metrics.jsonl at scale).
    TENSORBOARD_ONLY = ("expert_token_share",)

    def __init__(
        self,
        out_dir: pathlib.Path,
        tensorboard: bool = False,
        start_step: int = 0,
        moe_layers: Optional[list[int]] = None,
    ):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.moe_layers = moe_layers
        self.path = out_dir / "metrics.jsonl"
        self._keep_before(start_step)
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # optional extra: pip install -e '.[tensorboard]'

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))

    def _keep_before(self, start_step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        if start_step > 0:
            for line in self.path.read_text().splitlines():
                try:
                    step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short when an earlier attempt was killed
                if isinstance(step, int) and step < start_step:
                    kept.append(line + "\n")
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)

    def write(self, step: int, m: dict) -> None:
        record = {"step": step, **to_python(m)}
        tb_only = {k: record.pop(k) for k in self.TENSORBOARD_ONLY if k in record}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for row, share in enumerate(tb_only.get("expert_token_share") or []):
                # The distribution of the experts' shares of this layer's assignments: a spike at
                # 1/experts when balanced, a long right tail when a few experts take the tokens.
                layer = self.moe_layers[row] if self.moe_layers is not None else row
                self.tb.add_histogram(f"expert_token_share/layer_{layer}", np.asarray(share, np.float64), step)
            for k, v in record.items():
                if k == "step" or v is None:
                    continue
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        if x is not None:
                            self.tb.add_scalar(f"{k}/{i}", x, step)
                elif isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def write_json(path: pathlib.Path, obj: dict) -> None:
    # The temporary file is this process's own: two commands started in the same second share Hydra's
    # default run directory, and both write their summary there (two bad commands' error summaries
    # raced on one temporary name, and the second rename found it gone).
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(to_python(obj), indent=2) + "\n")
    os.replace(tmp, path)
