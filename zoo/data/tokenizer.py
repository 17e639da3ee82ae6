"""Text -> token ids: raw UTF-8 bytes (no tokenizer file), or a Hugging Face `tokenizers` tokenizer.json.

Both give `encode_batch(texts) -> list of int arrays`, `decode(ids) -> str`, `vocab_size` (one more than
the largest id it can produce) and `eos_id`, the id put after every document when documents are packed
into one stream (None: documents are simply concatenated).

Byte-level tokens: ids 0..255 are the bytes of the UTF-8 text, so `vocab_size` is 256 and a model with
`vocab_size: 256` (the tiny zoo models) fits. The document separator is byte 0 (NUL), which ordinary text
never contains; no id outside the 256 bytes is needed.
"""

import pathlib
from collections.abc import Sequence
from typing import Optional, Union

import numpy as np

from zoo.data.errors import DataError

# Tried in this order when a tokenizer.json is given without an explicit end-of-document token.
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class ByteTokenizer:
    """UTF-8 bytes as ids (0..255); documents are separated by byte 0."""

    name = "bytes"
    vocab_size = 256
    eos_id: Optional[int] = 0

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Union[Sequence[int], np.ndarray]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256, eos_id=0)"


class HFTokenizer:
    """A `tokenizers.Tokenizer` read from a tokenizer.json. Documents are encoded without the
    tokenizer's own special tokens (no BOS from a post-processor); `eos_id` separates them."""

    def __init__(self, path: Union[str, pathlib.Path], eos_token: Optional[str] = None):
        from tokenizers import Tokenizer

        p = pathlib.Path(path).expanduser()
        if not p.exists():
            raise DataError(
                f"data.tokenizer: {p} does not exist; give the path of a tokenizer.json, "
                "or data.tokenizer=null for byte-level tokens"
            )
        if p.is_dir():
            if not (p / "tokenizer.json").is_file():
                raise DataError(
                    f"data.tokenizer: folder {p} has no tokenizer.json; give the tokenizer.json file itself, "
                    "or data.tokenizer=null for byte-level tokens"
                )
            p = p / "tokenizer.json"
        try:
            self._tok = Tokenizer.from_file(str(p))
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception
            reason = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise DataError(
                f"data.tokenizer: {p} does not load as a Hugging Face tokenizer.json ({reason}); "
                "give a file written by tokenizers' Tokenizer.save or transformers' save_pretrained, "
                "or data.tokenizer=null for byte-level tokens"
            ) from None
        self.path = p
        self.name = str(p)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise DataError(f"data.tokenizer: {p} has an empty vocabulary; give a trained tokenizer.json")
        self.vocab_size = max(vocab.values()) + 1
        if eos_token is not None:
            if eos_token not in vocab:
                raise DataError(f"data.tokenizer: {p} has no token {eos_token!r} to end documents with; name one it has")
            self.eos_token: Optional[str] = eos_token
        else:
            self.eos_token = next((t for t in EOS_CANDIDATES if t in vocab), None)
        self.eos_id: Optional[int] = vocab[self.eos_token] if self.eos_token is not None else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in out]

    def decode(self, ids: Union[Sequence[int], np.ndarray]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos={self.eos_token!r})"


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def load_tokenizer(path: Optional[Union[str, pathlib.Path]] = None, eos_token: Optional[str] = None) -> Tokenizer:
    """`None`: byte-level tokens; else the tokenizer.json at `path` (or in the folder `path`)."""
    if path is None or str(path) == "":
        return ByteTokenizer()
    return HFTokenizer(path, eos_token=eos_token)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Every id the tokenizer can produce must index the model's embedding table."""
    if tokenizer.vocab_size > model_vocab_size:
        if isinstance(tokenizer, ByteTokenizer):
            fix = "use a model with model.vocab_size>=256, or give data.tokenizer a smaller tokenizer.json"
            what = "byte-level tokens (data.tokenizer=null) need 256 ids"
        else:
            fix = f"set model.vocab_size>={tokenizer.vocab_size} or give data.tokenizer a tokenizer with at most {model_vocab_size} tokens"
            what = f"{tokenizer.name} has {tokenizer.vocab_size} token ids"
        raise DataError(f"data.tokenizer: {what} but model.vocab_size={model_vocab_size}; {fix}")
