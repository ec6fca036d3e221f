"""Scheduler scenarios driven by a deterministic fake model (next token = f(token ids)).

The fake model is the test driver of the scheduler's own unit tests: it stands where the model
runner and sampler stand and returns, for every request with ``sample``, one token computed from
the request's tokens only, so a run with preemptions must produce exactly the tokens of a run
without.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.output import RequestOutput, SchedulerOutput
from kvmesh.model_worker.scheduling.request import Request, RequestStatus
from kvmesh.model_worker.scheduling.scheduler import Scheduler

BS = 16
HASHER = BlockHasher("test-model", block_size=BS)
EOS = 2

Model = Callable[[Request], int]


def hash_model(req: Request) -> int:
    """A deterministic "model": never EOS, depends on every token so far."""
    return 10 + (sum(req.all_token_ids) * 31 + req.num_tokens) % 1000


def make_scheduler(
    num_blocks: int = 41, block_size: int = BS, enable_caching: bool = True, **config: int | bool
) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_caching=enable_caching)
    config.setdefault("max_model_len", 256)
    return Scheduler(SchedulerConfig(**config), kv)


def make_request(
    request_id: str, prompt: list[int] | int, block_size: int = BS, **params: int | bool | list[int]
) -> Request:
    """``prompt``: the tokens, or a length (then tokens unique to the id: no accidental hits)."""
    base = 10_000 * (1 + sum(request_id.encode()) % 100)
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else prompt
    hasher = HASHER if block_size == BS else BlockHasher("test-model", block_size=block_size)
    return Request(request_id, tokens, SamplingParams(**params), eos_token_id=EOS, block_hasher=hasher)


def step(s: Scheduler, model: Model = hash_model) -> tuple[SchedulerOutput, list[RequestOutput]]:
    out = s.schedule()
    sampled = {sr.request.request_id: [model(sr.request)] for sr in out.scheduled if sr.sample}
    return out, s.update_from_output(out, sampled)


def batch(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(sr.request.request_id, sr.num_new_tokens, sr.start, sr.sample) for sr in out.scheduled]


def drain(s: Scheduler, model: Model = hash_model, max_steps: int = 500) -> dict[str, RequestOutput]:
    """Runs to completion; returns each request's outputs merged into one."""
    merged: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return merged
        for o in step(s, model)[1]:
            if o.request_id in merged:
                merged[o.request_id].new_token_ids += o.new_token_ids
                merged[o.request_id].finished = o.finished
                merged[o.request_id].finish_reason = o.finish_reason
            else:
                merged[o.request_id] = o
    raise AssertionError(f"not drained after {max_steps} steps")


def test_token_budget_splits_prefill_into_chunks_and_mixes_decodes() -> None:
    s = make_scheduler(max_num_batched_tokens=64, max_model_len=256)
    s.add_request(make_request("A", 100, max_tokens=3))
    s.add_request(make_request("B", 30, max_tokens=3))
    assert s.queued_prefill_tokens == 130

    out, res = step(s)
    assert batch(out) == [("A", 64, 0, False)]  # B: no budget left
    assert out.num_scheduled_tokens == 64
    assert res == []
    assert (s.num_running, s.num_waiting, s.queued_prefill_tokens) == (1, 1, 36 + 30)

    out, res = step(s)
    assert batch(out) == [("A", 36, 64, True), ("B", 28, 0, False)]  # B's first chunk
    assert out.scheduled[0].block_ids == [1, 2, 3, 4, 5, 6, 7]
    assert out.scheduled[1].block_ids == [8, 9]
    assert [o.request_id for o in res] == ["A"]
    assert s.queued_prefill_tokens == 2

    out, res = step(s)
    assert batch(out) == [("A", 1, 100, True), ("B", 2, 28, True)]  # a decode next to a prefill
    out, res = step(s)
    assert batch(out) == [("A", 1, 101, True), ("B", 1, 30, True)]
    assert [(o.request_id, o.finished, o.finish_reason) for o in res] == [
        ("A", True, "length"),
        ("B", False, None),
    ]
    out, res = step(s)
    assert batch(out) == [("B", 1, 31, True)]
    assert out.finished_ids == ["A"]
    assert [(o.request_id, o.finish_reason) for o in res] == [("B", "length")]
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == 40


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    s = make_scheduler(max_num_batched_tokens=128, max_model_len=128, enable_chunked_prefill=False)
    s.add_request(make_request("A", 100, max_tokens=2))
    s.add_request(make_request("B", 30, max_tokens=2))
    s.add_request(make_request("C", 5, max_tokens=2))
    out, _ = step(s)
    assert batch(out) == [("A", 100, 0, True)]  # B does not fit in 28; FCFS: C waits behind it
    out, _ = step(s)
    assert batch(out) == [("A", 1, 100, True), ("B", 30, 0, True), ("C", 5, 0, True)]


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make_scheduler(max_num_seqs=2)
    for rid, max_tokens in (("A", 1), ("B", 3), ("C", 1)):
        s.add_request(make_request(rid, 8, max_tokens=max_tokens))
    out, res = step(s)
    assert batch(out) == [("A", 8, 0, True), ("B", 8, 0, True)]
    assert [(o.request_id, o.finished) for o in res] == [("A", True), ("B", False)]
    out, _ = step(s)
    assert batch(out) == [("B", 1, 8, True), ("C", 8, 0, True)]
    assert out.finished_ids == ["A"]


def test_prefilling_tokens_count_each_prompt_whole_until_its_first_token() -> None:
    """The report's prefilling tokens: a prompt partly computed still counts whole (less its cached prefix)
    until its first token, unlike the queued prefill, which counts the part still to compute; a request
    past its first token counts in neither."""
    s = make_scheduler(max_num_batched_tokens=64, max_model_len=256)
    shared = list(range(500, 500 + 3 * BS))
    s.add_request(make_request("A", shared + [1, 2, 3], max_tokens=3))
    assert s.prefilling_tokens == s.queued_prefill_tokens == 51
    out, res = step(s)
    assert res and (s.prefilling_tokens, s.queued_prefill_tokens) == (0, 0)  # A prefilled in one step
    s.add_request(make_request("B", shared + list(range(7, 7 + 100)), max_tokens=2))  # 48 cached, 100 new
    s.add_request(make_request("C", 90, max_tokens=2))
    assert s.prefilling_tokens == s.queued_prefill_tokens == 100 + 90
    out, _ = step(s)
    assert ("B", 63, 48, False) in batch(out)  # B's first chunk: 63 of its 100 (A's decode took one token)
    assert s.queued_prefill_tokens == 37 + 90
    assert s.prefilling_tokens == 100 + 90  # B still counts whole: no token yet
    drain(s)
    assert (s.prefilling_tokens, s.queued_prefill_tokens) == (0, 0)


def test_prefix_cache_hit_on_admission_sets_num_cached_tokens() -> None:
    s = make_scheduler()
    shared = list(range(500, 500 + 3 * BS))
    s.add_request(make_request("A", shared + [1, 2, 3], max_tokens=2))
    out, res = step(s)
    assert batch(out) == [("A", 51, 0, True)]
    assert res[0].num_cached_tokens == 0
    s.add_request(make_request("B", shared + [7], max_tokens=1))
    out, res = step(s)
    assert batch(out) == [("A", 1, 51, True), ("B", 1, 48, True)]
    assert out.scheduled[1].block_ids == [1, 2, 3, 5]
    assert [(o.request_id, o.num_cached_tokens, o.num_prompt_tokens) for o in res] == [
        ("A", 0, 51),
        ("B", 48, 49),
    ]
    kv = s.kv_cache_manager
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (51 + 49, 48)


def test_preemption_by_recompute_loses_nothing() -> None:
    # 8 usable blocks of 4 tokens; each request needs 6 blocks: both cannot run to the end.
    waiting_after: list[list[tuple[str, RequestStatus]]] = []
    tables: list[list[list[int]]] = []

    def run(num_blocks: int) -> tuple[Scheduler, dict[str, RequestOutput], list[SchedulerOutput]]:
        waiting_after.clear()
        s = make_scheduler(num_blocks=num_blocks, block_size=4, max_model_len=32)
        s.add_request(make_request("A", 10, block_size=4, max_tokens=12))
        s.add_request(make_request("B", list(range(300, 310)), block_size=4, max_tokens=12))
        outs = []
        tables.clear()
        merged: dict[str, RequestOutput] = {}
        while s.has_unfinished_requests():
            out, res = step(s)
            outs.append(out)
            tables.append([sr.block_ids for sr in out.scheduled])  # valid until the next schedule()
            waiting_after.append([(r.request_id, r.status) for r in s.waiting])
            for o in res:
                merged.setdefault(o.request_id, RequestOutput(o.request_id, [], False, None, 10, 0))
                merged[o.request_id].new_token_ids += o.new_token_ids
                merged[o.request_id].finish_reason = o.finish_reason
            assert len(outs) < 100
        return s, merged, outs

    ref_s, ref, ref_outs = run(num_blocks=64)
    assert ref_s.num_preemptions == 0 and len(ref_outs) == 12

    s, got, outs = run(num_blocks=9)
    # Step 8 (tokens 13..16 filled 4 blocks each; the 17th needs a fifth): B, admitted last, goes.
    preempting = [i for i, o in enumerate(outs) if o.preempted_ids]
    assert preempting[0] == 7
    assert outs[7].preempted_ids == ["B"]
    assert waiting_after[7] == [("B", RequestStatus.PREEMPTED)]
    assert batch(outs[7]) == [("A", 1, 16, True)]
    # B waits at the front of the queue: its hits 4, 5, 6 (block 8 went to A) plus 2 new blocks
    # do not fit in the 3 free ones. When A finishes, A's last allocation has evicted block 6, so
    # B hits 4, 5 and recomputes the other 9 of its 17 tokens (prompt + 7 outputs) in one chunk.
    assert [batch(o) for o in outs[8:11]] == [[("A", 1, t, True)] for t in (17, 18, 19)]
    assert [o.finished_ids for o in outs[11:13]] == [[], ["A"]]
    assert batch(outs[12]) == [("B", 9, 8, True)]
    assert tables[12] == [[4, 5, 6, 8, 7]]
    assert s.num_preemptions == 1 and len(outs) == 17
    assert {rid: (o.new_token_ids, o.finish_reason) for rid, o in got.items()} == {
        rid: (o.new_token_ids, o.finish_reason) for rid, o in ref.items()
    }
    assert all(len(o.new_token_ids) == 12 for o in got.values())
    assert s.kv_cache_manager.num_free_blocks == 8
    assert all(b.ref_cnt == 0 for b in s.kv_cache_manager.block_pool.blocks)


def test_a_request_that_cannot_get_blocks_waits() -> None:
    s = make_scheduler(num_blocks=5, block_size=4, max_model_len=16)  # 4 usable blocks
    s.add_request(make_request("A", 12, block_size=4, max_tokens=4))  # 3 blocks, then a 4th
    s.add_request(make_request("B", 6, block_size=4, max_tokens=1))  # 2 blocks: only 1 left
    out, _ = step(s)
    assert batch(out) == [("A", 12, 0, True)]
    assert s.num_waiting == 1
    outputs = drain(s)
    assert outputs["B"].finished and len(outputs["B"].new_token_ids) == 1
    assert s.kv_cache_manager.num_free_blocks == 4


def test_abort_frees_blocks_at_once() -> None:
    s = make_scheduler()
    s.add_request(make_request("A", 40, max_tokens=5))
    s.add_request(make_request("B", 20, max_tokens=5))
    step(s)
    kv = s.kv_cache_manager
    assert kv.get_block_ids("A") == [1, 2, 3] and kv.num_free_blocks == 35
    a = s.requests["A"]
    assert s.abort_request("A") is True
    assert kv.get_block_ids("A") == [] and kv.num_free_blocks == 38
    assert (a.status, a.finish_reason) == (RequestStatus.FINISHED_ABORTED, "abort")
    assert s.abort_request("A") is False
    assert s.abort_request("nope") is False
    out, _ = step(s)
    assert batch(out) == [("B", 1, 20, True)]
    assert out.finished_ids == ["A"]

    s.add_request(make_request("W", 10))
    assert s.abort_request("W") is True  # still waiting
    assert s.num_waiting == 0

    # Aborted between schedule() and update_from_output(): its result is dropped.
    out = s.schedule()
    assert out.finished_ids == ["W"]
    assert s.abort_request("B") is True
    assert s.update_from_output(out, {"B": [7]}) == []
    assert not s.has_unfinished_requests()
    assert kv.num_free_blocks == 40


@pytest.mark.parametrize(
    ("params", "model_tokens", "expected", "reason"),
    [
        ({"max_tokens": 10}, [5, 6, EOS, 8], [5, 6, EOS], "stop"),
        ({"max_tokens": 4, "ignore_eos": True}, [5, EOS, EOS, EOS, 9], [5, EOS, EOS, EOS], "length"),
        ({"max_tokens": 10, "stop_token_ids": [6]}, [5, 6, 7], [5, 6], "stop"),
        ({"max_tokens": 3}, [5, 6, 7, 8], [5, 6, 7], "length"),
        ({"max_tokens": 2}, [5, EOS], [5, EOS], "stop"),  # a stop token wins over the length limit
    ],
)
def test_stop_conditions(params: dict, model_tokens: list[int], expected: list[int], reason: str) -> None:
    s = make_scheduler()
    s.add_request(make_request("A", 4, **params))

    def scripted(req: Request) -> int:
        return model_tokens[req.num_output_tokens]

    out = drain(s, scripted)["A"]
    assert (out.new_token_ids, out.finished, out.finish_reason) == (expected, True, reason)


def test_max_model_len_finishes_with_length() -> None:
    s = make_scheduler(max_model_len=20)
    s.add_request(make_request("A", 17, max_tokens=100))
    out = drain(s)["A"]
    assert (len(out.new_token_ids), out.finish_reason) == (3, "length")


def test_rejects_requests_that_could_never_run() -> None:
    s = make_scheduler(max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        s.add_request(make_request("long", 64))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_request("empty", []))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request(make_request("bad", 4, max_tokens=0))
    with pytest.raises(ValueError, match="blocks of 4"):
        s.add_request(make_request("bs", 4, block_size=4))
    s.add_request(make_request("ok", 63, max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("ok", 3))
    assert s.num_waiting == 1


def test_rejects_configs_that_could_never_schedule() -> None:
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        make_scheduler(num_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match="chunked prefill"):
        make_scheduler(max_num_batched_tokens=64, max_model_len=128, enable_chunked_prefill=False)
