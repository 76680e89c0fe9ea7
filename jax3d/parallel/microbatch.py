"""Micro-batches, and the batch outside the pipeline's loop.

Micro-batch i holds rows i, i+m, i+2m, ... of the batch (a dp shard's rows stay on it). Outside
the loop (embedding, head, loss) the batch is split over (dp, pp) when each micro-batch divides
(`batch_axes`), so each device does 1/(dp*pp) of that work; stages all-gather their micro-batch
rows over pp on the way in and reduce-scatter the outputs on the way out. When a
micro-batch is too small for that (a few sequences) but the micro-batches divide over pp
(`splits_microbatches`), whole micro-batches are split over pp instead: micro-batch i is then rows
[i*r, (i+1)*r) of each dp shard, so that a pp rank's micro-batches are a block of its dp shard's
rows, and the stages gather and scatter the micro-batch axis.
"""

from __future__ import annotations

import jax

from jax3d.config import RunPlan
from jax3d.parallel import sharding
from jax3d.parallel.sharding import DP, EP, PP


def batch_axes(plan: RunPlan) -> str | tuple[str, ...]:
  """The mesh axes of the batch outside the loop: dp*pp when each micro-batch splits over them, or
  the micro-batches do (`splits_microbatches`); else dp. With expert parallelism and no pipeline,
  dp*ep (the rows as the layers split them: ep is data parallel outside the experts)."""
  if plan.ep > 1 and plan.pp == 1:
    return (DP, EP)
  return (DP, PP) if plan.pp_batch_split else DP


def splits_microbatches(plan: RunPlan) -> bool:
  """Whether whole micro-batches, not their rows, are split over pp outside the loop: where a
  micro-batch's rows do not divide over dp*pp but the micro-batches divide over pp (2x2x2 with
  micro-batches of 2 sequences), so that no two stages compute the same embedding, head and loss."""
  return plan.pp_batch_split == 'micro'


def micro_axes(plan: RunPlan) -> str | None:
  """The mesh axis of the micro-batch axis outside the loop (logical 'micro')."""
  return PP if splits_microbatches(plan) else None


def scatter_axis(plan: RunPlan) -> int | None:
  """The axis of the loop's [m, b, ...] input and output that is split over pp outside it (1: the
  rows of each micro-batch, 0: the micro-batches), or None."""
  if plan.pp == 1 or plan.pp_batch_split is None:
    return None
  return 0 if plan.pp_batch_split == 'micro' else 1


def microbatches(x_b: jax.Array, m: int, blocks: int | None = None) -> jax.Array:
  """[B, ...] -> [m, B/m, ...], micro-batch i = rows i, i+m, i+2m, ... (local to each dp shard).
  With `blocks` = g: micro-batch i = rows [i*r, (i+1)*r) of each of the batch's g equal blocks (its
  dp shards), r = B/(g*m), so that splitting the micro-batches over pp splits each block
  (`splits_microbatches`)."""
  if blocks is None:
    return x_b.reshape(x_b.shape[0] // m, m, *x_b.shape[1:]).swapaxes(0, 1)
  rest = x_b.shape[1:]
  return x_b.reshape(blocks, m, x_b.shape[0] // (blocks * m), *rest).swapaxes(0, 1).reshape(m, -1, *rest)


def merge_microbatches(x_m: jax.Array, blocks: int | None = None) -> jax.Array:
  """The inverse of `microbatches`."""
  m, rest = x_m.shape[0], x_m.shape[2:]
  if blocks is None:
    return x_m.swapaxes(0, 1).reshape(m * x_m.shape[1], *rest)
  return x_m.reshape(m, blocks, x_m.shape[1] // blocks, *rest).swapaxes(0, 1).reshape(-1, *rest)


def stacked(x_b: jax.Array, plan: RunPlan, manual: bool) -> tuple[jax.Array, int | None]:
  """[B, T, ...] -> [m, b, T, ...] as the pipeline's loop takes it (annotated), and the `blocks`
  that merge it back (`merge_microbatches`)."""
  names = ('micro', 'batch', 'seq', 'embed')[: x_b.ndim + 1]
  if splits_microbatches(plan):  # whole micro-batches over pp: blocks of each dp shard's rows
    m, blocks = (plan.microbatches // plan.pp, 1) if manual else (plan.microbatches, plan.dp)
    return sharding.constrain(microbatches(x_b, m, blocks), names), blocks
  names = ('micro', 'batch_all', *names[2:])
  return sharding.constrain(microbatches(x_b, plan.microbatches), names), None


def local_rows(x_b: jax.Array, plan: RunPlan) -> jax.Array:
  """Inside a shard_map manual over dp and pp: this pp rank's slice of each micro-batch's rows
  (the rows the automatic layout gives it when the batch is split over dp*pp), in [B, ...] order;
  with whole micro-batches split over pp, its block of the rows."""
  axis = scatter_axis(plan)
  if axis is None:
    return x_b
  if axis == 0:
    n = x_b.shape[0] // plan.pp
    return jax.lax.dynamic_slice_in_dim(x_b, jax.lax.axis_index(PP) * n, n)
  x_m = microbatches(x_b, plan.microbatches)
  b = x_m.shape[1] // plan.pp
  return merge_microbatches(jax.lax.dynamic_slice_in_dim(x_m, jax.lax.axis_index(PP) * b, b, axis=1))
