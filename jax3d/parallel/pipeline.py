"""Pipeline parallelism: the stacked layers split into `pp` stages, run as a scanned `shard_map`.

Only this module names the `pp` mesh axis. Inside `jax.shard_map(..., axis_names={'pp'})` each
device sees its own stage's layers and the micro-batches; `dp` and `tp` stay under the compiler's
automatic sharding, so data and tensor parallelism keep working inside a stage.

Schedule (GPipe, and circular when `repeats` v > 1). The loop runs v*m + p - 1 iterations. At
iteration t, stage s works on u = t - s: micro-batch u mod m, on its layer chunk u // m. Every
stage sends its output to stage s+1 (mod p) with one `ppermute`. What arrives at stage 0 from the
last stage goes back into the stage-0 queue (the next pass round the ring) or, on the last pass,
into the outputs. Bubble iterations (u outside [0, v*m)) compute on stale inputs and their
results are never written, so they reach neither outputs nor gradients.

Layer storage. With v chunks per stage, chunk c = r*p + s (r = 0..v-1) runs on stage s, so the
stacked weights are stored stage-major: position j holds canonical layer `layer_order(...)[j]`,
and a plain P('pp') sharding of the layer axis gives each stage exactly its chunks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax3d.model import remat


def layer_order(n_layers: int, pp: int, repeats: int) -> np.ndarray:
  """Canonical layer index held at each storage position of the stacked layer axis."""
  lc = n_layers // (pp * repeats)  # layers per chunk
  j = np.arange(n_layers)
  s, r, l = j // (repeats * lc), (j // lc) % repeats, j % lc
  return (r * pp + s) * lc + l


def to_canonical(layers, n_layers: int, pp: int, repeats: int):
  """Stacked layer params in storage order -> canonical layer order (for comparisons, export)."""
  inv = np.argsort(layer_order(n_layers, pp, repeats))
  return jax.tree.map(lambda a: a[inv], layers)


def from_canonical(layers, n_layers: int, pp: int, repeats: int):
  order = layer_order(n_layers, pp, repeats)
  return jax.tree.map(lambda a: a[order], layers)


def run_layers(layer_fn, layers, x, policy: str):
  """Sequential scan of `layer_fn` over the stacked `layers` (each layer under the remat policy)."""
  step = remat.wrap_layer(lambda h, p: (layer_fn(p, h), None), policy)
  return jax.lax.scan(step, x, layers)[0]


def pipeline(layer_fn, layers, x_mbtd, *, mesh, pp: int, repeats: int, policy: str,
             batch_axis: str = 'dp', scatter: bool = False, manual_outside: bool = False):
  """Runs every micro-batch of x_mbtd [m, b, t, d] through all layers, pipelined over `pp`.

  `layers` is the stacked layer pytree in storage order (leading axis sharded over pp). The loop
  is manual over `pp` and over `batch_axis` (dp): each device runs its stage on its own rows, so
  the gradients of the stage weights are summed over dp once, when the loop ends, not once per
  iteration. `tp` stays automatic inside. With `scatter`, x arrives and leaves with its rows split
  over (dp, pp) (where the embedding and head work): stages all-gather it over pp on the way in,
  and the outputs are reduce-scattered back on the way out.
  With `manual_outside` the caller is already inside a shard_map manual over `batch_axis` and pp
  (step.loss_and_grads_explicit, for the explicit dp gradient reduction): `layers` are this stage's,
  already varying per dp rank (so their gradients come back un-reduced), x holds this device's rows
  (with `scatter`, its pp slice of them), and the loop runs here without a shard_map of its own.
  Returns [m, b, t, d], equal to `run_layers` applied to each micro-batch in turn.
  """
  m = x_mbtd.shape[0]
  p, v = pp, repeats
  n_iter = v * m + p - 1
  scatter = scatter and p > 1
  # Only axes of size > 1 are made manual (XLA rejects collectives over size-1 manual groups).
  manual = {a for a in ('pp', batch_axis) if mesh.shape[a] > 1}
  ax = lambda *names: tuple(n for n in names if n in manual) or None
  rows = P(None, ax(batch_axis, 'pp') if scatter else ax(batch_axis))
  stages = P(ax('pp'))

  dtype = x_mbtd.dtype

  def stage_loop(layers_local, x_mbtd):
    if batch_axis in manual:
      # The weights are the same on every dp rank; marking them as varying here, in their stored
      # dtype, puts the transpose (the gradient sum over dp) here too: once per step, after the
      # loop, instead of once per micro-batch inside it.
      layers_local = jax.tree.map(lambda a: _vary(a, (batch_axis,)), layers_local)
    if scatter:
      x_mbtd = jax.lax.all_gather(x_mbtd, 'pp', axis=1, tiled=True)
    if p == 1:  # no ring: the micro-batches simply run one after another
      one = remat.wrap_iteration(lambda _, x_btd: (None, run_layers(layer_fn, layers_local, x_btd, policy)),
                                 policy)
      return jax.lax.scan(one, None, x_mbtd.astype(dtype))[1].astype(jnp.float32)
    # Marked as differing per stage while still fp32, so that the gradient sum over pp is fp32.
    out_mbtd = _ring(layer_fn, layers_local, _vary(x_mbtd, ('pp',)).astype(dtype), p, v, m, n_iter, policy)
    # Only stage 0 holds the outputs (the others hold zeros): a sum over pp hands them on.
    out_mbtd = out_mbtd.astype(jnp.float32)
    if scatter:
      out_mbtd = jax.lax.psum_scatter(out_mbtd, 'pp', scatter_dimension=1, tiled=True)
    else:
      out_mbtd = jax.lax.psum(out_mbtd, 'pp')
    return out_mbtd

  # The activations cross the loop's boundary in fp32 (the sums over pp of their gradients too):
  # exact, a one-off m*b*t*d per step, and it avoids XLA:CPU's failing bf16 all-reduce promotion.
  x32_mbtd = x_mbtd.astype(jnp.float32)
  if not manual or manual_outside:
    return stage_loop(layers, x32_mbtd).astype(dtype)
  return jax.shard_map(stage_loop, mesh=mesh, in_specs=(stages, rows), out_specs=rows,
                       axis_names=manual, check_vma=True)(layers, x32_mbtd).astype(dtype)


def _vary(a, axes):
  """Marks `a` as varying over the manual `axes` it is not yet varying over (shard_map's vma)."""
  missing = tuple(ax for ax in axes if ax not in jax.typeof(a).manual_axis_type.varying)
  return jax.lax.pcast(a, missing, to='varying') if missing else a


def _ring(layer_fn, layers_local, x_mbtd, p, v, m, n_iter, policy):
  """The circulating loop on one stage; returns the finished micro-batches on stage 0, else 0."""
  # layers_local: this stage's v chunks, [v * lc, ...] -> [v, lc, ...]
  chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers_local)
  s = jax.lax.axis_index('pp')
  ring = [(i, (i + 1) % p) for i in range(p)]

  def stage_work(chunks, r, x_btd):  # this stage's layer chunk r on one micro-batch
    chunk = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, keepdims=False), chunks)
    return run_layers(layer_fn, chunk, x_btd, policy)

  # Under 'full' remat an iteration keeps only its stage input; the queue and outputs carried by
  # the loop are updated in place and never saved per iteration.
  stage_fn = remat.wrap_iteration(stage_work, policy)

  def iteration(carry, t):
    state_btd, queue_mbtd, out_mbtd = carry
    u = t - s
    r = jnp.clip(u // m, 0, v - 1)
    x_btd = jnp.where(s == 0, queue_mbtd[jnp.mod(u, m)], state_btd)
    y_btd = stage_fn(chunks, r, x_btd)
    recv_btd = jax.lax.ppermute(y_btd, 'pp', ring)
    # On stage 0, recv is the last stage's output for u_last = t - (p - 1).
    u_last = t - (p - 1)
    i_last, r_last = jnp.mod(u_last, m), u_last // m
    arrived = (s == 0) & (u_last >= 0) & (u_last < v * m)
    again = arrived & (r_last < v - 1)  # another pass round the ring
    done = arrived & (r_last == v - 1)  # finished all layers
    queue_mbtd = queue_mbtd.at[i_last].set(jnp.where(again, recv_btd, queue_mbtd[i_last]))
    out_mbtd = out_mbtd.at[i_last].set(jnp.where(done, recv_btd, out_mbtd[i_last]))
    return (recv_btd, queue_mbtd, out_mbtd), None

  init = (jnp.zeros_like(x_mbtd[0]), x_mbtd, jnp.zeros_like(x_mbtd))
  init = jax.tree.map(lambda a: _vary(a, ('pp',)), init)  # the carry differs per stage
  (_, _, out_mbtd), _ = jax.lax.scan(iteration, init, jnp.arange(n_iter))
  return out_mbtd
