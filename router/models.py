"""The models one router serves: one request path (a :class:`ModelRouter`) per model.

A model is served once it is configured (``--model DIR``: its tokenizer and chat template, or
``--model-id ID``) or once discovery sees a live worker of it. Each model has its own worker pool,
its own routing state (speculative map, in-flight view, index breaker) and its own block-hash
namespace (the model id is the root of every chain, docs/block-hashing.md), so two models never
share a decision. A request names its model by id, or by the directory given with ``--model``;
one that names none gets the default model: the first configured one, else the only one served.
A request may also name a LoRA adapter a live worker serves (its load report lists it,
docs/adapters.md): it goes to the adapter's base model, under the adapter.

This module imports neither grpc nor redis: the server passes in how a pool is made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from kvmesh.contract.errors import InvalidArgument, NotFound
from kvmesh.contract.modelinfo import context_length, load_tokenizer, model_id_for, vocab_size
from kvmesh.router.config import RouterConfig
from kvmesh.router.core.upstream import AsyncPrefixIndex, WorkerPool
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.model_router import ModelRouter
from kvmesh.router.text.chat_template import ChatTemplate

log = logging.getLogger("kvmesh.router")

MAX_MODEL_NAME_CHARS = 256
"""Longer model names are refused before any lookup (and never echoed whole)."""


@dataclass(slots=True)
class ModelFiles:
    """What the router reads from a model directory: the tokenizer and the chat template."""

    model_id: str
    model_dir: str
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    context_len: int | None = None
    """The model's context length (config.json): the default bound on a prompt's tokens."""
    vocab_size: int | None = None
    """Token ids at or past this are refused: the larger of config.json's vocab_size and the tokenizer's
    ids (added tokens included), as vLLM takes it."""

    @classmethod
    def load(cls, model_dir: str, model_id: str | None = None) -> ModelFiles:
        """Raises FileNotFoundError / ValueError naming the directory's problem."""
        tokenizer = load_tokenizer(model_dir)
        vocab = max(vocab_size(model_dir) or 0, tokenizer.get_vocab_size(with_added_tokens=True)) or None
        return cls(model_id_for(model_dir, model_id), model_dir, tokenizer, ChatTemplate.from_dir(model_dir),
                   context_length(model_dir), vocab)


@dataclass(slots=True)
class ServedModel:
    model_id: str
    router: ModelRouter
    files: ModelFiles | None = None
    """None: the router has no directory of the model (token ids only)."""

    @property
    def pool(self) -> WorkerPool:
        return self.router.pool


class ModelSet:
    """Every model this router serves, by id; made on the router's loop.

    Args:
        config: the router's flags (``model_dirs``, ``model_id``).
        make_pool: a worker pool for a model id (router/workers/discovery.py's GrpcWorkerPool live).
        index: the kv_service Lookup shared by every model (each Lookup names its model).
        metrics: the server's metrics, shared by every model's request path.
    """

    def __init__(self, config: RouterConfig, make_pool: Callable[[str], WorkerPool],
                 index: AsyncPrefixIndex | None, metrics: RouterMetrics) -> None:
        self.config = config
        self._make_pool = make_pool
        self._index = index
        self._metrics = metrics
        self._models: dict[str, ServedModel] = {}
        self._aliases: dict[str, str] = {}
        self.configured: list[str] = []
        """Ids of the models given by flags, in order (the first is the default)."""
        for i, d in enumerate(config.model_dirs):
            files = ModelFiles.load(d, config.model_id if i == 0 else None)
            if files.model_id in self._models:
                raise ValueError(f"--model {d}: model id {files.model_id!r} is given twice (rename the directory "
                                 "or pass --model-id for the first)")
            self._add(files.model_id, files)
            for alias in {d, str(Path(d).resolve())}:
                self._aliases[alias] = files.model_id
        if config.model_id and not config.model_dirs:
            self._add(config.model_id, None)

    def _add(self, model_id: str, files: ModelFiles | None) -> ServedModel:
        pool = self._make_pool(model_id)
        router = ModelRouter(self.config, pool, self._index, files.tokenizer if files else None, metrics=self._metrics,
                        chat_template=files.chat_template if files else None,
                        context_len=files.context_len if files else None,
                        vocab_size=files.vocab_size if files else None)
        served = self._models[model_id] = ServedModel(model_id, router, files)
        if files is not None or self.config.model_id == model_id:
            self.configured.append(model_id)
        return served

    def pool_for(self, model_id: str) -> WorkerPool:
        """The model's pool, the model added on first sight (discovery calls this)."""
        served = self._models.get(model_id)
        if served is None:
            log.info("serving model %r (a worker of it registered)", model_id)
            served = self._add(model_id, None)
        return served.pool

    def pools(self) -> list[WorkerPool]:
        return [m.pool for m in self._models.values()]

    def all(self) -> list[ServedModel]:
        """Configured models, and discovered ones while they have a worker."""
        return [m for m in self._models.values() if m.model_id in self.configured or m.pool.endpoints()]

    def default(self) -> ServedModel | None:
        """The model of a request that names none: the first configured one, else the only one served."""
        if self.configured:
            return self._models[self.configured[0]]
        served = self.all()
        return served[0] if len(served) == 1 else None

    def adapters(self) -> dict[str, ServedModel]:
        """The LoRA adapters some live worker serves, by name, each with its base model (the workers' load
        reports: docs/adapters.md)."""
        out: dict[str, ServedModel] = {}
        for m in self.all():
            for e in m.pool.endpoints():
                for a in e.load.adapters:
                    out.setdefault(a.name, m)
        return out

    def target(self, name: str) -> tuple[ServedModel, str]:
        """The model a request's ``model`` names and the LoRA adapter to run it under: ``(the model, "")``, or
        for an adapter's name ``(its base model, the name)``. A model's id wins over an adapter's name.

        Raises:
            NotFound / InvalidArgument: as :meth:`resolve`, when ``name`` is no adapter either.
        """
        try:
            return self.resolve(name), ""
        except NotFound:
            served = self.adapters().get(name) if name else None
            if served is None:
                raise
            return served, name

    def resolve(self, name: str) -> ServedModel:
        """The model a request names ("" = the default).

        Raises:
            NotFound: no such model is served.
            InvalidArgument: no model named while several are served, or an over-long name.
        """
        if not name:
            served = self.default()
            if served is not None:
                return served
            names = sorted(m.model_id for m in self.all())
            if not names:
                raise NotFound("this router serves no model yet: no worker has registered with the kv_service",
                               param="model")
            raise InvalidArgument(f"this router serves several models ({', '.join(names)}): name one in model",
                                  param="model")
        if len(name) > MAX_MODEL_NAME_CHARS:
            raise InvalidArgument(f"model is {len(name)} characters long; at most {MAX_MODEL_NAME_CHARS}",
                                  param="model")
        served = self._models.get(self._aliases.get(name, name))
        if served is None or served not in self.all():
            names = sorted(m.model_id for m in self.all())
            shown = name if len(name) <= 64 else name[:61] + "..."
            raise NotFound(f"the model {shown!r} does not exist on this router; models: {', '.join(names) or 'none'}",
                           param="model")
        return served
