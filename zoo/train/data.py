"""Synthetic token batches, deterministic in (seed, step) so every mesh sees the same data; `make_data`
picks them or real text (zoo.data) by `data.name`.

`markov`: a fixed random transition table in which every token has `branching` successors with
random probabilities (drawn with replacement: rarely two coincide); a model that learns the table reaches a loss near the table's entropy
(at most log(branching)). `uniform`: i.i.d. uniform tokens (loss cannot fall below log(vocab)).
"""

import numpy as np

from zoo.train.config import ConfigError, DataConfig, TrainConfig


class SyntheticData:
    def __init__(self, c: DataConfig, vocab_size: int, process_index: int = 0, process_count: int = 1):
        self.c = c
        self.vocab_size = vocab_size
        if c.batch_size % process_count:
            raise ConfigError(f"data.batch_size: {c.batch_size} does not split over {process_count} processes; use a multiple of {process_count}")
        self.rows = slice(process_index * c.batch_size // process_count, (process_index + 1) * c.batch_size // process_count)
        rng = np.random.default_rng(c.seed)
        k = min(c.branching, vocab_size)
        self.successors = rng.integers(0, vocab_size, size=(vocab_size, k), dtype=np.int32)
        probs = rng.dirichlet(np.ones(k), size=vocab_size)
        self.cumprobs = np.cumsum(probs, axis=-1)
        self.cumprobs[:, -1] = 1.0
        self.entropy = float(-(probs * np.log(probs)).sum(-1).mean())  # nats, averaged over tokens

    def floor(self) -> float:
        """The loss a perfect model reaches (nats): mean successor entropy (markov) or log(vocab)."""
        return self.entropy if self.c.name == "markov" else float(np.log(self.vocab_size))

    def batch(self, step: int) -> np.ndarray:
        """int32 `[batch_size / process_count, seq_len]`: this process's rows of step `step`'s batch."""
        return self.global_batch(step)[self.rows]

    def global_batch(self, step: int) -> np.ndarray:
        """int32 `[batch_size, seq_len]` for optimizer step `step` (every process draws the same)."""
        c = self.c
        rng = np.random.default_rng((c.seed, step))
        if c.name == "uniform":
            return rng.integers(0, self.vocab_size, size=(c.batch_size, c.seq_len), dtype=np.int32)
        out = np.empty((c.batch_size, c.seq_len), np.int32)
        out[:, 0] = rng.integers(0, self.vocab_size, size=c.batch_size)
        u = rng.random((c.batch_size, c.seq_len))
        for t in range(1, c.seq_len):
            prev = out[:, t - 1]
            choice = (u[:, t, None] > self.cumprobs[prev]).sum(-1)
            out[:, t] = self.successors[prev, np.minimum(choice, self.successors.shape[1] - 1)]
        return out


def make_data(c: TrainConfig, process_index: int = 0, process_count: int = 1):
    """The `data` group's source: SyntheticData, or zoo.data's TextData for `data.name: text` (its bad
    input, e.g. a missing file or a tokenizer too big for the model, becomes a one-line ConfigError).
    Both have `batch(step)` (this process's rows of step's batch) and `floor()` (None for text)."""
    if c.data.name != "text":
        return SyntheticData(c.data, c.model.vocab_size, process_index, process_count)
    from zoo.data import DataError, from_config

    try:
        return from_config(c.data, c.model.vocab_size, process_index=process_index, process_count=process_count)
    except DataError as e:
        raise ConfigError(str(e)) from None
