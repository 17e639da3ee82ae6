"""Documents -> text pieces, each marked whether the loss counts it.

- plain text: one piece, counted.
- a prompt/response pair: the prompt (not counted), then the response (counted), as given: no
  template, so the separators are what the data holds.
- a chat: the conversation rendered by the tokenizer's chat template (Jinja, through jinja2, as
  transformers renders it) or, where the tokenizer has none, by `FALLBACK`. What each assistant
  message adds is counted, the rest is not. It is found by rendering prefixes: the text of assistant
  message i is what `render(messages[:i+1])` adds to `render(messages[:i], add_generation_prompt=True)`,
  so a counted piece holds the reply and the template's end-of-turn marker (`<|im_end|>`,
  `<|eot_id|>`, ...), and the prompt pieces end with the header that asks for a reply, as at inference.
  A template under which a shorter conversation does not render as the start of a longer one (e.g. one
  that drops earlier turns' reasoning) cannot be cut this way and is refused.

The pieces are tokenized one by one (`zoo.data.pipeline`), so a prompt's ids are those the tokenizer
gives the prompt alone, as when the model is prompted with it.
"""

import datetime
from typing import Callable, Optional

from zoo.data.errors import DataError
from zoo.data.text import Chat, Document, PromptResponse

Piece = tuple[str, bool]  # (text, whether the loss counts its tokens)
Render = Callable[[list[dict], bool], str]  # (messages, add_generation_prompt) -> text

ASSISTANT = "assistant"


def fallback_render(messages: list[dict], add_generation_prompt: bool) -> str:
    """The chat format of a tokenizer without a template (the bytes, or a bare tokenizer.json): each
    message as `<role>: <content>` and a newline; the reply header is `assistant: `."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + (f"{ASSISTANT}: " if add_generation_prompt else "")


FALLBACK = "each message as '<role>: <content>\\n', replies after 'assistant: '"


def jinja_render(template: str, special_tokens: dict[str, str], source: str) -> Render:
    """The template compiled once, in a sandbox, with what HF templates use (`raise_exception`,
    `strftime_now`, loop controls, `bos_token` / `eos_token`)."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError(
            f"data.tokenizer: {source} has a chat template, and rendering it needs jinja2; pip install jinja2"
        ) from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise DataError(
            f"data.tokenizer: the chat template of {source} does not compile ({e}); fix it or remove it"
        ) from None

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(
                f"data.path: the chat template of {source} refuses a conversation ({e}); fix the data or the template"
            ) from None

    return render


def renderer(tokenizer) -> tuple[Render, str]:
    """The tokenizer's chat rendering and a few words saying which it is."""
    template: Optional[str] = getattr(tokenizer, "chat_template", None)
    if template is None:
        return fallback_render, f"no chat template: {FALLBACK}"
    return jinja_render(
        template, dict(tokenizer.special_tokens), tokenizer.name
    ), f"the chat template of {tokenizer.name}"


def chat_pieces(chat: Chat, render: Render) -> list[Piece]:
    messages = [{"role": r, "content": c} for r, c in chat.messages]
    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != ASSISTANT:
            continue
        asked = render(messages[:i], True)
        answered = render(messages[: i + 1], False)
        if not (answered.startswith(asked) and full.startswith(answered)):
            raise DataError(
                "data.tokenizer: its chat template does not render a conversation's first turns as the start of the "
                "whole conversation, so the replies cannot be told from the prompts; use a template that does, or "
                "prompt/response lines"
            )
        spans.append((len(asked), len(answered)))
    pieces: list[Piece] = []
    at = 0
    for start, end in spans:
        start = max(start, at)  # two replies in a row: the second's prompt part is empty
        if start > at:
            pieces.append((full[at:start], False))
        if end > start:
            pieces.append((full[start:end], True))
        at = max(at, end)
    if at < len(full):
        pieces.append((full[at:], False))
    return pieces


def document_pieces(doc: Document, render: Optional[Render]) -> list[Piece]:
    """The pieces of one document (see the module doc). `render` is needed for chats only."""
    if isinstance(doc, str):
        return [(doc, True)]
    if isinstance(doc, PromptResponse):
        return [(doc.prompt, False), (doc.response, True)]
    assert render is not None
    return chat_pieces(doc, render)
