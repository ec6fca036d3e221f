"""Offline batch generation: ``LLM(model_dir).generate(prompts, params)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm_engine import LLMEngine


@dataclass(slots=True)
class GenerationOutput:
    token_ids: list[int]
    """Generated tokens (a stop token that ended the request included)."""
    text: str
    """``token_ids`` decoded, special tokens skipped ("" without a tokenizer)."""
    finish_reason: str
    """"stop" (EOS or a stop id) or "length" (max_tokens / max_model_len)."""
    cached_tokens: int
    """Prompt tokens served from the prefix cache at first admission."""
    prompt_token_ids: list[int]


class LLM:
    """An engine plus a run-to-completion loop.

    Args:
        model_dir: a Hugging Face model directory (config.json, safetensors, tokenizer.json).
        **engine_kwargs: fields of ``EngineConfig`` (block_size, num_blocks, ...).
    """

    def __init__(self, model_dir: str, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(model=str(model_dir), **engine_kwargs)
        self._next_id = 0

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the model's tokenizer makes them (BOS included if it adds one)."""
        if self.engine.tokenizer is None:
            raise ValueError(f"{self.engine.config.model} has no tokenizer.json; pass token ids instead")
        return self.engine.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return "" if tok is None else tok.decode(token_ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        lora_names: str | list[str | None] | None = None,
    ) -> list[GenerationOutput]:
        """Generates for every prompt; outputs are in input order.

        Args:
            prompts: texts (tokenized here) or token id lists.
            sampling_params: one for all prompts, or one per prompt; None = greedy, 16 tokens.
            lora_names: the LoRA adapter of every prompt, or one per prompt (None = the base model).

        Raises:
            ValueError: a prompt or its parameters are invalid (no request is started then).
        """
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        loras = [lora_names] * len(prompts) if lora_names is None or isinstance(lora_names, str) else list(lora_names)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA names")
        token_lists = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids, p, lora in zip(token_lists, params, loras, strict=True):  # fail before starting anything
            p.validate()
            self.engine.check_prompt(ids)
            self.engine.inputs.check_adapter(lora)
        ids_by_index: list[str] = []
        for ids, p, lora in zip(token_lists, params, loras, strict=True):
            request_id = f"llm-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(request_id, ids, p, lora_name=lora)
            ids_by_index.append(request_id)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids_by_index}
        done: dict[str, tuple[str, int]] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    done[out.request_id] = (out.finish_reason or "", max(out.num_cached_tokens, 0))
        return [
            GenerationOutput(
                token_ids=tokens[rid],
                text=self.decode(tokens[rid]),
                finish_reason=done[rid][0],
                cached_tokens=done[rid][1],
                prompt_token_ids=ids,
            )
            for rid, ids in zip(ids_by_index, token_lists, strict=True)
        ]
