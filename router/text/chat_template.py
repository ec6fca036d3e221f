"""A checkpoint's chat template, rendered the way transformers' ``apply_chat_template`` renders it.

Where the template comes from (transformers' order): ``chat_template.jinja`` beside the tokenizer,
else ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of ``{name, template}`` of
which "default" is used). It is Jinja2 from the checkpoint's author, so it runs in Jinja's
immutable sandbox with transformers' environment: ``trim_blocks`` / ``lstrip_blocks``, the loop
controls extension, a ``tojson`` that does not HTML-escape, ``raise_exception``, ``strftime_now``,
and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables. Keys whose
value is None are dropped from each message first, as transformers does (OpenAI clients send
``content: null``).

The rendered text already holds the template's special tokens (its BOS, role markers), so it is
encoded without the tokenizer's own ones (``add_special_tokens=False``), as transformers does.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvmesh.contract.errors import InvalidArgument

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
"""Template variables the router passes itself; ``chat_template_kwargs`` may not set them."""


def _public(exc: BaseException) -> str:
    """An exception's text for a client: cut to 200 characters, without Python's qualified names
    (``jinja2.environment.Template.render()``) or file paths, which are the server's business."""
    text = re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*\(\))", r"\1", str(exc))
    text = re.sub(r"(?:[A-Za-z]:)?[\\/][^\s'\"]*[\\/][^\s'\"]*", "<path>", text)
    return text if len(text) <= 200 else text[:200] + "…"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template plus the special-token variables it is rendered with.

    Args:
        source: the Jinja2 template text.
        special_tokens: ``bos_token`` etc. -> their text.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.source)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none.

        Raises:
            ValueError: the template does not compile, or several are named and none is "default".
        """
        d = Path(model_dir)
        config_path = d / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        specials_path = d / "special_tokens_map.json"
        specials_map = json.loads(specials_path.read_text(encoding="utf-8")) if specials_path.is_file() else {}
        special = {}
        for name in SPECIAL_TOKENS:
            text = _token_text(config.get(name)) or _token_text(specials_map.get(name))
            if text is not None:
                special[name] = text
        source: str | None = None
        if (d / TEMPLATE_FILE).is_file():
            source = (d / TEMPLATE_FILE).read_text(encoding="utf-8")
        else:
            raw = config.get("chat_template")
            if isinstance(raw, list):
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
                if "default" not in named:
                    raise ValueError(f"{config_path} names chat templates {sorted(named)} but none 'default'")
                raw = named["default"]
            source = raw if isinstance(raw, str) else None
        if source is None:
            return None
        template = cls(source, special)
        try:
            template._template  # noqa: B018 - compile now: a broken template fails at start, not per request
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template of {d} does not compile: {exc}") from None
        return template

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, extra: Mapping[str, Any] | None = None) -> str:
        """The conversation as the model's prompt text.

        Args:
            messages: ``{"role", "content", ...}`` dicts; keys set to None are dropped.
            add_generation_prompt: end with the header of a new assistant turn.
            continue_final_message: end inside the last message (the model continues it); excludes
                ``add_generation_prompt``.
            extra: more template variables (``chat_template_kwargs``); they override special tokens.

        Raises:
            InvalidArgument: the conversation is empty, or the template refused it (its
                ``raise_exception`` message, or an error rendering it).
        """
        if not messages:
            raise InvalidArgument("messages is empty: send at least one message", param="messages")
        if continue_final_message and add_generation_prompt:
            raise InvalidArgument("continue_final_message and add_generation_prompt exclude each other: "
                                  "set add_generation_prompt to false to continue the last message",
                                  param="continue_final_message")
        taken = sorted(RESERVED_VARIABLES.intersection(extra or {}))
        if taken:
            raise InvalidArgument(f"chat_template_kwargs may not set {', '.join(taken)}: the router sets "
                                  f"{', '.join(sorted(RESERVED_VARIABLES))} itself", param="chat_template_kwargs")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        final = ""
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise InvalidArgument("continue_final_message needs a last message with text content")
            chat[-1] = {**chat[-1], "content": final + tag}
        variables = {**self.special_tokens, **(extra or {})}
        try:
            text = self._template.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"the model's chat template refused the messages: {_public(exc)}",
                                  param="messages") from None
        except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
            raise InvalidArgument(f"the model's chat template failed on the messages ({type(exc).__name__}: "
                                  f"{_public(exc)}); check each message's role and content", param="messages") from None
        if continue_final_message:
            # NOTE: transformers' rule: cut at the tag; if the template trimmed the space after it,
            # the message's own trailing whitespace went too.
            at = text.rfind(tag.strip())
            if at < 0 or final.strip() not in text:
                raise InvalidArgument("continue_final_message: the chat template does not keep the last message's "
                                      "text, so it cannot be continued")
            text = text[:at] if text[at:at + len(tag)] == tag else text[:at].rstrip()
        return text
