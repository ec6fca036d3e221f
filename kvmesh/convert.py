"""Protobuf <-> core conversions shared by the router and the worker server (adapters only)."""

from __future__ import annotations

from kvmesh.v1 import common_pb2
from model_worker.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16

FINISH_TO_PB = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
PB_TO_FINISH = {v: k for k, v in FINISH_TO_PB.items()}


def sampling_from_pb(m: common_pb2.SamplingParams) -> SamplingParams:
    """Proto defaults: max_tokens 0 -> 16, top_p 0 -> 1.0. Raises ValueError on bad values."""
    params = SamplingParams(
        max_tokens=m.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=m.temperature,
        top_p=m.top_p if m.top_p != 0.0 else 1.0,
        top_k=m.top_k,
        seed=m.seed if m.HasField("seed") else None,
        stop_token_ids=list(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
    )
    params.validate()
    return params


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    m = common_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        m.seed = p.seed
    return m
