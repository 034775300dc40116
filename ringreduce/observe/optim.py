"""Bayesian optimisation for the autotuner: a Gaussian process with expected improvement.

The same method as Horovod's ``horovod/common/optim`` (a GP regressor whose noise term is
HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE, and the next sample where the expected
improvement over the best mean seen is largest), written here in NumPy alone:

* the inputs are scaled to the unit box, the scores to mean 0 and deviation 1;
* the kernel is RBF; its length scale is the one of a small grid with the highest
  marginal likelihood (cheaper than Horovod's L-BFGS fit, and as good for a handful of
  samples in two to four dimensions);
* the expected improvement is maximised over random points of the box, its corners, and
  points near the best sample so far (Horovod: L-BFGS from random starts).

It *maximises* the score, as Horovod does (bytes reduced per microsecond).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

# The length scales tried for the RBF kernel, in units of the unit box.
LENGTH_SCALES = (0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
# Exploration margin of the expected improvement (Horovod's xi), in standardised score units.
XI = 0.01
CANDIDATES = 2000


def _rbf(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
    d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=-1)
    return np.exp(-0.5 * d2 / (length * length))


class GaussianProcess:
    """GP regression with an RBF kernel and ``noise`` added to the diagonal (Horovod's alpha)."""

    def __init__(self, noise: float) -> None:
        self.noise = max(float(noise), 1e-9)
        self.length = LENGTH_SCALES[0]
        self._x = np.empty((0, 0))
        self._alpha = np.empty(0)
        self._chol = np.empty((0, 0))

    def _factor(self, x: np.ndarray, length: float) -> np.ndarray:
        k = _rbf(x, x, length) + self.noise * np.eye(len(x))
        return np.linalg.cholesky(k)

    def fit(self, x: np.ndarray, y: np.ndarray) -> None:
        best = -math.inf
        for length in LENGTH_SCALES:
            chol = self._factor(x, length)
            alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, y))
            # log marginal likelihood, up to a constant
            likelihood = -0.5 * float(y @ alpha) - float(np.log(np.diag(chol)).sum())
            if likelihood > best:
                best, self.length, self._chol, self._alpha = likelihood, length, chol, alpha
        self._x = x

    def predict(self, x: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
        """Mean and standard deviation at the points ``x`` (rows)."""
        k = _rbf(x, self._x, self.length)
        mean = k @ self._alpha
        v = np.linalg.solve(self._chol, k.T)
        var = np.clip(1.0 - (v * v).sum(axis=0), 0.0, None)
        return mean, np.sqrt(var)


def _norm_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))


def expected_improvement(mean: np.ndarray, std: np.ndarray, best: float, xi: float = XI) -> np.ndarray:
    improvement = mean - best - xi
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(std > 0, improvement / std, 0.0)
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    ei = improvement * _norm_cdf(z) + std * pdf
    return np.where(std > 0, ei, 0.0)


class BayesianOptimizer:
    """Proposes points in the box ``bounds`` (one (low, high) per dimension) that maximise a
    noisy score. Deterministic for a given ``seed`` and sequence of samples."""

    def __init__(self, bounds: "Sequence[tuple[float, float]]", noise: float, seed: int = 0) -> None:
        if not bounds:
            raise ValueError("BayesianOptimizer needs at least one dimension")
        self.low = np.array([b[0] for b in bounds], dtype=np.float64)
        self.high = np.array([b[1] for b in bounds], dtype=np.float64)
        if np.any(self.high <= self.low):
            raise ValueError(f"every bound must have low < high: {list(bounds)}")
        self.noise = noise
        self._rng = np.random.default_rng(seed)
        self.xs: "list[np.ndarray]" = []
        self.ys: "list[float]" = []

    def _unit(self, x: np.ndarray) -> np.ndarray:
        return (x - self.low) / (self.high - self.low)

    def _box(self, u: np.ndarray) -> np.ndarray:
        return self.low + np.clip(u, 0.0, 1.0) * (self.high - self.low)

    def add_sample(self, x: "Sequence[float]", y: float) -> None:
        self.xs.append(np.asarray(x, dtype=np.float64))
        self.ys.append(float(y))

    def best(self) -> "tuple[np.ndarray, float]":
        i = int(np.argmax(self.ys))
        return self.xs[i], self.ys[i]

    def next_sample(self) -> np.ndarray:
        """The point of the box with the highest expected improvement (a random one before any sample)."""
        dims = len(self.low)
        if not self.xs:
            return self._box(self._rng.random(dims))
        x = self._unit(np.array(self.xs))
        y = np.array(self.ys)
        spread = y.std()
        y = (y - y.mean()) / (spread if spread > 0 else 1.0)
        gp = GaussianProcess(self.noise)
        gp.fit(x, y)
        corners = np.array([[(i >> d) & 1 for d in range(dims)] for i in range(min(1 << dims, 64))], dtype=float)
        near = x[int(np.argmax(y))] + self._rng.normal(0.0, 0.05, (200, dims))
        candidates = np.vstack([self._rng.random((CANDIDATES, dims)), corners, np.clip(near, 0.0, 1.0)])
        mean, std = gp.predict(candidates)
        best_mean = float(gp.predict(x)[0].max())  # the noisy model's best (Horovod: mu_sample_opt)
        ei = expected_improvement(mean, std, best_mean)
        return self._box(candidates[int(np.argmax(ei))])
