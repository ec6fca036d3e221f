"""Multi-step decode behind the worker's gRPC stream: one message per token, sent by its inner step."""

from __future__ import annotations

import threading

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2
from kvmesh.v1 import worker_pb2 as pb
from kvmesh.v1 import worker_pb2_grpc as pb_grpc

PROMPT = [(5 * i + 2) % 200 + 5 for i in range(21)]


def test_window_tokens_reach_the_client_one_message_each_before_the_window_ends(start_worker, model_dir):
    worker = start_worker("w1", None, num_scheduler_steps=8)
    runner = worker.engine.runner
    received: list[int] = []
    arrived = threading.Condition()
    # Inner step i of a window waits until the client holds every token so far: it can only get
    # them if the server streamed them before the window's last step. The timeout only turns a
    # regression into a failure instead of a hang (after one miss the waits stop).
    seen_in_time: list[bool] = []
    windows: list[int] = []
    execute_window = runner.execute_window

    def traced_window(out, on_step):
        windows.append(out.num_steps)

        def step_then_wait(tokens):
            before = 1 + len(seen_in_time)  # the prefill's token and earlier inner steps'
            in_time = all(seen_in_time)
            if in_time:
                # NOTE: the client holds every earlier token before this one is handed out, so
                # a message can only carry this one. Without it, a reader thread that wakes late
                # on a loaded host finds two tokens ready and sends both in one message, as it
                # should (the stream sends what is ready).
                with arrived:
                    in_time = arrived.wait_for(lambda: len(received) >= before, timeout=10)
            active = on_step(tokens)
            if in_time:
                with arrived:
                    in_time = arrived.wait_for(lambda: len(received) >= before + 1, timeout=10)
            seen_in_time.append(in_time)
            return active

        return execute_window(out, step_then_wait)

    runner.execute_window = traced_window
    stub = pb_grpc.WorkerStub(dial(worker.address))
    call = stub.Generate(pb.WorkerGenerateRequest(
        request_id="ms", prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=20, ignore_eos=True)), timeout=60)
    msgs = []
    for m in call:
        msgs.append(m)
        if m.token_ids:
            with arrived:
                received.extend(m.token_ids)
                arrived.notify_all()

    offline = LLM(str(model_dir), num_blocks=128, max_num_batched_tokens=256, max_model_len=512)
    (want,) = offline.generate([PROMPT], SamplingParams(max_tokens=20, ignore_eos=True))
    assert [len(m.token_ids) for m in msgs[:-1]] == [1] * 20 and msgs[-1].token_ids == []
    assert received == want.token_ids
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 20
    # Token 1 comes from the prefill step, 2-9 and 10-17 from windows of 8, 18-20 from one of 3.
    assert windows == [8, 8, 3]
    assert seen_in_time == [True] * 19
    kv = worker.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1

