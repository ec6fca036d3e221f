"""OpenAI request bodies (chat completions, completions) as pydantic models, and their conversion
to the router's :class:`GenerateInput`.

Parameters follow OpenAI's API; extra parameters follow vLLM's names (``top_k``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``, ``cache_salt``, ``return_token_ids``). A
parameter kvmesh cannot honour (``n`` > 1, logprobs, penalties, tools, ...) is refused with 400
naming it (``param``), never silently ignored; unknown fields are ignored, as OpenAI and vLLM do.
The body reaches these models already bounded (router/api/request_body.py: message, part, stop and
token-id counts), so validating them costs what the bounds allow.
Value checks (ranges, limits) are the router's own (SamplingParams.validate, router/model_router.py),
the same for gRPC and HTTP.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from kvmesh.contract.errors import InvalidArgument
from kvmesh.contract.types import SamplingParams
from kvmesh.router.generate_types import ChatInput, GenerateInput
from kvmesh.router.text.prompt import check_prompt_ids

OPENAI_DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default: an HTTP request that sets no temperature samples (gRPC's default is greedy)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None


class _Sampling(_Body):
    """The parameters both endpoints share."""

    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # kvmesh can't honour these; a value other than the default is refused (see _refuse_unsupported).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    best_of: int | None = None
    # vLLM's extra parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    return_token_ids: bool = False
    """vLLM's: the response carries the prompt's and each choice's token ids."""

    def _refuse_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidArgument(f"n={self.n}: kvmesh returns one choice per request; send n=1 (or several requests)",
                                  param="n")
        if self.best_of not in (None, 1):
            raise InvalidArgument("best_of is not supported: leave it unset", param="best_of")
        if self.logprobs not in (None, False):
            raise InvalidArgument("logprobs are not supported: leave logprobs unset", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise InvalidArgument(f"{name} is not supported: leave it unset or 0", param=name)
        if self.repetition_penalty not in (None, 1, 1.0):
            raise InvalidArgument("repetition_penalty is not supported: leave it unset or 1", param="repetition_penalty")
        if self.min_p not in (None, 0, 0.0):
            raise InvalidArgument("min_p is not supported: leave it unset or 0", param="min_p")
        if self.min_tokens:
            raise InvalidArgument("min_tokens is not supported: leave it unset or 0", param="min_tokens")
        if self.logit_bias:
            raise InvalidArgument("logit_bias is not supported: leave it unset", param="logit_bias")
        if not self.skip_special_tokens:
            raise InvalidArgument("skip_special_tokens=false is not supported: output text always skips them",
                                  param="skip_special_tokens")

    def _sampling(self, max_tokens: int | None) -> SamplingParams:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,  # vLLM's -1 = off
            seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
        )
        params.validate()  # ValueError -> 400 naming the field, as gRPC's INVALID_ARGUMENT
        return params

    def _stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")
"""Function calling, current and legacy: refused whatever the value (kvmesh parses no tool calls)."""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: dict[str, Any] | None = None
    top_logprobs: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def to_input(self, request_id: str) -> GenerateInput:
        """Raises InvalidArgument / ValueError naming the parameter to fix."""
        self._refuse_unsupported()
        for name in TOOL_FIELDS:
            if getattr(self, name) is not None:
                raise InvalidArgument(f"{name}: function calling (tools, tool_choice, functions, function_call, "
                                      "parallel_tool_calls) is not supported: leave it unset", param=name)
        if self.top_logprobs is not None:
            raise InvalidArgument("top_logprobs is not supported (it needs logprobs, which kvmesh does not return): "
                                  "leave it unset", param="top_logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidArgument("response_format other than text is not supported", param="response_format")
        messages = []
        for i, m in enumerate(self.messages):
            for name in ("tool_calls", "tool_call_id", "function_call"):
                if getattr(m, name) is not None:
                    raise InvalidArgument(f"messages[{i}].{name}: function calling is not supported: send messages "
                                          "without tool calls", param=f"messages[{i}].{name}")
            content: str | None
            if isinstance(m.content, list):
                bad = next((p.type for p in m.content if p.type != "text"), None)
                if bad is not None:
                    raise InvalidArgument(f"messages[{i}].content has a {bad!r} part: only text parts are supported",
                                          param=f"messages[{i}].content")
                # NOTE: text parts joined by a newline, as vLLM does for string-content templates.
                content = "\n".join(p.text or "" for p in m.content)
            else:
                content = m.content
            messages.append({"role": m.role, "content": content, "name": m.name})
        completion = self.max_completion_tokens is not None
        max_tokens = self.max_completion_tokens if completion else self.max_tokens
        try:
            sampling = self._sampling(max_tokens)
        except InvalidArgument as exc:
            if completion and exc.param == "max_tokens":
                raise InvalidArgument(str(exc).replace("max_tokens", "max_completion_tokens", 1),
                                      param="max_completion_tokens") from None
            raise
        return GenerateInput(
            text=None, token_ids=None, sampling=sampling, cache_salt=self.cache_salt or "",
            request_id=request_id,
            chat=ChatInput(messages, self.add_generation_prompt, self.continue_final_message,
                           self.chat_template_kwargs or {}),
            stop=self._stops(), include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(_Sampling):
    # NOTE: token ids first: pydantic's smart union picks the same member whatever the order (strict
    # matches first), but validates a 4k-id list 13x faster with list[int] tried first (0.07 vs 0.94 ms).
    prompt: list[int] | str | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None

    def to_input(self, request_id: str) -> GenerateInput:
        """Raises InvalidArgument / ValueError naming the parameter to fix."""
        self._refuse_unsupported()
        if self.echo:
            raise InvalidArgument("echo is not supported: leave it unset", param="echo")
        if self.suffix:
            raise InvalidArgument("suffix is not supported: leave it unset", param="suffix")
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidArgument(f"prompt holds {len(prompt)} prompts: kvmesh takes one prompt per request",
                                      param="prompt")
            prompt = prompt[0]
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        if ids is not None:
            check_prompt_ids(ids, "prompt")
        return GenerateInput(
            text=text, token_ids=ids, sampling=self._sampling(self.max_tokens), cache_salt=self.cache_salt or "",
            request_id=request_id, stop=self._stops(), include_stop_str_in_output=self.include_stop_str_in_output)


def public_param(param: str | None, chat: bool | None) -> str | None:
    """The request path's names for the prompt (``prompt``, gRPC's ``token_ids``) as this API calls it."""
    if param in ("prompt", "token_ids") and chat is not None:
        return "messages" if chat else "prompt"
    return param


def validation_error(exc: pydantic.ValidationError) -> InvalidArgument:
    """The first problems of a body the models refuse, each named as a parameter (``messages[0].role``)."""
    problems: list[str] = []
    first: str | None = None
    for e in exc.errors()[:3]:
        where = ""
        for part in e.get("loc", ()):
            if isinstance(part, int):
                where += f"[{part}]"
            elif where and not part[:1].isalpha():
                continue  # pydantic's union-member labels ("str", "list[TextPart]") are not fields
            else:
                where += f".{part}"
        where = where.lstrip(".")
        first = first or where or None
        problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return InvalidArgument("invalid request body: " + "; ".join(problems), param=first)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvmesh"
    root: str
    """The model id again (vLLM puts the checkpoint's path here; a client has no use for the router's files)."""
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
