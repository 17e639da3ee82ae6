"""Text -> token ids: raw UTF-8 bytes (no tokenizer file), or a Hugging Face `tokenizers` tokenizer.json.

Both give `encode_batch(texts) -> list of int arrays`, `decode(ids) -> str`, `vocab_size` (one more than
the largest id it can produce), `eos_id`, the id put after every document when documents are packed
into one stream (None: documents are simply concatenated), `bos_id`, the id put before every document
(None: no beginning-of-document token), and `chat_template` (a Jinja template string, or None).

Byte-level tokens: ids 0..255 are the bytes of the UTF-8 text, so `vocab_size` is 256 and a model with
`vocab_size: 256` (the tiny zoo models) fits. The document separator is byte 0 (NUL), which ordinary text
never contains; no id outside the 256 bytes is needed, and there is no BOS.

A tokenizer.json's BOS is what its post-processor puts before a text (Llama 3's `<|begin_of_text|>`,
Gemma's `<bos>`, Mistral's `<s>`; Qwen's adds nothing), unless a `tokenizer_config.json` beside it says
otherwise (`add_bos_token` with `bos_token`). Its chat template comes from `chat_template.jinja` or
`tokenizer_config.json`'s `chat_template` beside it, as transformers' `save_pretrained` writes them.
"""

import json
import pathlib
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from zoo.data.errors import DataError

# Tried in this order when a tokenizer.json is given without an explicit end-of-document token.
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class ByteTokenizer:
    """UTF-8 bytes as ids (0..255); documents are separated by byte 0."""

    name = "bytes"
    vocab_size = 256
    eos_id: Optional[int] = 0
    bos_id: Optional[int] = None
    chat_template: Optional[str] = None
    special_tokens: dict[str, str] = {}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Union[Sequence[int], np.ndarray]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256, eos_id=0)"


def _token_text(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string, or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_tokenizer_config(folder: pathlib.Path) -> dict:
    f = folder / "tokenizer_config.json"
    if not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"data.tokenizer: {f} does not read as JSON ({e}); fix or remove it") from None
    if not isinstance(cfg, dict):
        raise DataError(f"data.tokenizer: {f} is not a JSON object; fix or remove it")
    return cfg


def _read_chat_template(folder: pathlib.Path, cfg: dict) -> Optional[str]:
    """`chat_template.jinja` beside the tokenizer, else tokenizer_config.json's `chat_template` (a
    string, or a list of named templates: the one named "default")."""
    f = folder / "chat_template.jinja"
    if f.is_file():
        return f.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


class HFTokenizer:
    """A `tokenizers.Tokenizer` read from a tokenizer.json. Texts are encoded without the tokenizer's
    own special tokens; packing puts `bos_id` (if any) before each document and `eos_id` after it."""

    def __init__(
        self, path: Union[str, pathlib.Path], eos_token: Optional[str] = None, bos_token: Optional[str] = None
    ):
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
        if not p.is_file():  # a device (/dev/zero: the reader never ends) or a pipe
            raise DataError(
                f"data.tokenizer: {p} is neither a file nor a folder; give the path of a tokenizer.json, "
                "or data.tokenizer=null for byte-level tokens"
            )
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
                raise DataError(
                    f"data.tokenizer: {p} has no token {eos_token!r} to end documents with; name one it has"
                )
            self.eos_token: Optional[str] = eos_token
        else:
            self.eos_token = next((t for t in EOS_CANDIDATES if t in vocab), None)
        self.eos_id: Optional[int] = vocab[self.eos_token] if self.eos_token is not None else None
        config = _read_tokenizer_config(p.parent)
        if bos_token is not None:
            if bos_token not in vocab:
                raise DataError(
                    f"data.tokenizer: {p} has no token {bos_token!r} to begin documents with; name one it has"
                )
            self.bos_token: Optional[str] = bos_token
        else:
            self.bos_token = self._default_bos(config, vocab)
        self.bos_id: Optional[int] = vocab[self.bos_token] if self.bos_token is not None else None
        self.chat_template = _read_chat_template(p.parent, config)
        # What a chat template may name (`{{ bos_token }}`): tokenizer_config.json's, else the ones found here.
        self.special_tokens = {
            "bos_token": _token_text(config.get("bos_token")) or self.bos_token or "",
            "eos_token": _token_text(config.get("eos_token")) or self.eos_token or "",
        }

    def _default_bos(self, config: dict, vocab: dict[str, int]) -> Optional[str]:
        """tokenizer_config.json's `bos_token` where its `add_bos_token` is true; none where it is
        false; otherwise the one token the post-processor puts before a text (if it puts one)."""
        add = config.get("add_bos_token")
        named = _token_text(config.get("bos_token"))
        if add is True and named in vocab:
            return named
        if add is False:
            return None
        plain = self._tok.encode("a b", add_special_tokens=False).ids
        special = self._tok.encode("a b", add_special_tokens=True).ids
        for start in range(len(special) - len(plain) + 1):
            if special[start : start + len(plain)] == plain:
                if start == 1:
                    return self._tok.id_to_token(special[0])
                break
        return None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in out]

    def decode(self, ids: Union[Sequence[int], np.ndarray]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r})"
        )


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def load_tokenizer(
    path: Optional[Union[str, pathlib.Path]] = None, eos_token: Optional[str] = None, bos_token: Optional[str] = None
) -> Tokenizer:
    """`None`: byte-level tokens; else the tokenizer.json at `path` (or in the folder `path`).
    `eos_token` / `bos_token` name the tokens to end / begin documents with (None: the tokenizer's)."""
    if path is None or str(path) == "":
        return ByteTokenizer()
    return HFTokenizer(path, eos_token=eos_token, bos_token=bos_token)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Every id the tokenizer can produce must index the model's embedding table."""
    if tokenizer.vocab_size > model_vocab_size:
        if isinstance(tokenizer, ByteTokenizer):
            fix = "use a model with model.vocab_size>=256, or give data.tokenizer a smaller tokenizer.json"
            what = "byte-level tokens (data.tokenizer=null) need 256 ids"
        else:
            fix = (
                f"set model.vocab_size>={tokenizer.vocab_size} or give data.tokenizer a tokenizer with at most "
                f"{model_vocab_size} tokens"
            )
            what = f"{tokenizer.name} has {tokenizer.vocab_size} token ids"
        raise DataError(f"data.tokenizer: {what} but model.vocab_size={model_vocab_size}; {fix}")
