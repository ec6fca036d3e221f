"""The compiled forward pass: ``torch.compile`` of the model, attention kept opaque.

Inductor fuses the per-layer work around the attention op (RMSNorm, rotary, the residual adds,
SiLU x up) into a few kernels: on a GPU that is what a decode step is mostly made of (docs/engine.md,
"The worker on a GPU"). The KV write and the ragged paged attention are one custom op
(models/attention.py), called as it is. The graph's only inputs are the ``[T]`` token ids and
positions (the metadata comes from the forward context), and ``T`` is dynamic: one graph serves
every batch size, plus the sizes torch specialises (``T = 1``; on CPU ``T >= 128``, where float32
products go to oneDNN). ``ModelRunner.warm_up`` runs each of them before the worker serves, and
:attr:`CompiledForward.num_compiles` says whether anything compiled later. The default (on for
CUDA, off for the CPU) is ``EngineConfig.check``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

_RECOMPILE_LIMIT = 64
"""Graphs dynamo keeps per code object before it gives up and runs eagerly (its default is 8).

NOTE: every model of a process shares ``LlamaForCausalLM.forward``'s code object; a process with
many engines (the tests, the benchmarks) compiles a few graphs for each model shape."""


def _raise_recompile_limits() -> None:
    cfg: Any = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch releases
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), _RECOMPILE_LIMIT))


class _Inductor:
    """The backend of every compiled forward pass of the process: inductor, counted.

    NOTE: one backend for all models, so a model of a shape compiled before (another engine of this
    process: the tests, the benchmarks) reuses its graphs: parameters are graph inputs
    (``inline_inbuilt_nn_modules``), so a graph does not depend on one model's weights.
    """

    def __init__(self) -> None:
        self.compiles = 0
        self.seconds = 0.0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        compiled = compile_fx(gm, example_inputs)
        seconds = time.perf_counter() - start
        self.compiles += 1
        self.seconds += seconds
        log.info("compiled a forward graph in %.1f s (%d in this process)", seconds, self.compiles)
        return compiled


_INDUCTOR = _Inductor()


class CompiledForward:
    """``model.forward`` compiled by inductor (``fullgraph``, dynamic token count).

    The first call of each specialisation compiles (seconds to a minute); later calls run the
    compiled code. Token-exact with the eager model on the same device and dtype (the fused
    reductions round differently in the last bits; the greedy tokens are what the tests compare).
    """

    def __init__(self, model: nn.Module) -> None:
        _raise_recompile_limits()
        self._fn: Callable[..., torch.Tensor] = torch.compile(
            model.forward, fullgraph=True, dynamic=True, backend=_INDUCTOR)

    @property
    def num_compiles(self) -> int:
        """Graphs compiled in this process so far (by any model): a request that compiles raises it."""
        return _INDUCTOR.compiles

    @property
    def compile_s(self) -> float:
        """Seconds spent in inductor in this process (dynamo's tracing not included)."""
        return _INDUCTOR.seconds

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._fn(input_ids, positions)
