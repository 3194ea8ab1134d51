"""Prompts as an engine sees them: chat messages rendered to text.

A router hashes the same token ids the engine will (events.hashing), so both sides must render
alike (and encode alike: events.tokenizer). The chat template is ``chat_template`` of the model
directory's ``tokenizer_config.json`` (or ``chat_template.jinja``) rendered with Jinja2
(sandboxed) as Hugging Face does, else the plain template :data:`PLAIN_CHAT_TEMPLATE` describes.

``jinja2`` is imported only when the model directory needs it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from events.errors import EventsError

PLAIN_CHAT_TEMPLATE: Final = (
    "Each message as '<Role>: <content>' and a newline (the role capitalised: 'System', "
    "'User', 'Assistant', ...), then 'Assistant:' when a reply is to be generated."
)


class PromptError(EventsError, ValueError):
    """A chat message or template that cannot be rendered; the message says which and why."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class ChatTemplate:
    """Renders chat messages to the prompt text; ``source`` says which template it uses."""

    def __init__(self, template: str | None = None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = "plain" if template is None else "tokenizer"
        self._render: Callable[[Sequence[ChatMessage], bool], str] = _plain
        if template is not None:
            self._render = _jinja(template, bos_token, eos_token)

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        if not messages:
            raise PromptError("messages must not be empty")
        return self._render(messages, add_generation_prompt)


def _plain(messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
    text = "".join(f"{m.role.capitalize()}: {m.content}\n" for m in messages)
    return text + "Assistant:" if add_generation_prompt else text


def _jinja(template: str, bos: str, eos: str) -> Callable[[Sequence[ChatMessage], bool], str]:
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise PromptError("the model's chat template needs the jinja2 package: pip install jinja2") from exc

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise PromptError(f"the chat template refused the messages: {message}")

    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
    except TemplateError as exc:
        raise PromptError(f"the model's chat template does not compile: {exc}") from exc

    def render(messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
        try:
            return compiled.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)
        except TemplateError as exc:
            raise PromptError(f"the chat template failed on these messages: {exc}") from exc

    return render


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def load_chat_template(model_dir: str | Path) -> ChatTemplate:
    """The model's chat template, or the plain one when it has none."""
    root = Path(model_dir)
    config: dict[str, Any] = {}
    path = root / "tokenizer_config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise PromptError(f"{path} is not readable JSON: {exc}") from exc
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = root / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    if not isinstance(template, str) or not template:
        return ChatTemplate()
    return ChatTemplate(template, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

