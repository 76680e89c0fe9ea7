"""Pipeline parallelism: micro-batching, stage placement, and the `shard_map` around the stages' loop.

The package: chunk.py (a chunk of layers, its forward with VJP residuals and its backward: both
schedules' one), gpipe.py (the GPipe/circular loop), timetable.py (the 1F1B schedule as data),
one_f_one_b.py (the 1F1B loop, the head and the loss inside), and here the `shard_map` both share
(`_over_stages`) and the public entry points: `apply`/`run` (GPipe) and `loss`/`run_loss` (1F1B).

The stacked layers are split into `pp` stages. `apply` takes the embedded batch [B, T, D], forms
m micro-batches, runs them through every layer pipelined over `pp`, and returns [B, T, D].
Inside `jax.shard_map(..., axis_names={'pp', 'dp'})` each device sees its own stage's layers and
its dp shard of the micro-batches; `tp` stays under the compiler's automatic sharding, so tensor
parallelism keeps working inside a stage.

Micro-batches and the batch outside the loop: jax3d/parallel/microbatch.py (`batch_axes`).

Schedule (GPipe, and circular when `repeats` v > 1). The loop runs v*m + p - 1 iterations. At
iteration t, stage s works on u = t - s: micro-batch u mod m, on its layer chunk u // m. Every
stage sends its output to stage s+1 (mod p) with one `ppermute`. What arrives at stage 0 from the
last stage goes back into the stage-0 queue (the next pass round the ring) or, on the last pass,
into the outputs. Bubble iterations (u outside [0, v*m)) write nothing, to outputs or gradients
(on CPU they skip their layers: `skips_bubbles`). The loop itself, one stage's scan over the
iterations, and its backward pass (written out under remat 'full' and 'stage'):
jax3d/parallel/pipeline/gpipe.py.

Stage placement. With v chunks per stage, chunk c = r*p + s (r = 0..v-1) runs on stage s, so the
stacked weights are stored stage-major: position j holds canonical layer `layer_order(...)[j]`,
and a plain P('pp') sharding of the layer axis gives each stage exactly its chunks.

Gradients over dp (and cp). The loop is manual over dp (and cp: each device its own tokens) too:
the weights are marked varying at its entry, so their gradient sum (that mark's transpose) happens
once per step, after the loop. Inside a caller's shard_map manual over dp and pp (the explicit reduction of
jax3d/parallel/data_parallel.py, `manual=True`) it opens none of its own
(`microbatch.local_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jax3d.config import RunPlan
from jax3d.parallel import microbatch, remat, sharding, zero3
from jax3d.parallel.pipeline import gpipe, one_f_one_b, timetable
from jax3d.parallel.pipeline.chunk import LayerFn, run_layers
from jax3d.parallel.sharding import CP, DP, PP


# --- the pipeline ---------------------------------------------------------------------------
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
    def annotate(x_mrd):  # split: [m, b, t, d] -> this device's rows [m, b*t, d] (cp is manual here)
      x_mrd = x_mrd.reshape(x_mrd.shape[0], -1, x_mrd.shape[-1]) if split else x_mrd
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
  the sum over pp hands them on. `skip_bubbles`: bubble
  iterations run no layers (`skips_bubbles`). `side_mbt`: per-row arrays [m, b, t] laid out as x's
  first two axes; each layer gets its micro-batch's (`LayerFn`). `gather` (ZeRO-3, not with
  `manual`): `layers` are stored sharded over dp too, gathered in the loop (zero3.Gather)."""
  split, whole = carry or (lambda a: a, lambda a: a)
  p, v, dtype = mesh.shape[PP], repeats, x_mbtd.dtype

  def stage_loop(layer_fn, layers_local, _, x_mbtd, side_m):
    shape = x_mbtd.shape
    x_mbtd = split(x_mbtd)
    if p == 1:  # no ring: the micro-batches simply run one after another
      one = remat.wrap_iteration(
        lambda _, xs: (None, run_layers(layer_fn, layers_local, xs[0], policy, side=xs[1])), policy
      )
      return whole(jax.lax.scan(one, None, (x_mbtd.astype(dtype), side_m))[1].astype(jnp.float32)).reshape(
        shape
      )
    # Marked as differing per stage while still fp32, so that the gradient sum over pp is fp32.
    out_mbtd = gpipe.circulate(
      layer_fn, layers_local, sharding.vary(x_mbtd, (PP,)), dtype, p, v, policy, skip_bubbles, side_m
    )
    # Only stage 0 holds the outputs (the others hold zeros): a sum over pp hands them on.
    out_mbtd = whole(out_mbtd).reshape(shape)
    if scatter is not None:
      return jax.lax.psum_scatter(out_mbtd, PP, scatter_dimension=scatter, tiled=True)
    return jax.lax.psum(out_mbtd, PP)

  stages = _over_stages(stage_loop, layer_fn, mesh, scatter, manual, gather, policy, rows_out=True)
  return stages(layers, {}, x_mbtd, side_mbt or {}).astype(dtype)


def _over_stages(
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
  dp = names(DP)
  rows = {None: P(None, dp, seq), 1: P(None, names(DP, PP), seq), 0: P(names(PP), dp, seq)}[scatter]

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


# --- 1F1B: the loss inside the loop ---------------------------------------------------------------
def in_loop_loss(schedule: str, plan: RunPlan) -> bool:
  """Whether the step computes its loss with `loss` (pipeline.schedule='1f1b' with stages) rather
  than with the head after `apply`."""
  return schedule == '1f1b' and plan.pp > 1


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

  stages = _over_stages(stage_loss, layer_fn, mesh, scatter, manual, gather, policy, rows_out=False)
  return stages(layers, head, x_mbtd, side_mbt)


def _with_rules(rules: sharding.Rules, fn: Callable, *args: Any) -> Any:
  with sharding.use_rules(rules):
    return fn(*args)


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
