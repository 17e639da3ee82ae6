"""Reading documents from a text file, a jsonl file, or a folder of them.

- `*.jsonl`: one JSON object per line; its `text_field` (default "text") is one document. Blank lines
  and empty strings are skipped.
- any other file given directly, and `*.txt`, `*.md`, `*.text` inside a folder: the whole file is one
  document.
- a folder: every such file below it (recursively; hidden files and folders skipped), in sorted order
  of their relative paths, so every process and every restart reads the same documents in the same order.

Files must be UTF-8 (a leading byte-order mark is dropped). Anything else raises `DataError` with one
line that names the file, what is wrong and the fix.
"""

import dataclasses
import json
import pathlib
from typing import Union

from zoo.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl",)


@dataclasses.dataclass(frozen=True)
class Corpus:
    files: tuple[pathlib.Path, ...]
    documents: tuple[str, ...]

    @property
    def num_chars(self) -> int:
        return sum(len(d) for d in self.documents)


def list_files(path: Union[str, pathlib.Path]) -> list[pathlib.Path]:
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise DataError(
            f"data.path: {p} does not exist; point data.path at a .txt or .jsonl file or a folder of them "
            "(relative paths start from the current directory)"
        )
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise DataError(f"data.path: {p} is neither a file nor a folder; point data.path at a .txt/.jsonl file or a folder")
    wanted = TEXT_SUFFIXES + JSONL_SUFFIXES
    files = [
        f
        for f in p.rglob("*")
        if f.is_file() and f.suffix.lower() in wanted and not any(part.startswith(".") for part in f.relative_to(p).parts)
    ]
    if not files:
        raise DataError(
            f"data.path: folder {p} has no {', '.join(wanted)} files; put text files in it or point data.path at a file"
        )
    return sorted(files, key=lambda f: f.relative_to(p).as_posix())


def decode_utf8(f: pathlib.Path) -> str:
    """The file's text; DataError for an unreadable, empty or non-UTF-8 file."""
    try:
        raw = f.read_bytes()
    except OSError as e:
        raise DataError(f"data.path: cannot read {f} ({e.strerror}); fix its permissions or remove it") from None
    if not raw.strip():
        raise DataError(f"data.path: {f} is empty; put text in it or remove it from data.path")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(
            f"data.path: {f} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}, line {line}); "
            f"convert it, e.g. iconv -f latin1 -t utf-8, or remove it from data.path"
        ) from None
    return text


def jsonl_documents(f: pathlib.Path, text: str, text_field: str) -> list[str]:
    docs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"data.path: {f} line {lineno} is not JSON ({e.msg}); write one JSON object per line") from None
        if not isinstance(obj, dict) or text_field not in obj:
            keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else f"a JSON {type(obj).__name__}, not an object"
            raise DataError(
                f"data.text_field: {f} line {lineno} has no key {text_field!r} (it has: {keys or 'no keys'}); "
                "set data.text_field to the key that holds the text"
            )
        value = obj[text_field]
        if not isinstance(value, str):
            raise DataError(
                f"data.text_field: {f} line {lineno}: {text_field!r} holds a {type(value).__name__}, not a string; "
                "set data.text_field to the key that holds the text"
            )
        if value:
            docs.append(value)
    if not docs:
        raise DataError(f"data.path: {f} has no text under the key {text_field!r}; check the file or data.text_field")
    return docs


def read_corpus(path: Union[str, pathlib.Path], text_field: str = "text") -> Corpus:
    files = list_files(path)
    documents: list[str] = []
    for f in files:
        text = decode_utf8(f)
        if f.suffix.lower() in JSONL_SUFFIXES:
            documents.extend(jsonl_documents(f, text, text_field))
        else:
            documents.append(text)
    return Corpus(files=tuple(files), documents=tuple(documents))
