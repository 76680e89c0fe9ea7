"""Stage placement: which canonical layer each position of the stacked layer axis holds.

With v chunks per stage, chunk c = r*p + s (r = 0..v-1) runs on stage s, so the stacked weights are
stored stage-major: position j holds canonical layer `layer_order(...)[j]`, and a plain P('pp')
sharding of the layer axis gives each stage exactly its chunks (jax3d/parallel/pipeline/__init__.py).
Checkpoints and exports hold the canonical order (`to_canonical`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def layer_order(n_layers: int, pp: int, repeats: int) -> np.ndarray:
  """Canonical layer index held at each storage position of the stacked layer axis."""
  lc = n_layers // (pp * repeats)  # layers per chunk
  j = np.arange(n_layers)
  s, r, i = j // (repeats * lc), (j // lc) % repeats, j % lc
  return (r * pp + s) * lc + i


def _reordered(layers: Any, index: np.ndarray) -> Any:
  """Every leaf's layers in `index` order (the same tree when that is the identity)."""
  return layers if (index == np.arange(len(index))).all() else jax.tree.map(lambda a: a[index], layers)


def to_canonical(layers: Any, n_layers: int, pp: int, repeats: int) -> Any:
  """Stacked layer params in storage order -> canonical layer order (for comparisons, export)."""
  return _reordered(layers, np.argsort(layer_order(n_layers, pp, repeats)))


def from_canonical(layers: Any, n_layers: int, pp: int, repeats: int) -> Any:
  return _reordered(layers, layer_order(n_layers, pp, repeats))
