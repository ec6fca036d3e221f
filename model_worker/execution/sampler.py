"""Next-token sampling for one step: greedy, temperature, top-k, top-p, per-request seeds.

Stop conditions (EOS, stop ids, max_tokens) are the scheduler's; this module only picks tokens.
"""

from __future__ import annotations

import torch

from kvmesh.contract.types import SamplingParams


def _on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without a host sync (pinned and non-blocking on CUDA): a plain copy
    would wait for the step in flight (async scheduling)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


class Sampler:
    """Picks one token per logits row.

    Greedy rows (temperature 0, or top_k 1) take one batched argmax. Sampled rows are filtered
    (temperature, then top-k, then top-p over the sorted distribution) in one batch and drawn with
    the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``, whose noise comes from the request's
    own generator when it has a seed, so its tokens do not depend on what else is in the batch.

    Args:
        seed: seeds the shared generator of sampled requests without a seed.
    """

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._per_request: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]) -> list[int]:
        """Args:
            logits: ``[N, vocab]`` float32, one row per sampling request.
            params: the N requests' sampling parameters.
            request_ids: the N requests' ids (keys of their generators).

        Returns:
            N token ids, in row order.
        """
        if logits.shape[0] == 0:
            return []
        return self.sample_on_device(logits, params, request_ids).tolist()

    def sample_on_device(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> torch.Tensor:
        """Like ``sample`` but returns the ``[N]`` int64 ids on the logits' device, with no sync
        (multi-step decode feeds them to the next step and copies them to the host on the side)."""
        out = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if p.temperature > 0.0 and p.top_k != 1]
        if rows:
            index = _on_device(rows, torch.int64, logits.device)
            picked = self._sample_rows(
                logits[index], [params[i] for i in rows], [request_ids[i] for i in rows]
            )
            out[index] = picked
        return out

    def release(self, request_id: str) -> None:
        """Forgets a finished request's generator."""
        self._per_request.pop(request_id, None)

    def _sample_rows(
        self, logits: torch.Tensor, params: list[SamplingParams], ids: list[str]
    ) -> torch.Tensor:
        device = logits.device
        temps = _on_device([p.temperature for p in params], torch.float32, device)
        logits = logits / temps[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        rank = torch.arange(vocab, device=device)[None, :]
        if any(p.top_k > 0 for p in params):
            ks = _on_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64, device)
            sorted_logits = sorted_logits.masked_fill(rank >= ks[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = _on_device([p.top_p for p in params], probs.dtype, device)
            # NOTE: a token is kept while the mass before it is < top_p, so the top token always is.
            mass_before = probs.cumsum(dim=-1) - probs
            probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
        noise = torch.stack(
            [self._noise(rid, p.seed, vocab, device) for rid, p in zip(ids, params, strict=True)]
        )
        choice = (probs / noise).argmax(dim=-1, keepdim=True)
        return order.gather(-1, choice).squeeze(-1)

    def _noise(self, request_id: str, seed: int | None, vocab: int, device: torch.device) -> torch.Tensor:
        if seed is None:
            gen = self._shared.get(device)
            if gen is None:
                gen = self._shared[device] = torch.Generator(device=device).manual_seed(self._seed)
        else:
            gen = self._per_request.get(request_id)
            if gen is None:
                gen = self._per_request[request_id] = torch.Generator(device=device).manual_seed(seed)
        return torch.empty(vocab, device=device).exponential_(generator=gen).clamp_min_(1e-30)
