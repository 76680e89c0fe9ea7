"""1F1B pipelining (pipeline.schedule='1f1b'): the loss inside the loop. `loss` takes the embedded
batch [B, T, D] through every layer and computes the loss of each micro-batch in the loop,
`run_loss` does so for its micro-batches [m, b, t, d]. The timetable: timetable.py; the loop on one
stage: one_f_one_b.py; the `shard_map` over the stages: stages.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from jax3d.config import RunPlan
from jax3d.parallel import microbatch, sharding, zero3
from jax3d.parallel.layer_fn import LayerFn
from jax3d.parallel.pipeline import one_f_one_b, timetable
from jax3d.parallel.pipeline.stages import over_stages, skips_bubbles
from jax3d.parallel.sharding import PP


def loss(
  layer_fn: LayerFn,
  layers: Any,
  head: Any,
  x_btd: jax.Array,
  side_bt: dict[str, jax.Array],
  loss_fn: one_f_one_b.LossFn,
  *,
  mesh: Mesh,
  plan: RunPlan,
  rules: sharding.Rules,
  policy: str,
  manual: bool = False,
  gather: zero3.Gather | None = None,
) -> jax.Array:
  """The loss sum of the embedded batch [B, T, D] under the 1F1B schedule: the micro-batches
  through all layers (stacked, in storage order, as `apply`), and `loss_fn(head, y_btd, side)` of
  each inside the loop, split over pp (`run_loss`). `side_bt`: per-row inputs of the loss and the
  layers ([B, T] arrays: targets, weights, segment ids, ...), micro-batched as x is; `head`: the
  parameters `loss_fn` reads. With `manual` the sum is this device's share (see `apply`)."""
  local = lambda fn: lambda *a: _with_rules(sharding.without_dp_pp(rules), fn, *a)
  rows_sp = None
  if plan.sequence_parallel:  # the loop carries each micro-batch's rows [b*t, d], split over tp
    rows_sp = local(lambda x_mrd: sharding.constrain(x_mrd, ('micro', 'rows_sp', 'embed')))
  return run_loss(
    local(layer_fn),
    layers,
    head,
    microbatch.stacked(x_btd, plan, manual)[0],
    {k: microbatch.stacked(a, plan, manual)[0] for k, a in side_bt.items()},
    local(loss_fn),
    mesh=mesh,
    repeats=plan.repeats,
    policy=policy,
    scatter=microbatch.scatter_axis(plan),
    manual=manual,
    rows_sp=rows_sp,
    skip_bubbles=skips_bubbles(plan, mesh),
    gather=gather,
  )


def run_loss(
  layer_fn: LayerFn,
  layers: Any,
  head: Any,
  x_mbtd: jax.Array,
  side_mbt: dict[str, jax.Array],
  loss_fn: one_f_one_b.LossFn,
  *,
  mesh: Mesh,
  repeats: int,
  policy: str,
  scatter: int | None = None,
  manual: bool = False,
  rows_sp: Callable[[jax.Array], jax.Array] | None = None,
  skip_bubbles: bool = False,
  gather: zero3.Gather | None = None,
) -> jax.Array:
  """The loss sum of the micro-batches x_mbtd [m, b, t, d] (side inputs [m, b, t]) under 1F1B, equal
  to `loss_fn(head, chunk.run_layers(...), side)` summed over the micro-batches; `scatter` and
  `manual` as in `run`. `rows_sp`: sequence parallelism, the loop carries each micro-batch's rows
  [b*t, d] (annotated by it) and `loss_fn` gets them back as [b, t, d]. `gather`: as in `run`."""
  p, v, dtype = mesh.shape[PP], repeats, x_mbtd.dtype

  def stage_loss(layer_fn, layers_local, head, x_mbtd, side_m):
    m, b, t, d = x_mbtd.shape
    if rows_sp is not None:
      x_mbtd = rows_sp(x_mbtd.reshape(m, b * t, d))
    chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers_local)
    loop = one_f_one_b.Loop(
      layer_fn, loss_fn, timetable.build(p, v, m), dtype, policy, skip_bubbles, (b, t, d)
    )
    return loop.loss()(chunks, head, sharding.vary(x_mbtd, (PP,)), side_m)

  stages = over_stages(stage_loss, layer_fn, mesh, scatter, manual, gather, policy, rows_out=False)
  return stages(layers, head, x_mbtd, side_mbt)


def _with_rules(rules: sharding.Rules, fn: Callable, *args: Any) -> Any:
  with sharding.use_rules(rules):
    return fn(*args)
