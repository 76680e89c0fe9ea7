"""The step's batch across processes and devices: the rows of the global batch this process
holds (`process_rows`), the global arrays assembled from them (`to_global`), and the batch's shape
checked at a step's boundary (`check_batch`). Each process builds only its own rows
(jax3d/data/corpus.py `batch_at`, jax3d/data/prefetch.py).
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import numpy as np

from jax3d.data.corpus import STEP_KEYS


def process_rows(sharding: jax.sharding.Sharding, batch: int) -> np.ndarray:
  """Indices of the global-batch rows this process holds, in global order (its row blocks
  concatenated: what jax.make_array_from_process_local_data expects)."""
  idx = sharding.addressable_devices_indices_map((batch,))
  blocks = sorted({(s[0].start or 0, batch if s[0].stop is None else s[0].stop) for s in idx.values()})
  return np.concatenate([np.arange(a, b) for a, b in blocks])


def to_global(
  local: dict[str, np.ndarray], sharding: jax.sharding.Sharding, batch: int
) -> dict[str, jax.Array]:
  """Global arrays of `batch` rows from this process's rows (those of `process_rows`) of each entry."""
  return {
    k: jax.make_array_from_process_local_data(sharding, v, (batch,) + v.shape[1:]) for k, v in local.items()
  }


def check_batch(batch: dict[str, Any], rows: int, seq_len: int, what: str) -> None:
  """The batch at a step's boundary, checked when the step is traced (chex; nothing runs per
  step): STEP_KEYS arrays of shape [rows, seq_len], weights float and the others integers.
  Another shape would otherwise be split into micro-batches of the wrong size, or fail deep inside
  the pipeline."""
  missing = [k for k in STEP_KEYS if k not in batch]
  assert not missing, f'{what}: the batch has no {", ".join(missing)} (it takes {", ".join(STEP_KEYS)})'
  arrays = [batch[k] for k in STEP_KEYS]
  msg = f'{what}: batch inputs, targets, weights, segment_ids and positions must be [{rows}, {seq_len}]'
  chex.assert_rank(arrays, 2, custom_message=msg)
  chex.assert_shape(arrays, (rows, seq_len), custom_message=msg)
  chex.assert_type([batch[k] for k in STEP_KEYS if k != 'weights'], int, custom_message=msg)
  chex.assert_type(batch['weights'], float, custom_message=msg)
