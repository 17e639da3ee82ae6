"""Held-out loss during training: the mean next-token loss (and its perplexity) over the first
`trainer.eval_batches` batches of the eval split (`data.eval_fraction` or `data.eval_path`), every
`trainer.eval_every` steps and after the last step.

The eval step is forward only and compiled once: one batch (`[grad_accum, microbatch, seq]`, sharded
like the training batch, so a microbatch at a time as in training) -> the summed loss of its targets
and their count. The sums add up on the device over the batches and are read once, so the loss is
the mean over every target of the eval batches (`zoo.loss.target_weights`: a response-only format
counts responses here too).
"""

import math
from typing import Optional

import jax
import jax.numpy as jnp

from zoo import sharding as zs
from zoo.loss import target_weights
from zoo.train.run_config import TrainConfig


class Evaluator:
    def __init__(self, c: TrainConfig, trainer, eval_data):
        self.trainer = trainer
        self.data = eval_data
        self.every = c.trainer.eval_every
        self.num_batches = min(c.trainer.eval_batches, eval_data.num_batches)
        self.last: Optional[dict] = None  # the latest result, with its step
        self._sums = jax.jit(
            self._batch_sums,
            in_shardings=(trainer.param_shardings, trainer.token_sharding),
            out_shardings=trainer.replicated,
        )

    def _batch_sums(self, params, batch):
        trainer = self.trainer
        with zs.activate(trainer.mesh, trainer.rules):
            params = trainer._device_params(params)

            def micro(carry, mb):
                # A denominator of 1: the sum of the targets' losses, which add up over batches.
                total, _ = trainer.loss_and_aux(params, {**mb, "loss_denominator": jnp.float32(1.0)})
                count = target_weights(mb["loss_mask"], mb["segment_ids"]).sum()
                return (carry[0] + total, carry[1] + count), None

            (total, count), _ = jax.lax.scan(micro, (jnp.float32(0), jnp.float32(0)), batch)
        return total, count

    def due(self, done: int, steps: int) -> bool:
        """Whether to evaluate after `done` of `steps` steps."""
        return done == steps or (self.every > 0 and done % self.every == 0)

    def __call__(self, params, step: int) -> dict:
        """`eval_loss`, `eval_perplexity` and `eval_tokens` (the targets counted) of `params`."""
        total = count = jnp.float32(0)
        for i in range(self.num_batches):
            t, n = self._sums(params, self.trainer.shard_tokens(self.data.batch(i)))
            total, count = total + t, count + n
        total, count = (float(x) for x in jax.device_get((total, count)))
        loss = total / max(count, 1.0)
        self.last = {
            "eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 700.0)),
            "eval_tokens": int(count),
            "step": step,
        }
        return {k: v for k, v in self.last.items() if k != "step"}

    def describe(self) -> str:
        when = f"every {self.every} steps and at the end" if self.every else "at the end"
        return f"eval: {self.num_batches} batch(es) of {self.data.source} ({self.data.split} split), {when}"


def attach_data(c: TrainConfig, trainer, data) -> Optional[Evaluator]:
    """Before anything compiles: give the trainer what its programs take from the data (the segment
    bound of both splits), and return the evaluator of a run whose data has an eval split (else None)."""
    trainer.set_data(data)
    eval_data = getattr(data, "eval", None)
    return Evaluator(c, trainer, eval_data) if eval_data is not None else None
