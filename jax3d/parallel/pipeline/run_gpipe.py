"""GPipe and circular pipelining (pipeline.schedule 'gpipe' and 'circular'): `apply` takes the
embedded batch [B, T, D] through every layer, `run` its micro-batches [m, b, t, d]. The loop on
one stage, and its backward pass: gpipe.py; the `shard_map` over the stages: stages.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jax3d.config import RunPlan
from jax3d.parallel import microbatch, remat, sharding, zero3
from jax3d.parallel.layer_fn import LayerFn
from jax3d.parallel.pipeline import gpipe
from jax3d.parallel.pipeline.chunk import run_layers
from jax3d.parallel.pipeline.stages import over_stages, skips_bubbles
from jax3d.parallel.sharding import PP


def apply(
  layer_fn: LayerFn,
  layers: Any,
  x_btd: jax.Array,
  side_bt: dict[str, jax.Array] | None = None,
  *,
  mesh: Mesh,
  plan: RunPlan,
  rules: sharding.Rules,
  policy: str,
  manual: bool = False,
  gather: zero3.Gather | None = None,
) -> jax.Array:
  """The embedded batch [B, T, D] through all layers (stacked, in storage order), pipelined.
  `side_bt`: per-row arrays [B, T] (segment ids, positions, ...), micro-batched as the rows; each
  layer gets its micro-batch's (`LayerFn`). `gather`: ZeRO-3, the layers arrive as dp slices
  (jax3d/parallel/zero3.py).

  With sequence parallelism (`plan.sequence_parallel`) the loop carries each micro-batch as its
  flattened rows [b*t, D] and `layer_fn` takes and returns them (layers.Block's `seq_len` path):
  the layers keep the rows split over tp from one layer to the next, across the ring too."""

  def stage_layer(p, h, side):  # rows are local inside the loop: the rules name no manual axis there
    with sharding.use_rules(sharding.without_dp_pp(rules)):
      return layer_fn(p, h, side)

  x_mbtd, blocks = microbatch.stacked(x_btd, plan, manual)
  side_mbt = {k: microbatch.stacked(a, plan, manual)[0] for k, a in (side_bt or {}).items()}

  def rows_over_tp(split):  # the loop's micro-batches with their rows over tp (the layers'), or whole
    def annotate(x_mrd):
      if split:  # [m, b, t, d] -> [m, b*t, d]: this device's rows (its tokens: cp is manual here)
        x_mrd = x_mrd.reshape(x_mrd.shape[0], -1, x_mrd.shape[-1])
      with sharding.use_rules(sharding.without_dp_pp(rules)):
        return sharding.constrain(x_mrd, ('micro', 'rows_sp' if split else 'batch', 'embed'))

    return annotate

  y_mbtd = run(
    stage_layer,
    layers,
    x_mbtd,
    mesh=mesh,
    repeats=plan.repeats,
    policy=policy,
    scatter=microbatch.scatter_axis(plan),
    manual=manual,
    carry=(rows_over_tp(True), rows_over_tp(False)) if plan.sequence_parallel else None,
    skip_bubbles=skips_bubbles(plan, mesh),
    side_mbt=side_mbt,
    gather=gather,
  )
  return sharding.constrain(microbatch.merge_microbatches(y_mbtd, blocks), ('batch_all', 'seq', 'embed'))


def run(
  layer_fn: LayerFn,
  layers: Any,
  x_mbtd: jax.Array,
  *,
  mesh: Mesh,
  repeats: int,
  policy: str,
  scatter: int | None = None,
  manual: bool = False,
  carry: tuple[Callable[[jax.Array], jax.Array], Callable[[jax.Array], jax.Array]] | None = None,
  skip_bubbles: bool = False,
  side_mbt: dict[str, jax.Array] | None = None,
  gather: zero3.Gather | None = None,
) -> jax.Array:
  """Every micro-batch of x_mbtd [m, b, t, d] through all layers, pipelined over `pp`; returns
  [m, b, t, d], equal to `chunk.run_layers` applied to each micro-batch in turn. With `scatter` = k, x
  arrives and leaves with its axis k split over pp (1: the rows, with dp; 0: the micro-batches,
  the rows over dp); with `manual`, the caller is already inside a shard_map manual over dp and
  pp (see the module docstring). `carry` = (split, whole) annotates the loop's micro-batches
  inside it: sequence parallelism splits the inputs' rows over tp (the queue, and so the ring,
  hold and move 1/tp of them) and makes the outputs whole again (one all-gather over tp) before
  the sum over pp hands them on. `skip_bubbles`: bubble iterations run no layers
  (`stages.skips_bubbles`). `side_mbt`: per-row arrays [m, b, t] laid out as x's first two axes;
  each layer gets its micro-batch's (`LayerFn`). `gather` (ZeRO-3, not with `manual`): `layers`
  are stored sharded over dp too, gathered in the loop (zero3.Gather)."""
  split, whole = carry or (lambda a: a, lambda a: a)
  p, v, dtype = mesh.shape[PP], repeats, x_mbtd.dtype

  def stage_loop(layer_fn, layers_local, _, x_mbtd, side_m):
    shape = x_mbtd.shape
    x_mbtd = split(x_mbtd)
    if p == 1:  # no ring: the micro-batches simply run one after another
      one = remat.wrap_iteration(
        lambda _, xs: (None, run_layers(layer_fn, layers_local, xs[0], policy, side=xs[1])), policy
      )
      ys = jax.lax.scan(one, None, (x_mbtd.astype(dtype), side_m))[1]
      return whole(ys.astype(jnp.float32)).reshape(shape)
    # Marked as differing per stage while still fp32, so that the gradient sum over pp is fp32.
    out_mbtd = gpipe.circulate(
      layer_fn, layers_local, sharding.vary(x_mbtd, (PP,)), dtype, p, v, policy, skip_bubbles, side_m
    )
    # Only stage 0 holds the outputs (the others hold zeros): a sum over pp hands them on.
    out_mbtd = whole(out_mbtd).reshape(shape)
    if scatter is not None:
      return jax.lax.psum_scatter(out_mbtd, PP, scatter_dimension=scatter, tiled=True)
    return jax.lax.psum(out_mbtd, PP)

  stages = over_stages(stage_loop, layer_fn, mesh, scatter, manual, gather, policy, rows_out=True)
  return stages(layers, {}, x_mbtd, side_mbt or {}).astype(dtype)
