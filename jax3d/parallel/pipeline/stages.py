"""The `shard_map` over the pipeline's stages that both schedules share (`over_stages`), and
whether the stages skip their bubble iterations (`skips_bubbles`).

Gradients over dp (and cp). The loop is manual over dp (and cp: each device its own tokens) too:
the weights are marked varying at its entry, so their gradient sum (that mark's transpose) happens
once per step, after the loop. Inside a caller's shard_map manual over dp and pp (the explicit
reduction of jax3d/parallel/data_parallel.py, `manual=True`) it opens none of its own
(`microbatch.local_rows`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jax3d.config import RunPlan
from jax3d.parallel import sharding, zero3
from jax3d.parallel.layer_fn import LayerFn
from jax3d.parallel.sharding import CP, DP, PP


def over_stages(
  body: Callable,
  layer_fn: LayerFn,
  mesh: Mesh,
  scatter: int | None,
  manual: bool,
  gather: zero3.Gather | None,
  policy: str,
  rows_out: bool,
) -> Callable:
  """Both schedules' `shard_map` over the stages: (layers, head, x_mbtd, side_mbt) ->
  `body(layer_fn, layers_local, head, x_mbtd, side_m)` on each stage, which returns the rows
  (GPipe, `rows_out`) or this stage's loss (1F1B, summed over the stages), with its layers
  (ZeRO-3: gathered, `gather`), marked dp-varying (their gradient sum over dp happens once, after
  the loop), and the micro-batches whole over pp (`scatter`: all-gathered at the entry). The
  activations cross the loop's boundary in fp32 (the sums over pp of their gradients too): exact,
  a one-off m*b*t*d per step, and it avoids XLA:CPU's failing bf16 all-reduce promotion."""
  # Only axes of size > 1 are made manual (XLA rejects collectives over size-1 manual groups).
  # a tuple, in mesh order: a set's order follows the hash seed, and the collectives' device groups
  # with it, so two processes of one run could compile different programs (issue 44)
  axes = tuple(a for a in (PP, DP, CP) if mesh.shape.get(a, 1) > 1)
  names = lambda *ns: tuple(n for n in ns if n in axes) or None
  seq = names(CP)  # mesh.cp > 1: each device its own tokens of the rows (jax3d/parallel/context.py)
  specs = {  # the micro-batches: whole over pp, or split over it along axis `scatter`
    None: P(None, names(DP), seq),
    1: P(None, names(DP, PP), seq),
    0: P(names(PP), names(DP), seq),
  }
  rows = specs[scatter]

  stage_fn = layer_fn if gather is None else gather.layer(layer_fn, policy)

  def on_stage(layers_local, head, x_mbtd, side_m):
    if gather is not None:
      layers_local = gather.stage(layers_local)
    # The weights are the same on every dp rank; marking them as varying here, in their stored
    # dtype, puts the transpose (the gradient sum over dp) here too: once per step, after the
    # loop, instead of once per micro-batch inside it.
    layers_local = jax.tree.map(lambda a: sharding.vary(a, names(DP, CP) or ()), layers_local)
    if scatter is not None:
      over_pp = lambda a: jax.lax.all_gather(a, PP, axis=scatter, tiled=True)
      x_mbtd, side_m = over_pp(x_mbtd), jax.tree.map(over_pp, side_m)
    if rows_out:
      return body(stage_fn, layers_local, head, x_mbtd, side_m)
    head = jax.tree.map(lambda a: sharding.vary(a, axes), head)
    out = body(stage_fn, layers_local, head, x_mbtd, side_m)
    return out if manual else jax.lax.psum(out, axes)

  def run_stages(layers, head, x_mbtd, side_mbt):
    x32 = x_mbtd.astype(jnp.float32)
    if not axes or manual:
      return on_stage(layers, head, x32, side_mbt)
    return jax.shard_map(
      on_stage,
      mesh=mesh,
      in_specs=(P(names(PP)) if gather is None else gather.specs(names(PP)), P(), rows, rows),
      out_specs=rows if rows_out else P(),
      axis_names=set(axes),
      check_vma=True,
    )(layers, head, x32, side_mbt)

  return run_stages


# jax < 0.12 saves a cond's loop-invariant operands (here: the stage's weights) as a residual of
# every pipeline iteration, so skipping bubbles there costs memory; 'auto' skips them only where
# it costs none.
COND_FORWARDS_OPERANDS = jax.__version_info__ >= (0, 12)


def skips_bubbles(plan: RunPlan, mesh: Mesh) -> bool:
  """Whether the stages skip their bubble iterations (pipeline.skip_bubbles; 'auto' = on CPU with
  jax >= 0.12).

  A bubble iteration's output is never written, so computing it only costs time when its work
  could have gone to another device: with fake CPU devices sharing the cores, skipping it (a
  `lax.cond` around the stage's layers, forward and backward) gives that time to the busy stages.
  On an accelerator the bubble is idle time either way and a conditional costs a device-to-host
  read of its predicate every iteration, so 'auto' computes it there."""
  if plan.pp == 1:
    return False
  if plan.skip_bubbles is not None:
    return plan.skip_bubbles
  return COND_FORWARDS_OPERANDS and all(d.platform == 'cpu' for d in mesh.devices.flat)
