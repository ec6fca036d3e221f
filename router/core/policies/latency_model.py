"""An online latency regressor: a bucketed sliding window of (features -> seconds) samples and a small
gradient-boosted ensemble of regression trees fitted to it (llm-d's predicted-latency scheduler trains XGBoost the
same way; router/core/policies/llmd_predicted.py says where this one differs).

Squared loss, histogram splits (each feature cut at its window's quantiles, as XGBoost's ``hist`` method), complete
trees of a fixed depth stored as arrays, so one prediction of every tree for every candidate is a few numpy
operations. Pure: no clock, no I/O; deterministic for the same samples.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np


class BoostedTrees:
    """Gradient boosting of depth-``depth`` regression trees on squared loss. The defaults are XGBoost's own
    (``n_estimators`` 100, ``max_depth`` 6, ``learning_rate`` 0.3, ``min_child_weight`` 1 as one sample a leaf).

    Args:
        rounds: trees fitted.
        depth: levels of splits per tree (a tree has ``2**depth`` leaves).
        learning_rate: each tree's shrinkage.
        min_leaf: fewest samples on each side of a split.
        bins: most quantile cuts per feature.
    """

    def __init__(self, rounds: int = 100, depth: int = 6, learning_rate: float = 0.3, min_leaf: int = 1,
                 bins: int = 32) -> None:
        self.rounds, self.depth, self.learning_rate, self.min_leaf, self.bins = rounds, depth, learning_rate, min_leaf, bins
        self.base = 0.0
        n_inner = 2 ** depth - 1
        self._feature = np.zeros((0, n_inner), dtype=np.int64)
        self._threshold = np.zeros((0, n_inner))
        self._leaf = np.zeros((0, 2 ** depth))

    @property
    def fitted(self) -> bool:
        return len(self._feature) > 0

    def fit(self, x: np.ndarray, y: np.ndarray) -> BoostedTrees:
        x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
        n, n_features = x.shape
        self.base = float(y.mean())
        pred = np.full(n, self.base)
        cuts = [np.unique(np.quantile(x[:, f], np.linspace(0, 1, self.bins + 1)[1:-1])) for f in range(n_features)]
        # NOTE: bin k holds cuts[k-1] < x <= cuts[k]; "bin <= k" is "x <= cuts[k]"
        binned = np.stack([np.searchsorted(cuts[f], x[:, f], side="left") for f in range(n_features)], axis=1)
        features, thresholds, leaves = [], [], []
        for _ in range(self.rounds):
            residual = y - pred
            feat, thr, leaf, leaf_of = self._grow(binned, cuts, residual)
            features.append(feat)
            thresholds.append(thr)
            leaves.append(leaf)
            pred += self.learning_rate * leaf[leaf_of]
        self._feature, self._threshold, self._leaf = np.array(features), np.array(thresholds), np.array(leaves)
        return self

    def _grow(self, binned: np.ndarray, cuts: list[np.ndarray], residual: np.ndarray):
        """One complete tree, level by level: every node and feature of a level in one histogram. A node with no
        split worth making passes everything left (threshold +inf)."""
        n, n_features = binned.shape
        nb = self.bins + 1
        splits = np.array([len(c) for c in cuts])  # feature f splits after bins 0 .. splits[f] - 1
        valid = np.arange(nb - 1)[None, :] < splits[:, None]  # (F, nb - 1)
        n_inner = 2 ** self.depth - 1
        feat = np.zeros(n_inner, dtype=np.int64)
        thr = np.full(n_inner, np.inf)
        node = np.zeros(n, dtype=np.int64)  # each sample's node within its level
        rows = np.arange(n)
        col = np.arange(n_features)[None, :]
        for level in range(self.depth):
            width = 2 ** level
            key = ((col * width + node[:, None]) * nb + binned).ravel()
            size = n_features * width * nb
            s = np.bincount(key, weights=np.repeat(residual, n_features), minlength=size).reshape(n_features, width, nb)
            c = np.bincount(key, minlength=size).reshape(n_features, width, nb).astype(float)
            sl, cl = np.cumsum(s, axis=2)[:, :, :-1], np.cumsum(c, axis=2)[:, :, :-1]
            st, ct = s.sum(axis=2, keepdims=True), c.sum(axis=2, keepdims=True)
            sr, cr = st - sl, ct - cl
            ok = (cl >= self.min_leaf) & (cr >= self.min_leaf) & valid[:, None, :]
            with np.errstate(divide="ignore", invalid="ignore"):
                gain = np.where(ok, sl ** 2 / cl + sr ** 2 / cr - st ** 2 / np.maximum(ct, 1), 0.0)
            flat = gain.transpose(1, 0, 2).reshape(width, -1)  # (node, feature * split)
            best = flat.argmax(axis=1)
            split = flat[np.arange(width), best] > 1e-12
            best_f, best_k = best // (nb - 1), best % (nb - 1)
            best_k = np.where(split, best_k, np.iinfo(np.int64).max)  # no split: every sample goes left
            first = width - 1
            for j in np.flatnonzero(split):
                feat[first + j] = best_f[j]
                thr[first + j] = cuts[best_f[j]][best_k[j]]
            go_right = binned[rows, best_f[node]] > best_k[node]
            node = 2 * node + go_right
        sums = np.bincount(node, weights=residual, minlength=2 ** self.depth)
        counts = np.bincount(node, minlength=2 ** self.depth)
        leaf = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
        return feat, thr, leaf, node

    def predict(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        n = len(x)
        if not self.fitted:
            return np.full(n, self.base)
        trees = len(self._feature)
        node = np.zeros((trees, n), dtype=np.int64)
        t = np.arange(trees)[:, None]
        rows = np.arange(n)[None, :]
        for _ in range(self.depth):
            f = self._feature[t, node]
            right = x[rows, f] > self._threshold[t, node]
            node = 2 * node + 1 + right
        leaf = node - (2 ** self.depth - 1)
        return self.base + self.learning_rate * self._leaf[t, leaf].sum(axis=0)


class LatencyModel:
    """A bucketed sliding window of samples and the ensemble refitted on it every ``refit_every`` new samples.

    Samples are kept per bucket (``bucket(features)``; llm-d stratifies by KV usage and prefix hit), each bucket
    holding its last ``per_bucket``, so a burst of one kind of traffic cannot push every other kind out.
    """

    def __init__(self, bucket_of, per_bucket: int = 64, min_samples: int = 32, refit_every: int = 32,
                 trees: BoostedTrees | None = None) -> None:
        self.bucket_of = bucket_of
        self.per_bucket = per_bucket
        self.min_samples = min_samples
        self.refit_every = refit_every
        self.trees = trees or BoostedTrees()
        self._window: dict[object, deque] = {}
        self._new = 0
        self.fits = 0

    @property
    def ready(self) -> bool:
        return self.trees.fitted

    def __len__(self) -> int:
        return sum(len(d) for d in self._window.values())

    def add(self, features: Sequence[float], seconds: float) -> None:
        """One observed sample; refits when enough new ones came."""
        key = self.bucket_of(features)
        bucket = self._window.get(key)
        if bucket is None:
            bucket = self._window[key] = deque(maxlen=self.per_bucket)
        bucket.append((tuple(features), seconds))
        self._new += 1
        if self._new >= self.refit_every and len(self) >= self.min_samples:
            self.refit()

    def refit(self) -> None:
        samples = [s for key in sorted(self._window, key=repr) for s in self._window[key]]
        x = np.array([s[0] for s in samples], dtype=float)
        y = np.array([s[1] for s in samples], dtype=float)
        self.trees.fit(x, y)
        self._new = 0
        self.fits += 1

    def predict(self, rows: Sequence[Sequence[float]]) -> np.ndarray:
        return self.trees.predict(np.array(rows, dtype=float))
