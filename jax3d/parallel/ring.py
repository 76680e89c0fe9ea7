"""The pipeline's loop on one stage: the ring of `pp` stages inside pipeline.py's `shard_map`.

`circulate` runs the schedule of jax3d/parallel/pipeline.py (GPipe, or circular with v chunks per
stage) as one `lax.scan` over its v*m + p - 1 iterations; `run_layers` is the scan over a chunk's
layers that each iteration runs. Under remat 'full' and 'stage' the loop's backward pass is
written out (`Ring.backward`, a `jax.custom_vjp`): the iterations in reverse, the ring's
`ppermute` reversed, each layer recomputed from its kept input and its weight gradient added in
place into one accumulator of the stage's weights. Other policies keep what the policy saves, so
JAX differentiates the loop itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax3d.parallel import remat
from jax3d.parallel.sharding import PP, vary

# (one layer's params, x_btd, side) -> y_btd. `side`: the micro-batch's per-row arrays ([b, t]
# each: segment ids, positions, ...), a dict, possibly empty; the pipeline hands each iteration
# those of the micro-batch it works on.
LayerFn = Callable[[Any, jax.Array, dict], jax.Array]
Side = dict[str, jax.Array]


def run_layers(
  layer_fn: LayerFn,
  layers: Any,
  x: jax.Array,
  policy: str,
  chunk: jax.Array | None = None,
  side: Side | None = None,
) -> jax.Array:
  """Sequential scan of `layer_fn` over the stacked `layers` (each layer under the remat policy),
  every layer given the micro-batch's `side` arrays.

  With `chunk`, `layers` is [v, lc, ...] and the layers of chunk `chunk` (a traced index) run:
  each layer's weights are sliced inside its checkpoint, so the backward pass slices them again
  instead of saving a copy of the chunk's weights for every pipeline iteration."""
  side = {} if side is None else side
  if chunk is None:
    step = remat.wrap_layer(lambda h, p: (layer_fn(p, h, side), None), policy)
    return jax.lax.scan(step, x, layers)[0]

  def one(h, j):
    return layer_fn(_layer(layers, chunk, j), h, side), None

  lc = jax.tree.leaves(layers)[0].shape[1]
  return jax.lax.scan(remat.wrap_layer(one, policy), x, jnp.arange(lc))[0]


@dataclasses.dataclass(frozen=True)
class Ring:
  """One stage's view of the schedule: m micro-batches, v chunks per stage, p stages."""

  layer_fn: LayerFn
  dtype: Any  # the compute dtype of the activations in the loop
  p: int
  v: int
  m: int
  skip_bubbles: bool

  @property
  def iterations(self) -> int:
    return self.v * self.m + self.p - 1

  def at(self, t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(u, chunk r, busy) of this stage at iteration t: u = t - s, r = u // m, busy = u in [0, v*m)."""
    u = t - jax.lax.axis_index(PP)
    return u, jnp.clip(u // self.m, 0, self.v - 1), (u >= 0) & (u < self.v * self.m)

  def again(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(slot, flag): what stage 0 receives at iteration t goes back into its queue at `slot` for
    another pass round the ring (v > 1) where `flag`; on the last pass it is an output."""
    u_last = t - (self.p - 1)
    flag = (jax.lax.axis_index(PP) == 0) & (u_last >= 0) & (u_last < (self.v - 1) * self.m)
    return jnp.mod(u_last, self.m), flag

  def side_at(self, side: Side, u: jax.Array) -> Side:
    """The side arrays of micro-batch u mod m (the one this stage works on)."""
    return {k: a[jnp.mod(u, self.m)] for k, a in side.items()}

  def forward(
    self, chunks: Any, xs: jax.Array, side: Side, stage: Callable, bubble: Callable
  ) -> tuple[jax.Array, Any]:
    """The circulating loop: returns what each iteration received from the previous stage [n, b, t, d]
    and each iteration's `aux`. `stage(chunks, r, x, side_u) -> (y, aux)` runs chunk r on the stage's
    input x (side_u: its micro-batch's side arrays, of `side` [m, b, t]);
    `bubble(x)` gives a bubble iteration's (y, aux) when bubbles are skipped. xs: the inputs padded
    with p-1 zero micro-batches (v = 1, taken by the scan as they come) or the stage-0 queue (v > 1)."""
    s = jax.lax.axis_index(PP)
    ring = [(i, (i + 1) % self.p) for i in range(self.p)]

    def iteration(carry, t_x):
      state_btd, queue_mbtd = carry
      t, x_t_btd = t_x
      u, r, busy = self.at(t)
      first_btd = x_t_btd if queue_mbtd is None else queue_mbtd[jnp.mod(u, self.m)]
      x_btd = jnp.where(s == 0, first_btd.astype(self.dtype), state_btd)
      side_u = self.side_at(side, u)
      if self.skip_bubbles:  # a bubble iteration's result is never used: do not compute it
        y_btd, aux = jax.lax.cond(busy, stage, lambda c, r, x, sd: bubble(x), chunks, r, x_btd, side_u)
      else:
        y_btd, aux = stage(chunks, r, x_btd, side_u)
      recv_btd = jax.lax.ppermute(y_btd, PP, ring)
      if queue_mbtd is not None:
        slot, again = self.again(t)
        recv32_btd = recv_btd.astype(queue_mbtd.dtype)
        queue_mbtd = queue_mbtd.at[slot].set(jnp.where(again, recv32_btd, queue_mbtd[slot]))
      return (recv_btd, queue_mbtd), (recv_btd, aux)

    state = vary(jnp.zeros_like(xs[0], dtype=self.dtype), (PP,))  # the carry differs per stage
    ts = jnp.arange(self.iterations)
    init, scan_xs = ((state, xs), (ts, None)) if self.v > 1 else ((state, None), (ts, xs))
    return jax.lax.scan(iteration, init, scan_xs)[1]

  def layer_inputs(
    self, chunks: Any, r: jax.Array, x_btd: jax.Array, side_u: Side
  ) -> tuple[jax.Array, jax.Array]:
    """Chunk r on x: (its output, each layer's input [lc, b, t, d])."""

    def one(h, j):
      return self.layer_fn(_layer(chunks, r, j), h, side_u), h

    return jax.lax.scan(one, x_btd, jnp.arange(jax.tree.leaves(chunks)[0].shape[1]))

  def backward(
    self, chunks: Any, aux_n: jax.Array, side: Side, ct_recv_nbtd: jax.Array, policy: str
  ) -> tuple[Any, jax.Array]:
    """The loop's backward pass, written out: iterations in reverse, each layer of the chunk
    recomputed from its input and its weight gradient added in place into one accumulator of the
    stage's weights. Returns the gradients of the weights and of `forward`'s xs."""
    s = jax.lax.axis_index(PP)
    back = [((i + 1) % self.p, i) for i in range(self.p)]
    lc = jax.tree.leaves(chunks)[0].shape[1]

    def layers_back(acc, r, ct_btd, aux, side_u):
      h_lbtd = aux if policy == 'full' else self.layer_inputs(chunks, r, aux[0], side_u)[1]
      layer_fn = lambda p, h: self.layer_fn(p, h, side_u)

      def one(carry, j):
        ct_h, acc = carry
        _, vjp = jax.vjp(layer_fn, _layer(chunks, r, j), h_lbtd[j])
        g_p, ct_h = vjp(ct_h)
        return (ct_h, jax.tree.map(lambda a, g: _add_at(a, g, (r, j)), acc, g_p)), None

      return jax.lax.scan(one, (ct_btd, acc), jnp.arange(lc), reverse=True)[0]

    def iteration(carry, inp):
      ct_state, ct_queue, acc = carry
      t, ct_recv_btd, aux = inp
      u, r, busy = self.at(t)
      ct_recv_btd = ct_recv_btd + ct_state
      if ct_queue is not None:  # the queue's write, transposed: the slot's gradient goes to recv
        slot, again = self.again(t)
        ct_slot = ct_queue[slot]
        ct_recv_btd = ct_recv_btd + jnp.where(again, ct_slot, 0.0).astype(self.dtype)
        ct_queue = ct_queue.at[slot].set(jnp.where(again, 0.0, ct_slot))
      ct_y_btd = jax.lax.ppermute(ct_recv_btd, PP, back)
      args = (acc, r, ct_y_btd, aux, self.side_at(side, u))
      if self.skip_bubbles:
        ct_x_btd, acc = jax.lax.cond(busy, layers_back, lambda a, r, c, x, sd: (c, a), *args)
      else:
        ct_x_btd, acc = layers_back(*args)
      zero = jnp.zeros_like(ct_x_btd)
      ct_first = jnp.where(s == 0, ct_x_btd, zero).astype(jnp.float32)
      ct_state = jnp.where(s == 0, zero, ct_x_btd)
      if ct_queue is None:
        return (ct_state, None, acc), ct_first
      return (ct_state, _add_at(ct_queue, ct_first, (jnp.mod(u, self.m),)), acc), None

    ct_queue = (
      None if self.v == 1 else _zeros(ct_recv_nbtd[0], (self.m, *ct_recv_nbtd.shape[1:]), jnp.float32)
    )
    init = (_zeros(ct_recv_nbtd[0]), ct_queue, jax.tree.map(_zeros, chunks))
    ts = jnp.arange(self.iterations)
    (_, ct_queue, acc), ct_xs = jax.lax.scan(iteration, init, (ts, ct_recv_nbtd, aux_n), reverse=True)
    return acc, ct_xs if ct_queue is None else ct_queue

  def with_backward(self, policy: str) -> Callable[[Any, jax.Array, Side], jax.Array]:
    """`forward` of the plain layers as a function of (chunks, xs, side) whose backward pass is
    `backward`: under 'full' each iteration keeps its layers' inputs, under 'stage' only its own
    input. The side arrays (integers) get no gradient."""

    def plain(chunks, r, x_btd, side_u):
      return run_layers(self.layer_fn, chunks, x_btd, 'none', chunk=r, side=side_u), None

    def keeping(chunks, r, x_btd, side_u):
      if policy == 'full':
        return self.layer_inputs(chunks, r, x_btd, side_u)
      return plain(chunks, r, x_btd, side_u)[0], x_btd[None]

    lc = lambda chunks: jax.tree.leaves(chunks)[0].shape[1]
    ring = jax.custom_vjp(
      lambda chunks, xs, side: self.forward(chunks, xs, side, plain, lambda x: (x, None))[0]
    )

    def fwd(chunks, xs, side):
      k = lc(chunks) if policy == 'full' else 1
      recv_nbtd, aux_n = self.forward(
        chunks, xs, side, keeping, lambda x: (x, jnp.broadcast_to(jnp.zeros_like(x), (k, *x.shape)))
      )
      return recv_nbtd, (chunks, aux_n, side)

    def bwd(res, ct_recv_nbtd):
      chunks, aux_n, side = res
      return (*self.backward(chunks, aux_n, side, ct_recv_nbtd, policy), None)

    ring.defvjp(fwd, bwd)
    return ring


# Policies whose pipeline loop has its backward pass written out (`Ring.backward`): they keep a
# layer's input at most, so each layer is recomputed from it in the backward pass.
WRITTEN_OUT = ('full', 'stage')


def circulate(
  layer_fn: LayerFn,
  layers_local: Any,
  x_mbtd: jax.Array,
  dtype: Any,
  p: int,
  v: int,
  policy: str,
  skip_bubbles: bool,
  side_mbt: Side | None = None,
) -> jax.Array:
  """The circulating loop on one stage; returns the finished micro-batches (fp32) on stage 0, else 0.
  `side_mbt`: each micro-batch's side arrays [m, b, t] (every stage holds all of them: an
  iteration's layers read those of its micro-batch).

  Stage 0 takes micro-batch u at iteration u, and gets micro-batch i's last pass back from the
  last stage at iteration (v-1)*m + p-1 + i: both are fixed by the schedule, so with one chunk
  (v = 1) the inputs are the scan's xs and the outputs its ys, sliced statically after the loop.
  The loop then carries one micro-batch, and its backward pass is a slice of each (not, as with
  a carried buffer read and written at a slot each iteration, a pass over all m micro-batches'
  gradient buffers every iteration, which XLA:CPU copies whole, and in bf16 converts to fp32 and
  back). With v > 1 a micro-batch goes round the ring again: the stage-0 queue stays a carried
  buffer, fp32 (where XLA adds a slot's gradient in place), read and written in `dtype`'s values
  (exact in fp32).

  Under 'full' and 'stage' remat the backward pass is `Ring.backward`: JAX's transpose of the
  scan would zero a stage-sized gradient buffer in every iteration and add it to the loop's
  accumulator (its transpose of a loop-invariant operand)."""
  m = x_mbtd.shape[0]
  # layers_local: this stage's v chunks, [v * lc, ...] -> [v, lc, ...]
  chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers_local)
  ring = Ring(layer_fn, dtype, p, v, m, skip_bubbles)
  if v > 1:
    xs = x_mbtd
  else:
    xs = jnp.concatenate([x_mbtd, vary(jnp.zeros((p - 1, *x_mbtd.shape[1:]), x_mbtd.dtype), (PP,))])
  side = {} if side_mbt is None else side_mbt
  if policy in WRITTEN_OUT:
    recv_nbtd = ring.with_backward(policy)(chunks, xs, side)
  else:
    stage_fn = remat.wrap_iteration(
      lambda c, r, x, sd: run_layers(layer_fn, c, x, policy, chunk=r, side=sd), policy
    )
    stage = lambda c, r, x, sd: (stage_fn(c, r, x, sd), None)
    recv_nbtd = ring.forward(chunks, xs, side, stage, lambda x: (x, None))[0]
  first_done = (v - 1) * m + p - 1
  out_mbtd = recv_nbtd[first_done : first_done + m].astype(jnp.float32)
  # only stage 0's are the outputs: the sum over pp
  return jnp.where(jax.lax.axis_index(PP) == 0, out_mbtd, 0.0)


def _layer(chunks: Any, r: jax.Array, j: jax.Array) -> Any:
  """Layer j of chunk r: one layer's weights."""
  return jax.tree.map(lambda a: a[r, j], chunks)


def _zeros(a: jax.Array, shape: tuple[int, ...] | None = None, dtype: Any = None) -> jax.Array:
  """Zeros like `a` (or of `shape`, `dtype`), varying over the same manual axes."""
  z = jnp.zeros_like(a, dtype=dtype)
  varying = tuple(sorted(jax.typeof(a).manual_axis_type.varying))  # sorted: not the hash seed's order
  return vary(jnp.broadcast_to(z, shape) if shape else z, varying)


def _add_at(acc: jax.Array, g: jax.Array, index: tuple[jax.Array, ...]) -> jax.Array:
  """acc with g added at `index` of its leading dims, written as XLA fuses it into one in-place
  add of the slice (a zero buffer with g placed in it, added: `.at[].add` is a scatter-add)."""
  start = (*index, *(0,) * g.ndim)
  g = g.reshape((1,) * len(index) + g.shape)
  return acc + jax.lax.dynamic_update_slice(jnp.zeros_like(acc), g.astype(acc.dtype), start)
