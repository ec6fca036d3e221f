"""The block-hash spec shared by router, kv_service and workers (docs/block-hashing.md).

A prompt is cut into full blocks of ``block_size`` tokens; a trailing partial block is never
hashed. Each block's hash chains its parent's:

    root        = H(field(model_id) ‖ field(algorithm) ‖ field(cache_salt))
    hash(block) = H(parent ‖ token_ids as little-endian int32 ‖ extra_keys)

``field(s)`` is the UTF-8 bytes of ``s`` preceded by their length as a little-endian uint32, so
no two different (model, algorithm, salt) triples encode to the same bytes. ``extra_keys`` is
``field(k)`` for each extra key in order (empty when there are none). ``H`` is SHA-256 truncated
to 16 bytes (default) or XXH3-128 (opt-in, faster, not collision-resistant against adversaries).

This module imports neither torch nor grpc nor redis.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

HASH_LEN = 16
SHA256_128 = "sha256_128"
XXH3_128 = "xxh3_128"
ALGORITHMS = (SHA256_128, XXH3_128)
DEFAULT_BLOCK_SIZE = 16
_MAX_TOKEN_ID = 2**31 - 1


def _sha256_128(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:HASH_LEN]


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


_HASH_FNS: dict[str, Callable[[bytes], bytes]] = {SHA256_128: _sha256_128, XXH3_128: _xxh3_128}


def _field(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive little-endian int32.

    Raises:
        ValueError: a token id is negative or not an integer.
    """
    # NOTE: packing as unsigned gives the int32 bytes for every id in [0, 2**31) and rejects
    # negatives for free; vocabularies are far below 2**31. struct.pack is ~2x faster than array
    # for a list; anything else (a protobuf repeated field: unpacking it costs 40 ns an id) goes
    # through one numpy copy, at memory speed.
    if not isinstance(token_ids, (list, tuple)):
        try:
            ids = np.asarray(token_ids, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            ids = None
        if ids is not None and ids.ndim == 1:
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) > _MAX_TOKEN_ID):
                raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]")
            return ids.astype("<u4").tobytes()
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]: {exc}") from None


class BlockHasher:
    """Computes the chained block hashes of one model under one algorithm.

    Args:
        model_id: the model's identity (its name or path as the worker registers it).
        block_size: tokens per block; only full blocks are hashed.
        algorithm: ``"sha256_128"`` (default) or ``"xxh3_128"``.
        extra_keys: strings mixed into every block (e.g. a LoRA adapter name).
    """

    __slots__ = ("model_id", "block_size", "algorithm", "extra_keys", "_extra", "_h", "_roots")

    def __init__(
        self,
        model_id: str,
        block_size: int = DEFAULT_BLOCK_SIZE,
        algorithm: str = SHA256_128,
        extra_keys: Sequence[str] = (),
    ) -> None:
        if algorithm not in _HASH_FNS:
            raise ValueError(f"unknown hash algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not model_id:
            raise ValueError("model_id must not be empty")
        self.model_id = model_id
        self.block_size = block_size
        self.algorithm = algorithm
        self.extra_keys = tuple(extra_keys)
        self._extra = b"".join(_field(k) for k in self.extra_keys)
        self._h = _HASH_FNS[algorithm]
        self._roots: dict[str, bytes] = {}

    def root(self, cache_salt: str = "") -> bytes:
        """The parent hash of a chain's first block."""
        root = self._roots.get(cache_salt)
        if root is None:
            root = self._h(_field(self.model_id) + _field(self.algorithm) + _field(cache_salt))
            if len(self._roots) < 4096:  # salts are per tenant; bound the memo
                self._roots[cache_salt] = root
        return root

    def hash_block(self, parent: bytes, token_ids: Sequence[int]) -> bytes:
        """Hash of one full block given its parent's hash."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"a block has exactly {self.block_size} tokens, got {len(token_ids)}")
        return self._h(parent + tokens_to_bytes(token_ids) + self._extra)

    def hash_prompt(
        self, token_ids: Sequence[int], cache_salt: str = "", parent: bytes | None = None
    ) -> list[bytes]:
        """Hashes of every full block of ``token_ids``, in order.

        Args:
            token_ids: the tokens; a trailing partial block is ignored.
            cache_salt: tenant salt, mixed into the root only.
            parent: continue a chain from this hash instead of the root.

        Returns:
            One 16-byte digest per full block.
        """
        bs = self.block_size
        n_full = len(token_ids) // bs
        if n_full == 0:
            return []
        raw = (tokens_to_bytes(token_ids[: n_full * bs]) if isinstance(token_ids, (list, tuple))
               else tokens_to_bytes(token_ids)[: n_full * 4 * bs])
        step = 4 * bs
        extra = self._extra
        prev = self.root(cache_salt) if parent is None else parent
        out: list[bytes] = []
        append = out.append
        # NOTE: the loops are spelled out per algorithm: a function call per block costs ~40% of
        # the SHA-256 path (8k tokens = 512 blocks).
        if self.algorithm == SHA256_128:
            sha256 = hashlib.sha256
            for off in range(0, n_full * step, step):
                prev = sha256(prev + raw[off : off + step] + extra).digest()[:HASH_LEN]
                append(prev)
        else:
            xxh = xxhash.xxh3_128_digest
            for off in range(0, n_full * step, step):
                prev = xxh(prev + raw[off : off + step] + extra)
                append(prev)
        return out


def adapter_extra_keys(adapter: str | None) -> tuple[str, ...]:
    """The extra keys of a request served under LoRA adapter ``adapter``: its name, as vLLM's
    ``extra_keys`` for LoRA (and the bridge's mirror); ``()`` for the base model (None or ""), so a
    base-model request's hashes are those of a hasher without extra keys (docs/block-hashing.md)."""
    return (adapter,) if adapter else ()


def adapter_hasher(base: BlockHasher, adapter: str | None) -> BlockHasher:
    """``base`` for the base model; for an adapter, the same chain spec with the adapter's key appended to
    ``base``'s extra keys: one prompt under two adapters is two chains. The one function the engine (and a
    router that hashes for an adapter) calls to key blocks by adapter."""
    keys = adapter_extra_keys(adapter)
    if not keys:
        return base
    return BlockHasher(base.model_id, base.block_size, base.algorithm, base.extra_keys + keys)


def algorithm_name(name: str) -> str:
    """Normalizes user spellings (``sha256``, ``xxh3``) to the canonical algorithm names."""
    aliases = {"sha256": SHA256_128, "sha256_128": SHA256_128, "xxh3": XXH3_128, "xxh3_128": XXH3_128}
    try:
        return aliases[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hash algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}") from None
