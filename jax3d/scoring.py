"""Per-token scores of rows of documents: the log-probability of each target and whether it is the
model's argmax, for lm-evaluation-harness requests packed several to a row (jax3d/harness/).

The program is the eval step's (jax3d/step.py `eval_step`): the same batch keys and
shapes (one accumulation chunk x train.seq_len, segment ids and positions), the same forward
(`loss.hidden`: embed -> the pipeline on the run's mesh, any layout) and the same head and
vocab-parallel cross-entropy (`llama.token_cross_entropy`); it returns the per-token values the
eval step sums.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d import loss as loss_lib, step as step_lib
from jax3d.data import global_batch
from jax3d.model import llama
from jax3d.parallel import sharding

if TYPE_CHECKING:
  from jax3d.setup import Setup


def token_scores(params: Any, batch: step_lib.Batch, s: Setup) -> tuple[jax.Array, jax.Array]:
  """(log p(target) [b, t] fp32, target == argmax [b, t] bool) of one chunk of rows of documents
  (attention within a segment, positions restarting: `batch` as the eval step takes it)."""
  global_batch.check_batch(
    batch, s.plan.chunk_batch, s.plan.seq_len, 'score step (one chunk x train.seq_len)'
  )
  with sharding.use_rules(s.rules):
    if s.zero3:
      params = loss_lib.gathered_outside_loop(params, s)
    doc = {k: batch[k] for k in loss_lib.DOC_KEYS if k in batch}
    logits_btv = loss_lib.logits(params, batch['inputs'], s, doc=doc)
    logp_bt = -llama.token_cross_entropy(logits_btv, batch['targets'])
    greedy_bt = jnp.argmax(logits_btv, axis=-1) == batch['targets']
  return logp_bt, greedy_bt


def make_score_step(s: Setup) -> step_lib.MeshJit:
  """jit(token_scores) on the run's mesh: the parameters in their shardings, the rows over dp, the
  scores replicated (every process reads them all)."""
  replicated = NamedSharding(s.mesh, P())
  return step_lib.MeshJit(
    lambda p, b: token_scores(p, b, s),
    s.mesh,
    in_shardings=(s.param_shardings, s.batch_shardings),
    out_shardings=(replicated, replicated),
  )
