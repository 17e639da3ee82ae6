"""The host loop of a training run: batches one step ahead, the steps dispatched before the last one's
metrics are read, each finished step logged and checked (`StepLog`), drained before a save or an
evaluation (`StepLoop`). `zoo.train.run` builds them; they are importable from there too."""

import dataclasses
import math
import pathlib
import time
from typing import Any, Callable, Optional

from zoo.train.metrics import MetricsWriter, Progress, Throughput, device_memory
from zoo.train.run_config import TrainConfig
from zoo.train.stop import raise_if_interrupted


def moe_layer_indices(c: TrainConfig) -> list[int]:
    """The model layers that are MoE layers, in order: row r of a per-MoE-layer metric is layer [r]."""
    return [i for i in range(c.model.num_layers) if c.model.is_moe_layer(i)]


class Batches:
    """The batches, one step ahead: step k+1's batch is built on the host and put on the devices
    while step k runs (`prefetch`); `take(k)` hands it over (or builds it, if none was prefetched)."""

    def __init__(self, data, trainer):
        self.data, self.trainer = data, trainer
        self._ahead: Optional[tuple[int, Any]] = None

    def prefetch(self, step: int):
        self._ahead = (step, self.trainer.shard_tokens(self.data.batch(step)))
        return self._ahead[1]

    def take(self, step: int):
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            return ahead[1]
        return self.trainer.shard_tokens(self.data.batch(step))


class Diverged(Exception):
    """Step `step` (0-based) gave a non-finite loss or gradient norm."""

    def __init__(self, step: int, metrics: dict):
        super().__init__(f"step {step + 1} diverged")
        self.step, self.metrics = step, metrics


@dataclasses.dataclass
class Dispatched:
    """A step handed to the devices whose metrics have not been read yet."""

    step: int  # 0-based: this step turns state `step` into state `step + 1`
    metrics: dict  # device arrays
    at: float  # perf_counter() when dispatched
    vote: Any  # StopSignals.vote() sent with it


class StepLog:
    """What is done with a finished step's metrics: read them (this waits for the step), time it,
    write metrics.jsonl and the progress line, and stop on a non-finite loss or gradient norm."""

    def __init__(
        self, c: TrainConfig, out_dir: Optional[pathlib.Path], start: int, num_devices: int, local_devices, show: bool
    ):
        self.throughput = Throughput(
            c.model, c.data.seq_len, c.data.batch_size * c.data.seq_len, num_devices, c.hardware.peak_flops
        )
        moe_layers = moe_layer_indices(c)
        self.writer = (
            MetricsWriter(out_dir, c.trainer.tensorboard, start_step=start, moe_layers=moe_layers)
            if out_dir is not None
            else None
        )
        self.progress = Progress(
            c.trainer.steps,
            c.trainer.log_every,
            c.trainer.progress and show,
            moe_imbalance_warn=c.trainer.moe_imbalance_warn,
            moe_layers=moe_layers,
        )
        self.local_devices = local_devices
        self.losses: list[float] = []
        self.times: list[float] = []
        self.peak_device: Optional[int] = None
        self.completed = start  # steps done and checked
        self._last_ready = -math.inf

    def read(self, ds: list[Dispatched], evaluate: Optional[Callable[[], dict]] = None) -> dict:
        """Wait for the steps `ds` (dispatched in this order) and log each (the last with `evaluate()`'s
        held-out metrics when given); Diverged at the first whose loss or gradient norm is not finite.
        The last step's metrics are returned.

        Steps read together (a drain before a save or an evaluation) share their time equally: the
        earlier one is usually finished by the time it is read (XLA:CPU runs a step inside its dispatch
        call), so timing each from its own read would give it the later one's time and the later one
        almost none."""
        import jax

        ms = jax.device_get([d.metrics for d in ds])  # waits for the steps
        ready = time.perf_counter()
        # They ran from the first one's dispatch or from the end of the step before, whichever came later.
        dt = (ready - max(ds[0].at, self._last_ready)) / len(ds)
        self._last_ready = ready
        mem = device_memory(self.local_devices)
        if mem:
            self.peak_device = max(self.peak_device or 0, mem["peak_bytes_in_use"])
        for i, (d, m) in enumerate(zip(ds, ms)):
            m = {k: (v.tolist() if getattr(v, "ndim", 0) else float(v)) for k, v in m.items()}
            m.update(self.throughput(dt))
            m["device_bytes_in_use"] = mem["bytes_in_use"] if mem else None
            m["device_peak_bytes"] = mem["peak_bytes_in_use"] if mem else None
            if evaluate is not None and i == len(ds) - 1:
                m.update(evaluate())
            self.losses.append(m["loss"])
            self.times.append(dt)
            if self.writer:
                self.writer.write(d.step, m)
            self.progress.update(d.step, m)
            if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
                raise Diverged(d.step, m)
            self.completed = d.step + 1
        return m

    def close(self) -> None:
        if self.writer:
            self.writer.close()


class StepLoop:
    """The host loop. JAX dispatches a step and returns at once, so step k+1 is handed to the devices
    before step k's metrics are read, and batch k+2 is built meanwhile: the devices always have the
    next step queued. Donation stays correct: step k+1 consumes state k+1, and the metrics of step k
    are separate buffers.

    The checkpoint guarantee is kept by draining at a save: before state k+1 is saved, step k's
    metrics are read and checked, and only then is step k+1 dispatched (which donates that state).
    So every saved state comes from a step whose loss and gradient norm were finite.
    `pipelined=False` reads every step's metrics before dispatching the next (the old loop; the
    benchmark compares the two)."""

    def __init__(
        self,
        compiled,
        batches: Batches,
        log,
        ckpt,
        stop,
        steps: int,
        every: int,
        pipelined: bool = True,
        evaluator=None,
    ):
        self.compiled, self.batches, self.log, self.ckpt, self.stop = compiled, batches, log, ckpt, stop
        self.evaluator = evaluator  # the held-out loss, evaluated on the state a due step leaves
        self.steps, self.every, self.pipelined = steps, every, pipelined
        self.stopped = False  # ended early on a stop signal, after step log.completed

    def save_due(self, done: int) -> bool:
        return self.ckpt is not None and (done % self.every == 0 or done == self.steps)

    def eval_due(self, done: int) -> bool:
        return self.evaluator is not None and self.evaluator.due(done, self.steps)

    def run(self, state, start: int):
        """Steps `start` .. `steps - 1` from `state`; the state after the last one run."""
        pending: Optional[Dispatched] = None
        for step in range(start, self.steps):
            if self.ckpt is not None:
                self.ckpt.check_saves()  # a save that failed in the background stops the run now
            raise_if_interrupted()  # a Ctrl-C Python swallowed during the step before stops the run as any Ctrl-C does
            if self.stop.requested_here():
                self.stopped = True
                break
            tokens = self.batches.take(step)
            t = time.perf_counter()
            state, metrics = self.compiled(state, tokens)  # returns before the step has run
            current = Dispatched(step, metrics, t, self.stop.vote())
            if self.pipelined and step + 1 < self.steps:
                self.batches.prefetch(step + 1)  # while the devices run this step
            done = step + 1
            stopping = pending is not None and self.stop.agreed(pending.vote)  # a signal: stop after this step
            if self.save_due(done) or self.eval_due(done) or stopping or not self.pipelined:
                # drained: this state is saved (or evaluated) before the next step donates it, and
                # saved only if its step was finite
                self._read([d for d in (pending, current) if d is not None], state if self.eval_due(done) else None)
                pending = None
                if self.save_due(done):
                    self.ckpt.save(done, state)  # returns once the arrays are copied: the next step may donate them
            else:
                if pending is not None:
                    self._read([pending])
                pending = current
            if self.stopped:
                break
        if pending is not None:
            self._read([pending])
        if self.log.completed == self.steps:
            self.stopped = False  # the signal came during the last step: the run is complete
        if self.stopped and self.ckpt is not None and self.log.completed > start:
            self.ckpt.save(self.log.completed, state)  # skipped when that step was just saved
        return state

    def _read(self, ds: list[Dispatched], eval_state=None) -> None:
        if eval_state is None:
            self.log.read(ds)
        else:
            self.log.read(ds, lambda: self.evaluator(eval_state["params"], ds[-1].step + 1))
        if any(self.stop.agreed(d.vote) for d in ds):  # a signal: stop after the step in flight
            self.stopped = True
