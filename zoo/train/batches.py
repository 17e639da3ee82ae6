"""Synthetic token batches, deterministic in (seed, step) so every mesh sees the same data; `make_data`
picks them or real text (zoo.data) by `data.name`.

`markov`: a fixed random transition table in which every token has `branching` successors with
random probabilities (drawn with replacement: rarely two coincide); a model that learns the table reaches a loss near
the table's entropy (at most log(branching)). `uniform`: i.i.d. uniform tokens (loss cannot fall below log(vocab)).

A markov batch costs one compiled scan over the sequence (on the host's CPU device, whatever the
accelerator) for this process's rows only; its tokens are those of the step-by-step definition
(`global_batch`'s docstring), bit for bit. `batch(step)` keeps no state: it may run ahead of the
step that uses it, from any thread.
"""

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from zoo.train.run_config import ConfigError, DataConfig, TrainConfig


def _float64_halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative float64s as (high, low) uint32 words of their bits: comparing the pairs
    lexicographically orders them as the floats (IEEE 754), exactly, without 64-bit types in JAX."""
    bits = np.ascontiguousarray(x, np.float64).view(np.uint64)
    return (bits >> np.uint64(32)).astype(np.uint32), (bits & np.uint64(0xFFFFFFFF)).astype(np.uint32)


@jax.jit
def _markov_chain(first, u_high, u_low, cum_high, cum_low, successors):
    """Rows `[rows, 1 + len(u)]` of the chain from `first`: token t+1 is successor number
    `#{j: u[t] > cumprobs[token t, j]}` (capped at the last) of token t."""
    last = successors.shape[1] - 1

    def step(prev, u):
        high, low = u[0][:, None], u[1][:, None]
        ch, cl = cum_high[prev], cum_low[prev]
        above = (high > ch) | ((high == ch) & (low > cl))
        choice = jnp.minimum(above.sum(-1), last)
        nxt = jnp.take_along_axis(successors[prev], choice[:, None], axis=1)[:, 0]
        return nxt, nxt

    _, rest = jax.lax.scan(step, first, (u_high.T, u_low.T))
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def _host_device() -> Optional[jax.Device]:
    """The CPU device (the default one where JAX runs without its CPU backend)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


class SyntheticData:
    def __init__(self, c: DataConfig, vocab_size: int, process_index: int = 0, process_count: int = 1):
        self.c = c
        self.vocab_size = vocab_size
        if c.batch_size % process_count:
            raise ConfigError(
                f"data.batch_size: {c.batch_size} does not split over {process_count} processes; use a multiple of "
                f"{process_count}"
            )
        self.rows = slice(
            process_index * c.batch_size // process_count, (process_index + 1) * c.batch_size // process_count
        )
        rng = np.random.default_rng(c.seed)
        k = min(c.branching, vocab_size)
        self.successors = rng.integers(0, vocab_size, size=(vocab_size, k), dtype=np.int32)
        probs = rng.dirichlet(np.ones(k), size=vocab_size)
        self.cumprobs = np.cumsum(probs, axis=-1)
        self.cumprobs[:, -1] = 1.0
        self.entropy = float(-(probs * np.log(probs)).sum(-1).mean())  # nats, averaged over tokens
        self._table = None  # (cumprobs' halves, successors) on the host device, made on first use

    def floor(self) -> float:
        """The loss a perfect model reaches (nats): mean successor entropy (markov) or log(vocab)."""
        return self.entropy if self.c.name == "markov" else float(np.log(self.vocab_size))

    def batch(self, step: int) -> np.ndarray:
        """int32 `[batch_size / process_count, seq_len]`: this process's rows of step `step`'s batch."""
        return self._rows_of(step, self.rows)

    def global_batch(self, step: int) -> np.ndarray:
        """int32 `[batch_size, seq_len]` for optimizer step `step` (every process draws the same).

        From the generator seeded `(seed, step)`: uniform draws the ids at once; markov draws the
        first token of each row, then `u = random([batch, seq])`, and token t (t >= 1) of a row is
        successor number `#{j: u[t] > cumprobs[token t-1, j]}` (capped at the last) of token t-1."""
        return self._rows_of(step, slice(None))

    def _rows_of(self, step: int, rows: slice) -> np.ndarray:
        c = self.c
        rng = np.random.default_rng((c.seed, step))
        if c.name == "uniform":
            return rng.integers(0, self.vocab_size, size=(c.batch_size, c.seq_len), dtype=np.int32)[rows]
        first = rng.integers(0, self.vocab_size, size=c.batch_size)[rows].astype(np.int32)
        u = rng.random((c.batch_size, c.seq_len))[rows, 1:]  # all rows drawn: the same numbers in every process
        if self._table is None:
            self._table = jax.device_put((*_float64_halves(self.cumprobs), self.successors), _host_device())
        device = next(iter(self._table[0].devices()))
        u_high, u_low = _float64_halves(u)
        return np.asarray(_markov_chain(*jax.device_put((first, u_high, u_low), device), *self._table))


def make_data(c: TrainConfig, process_index: int = 0, process_count: int = 1):
    """The `data` group's source: SyntheticData, or zoo.data's TextData for `data.name: text` (its bad
    input, e.g. a missing file or a tokenizer too big for the model, becomes a one-line ConfigError).
    Both have `batch(step)` (this process's rows of step's batch) and `floor()` (None for text)."""
    if c.data.name != "text":
        return SyntheticData(c.data, c.model.vocab_size, process_index, process_count)
    from zoo.data import DataError, from_config  # text runs only: zoo.data imports grain (about 1.1 s)

    try:
        return from_config(c.data, c.model.vocab_size, process_index=process_index, process_count=process_count)
    except DataError as e:
        raise ConfigError(str(e)) from None
