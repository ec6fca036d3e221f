"""Validation at the door: a prompt and its sampling parameters checked, with a message naming what is
wrong, and made into a Request before anything is queued (vLLM v1's input processor). Also the model
directory's tokenizer and EOS ids, which the checks and the requests use."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvmesh.contract.block_hash import BlockHasher, adapter_hasher
from kvmesh.contract.limits import excerpt
from kvmesh.contract.types import DEFAULT_MAX_TOKENS, SamplingParams
from kvmesh.model_worker.config import EngineConfig, ModelConfig
from kvmesh.model_worker.scheduling.request import Request


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The model's ``tokenizers.Tokenizer`` from tokenizer.json, or None when there is none."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def eos_token_ids(model_dir: str | Path, model_config: ModelConfig) -> list[int]:
    """config.json's EOS ids, then generation_config.json's others: all of them stop a request."""
    ids = list(model_config.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for e in [eos] if isinstance(eos, int) else (eos or []):
            if e not in ids:
                ids.append(e)
    return ids


class InputProcessor:
    """Checks requests against one engine's limits and builds them.

    Args:
        config: the checked engine config (``max_model_len`` set).
        model_config: the model's (its vocabulary).
        block_hasher: hashes the prompt's blocks when prefix caching is on.
        adapters: whether a LoRA adapter name is loaded (the runner's LoRA manager's ``has``); None =
            no LoRA (a request naming an adapter is refused).
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, block_hasher: BlockHasher,
                 adapters: Callable[[str], bool] | None = None) -> None:
        assert config.max_model_len is not None
        self.max_model_len = config.max_model_len
        self.vocab_size = model_config.vocab_size
        self.block_hasher = block_hasher if config.enable_prefix_caching else None
        self.eos_token_ids = eos_token_ids(config.model, model_config)
        self.adapters = adapters
        self._adapter_hashers: dict[str, BlockHasher] = {}

    def hasher_for(self, lora_name: str | None) -> BlockHasher | None:
        """The block hasher of a request under ``lora_name`` (the adapter keys its blocks); None without caching."""
        base = self.block_hasher
        if base is None or not lora_name:
            return base
        hasher = self._adapter_hashers.get(lora_name)
        if hasher is None:
            if len(self._adapter_hashers) >= 4096:  # adapters come and go at run time: bound the memo
                self._adapter_hashers.clear()
            hasher = self._adapter_hashers[lora_name] = adapter_hasher(base, lora_name)
        return hasher

    def check_adapter(self, lora_name: str | None) -> None:
        """Raises ValueError unless ``lora_name`` is None or a loaded adapter."""
        if not lora_name:
            return
        if self.adapters is None:
            raise ValueError(f"the request names LoRA adapter {excerpt(lora_name)}, but this engine serves no "
                             "adapters (start it with --enable-lora)")
        if not self.adapters(lora_name):
            raise ValueError(f"no LoRA adapter {excerpt(lora_name)} is loaded")

    def make_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None,
                     cache_salt: str, lora_name: str | None = None) -> Request:
        """The request for this prompt, its parameters validated and copied, its max_tokens and stop ids filled in.

        Raises:
            ValueError: the request is malformed or can never fit.
        """
        # NOTE: a copy the caller cannot change under us (its only mutable field is the stop list).
        params = (replace(sampling_params, stop_token_ids=copy.copy(sampling_params.stop_token_ids))
                  if sampling_params is not None else SamplingParams())
        params.validate()
        self.check_prompt(prompt_token_ids)
        self.check_adapter(lora_name)
        if params.max_tokens is None:
            params.max_tokens = min(DEFAULT_MAX_TOKENS, self.max_model_len - len(prompt_token_ids))
        extra_eos = self.eos_token_ids[1:]
        if extra_eos and not params.ignore_eos:
            params = replace(params, stop_token_ids=[*params.stop_token_ids, *extra_eos])
        return Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            block_hasher=self.hasher_for(lora_name),
            cache_salt=cache_salt,
            lora_name=lora_name,
        )

    def check_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Raises ValueError as :meth:`make_request` would for this prompt and these parameters."""
        sampling_params.validate()
        self.check_prompt(prompt_token_ids)
        self.check_room(len(prompt_token_ids), sampling_params.max_tokens)

    def check_fits(self, request: Request) -> None:
        """Raises ValueError unless a request built elsewhere fits: a non-empty prompt that leaves room for
        its ``max_tokens`` in ``max_model_len``."""
        self.check_prompt_length(request.num_prompt_tokens)
        self.check_room(request.num_prompt_tokens, request.sampling_params.max_tokens)

    def check_room(self, n: int, max_tokens: int | None) -> None:
        room = self.max_model_len - n
        if max_tokens is not None and max_tokens > room:
            raise ValueError(f"max_tokens is {max_tokens}, but the prompt's {n} tokens leave room for "
                             f"{room} of max_model_len {self.max_model_len}; ask for at most {room}")

    def check_prompt_length(self, n: int) -> None:
        """Raises ValueError unless a prompt of ``n`` tokens fits (and leaves room for one token)."""
        if n == 0:
            raise ValueError("the prompt is empty; it needs at least one token")
        max_len = self.max_model_len
        if n >= max_len:
            raise ValueError(
                f"the prompt has {n} tokens but max_model_len is {max_len}; shorten it to at most "
                f"{max_len - 1} tokens to leave room for one generated token"
            )

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError naming the problem: empty, too long for max_model_len, or an id outside the vocabulary."""
        self.check_prompt_length(len(prompt_token_ids))
        vocab = self.vocab_size
        for i, t in enumerate(prompt_token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token {i} is {t!r}, outside the vocabulary [0, {vocab})")
