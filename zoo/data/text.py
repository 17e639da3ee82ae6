"""Reading documents from a text file, a jsonl file, or a folder of them.

- `*.jsonl`: one JSON object per line, one document. With `format="auto"` a line with `messages` is a
  chat (`Chat`), a line with `prompt` and `response` (or `completion`) a prompt/response pair
  (`PromptResponse`), any other line plain text under `text_field` (default "text"); `format` "text",
  "prompt_response" or "chat" reads every line as that. Blank lines and empty texts are skipped.
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
from typing import Any, Union

from zoo.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl",)
FORMATS = ("auto", "text", "prompt_response", "chat")
RESPONSE_KEYS = ("response", "completion")  # the key of a pair's response, in the order looked for


@dataclasses.dataclass(frozen=True)
class PromptResponse:
    """A pair whose loss counts the response only: the text is `prompt + response`, as given."""

    prompt: str
    response: str


@dataclasses.dataclass(frozen=True)
class Chat:
    """Messages `(role, content)`; rendered by the tokenizer's chat template (zoo.data.chat), and the
    loss counts what the assistant says."""

    messages: tuple[tuple[str, str], ...]


Document = Union[str, PromptResponse, Chat]


def num_chars(doc: Document) -> int:
    if isinstance(doc, PromptResponse):
        return len(doc.prompt) + len(doc.response)
    if isinstance(doc, Chat):
        return sum(len(c) for _, c in doc.messages)
    return len(doc)


@dataclasses.dataclass(frozen=True)
class Corpus:
    files: tuple[pathlib.Path, ...]
    documents: tuple[Document, ...]

    @property
    def num_chars(self) -> int:
        return sum(num_chars(d) for d in self.documents)

    @property
    def has_responses(self) -> bool:
        """Whether some document's loss counts only part of it (prompt/response pairs, chats)."""
        return any(not isinstance(d, str) for d in self.documents)


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
        raise DataError(
            f"data.path: {p} is neither a file nor a folder; point data.path at a .txt/.jsonl file or a folder"
        )
    wanted = TEXT_SUFFIXES + JSONL_SUFFIXES
    files = [
        f
        for f in p.rglob("*")
        if f.is_file()
        and f.suffix.lower() in wanted
        and not any(part.startswith(".") for part in f.relative_to(p).parts)
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


FORMAT_HINT = 'or write {"prompt": ..., "response": ...} or {"messages": [{"role": ..., "content": ...}]} lines'


def _string(obj: dict, key: str, where: str, fix_key: str = "data.path") -> str:
    value = obj[key]
    if not isinstance(value, str):
        fix = (
            "set data.text_field to the key that holds the text" if fix_key == "data.text_field" else "make it a string"
        )
        raise DataError(f"{fix_key}: {where}: {key!r} holds a {type(value).__name__}, not a string; {fix}")
    return value


def _chat(obj: dict, where: str) -> Chat:
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"data.path: {where}: 'messages' must be a non-empty list of "
            '{"role": ..., "content": ...}; fix the line'
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(
                f'data.path: {where}: message {i} is not {{"role": <string>, "content": <string>}} '
                f"(got {json.dumps(m)[:80]}); fix the line"
            )
        out.append((m["role"], m["content"]))
    if not any(role == "assistant" for role, _ in out):
        raise DataError(
            f"data.path: {where}: no message has role 'assistant', so nothing would count in the loss; add the reply "
            "or drop the line"
        )
    return Chat(tuple(out))


def _pair(obj: dict, where: str) -> PromptResponse:
    key = next((k for k in RESPONSE_KEYS if k in obj), None)
    if "prompt" not in obj or key is None:
        have = ", ".join(map(str, obj)) or "no keys"
        raise DataError(
            f"data.path: {where} has no 'prompt' and 'response' (it has: {have}); fix the line or set data.format=auto"
        )
    return PromptResponse(_string(obj, "prompt", where), _string(obj, key, where))


def _document(obj: Any, where: str, text_field: str, fmt: str) -> Document:
    """One jsonl line -> a document ("" for an empty text, which the caller skips)."""
    if not isinstance(obj, dict):
        raise DataError(
            f"data.path: {where} is a JSON {type(obj).__name__}, not an object; write one JSON object per line"
        )
    if fmt == "chat" or (fmt == "auto" and "messages" in obj):
        if "messages" not in obj:
            raise DataError(f"data.path: {where} has no 'messages'; fix the line or set data.format=auto")
        return _chat(obj, where)
    if fmt == "prompt_response" or (fmt == "auto" and "prompt" in obj and any(k in obj for k in RESPONSE_KEYS)):
        return _pair(obj, where)
    if text_field not in obj:
        keys = ", ".join(map(str, obj))
        hint = f", {FORMAT_HINT}" if fmt == "auto" else ""
        raise DataError(
            f"data.text_field: {where} has no key {text_field!r} (it has: {keys or 'no keys'}); "
            f"set data.text_field to the key that holds the text{hint}"
        )
    return _string(obj, text_field, where, fix_key="data.text_field")


def jsonl_documents(f: pathlib.Path, text: str, text_field: str, fmt: str = "auto") -> list[Document]:
    docs: list[Document] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"data.path: {f} line {lineno} is not JSON ({e.msg}); write one JSON object per line"
            ) from None
        doc = _document(obj, f"{f} line {lineno}", text_field, fmt)
        if doc:
            docs.append(doc)
    if not docs:
        raise DataError(f"data.path: {f} has no text under the key {text_field!r}; check the file or data.text_field")
    return docs


def read_corpus(path: Union[str, pathlib.Path], text_field: str = "text", format: str = "auto") -> Corpus:
    """The documents under `path` (see the module doc); `format` applies to .jsonl lines."""
    if format not in FORMATS:
        raise DataError(f"data.format: unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    files = list_files(path)
    if format not in ("auto", "text") and not any(f.suffix.lower() in JSONL_SUFFIXES for f in files):
        raise DataError(
            f"data.format: {format} reads the fields of .jsonl lines, and {path} holds no .jsonl file (its text is "
            "read as it is); drop data.format (auto), or give a .jsonl file"
        )
    documents: list[Document] = []
    for f in files:
        text = decode_utf8(f)
        if f.suffix.lower() in JSONL_SUFFIXES:
            documents.extend(jsonl_documents(f, text, text_field, format))
        else:
            documents.append(text)
    return Corpus(files=tuple(files), documents=tuple(documents))
