"""Held-out evaluation (`Trainer.evaluate`): the weighted mean loss of the compiled eval step over
the eval.batches held-out batches, the same batches at every evaluation of a run (train.seed); a
mixture's batches are shared among its sources, and each source's loss is given too."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jax3d.data import corpus as corpus_lib, global_batch, mixture as mixture_lib
from jax3d.setup import Setup


def held_out_losses(
  setup: Setup, corpus: corpus_lib.Corpus | mixture_lib.Mixture, eval_step: Callable, params: dict
) -> dict[str, float]:
  """{'eval_loss': the held-out loss in nats per token} and, for a mixture, 'eval_loss/NAME' per
  source: the weighted mean sum(w * CE) / sum(w) over the held-out batches (of that source),
  each batch's weighted mean from `eval_step` weighted by its weight sum (with weight 1
  everywhere, the mean token loss). Every process reads its own rows of each batch
  (global_batch.process_rows) into the global batch that `eval_step(params, batch)` takes."""
  cfg, plan, sh = setup.cfg, setup.plan, setup.batch_sharding
  batches = mixture_lib.eval_batches(corpus, cfg.train.seed, cfg.eval.batches, plan.chunk_batch, plan.seq_len)
  rows = global_batch.process_rows(sh, plan.chunk_batch)
  losses = [
    eval_step(params, global_batch.to_global({k: v[rows] for k, v in b.items()}, sh, plan.chunk_batch))
    for _, b in batches
  ]
  w = np.array([b['weights'].sum(dtype=np.float64) for _, b in batches])
  means = np.asarray(jax.device_get(losses), np.float64)
  mean = lambda at: float(np.sum(means[at] * w[at]) / max(w[at].sum(), np.finfo(np.float32).tiny))
  names = np.array([name or '' for name, _ in batches])
  sources = {f'eval_loss/{n}': mean(names == n) for n in dict.fromkeys(names) if n}
  return {'eval_loss': mean(slice(None))} | sources
