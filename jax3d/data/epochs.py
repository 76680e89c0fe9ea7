"""The epoch order: which rows (jax3d/data/packing.py) make the batch of step i. Imports no jax.

The rows of a split are read in epochs; epoch e is the permutation `default_rng([seed, e])` of
all of them. The steps take `batch` rows each from that sequence in turn, so row slot b of step i
is entry i * batch + b of the sequence: epoch (i * batch + b) // n_rows. A batch that straddles
the end of an epoch takes the last rows of one epoch and the first of the next, so every row (and
so every target token) is trained on exactly once per epoch. Nothing but (seed, step, the number of
rows) decides a batch: no layout, process count or resume point can change it.
"""

from __future__ import annotations

import numpy as np


class Order:
  """The epoch order of `n_rows` rows under `seed` (the last few epochs' permutations cached)."""

  def __init__(self, n_rows: int, seed: int, keep: int = 4):
    self.n_rows, self.seed, self.keep = n_rows, seed, keep
    self._perms: dict[int, np.ndarray] = {}

  def permutation(self, epoch: int) -> np.ndarray:
    """The rows of `epoch` in their order."""
    if epoch not in self._perms:
      if len(self._perms) >= self.keep:
        self._perms.pop(next(iter(self._perms)))
      self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
    return self._perms[epoch]

  def rows(self, step: int, batch: int, which: slice | np.ndarray = slice(None)) -> np.ndarray:
    """The row indices of batch rows `which` (default all `batch`) of step `step`."""
    return self.at(step * batch + np.arange(batch, dtype=np.int64)[which])

  def at(self, entries: np.ndarray) -> np.ndarray:
    """The row indices of entries `entries` of the sequence (entry e: epoch e // n_rows); a
    mixture's source reads its k-th row this way (jax3d/data/mixture.py)."""
    entry = np.asarray(entries, np.int64)
    epoch, k = np.divmod(entry, self.n_rows)
    out = np.empty(entry.shape, np.int64)
    for e in np.unique(epoch):
      at = epoch == e
      out[at] = self.permutation(int(e))[k[at]]
    return out

  def epoch(self, step: int, batch: int) -> int:
    """The epoch (0-based) of the first row of step `step`'s batch."""
    return step * batch // self.n_rows
