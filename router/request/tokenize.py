"""The prompt's stage: a conversation rendered by the model's chat template, text tokenized, token ids
checked, all within the prompt bounds (router/text/prompt.py). Long texts and long conversations go to
the tokenizer pool, never onto the event loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenizers import Tokenizer

from kvmesh.contract.errors import InvalidArgument, KVMeshError
from kvmesh.router.generate_types import ChatInput, GenerateInput
from kvmesh.router.request.context import RequestContext
from kvmesh.router.text.chat_template import ChatTemplate
from kvmesh.router.text.prompt import (
    RENDER_ON_LOOP_MESSAGES,
    TOKENIZE_ON_LOOP_CHARS,
    PromptLimits,
    PromptTokenizer,
    check_prompt_ids,
)


class Tokenize:
    """Args:
    model_id: the model's name (in messages).
    tokenizer, chat_template: the model's (None: clients must send token ids / text).
    prompts: the tokenizer pool (None without a tokenizer).
    limits: the prompt bounds now (they follow the workers' context).
    vocab_size: ids at or past it are refused (0: the workers judge).
    refused: counts a refusal by the limit it hit (``bytes`` / ``tokens``).
    """

    name = "tokenize"

    def __init__(self, model_id: Callable[[], str], tokenizer: Tokenizer | None, chat_template: ChatTemplate | None,
                 prompts: PromptTokenizer | None, limits: Callable[[], PromptLimits], vocab_size: int,
                 refused: Callable[[str], None]) -> None:
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.prompts = prompts
        self.limits = limits
        self.vocab_size = vocab_size
        self.refused = refused

    async def __call__(self, ctx: RequestContext) -> None:
        ctx.limits = ctx.limits or self.limits()
        ctx.token_ids = await self.token_ids(ctx.inp, ctx.limits)

    async def token_ids(self, inp: GenerateInput, limits: PromptLimits) -> Sequence[int]:
        """The prompt's token ids within ``limits``; raises InvalidArgument on an empty or missing prompt,
        InvalidArgument / ResourceExhausted past a bound."""
        if inp.token_ids is not None:
            if not inp.token_ids:
                raise InvalidArgument("token_ids is empty: send at least one prompt token", param="token_ids")
            try:
                limits.check_tokens(len(inp.token_ids))
            except KVMeshError:
                self.refused("tokens")
                raise
            check_prompt_ids(inp.token_ids, "token_ids", self.vocab_size, self.model_id() if self.vocab_size else "")
            # NOTE: as it came (a protobuf repeated field, a JSON list): the chain hashes it through numpy and
            # the worker request copies it in C; a list() of 4,096 ids cost ~0.25 ms.
            return inp.token_ids
        if inp.chat is not None:
            return await self._encode(await self._render(inp.chat), limits, add_special_tokens=False)
        if inp.text is None:
            raise InvalidArgument("the request sets no input: set text, token_ids or chat")
        if not inp.text:
            raise InvalidArgument("text is empty: send a non-empty prompt", param="prompt")
        # NOTE: add_special_tokens=True, as the worker's offline path encodes, so both hash the same ids.
        return await self._encode(inp.text, limits, add_special_tokens=True)

    def render(self, chat: ChatInput) -> str:
        """The conversation as prompt text, by the model's chat template.

        Raises:
            InvalidArgument: no tokenizer or template for the model, or the template refused the messages.
        """
        model = self.model_id()
        if self.tokenizer is None:
            raise InvalidArgument(f"this router has no tokenizer for model {model!r} (start it with --model DIR): "
                                  "chat needs the model's tokenizer and chat template; send token_ids instead")
        if self.chat_template is None:
            raise InvalidArgument(f"model {model!r} has no chat template (chat_template in its tokenizer_config.json "
                                  "or a chat_template.jinja): send text or token_ids instead")
        return self.chat_template.render(chat.messages, add_generation_prompt=chat.add_generation_prompt,
                                         continue_final_message=chat.continue_final_message,
                                         extra=chat.template_kwargs)

    async def _render(self, chat: ChatInput) -> str:
        small = len(chat.messages) <= RENDER_ON_LOOP_MESSAGES and sum(
            len(m.get("content") or "") for m in chat.messages) <= TOKENIZE_ON_LOOP_CHARS
        if small or self.prompts is None:
            return self.render(chat)
        return await self.prompts.run(self.render, chat)

    async def _encode(self, text: str, limits: PromptLimits, add_special_tokens: bool) -> list[int]:
        """``text`` tokenized within ``limits`` (bytes first, then tokens), refusals counted."""
        if self.prompts is None:
            raise InvalidArgument("this router has no tokenizer (start it with --model DIR): send token_ids")
        try:
            limits.check_bytes(text)
        except KVMeshError:
            self.refused("bytes")
            raise
        try:
            return await self.prompts.encode(text, limits, add_special_tokens=add_special_tokens)
        except KVMeshError:
            self.refused("tokens")
            raise
