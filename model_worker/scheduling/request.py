"""One generation request as the engine core sees it: its tokens, progress and block hashes."""

from __future__ import annotations

import enum
import time

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # NOTE: every finished status sorts after PREEMPTED; is_finished relies on it.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """The OpenAI-style reason of a finished status ("stop" / "length" / "abort"), else None."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """A prompt, the tokens generated so far, and how far the KV cache has computed them.

    Args:
        request_id: unique among the scheduler's live requests.
        prompt_token_ids: the prompt; must not be empty.
        sampling_params: how to sample and when to stop.
        eos_token_id: the model's end-of-sequence id; None disables EOS stopping.
        block_hasher: hashes full blocks for prefix caching; None disables caching for this request.
        cache_salt: tenant salt mixed into the root of the hash chain.
        arrival_time: seconds since the epoch; defaults to now.
        block_hashes: the prompt's full-block hashes, when the caller computed them already with
            the same hasher (one per full block); None = hash here.
        lora_name: the LoRA adapter it runs under; None = the base model. Its blocks are keyed by it:
            ``block_hasher`` must be the adapter's (kvmesh.contract.block_hash.adapter_hasher).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        block_hasher: BlockHasher | None = None,
        cache_salt: str = "",
        arrival_time: float | None = None,
        block_hashes: list[bytes] | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora_name = lora_name or None
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        # NOTE: all_token_ids == prompt_token_ids + output_token_ids at all times.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.block_hasher = block_hasher
        self.cache_salt = cache_salt
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        """Tokens sampled by a step still in flight (async scheduling): counted in the request's length
        by the scheduler, not yet in ``all_token_ids``; at most 1 when ``schedule()`` runs."""
        self.num_cached_tokens = -1
        self.num_cached_hint = 0
        """Prompt tokens the prefix cache held when the request was queued (its reported queued prefill
        counts only the rest; the hit itself is taken at admission)."""
        self.num_preemptions = 0
        # NOTE: block_hashes[i] is the hash of all_token_ids[i*bs:(i+1)*bs] for every full block.
        self.block_hashes: list[bytes] = []
        if block_hasher is not None:
            if block_hashes is None:
                self.block_hashes = block_hasher.hash_prompt(self.prompt_token_ids, cache_salt)
            else:
                if len(block_hashes) != self.num_prompt_tokens // block_hasher.block_size:
                    raise ValueError(f"{len(block_hashes)} block hashes given for a prompt of "
                                     f"{self.num_prompt_tokens // block_hasher.block_size} full blocks")
                self.block_hashes = list(block_hashes)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def append_output_token_ids(self, ids: int | list[int]) -> None:
        """Appends sampled tokens and hashes every block they fill."""
        if isinstance(ids, int):
            ids = [ids]
        self.output_token_ids.extend(ids)
        self.all_token_ids.extend(ids)
        hasher = self.block_hasher
        if hasher is None:
            return
        bs = hasher.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.all_token_ids):
            start = len(self.block_hashes) * bs
            parent = self.block_hashes[-1] if self.block_hashes else hasher.root(self.cache_salt)
            self.block_hashes.append(hasher.hash_block(parent, self.all_token_ids[start : start + bs]))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
