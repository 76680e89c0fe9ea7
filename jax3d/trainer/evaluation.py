"""Held-out evaluation (`Trainer.evaluate`): the weighted mean loss of the compiled eval step over
the eval.batches held-out batches, the same batches at every evaluation of a run (train.seed)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jax3d.data import corpus as data_lib
from jax3d.setup import Setup


def held_out_loss(setup: Setup, corpus: data_lib.Corpus, eval_step: Callable, params: dict) -> float:
  """The held-out loss in nats per token: the weighted mean sum(w * CE) / sum(w) over all the
  held-out batches (each batch's weighted mean from `eval_step`, weighted by its weight sum; with
  weight 1 everywhere, the mean token loss). Every process reads its own rows of each batch
  (data_lib.process_rows) into the global batch that `eval_step(params, batch)` takes."""
  cfg, plan, sh = setup.cfg, setup.plan, setup.batch_sharding
  batches = data_lib.eval_batches(corpus, cfg.train.seed, cfg.eval.batches, plan.chunk_batch, plan.seq_len)
  rows = data_lib.process_rows(sh, plan.chunk_batch)
  losses = [
    eval_step(params, data_lib.to_global({k: v[rows] for k, v in b.items()}, sh, plan.chunk_batch))
    for b in batches
  ]
  w = np.array([b['weights'].sum(dtype=np.float64) for b in batches])
  means = np.asarray(jax.device_get(losses), np.float64)
  return float(np.sum(means * w) / max(w.sum(), np.finfo(np.float32).tiny))
