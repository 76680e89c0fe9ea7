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

from jax3d import remat


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


def pipeline(layer_fn, layers, x_mbtd, *, mesh, pp: int, repeats: int, policy: str):
  """Runs every micro-batch of x_mbtd [m, b, t, d] through all layers, pipelined over `pp`.

  `layers` is the stacked layer pytree in storage order (leading axis sharded over pp).
  Returns [m, b, t, d], equal to `run_layers` applied to each micro-batch in turn.
  """
  m = x_mbtd.shape[0]
  p, v = pp, repeats
  n_iter = v * m + p - 1

  def stage_loop(layers_local, x_mbtd):
    # layers_local: this stage's v chunks, [v * lc, ...] -> [v, lc, ...]
    chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers_local)
    s = jax.lax.axis_index('pp')
    ring = [(i, (i + 1) % p) for i in range(p)]

    def iteration(carry, t):
      state_btd, queue_mbtd, out_mbtd = carry
      u = t - s
      r = jnp.clip(u // m, 0, v - 1)
      x_btd = jnp.where(s == 0, queue_mbtd[jnp.mod(u, m)], state_btd)
      chunk = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, keepdims=False), chunks)
      y_btd = run_layers(layer_fn, chunk, x_btd, policy)
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

    iteration = remat.wrap_iteration(iteration, policy)
    init = (jnp.zeros_like(x_mbtd[0]), x_mbtd, jnp.zeros_like(x_mbtd))
    (_, _, out_mbtd), _ = jax.lax.scan(iteration, init, jnp.arange(n_iter))
    return out_mbtd[None]  # [1, m, b, t, d] per stage; only stage 0's is filled, the rest are 0

  out_pmbtd = jax.shard_map(stage_loop, mesh=mesh, in_specs=(P('pp'), P()), out_specs=P('pp'),
                            axis_names={'pp'}, check_vma=False)(layers, x_mbtd)
  # Summing over stages picks stage 0's outputs; the compiler turns it into a reduce-scatter
  # straight into the head's (dp, pp) batch sharding instead of a broadcast from stage 0.
  return out_pmbtd.sum(axis=0)
