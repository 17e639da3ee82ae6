"""Real text -> fixed-length packed batches: tokenize once, pack, hold out, shuffle, split across processes, resume.

1. Read the documents (`zoo.data.text`), cut each into pieces the loss counts or not
   (`zoo.data.chat`: all of a plain text, a pair's response, a chat's replies), tokenize them once,
   and pack them into one stream: each document as `[bos] + ids + [eos]` (the tokenizer's BOS where
   it has one and the document does not already start with it; its end-of-document id where it has
   one). The EOS counts when the document's last token does.
2. Cut the stream into windows of `seq_len` ids that overlap by one: window i is
   `stream[i*(seq_len-1) : i*(seq_len-1) + seq_len]`. The loss predicts ids 1..seq_len-1 of a window
   from the ids before them, so every id of the stream after the first is a target in exactly one
   window. The tail that does not fill a window is dropped.
3. Hold out (`eval_fraction` f > 0): window i is held out when floor((i+1) f) > floor(i f), so
   exactly floor(n f) windows, evenly spread over the corpus, whatever the seed. No held-out target
   is a training target (neighbouring windows share only their edge token, which the training window
   does not predict).
4. Step k's global batch is elements `k*batch_size .. (k+1)*batch_size - 1` of an endless stream of
   this split's windows, shuffled by `seed` anew each epoch (epoch e's order is a permutation drawn
   from `(seed, e)`); process p of P takes the p-th of P equal slices of it (`batch_size / P`
   rows). So the processes' data are disjoint within an epoch, the global batch at step k does not
   depend on how many processes share it, and a restarted run reads exactly the batches the
   uninterrupted run reads from step k: the loader's whole state is the step number.

Each batch is a dict of int32 `[rows, seq_len]` arrays (`BATCH_FIELDS`):
- `tokens`: the ids.
- `segment_ids`: 0 for the window's first document (or the part of it the window holds), 1 for the
  next, ...: attention stays within a document.
- `positions`: each token's place in its document, counted from the document's first token in the
  window (a document the window enters mid-way starts again at 0: RoPE never sees a position the
  window does not hold).
- `loss_mask`: 1 where the token counts as a target (plain text: everywhere; pairs and chats: the
  response's tokens). The loss also drops every target that starts a segment: the token after a
  document's EOS is not predicted from the document before it (`zoo.loss.target_weights`).
"""

import dataclasses
import math
import pathlib
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Optional, Union

import grain
import numpy as np

from zoo.data.chat import document_pieces, renderer
from zoo.data.errors import DataError
from zoo.data.text import Chat, Corpus, Document, read_corpus
from zoo.data.tokenizer import Tokenizer, check_vocab, load_tokenizer

SHIPPED_CORPUS = pathlib.Path(__file__).resolve().parent / "corpus" / "shakespeare"
BATCH_FIELDS = ("tokens", "segment_ids", "positions", "loss_mask")

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Packed:
    """The corpus as one stream: `tokens` [n] (uint16 when the ids fit, else int32), `doc_starts`
    (the stream index of each document's first token, ascending, from 0) and `loss_mask` (bool [n];
    None: every token counts)."""

    tokens: np.ndarray
    doc_starts: np.ndarray
    loss_mask: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.tokens)


def tokenize(tokenizer: Tokenizer, documents: Sequence[Document]) -> list[tuple[np.ndarray, Optional[np.ndarray]]]:
    """Each document's ids and (None for plain text) which of them the loss counts. Pieces are
    tokenized one by one, in one batched call."""
    if all(isinstance(d, str) for d in documents):
        return [(ids, None) for ids in tokenizer.encode_batch(list(documents))]
    render = renderer(tokenizer)[0] if any(isinstance(d, Chat) for d in documents) else None
    pieces = [document_pieces(d, render) for d in documents]
    ids = iter(tokenizer.encode_batch([text for p in pieces for text, _ in p]))
    out = []
    for p in pieces:
        parts = [next(ids) for _ in p]
        tokens = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
        mask = (
            np.concatenate([np.full(len(x), counted) for x, (_, counted) in zip(parts, p)])
            if parts
            else np.zeros((0,), bool)
        )
        out.append((tokens, mask))
    return out


def pack(
    documents: Sequence[tuple[np.ndarray, Optional[np.ndarray]]],
    bos_id: Optional[int],
    eos_id: Optional[int],
    vocab_size: int,
) -> Packed:
    """One stream: each document's ids between `bos_id` and `eos_id` (either may be None)."""
    dtype = np.uint16 if vocab_size <= 2**16 else np.int32
    masked = any(m is not None for _, m in documents)
    tokens, masks, lengths = [], [], []
    for ids, mask in documents:
        ids = np.asarray(ids)
        mask = np.ones(len(ids), bool) if mask is None else np.asarray(mask, bool)
        if bos_id is not None and not (len(ids) and ids[0] == bos_id):
            ids, mask = np.concatenate([[bos_id], ids]), np.concatenate([[False], mask])
        if eos_id is not None:
            ids, mask = np.concatenate([ids, [eos_id]]), np.concatenate([mask, mask[-1:] if len(mask) else [True]])
        tokens.append(ids.astype(dtype))
        masks.append(mask)
        lengths.append(len(ids))
    if not tokens:
        return Packed(np.zeros((0,), dtype), np.zeros((1,), np.int64), np.zeros((0,), bool) if masked else None)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return Packed(np.concatenate(tokens), starts, np.concatenate(masks) if masked else None)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows of seq_len ids at stride seq_len-1 that fit in a stream of num_tokens ids."""
    if num_tokens < seq_len:
        return 0
    return (num_tokens - 1) // (seq_len - 1)


def held_out(n: int, fraction: float) -> np.ndarray:
    """Which of n windows the evaluation holds out: exactly floor(n * fraction), evenly spread."""
    i = np.arange(n)
    return np.floor((i + 1) * fraction) > np.floor(i * fraction)


class Windows:
    """Random access to the windows of a packed stream: `[i]` is window i's ids, `gather(ids)` a batch."""

    def __init__(self, packed: Packed, seq_len: int):
        self.packed = packed
        self.tokens = packed.tokens
        self.seq_len = seq_len
        self.stride = seq_len - 1
        self._len = num_windows(len(packed), seq_len)
        self._starts_doc = np.zeros(len(packed), bool)
        self._starts_doc[packed.doc_starts[packed.doc_starts < len(packed)]] = True

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._len:
            raise IndexError(i)
        start = i * self.stride
        return self.tokens[start : start + self.seq_len]

    def gather(self, ids: np.ndarray) -> Batch:
        """The batch (see the module doc) of windows `ids` (int array [rows])."""
        ids = np.asarray(ids, np.int64)
        starts_doc = self._rows(self._starts_doc)[ids]  # True where a document begins
        starts_doc[:, 0] = True  # and where the window begins: positions count from there
        segment = np.cumsum(starts_doc, axis=1, dtype=np.int32) - 1
        # The column where each token's segment begins: the (row's first + segment)-th of all starts.
        rows_first = np.concatenate([[0], np.cumsum(segment[:, -1] + 1)[:-1]])
        start_column = np.nonzero(starts_doc)[1].astype(np.int32)
        mask = self.packed.loss_mask
        return {
            "tokens": self._rows(self.tokens)[ids].astype(np.int32),
            "segment_ids": segment,
            "positions": np.arange(self.seq_len, dtype=np.int32) - start_column[rows_first[:, None] + segment],
            "loss_mask": np.ones(segment.shape, np.int32) if mask is None else self._rows(mask)[ids].astype(np.int32),
        }

    def _rows(self, stream: np.ndarray) -> np.ndarray:
        """A read-only [windows, seq_len] view of a stream-long array: row i is window i (no copy)."""
        return np.lib.stride_tricks.as_strided(
            stream, (self._len, self.seq_len), (self.stride * stream.strides[0], stream.strides[0]), writeable=False
        )

    def max_segments(self) -> int:
        """The most documents (whole or in part) any window holds: the bound cuDNN's packed attention needs."""
        if not self._len:
            return 1
        first = np.arange(self._len, dtype=np.int64) * self.stride
        starts = self.packed.doc_starts
        inside = np.searchsorted(starts, first + self.seq_len - 1, side="right") - np.searchsorted(
            starts, first, side="right"
        )
        return int(inside.max()) + 1


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy (nats) of the ids' frequency distribution: the loss of the best model that ignores context."""
    counts = np.bincount(np.asarray(tokens).astype(np.int64).ravel())
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class TextData:
    """Batches of real text for one data-parallel process: `batch(step)` is a dict of int32
    `[batch_size/process_count, seq_len]` arrays (`BATCH_FIELDS`), the same for the same (corpus,
    tokenizer, seq_len, batch_size, seed, shuffle, eval_fraction, process_index, process_count)
    whatever happened before, cheap (a gather from the packed stream) and safe to call from several
    threads; `batches(start_step)` iterates them with a background prefetch thread. `eval` is the
    held-out split (a TextData in corpus order) or None."""

    def __init__(
        self,
        windows: Windows,
        window_ids: np.ndarray,
        *,
        corpus: Corpus,
        tokenizer: Tokenizer,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
        source: str = "",
        split: str = "train",
    ):
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
        self.windows = windows
        self.window_ids = np.asarray(window_ids, np.int64)
        self.corpus = corpus
        self.tokenizer = tokenizer
        self.seq_len = windows.seq_len
        self.batch_size = batch_size
        self.local_batch_size = batch_size // process_count
        self.seed = seed
        self.shuffle = shuffle
        self.process_index = process_index
        self.process_count = process_count
        self.source = source
        self.split = split
        self.eval: Optional["TextData"] = None
        self._orders: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @property
    def tokens(self) -> np.ndarray:
        """The packed stream (every split's windows cut from it)."""
        return self.windows.tokens

    # --- what the train loop calls -------------------------------------------------------------

    def _order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order of this split's windows (the last two epochs' are kept)."""
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                n = len(self.window_ids)
                perm = np.random.default_rng((self.seed, epoch)).permutation(n) if self.shuffle else np.arange(n)
                order = self.window_ids[perm]
                self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
                self._orders[epoch] = order
            return order

    def batch(self, step: int) -> Batch:
        """This process's rows of step `step`'s batch (see the module doc)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        first = step * self.batch_size + self.process_index * self.local_batch_size
        epochs, within = np.divmod(
            np.arange(first, first + self.local_batch_size, dtype=np.int64), len(self.window_ids)
        )
        ids = np.empty(self.local_batch_size, np.int64)
        for e in np.unique(epochs):
            ids[epochs == e] = self._order(int(e))[within[epochs == e]]
        return self.windows.gather(ids)

    def batches(self, start_step: int = 0, prefetch: int = 2) -> Iterator[Batch]:
        """`batch(start_step)`, `batch(start_step + 1)`, ... read ahead by one background thread."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        ds = grain.MapDataset.range(start_step, start_step + 2**40).map(self.batch)
        if prefetch <= 0:
            return iter(ds)
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)))

    # --- facts for logs and summaries ----------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Tokens of the packed stream this split's windows come from."""
        return int(len(self.tokens))

    @property
    def num_batches(self) -> int:
        """Whole batches in one pass over this split's windows."""
        return len(self.window_ids) // self.batch_size

    @property
    def steps_per_epoch(self) -> float:
        """Optimizer steps that read every window of this split once."""
        return len(self.window_ids) / self.batch_size

    @property
    def max_segments(self) -> int:
        return self.windows.max_segments()

    def epoch(self, step: int) -> float:
        return step / self.steps_per_epoch

    def unigram_entropy(self) -> float:
        """Nats: what a model that ignores context can reach; a learning model goes well below it."""
        return unigram_entropy(self.tokens)

    def floor(self) -> Optional[float]:
        """The loss a perfect model reaches: unknown for real text (SyntheticData knows its own)."""
        return None

    def describe(self) -> str:
        tok = self.tokenizer
        marks = [f"bos {tok.decode([tok.bos_id])!r}" if tok.bos_id is not None else "no bos"]
        if self.windows.packed.loss_mask is not None:
            counted = float(self.windows.packed.loss_mask.mean())
            marks.append(f"loss on responses only ({100 * counted:.1f}% of tokens)")
        line = (
            f"text {self.source}: {len(self.corpus.files)} file(s), {len(self.corpus.documents)} document(s), "
            f"{self.num_tokens} tokens ({'bytes' if tok.name == 'bytes' else tok.name}, vocab {tok.vocab_size}, "
            f"{', '.join(marks)}), "
            f"{len(self.window_ids)} windows of {self.seq_len}, {self.steps_per_epoch:.1f} steps/epoch at batch "
            f"{self.batch_size}"
            + (f", process {self.process_index} of {self.process_count}" if self.process_count > 1 else "")
        )
        if self.eval is not None:
            e = self.eval
            where = "held out" if e.windows is self.windows else f"from {e.source}"
            line += f"; eval: {len(e.window_ids)} windows {where} ({e.num_batches} batches)"
        return line


def _check_fits(n: int, batch_size: int, seq_len: int, key: str, what: str, fix: str) -> None:
    """A split must fill one batch: `<key>: <what> gives n windows ..., fewer than one batch; <fix>`."""
    if n < batch_size:
        raise DataError(
            f"{key}: {what} gives {n} windows of data.seq_len={seq_len} tokens, fewer than one batch of "
            f"data.batch_size={batch_size}; {fix}"
        )


def load_text(
    path: Optional[Union[str, pathlib.Path]] = None,
    *,
    seq_len: int,
    batch_size: int,
    tokenizer: Optional[Union[str, pathlib.Path]] = None,
    text_field: str = "text",
    format: str = "auto",
    seed: int = 0,
    shuffle: bool = True,
    process_index: int = 0,
    process_count: int = 1,
    vocab_size: Optional[int] = None,
    eos_token: Optional[str] = None,
    bos_token: Optional[str] = None,
    eval_fraction: float = 0.0,
    eval_path: Optional[Union[str, pathlib.Path]] = None,
) -> TextData:
    """The text at `path` (None: the shipped corpus) as batches for process `process_index` of
    `process_count`. `tokenizer`: a tokenizer.json (or a folder holding one); None: UTF-8 bytes.
    `vocab_size`: the model's; every token id must be below it. `eval_fraction` of the windows held
    out, or the text at `eval_path`, becomes `.eval`. Bad input raises DataError (one line)."""
    if seq_len < 2:
        raise DataError(f"data.seq_len: next-token loss needs at least 2 tokens, got {seq_len}")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"data.eval_fraction: must be in [0, 1), got {eval_fraction}; e.g. data.eval_fraction=0.05")
    if eval_fraction and eval_path:
        raise DataError(
            "data.eval_fraction: set it or data.eval_path, not both; data.eval_fraction=0 to evaluate on data.eval_path"
        )
    tok = load_tokenizer(tokenizer, eos_token=eos_token, bos_token=bos_token)
    if vocab_size is not None:
        check_vocab(tok, vocab_size)
    shipped = path is None or str(path) == ""
    source = f"{SHIPPED_CORPUS} (shipped)" if shipped else str(pathlib.Path(path).expanduser())
    corpus = read_corpus(SHIPPED_CORPUS if shipped else path, text_field=text_field, format=format)
    windows = Windows(pack(tokenize(tok, corpus.documents), tok.bos_id, tok.eos_id, tok.vocab_size), seq_len)
    if len(windows) == 0:
        raise DataError(
            f"data.path: {source} gives {len(windows.tokens)} tokens, fewer than data.seq_len={seq_len}; "
            "add text or lower data.seq_len"
        )
    common = dict(tokenizer=tok, batch_size=batch_size, process_index=process_index, process_count=process_count)
    out = held_out(len(windows), eval_fraction)
    train_ids = np.flatnonzero(~out)
    kept = f" after data.eval_fraction={eval_fraction} holds {int(out.sum())} out" if eval_fraction else ""
    _check_fits(
        len(train_ids),
        batch_size,
        seq_len,
        "data.batch_size",
        f"{source} ({len(windows.tokens)} tokens{kept})",
        "a step would read more than the corpus; lower data.batch_size or data.seq_len, or add text",
    )
    data = TextData(windows, train_ids, corpus=corpus, seed=seed, shuffle=shuffle, source=source, **common)
    if eval_fraction:
        eval_ids = np.flatnonzero(out)
        need = math.ceil(batch_size * 1000 / len(windows)) / 1000
        _check_fits(
            len(eval_ids),
            batch_size,
            seq_len,
            "data.eval_fraction",
            f"{eval_fraction} of {source}",
            f"raise data.eval_fraction to at least {need:g}, lower data.batch_size, or give data.eval_path",
        )
        data.eval = TextData(windows, eval_ids, corpus=corpus, shuffle=False, source=source, split="eval", **common)
    elif eval_path:
        eval_source = str(pathlib.Path(eval_path).expanduser())
        try:
            eval_corpus = read_corpus(eval_path, text_field=text_field, format=format)
        except DataError as e:  # its problems are data.eval_path's
            # the fix named in the message too ("point data.path at ..."), not only the key in front
            raise DataError(re.sub(r"\bdata\.path\b", "data.eval_path", str(e))) from None
        eval_windows = Windows(
            pack(tokenize(tok, eval_corpus.documents), tok.bos_id, tok.eos_id, tok.vocab_size), seq_len
        )
        _check_fits(
            len(eval_windows),
            batch_size,
            seq_len,
            "data.eval_path",
            f"{eval_source} ({len(eval_windows.tokens)} tokens)",
            "add text to it or lower data.batch_size",
        )
        data.eval = TextData(
            eval_windows,
            np.arange(len(eval_windows)),
            corpus=eval_corpus,
            shuffle=False,
            source=eval_source,
            split="eval",
            **common,
        )
    return data


def from_config(c, vocab_size: int, process_index: int = 0, process_count: int = 1) -> TextData:
    """From train.py's `data` group (any object with the attributes below; missing ones take defaults):
    path, tokenizer, text_field, format, seq_len, batch_size, seed, shuffle, eval_fraction, eval_path."""
    return load_text(
        getattr(c, "path", None),
        seq_len=c.seq_len,
        batch_size=c.batch_size,
        tokenizer=getattr(c, "tokenizer", None),
        text_field=getattr(c, "text_field", "text"),
        format=getattr(c, "format", "auto"),
        seed=getattr(c, "seed", 0),
        shuffle=getattr(c, "shuffle", True),
        process_index=process_index,
        process_count=process_count,
        vocab_size=vocab_size,
        eval_fraction=getattr(c, "eval_fraction", 0.0),
        eval_path=getattr(c, "eval_path", None),
    )


__all__ = [
    "BATCH_FIELDS",
    "SHIPPED_CORPUS",
    "Packed",
    "TextData",
    "Windows",
    "from_config",
    "held_out",
    "load_text",
    "num_windows",
    "pack",
    "tokenize",
    "unigram_entropy",
]
