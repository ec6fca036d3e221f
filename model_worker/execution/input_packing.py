"""A scheduled step packed into the forward pass's inputs: one ragged batch of token ids and positions, and
per KV cache group the slots the new K/V go to and the block tables attention reads (docs/engine.md, "A step").

``input_ids = all_token_ids[start:start+n]``, positions ``start..start+n-1``,
``slot_mapping = block_ids[p // bs] * bs + p % bs``, ``cu_q_lens``, ``kv_lens = start + n``, block tables padded
with the null block 0; only the last token of each row that samples goes through the LM head.
"""

from __future__ import annotations

import torch

from kvmesh.model_worker.execution.forward_context import AttentionMetadata
from kvmesh.model_worker.scheduling.output import SchedulerOutput

LastSampled = tuple[torch.Tensor, dict[str, int]]
"""The last launched step's sampled ids (on the device) and each request's row in them (async scheduling)."""


def pack_inputs(out: SchedulerOutput, block_size: int, device: torch.device, last_sampled: LastSampled | None
                ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata], torch.Tensor]:
    """Token ids, positions, attention metadata per KV cache group, rows to sample, on ``device``.

    A row whose last token is not on the host yet (async scheduling: the step launched before sampled it)
    gets it from ``last_sampled`` on the device.
    """
    ids: list[int] = []
    q_lens: list[int] = []
    starts: list[int] = []
    kv_lens: list[int] = []
    sample_rows: list[int] = []
    num_groups = len(out.scheduled[0].block_tables)
    max_blocks = max(len(s.block_ids) for s in out.scheduled)
    tables = torch.zeros((num_groups, len(out.scheduled), max_blocks), dtype=torch.int32)
    total = 0
    placeholders: list[tuple[int, str]] = []
    for i, s in enumerate(out.scheduled):
        known = s.request.all_token_ids[s.start : s.start + s.num_new_tokens]
        ids.extend(known)
        if len(known) < s.num_new_tokens:  # async scheduling: the last token is still on the device
            placeholders.append((total + s.num_new_tokens - 1, s.request.request_id))
            ids.extend([0] * (s.num_new_tokens - len(known)))
        q_lens.append(s.num_new_tokens)
        starts.append(s.start)
        kv_lens.append(s.start + s.num_new_tokens)
        for g, table in enumerate(s.block_tables):
            tables[g, i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        total += s.num_new_tokens
        if s.sample:
            sample_rows.append(total - 1)
    q_len_t = torch.tensor(q_lens, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_len_t)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    torch.cumsum(q_len_t, 0, out=cu[1:])
    positions = torch.arange(total) - cu[:-1][seq_of_token] + torch.tensor(starts)[seq_of_token]

    def h2d(t: torch.Tensor) -> torch.Tensor:
        return to_device(t, device)

    cu_dev = h2d(cu.to(torch.int32))
    kv_lens_dev = h2d(torch.tensor(kv_lens, dtype=torch.int32))
    metas = [
        AttentionMetadata(
            slot_mapping=h2d(slot_mapping(tables[g], positions, block_size, seq_of_token)),
            cu_q_lens=cu_dev,
            kv_lens=kv_lens_dev,
            block_tables=h2d(tables[g]),
        )
        for g in range(num_groups)
    ]
    input_ids = h2d(torch.tensor(ids, dtype=torch.int64))
    if placeholders:
        assert last_sampled is not None, "a placeholder token without a step in flight"
        sampled, row_of = last_sampled
        where = h2d(torch.tensor([[p for p, _ in placeholders], [row_of[rid] for _, rid in placeholders]]))
        input_ids[where[0]] = sampled[where[1]]
    return (
        input_ids,
        h2d(positions),
        metas,
        h2d(torch.tensor(sample_rows, dtype=torch.int64)),
    )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without a host sync: on CUDA through pinned memory, non-blocking
    (a plain ``.to`` waits for the stream, i.e. for the step in flight, under async scheduling)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def slot_mapping(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """Flat cache slot of each token: its row's block of its position, and the offset in it."""
    bs = block_size
    if rows is None:  # one token per row (decode)
        rows = torch.arange(positions.shape[0], device=positions.device)
    return block_tables[rows, positions // bs].long() * bs + positions % bs


def decode_rows(out: SchedulerOutput) -> tuple[list[int], list[int], list[list[list]]]:
    """Token ids, positions and, per KV cache group, the block lists of a decode batch: the KV
    cache manager's own lists (no copy; the graphs write only what changed since their last step)."""
    scheduled = out.scheduled
    lists = [s.live_blocks() for s in scheduled]
    # NOTE: a placeholder (async scheduling: the token is still on the device) loads as 0; launch() sets it.
    return ([t[s.start] if s.start < len(t := s.request.all_token_ids) else 0 for s in scheduled],
            [s.start for s in scheduled], [[t[g] for t in lists] for g in range(len(lists[0]))])
