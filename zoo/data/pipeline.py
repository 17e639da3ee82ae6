"""Real text -> fixed-length token batches: tokenize once, pack, shuffle, split across processes, resume.

1. Read the documents (`zoo.data.text`), tokenize them once, and pack them into one stream: each
   document's ids followed by the tokenizer's end-of-document id.
2. Cut the stream into windows of `seq_len` ids that overlap by one: window i is
   `stream[i*(seq_len-1) : i*(seq_len-1) + seq_len]`. The loss predicts ids 1..seq_len-1 of a window
   from the ids before them, so every id of the stream after the first is a target exactly once per
   epoch. The tail that does not fill a window is dropped.
3. A grain `MapDataset` over the windows: shuffled by `seed` (a fresh permutation each epoch: grain
   folds the epoch into the seed), repeated forever. Element j of this global stream is the same in
   every process and every run.
4. Step k's global batch is elements `k*batch_size .. (k+1)*batch_size - 1`; process p of P takes the
   p-th of P equal slices of it (`batch_size / P` rows). So the processes' data are disjoint (within an
   epoch each window goes to exactly one process), the global batch at step k does not depend on how
   many processes share it, and a run restarted at step k reads exactly the batches the uninterrupted
   run reads from step k: the loader's whole state is the step number.
"""

import pathlib
from collections.abc import Iterator
from typing import Optional, Union

import grain
import numpy as np

from zoo.data.errors import DataError
from zoo.data.text import Corpus, read_corpus
from zoo.data.tokenizer import Tokenizer, check_vocab, load_tokenizer

SHIPPED_CORPUS = pathlib.Path(__file__).resolve().parent / "corpus" / "shakespeare"


def pack(token_lists: list[np.ndarray], eos_id: Optional[int], vocab_size: int) -> np.ndarray:
    """One stream: each document's ids, then `eos_id` (if any). uint16 when the ids fit, else int32."""
    dtype = np.uint16 if vocab_size <= 2**16 else np.int32
    parts: list[np.ndarray] = []
    sep = None if eos_id is None else np.asarray([eos_id], dtype=dtype)
    for ids in token_lists:
        parts.append(np.asarray(ids, dtype=dtype))
        if sep is not None:
            parts.append(sep)
    return np.concatenate(parts) if parts else np.zeros((0,), dtype)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows of seq_len ids at stride seq_len-1 that fit in a stream of num_tokens ids."""
    if num_tokens < seq_len:
        return 0
    return (num_tokens - 1) // (seq_len - 1)


class Windows:
    """The random-access source grain reads: window i of the packed stream (see the module doc)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = seq_len - 1
        self._len = num_windows(len(tokens), seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._len:
            raise IndexError(i)
        start = i * self.stride
        return self.tokens[start : start + self.seq_len]


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy (nats) of the ids' frequency distribution: the loss of the best model that ignores context."""
    counts = np.bincount(np.asarray(tokens).astype(np.int64).ravel())
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class TextData:
    """Batches of real text for one data-parallel process. `batch(step)` is `[batch_size/process_count,
    seq_len]` int32, the same for the same (corpus, tokenizer, seq_len, batch_size, seed, shuffle,
    process_index, process_count) whatever happened before; `batches(start_step)` iterates them with a
    background prefetch thread."""

    def __init__(
        self,
        corpus: Corpus,
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
        source: str = "",
    ):
        if seq_len < 2:
            raise DataError(f"data.seq_len: next-token loss needs at least 2 tokens, got {seq_len}")
        if batch_size <= 0:
            raise DataError(f"data.batch_size: must be positive, got {batch_size}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} is not in [0, process_count={process_count})")
        if batch_size % process_count:
            raise DataError(
                f"data.batch_size: {batch_size} does not split over {process_count} processes; "
                f"use a multiple of {process_count}"
            )
        if not 0 <= seed < 2**32:
            raise DataError(f"data.seed: must be in [0, 2**32), got {seed}")
        self.corpus = corpus
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.local_batch_size = batch_size // process_count
        self.seed = seed
        self.shuffle = shuffle
        self.process_index = process_index
        self.process_count = process_count
        self.source = source or (str(corpus.files[0]) if len(corpus.files) == 1 else f"{len(corpus.files)} files")

        self.tokens = pack(tokenizer.encode_batch(corpus.documents), tokenizer.eos_id, tokenizer.vocab_size)
        self.windows = Windows(self.tokens, seq_len)
        if len(self.windows) == 0:
            raise DataError(
                f"data.path: {self.source} gives {len(self.tokens)} tokens, fewer than data.seq_len={seq_len}; "
                "add text or lower data.seq_len"
            )
        ds = grain.MapDataset.source(self.windows)
        if shuffle:
            ds = ds.shuffle(seed=seed)
        # Each epoch shuffled anew; 2**40 windows in all is "forever" and keeps grain's lengths (which
        # go through float division in batch) exact.
        ds = ds.repeat(max(1, 2**40 // len(self.windows)))
        ds = ds.batch(self.local_batch_size, batch_fn=lambda rows: np.stack(rows).astype(np.int32))
        # Local batch j of the global stream is slice (j % P) of global batch j // P.
        self.dataset: grain.MapDataset = ds[process_index::process_count]

    # --- what the train loop calls -------------------------------------------------------------

    def batch(self, step: int) -> np.ndarray:
        """int32 `[batch_size / process_count, seq_len]`: this process's rows of step `step`'s batch."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.dataset[step]

    def batches(self, start_step: int = 0, prefetch: int = 2) -> Iterator[np.ndarray]:
        """`batch(start_step)`, `batch(start_step + 1)`, ... read ahead by one background thread."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        ds = self.dataset[start_step:]
        if prefetch <= 0:
            return iter(ds)
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)))

    # --- facts for logs and summaries ----------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def steps_per_epoch(self) -> float:
        """Optimizer steps that read every window once."""
        return len(self.windows) / self.batch_size

    def epoch(self, step: int) -> float:
        return step / self.steps_per_epoch

    def unigram_entropy(self) -> float:
        """Nats: what a model that ignores context can reach; a learning model goes well below it."""
        return unigram_entropy(self.tokens)

    def floor(self) -> Optional[float]:
        """The loss a perfect model reaches: unknown for real text (SyntheticData knows its own)."""
        return None

    def describe(self) -> str:
        tok = "bytes" if self.tokenizer.name == "bytes" else self.tokenizer.name
        return (
            f"text {self.source}: {len(self.corpus.files)} file(s), {len(self.corpus.documents)} document(s), "
            f"{self.num_tokens} tokens ({tok}, vocab {self.tokenizer.vocab_size}), {len(self.windows)} windows of "
            f"{self.seq_len}, {self.steps_per_epoch:.1f} steps/epoch at batch {self.batch_size}"
            + (f", process {self.process_index} of {self.process_count}" if self.process_count > 1 else "")
        )


def load_text(
    path: Optional[Union[str, pathlib.Path]] = None,
    *,
    seq_len: int,
    batch_size: int,
    tokenizer: Optional[Union[str, pathlib.Path]] = None,
    text_field: str = "text",
    seed: int = 0,
    shuffle: bool = True,
    process_index: int = 0,
    process_count: int = 1,
    vocab_size: Optional[int] = None,
    eos_token: Optional[str] = None,
) -> TextData:
    """The text at `path` (None: the shipped corpus) as batches for process `process_index` of
    `process_count`. `tokenizer`: a tokenizer.json (or a folder holding one); None: UTF-8 bytes.
    `vocab_size`: the model's; every token id must be below it. Bad input raises DataError (one line)."""
    tok = load_tokenizer(tokenizer, eos_token=eos_token)
    if vocab_size is not None:
        check_vocab(tok, vocab_size)
    corpus = read_corpus(SHIPPED_CORPUS if path is None or str(path) == "" else path, text_field=text_field)
    source = str(pathlib.Path(path).expanduser()) if path else f"{SHIPPED_CORPUS} (shipped)"
    return TextData(
        corpus,
        tok,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        process_index=process_index,
        process_count=process_count,
        source=source,
    )


def from_config(c, vocab_size: int, process_index: int = 0, process_count: int = 1) -> TextData:
    """From train.py's `data` group (any object with the attributes below; missing ones take defaults):
    path, tokenizer, text_field, seq_len, batch_size, seed, shuffle."""
    return load_text(
        getattr(c, "path", None),
        seq_len=c.seq_len,
        batch_size=c.batch_size,
        tokenizer=getattr(c, "tokenizer", None),
        text_field=getattr(c, "text_field", "text"),
        seed=getattr(c, "seed", 0),
        shuffle=getattr(c, "shuffle", True),
        process_index=process_index,
        process_count=process_count,
        vocab_size=vocab_size,
    )


__all__ = ["SHIPPED_CORPUS", "TextData", "Windows", "from_config", "load_text", "num_windows", "pack", "unigram_entropy"]
