"""The first stage: what a request may ask for, checked before any work is spent on it.

Every front (gRPC, OpenAI HTTP, the endpoint picker) reaches this stage, so a bad request gets the
same answer whichever way it came (router/text/prompt.py holds the bounds).
"""

from __future__ import annotations

import uuid

from kvmesh.contract.errors import InvalidArgument, RequestTooLarge
from kvmesh.contract.types import DEFAULT_MAX_TOKENS
from kvmesh.router.config import RouterConfig
from kvmesh.router.generate_types import GenerateInput
from kvmesh.router.request.context import RequestContext
from kvmesh.router.text.prompt import check_input, check_message_count
from kvmesh.router.text.stop_strings import check_stop_strings


def request_id_for(inp: GenerateInput) -> str:
    """The id the request has from here on (worker, logs, the client's first message): the client's id
    with a random suffix, or a random one. Raises InvalidArgument on a bad id."""
    check_input(inp.request_id, inp.cache_salt)
    # NOTE: the client's id is only unique to that client; clients (or routers) sharing a worker may
    # reuse one, so the worker gets it with a random suffix, as vLLM's engine does.
    return f"{inp.request_id}-{uuid.uuid4().hex[:12]}" if inp.request_id else uuid.uuid4().hex


class Admit:
    """Stop strings, message count, ids and salt, max_tokens: the request's own bounds.

    Args:
        config: the router's flags (``--max-messages``, ``--max-tokens-limit``).
        has_tokenizer: stop strings need the model's tokenizer at the router.
    """

    name = "admit"

    def __init__(self, config: RouterConfig, has_tokenizer: bool) -> None:
        self.config = config
        self.has_tokenizer = has_tokenizer

    async def __call__(self, ctx: RequestContext) -> None:
        inp = ctx.inp
        if inp.stop:
            try:
                check_stop_strings(inp.stop)
            except ValueError as exc:
                raise InvalidArgument(str(exc), param="stop") from None
            if not self.has_tokenizer:
                raise InvalidArgument("stop strings need the model's tokenizer at the router (--model DIR); "
                                      "use stop_token_ids", param="stop")
        if inp.chat is not None:
            check_message_count(len(inp.chat.messages), self.config.max_messages)
        check_input(inp.request_id, inp.cache_salt)
        limit = self.config.max_tokens_limit
        want = inp.sampling.max_tokens or DEFAULT_MAX_TOKENS
        if limit and want > limit:
            raise RequestTooLarge(f"max_tokens {want} is over this router's limit of {limit} (--max-tokens-limit)",
                                  param="max_tokens")
