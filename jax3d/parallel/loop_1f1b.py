"""The 1F1B loop on one stage, inside pipeline.py's `shard_map`: one `lax.scan` over the ticks of
jax3d/parallel/schedule_1f1b.py, with the loss computed inside it and the backward written out.

Each tick a stage reads its row of the schedule's table (indexed by its pp rank) and does:
  forward   its unit's chunk on the input (the loop's own micro-batch for k = 0, else a stash
            slot); no residuals are kept: the backward recomputes the chunk from the input.
  backward  its unit's chunk again from the input, with `jax.vjp` (the chunk's layers under the
            remat policy: 'full' and 'stage' keep each layer's input and recompute the layer in
            its own `jax.vjp`; other policies keep what the policy saves, for this chunk and this
            tick only). On the last virtual stage the cotangent is the gradient of `loss_fn` (the
            head and the loss, on this micro-batch and its side inputs); elsewhere it is the slot of
            the gradient buffer the next stage sent. The chunk's weight gradient is added in place
            into one accumulator of the stage's weights; the loss into a scalar.
  send      the forward's output to stage s+1 and the backward's input gradient to stage s-1, one
            `ppermute` each, written into the receivers' stash and gradient-buffer slots.
With `skip` the idle halves of a tick (and the head on stages that do not need it) are skipped by a
`lax.switch`; without, every half computes and its writes are masked (the accelerator path).

The loop returns the loss and, as `jax.custom_vjp` residuals, the gradients it computed; the
caller's cotangent (the scale of the loss) multiplies them. The primal alone (evaluation) runs the
forwards and, on the last virtual stage, the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax3d.parallel import ring
from jax3d.parallel.schedule_1f1b import COL, Schedule
from jax3d.parallel.sharding import PP, vary

# (head params, y of one micro-batch, its side inputs) -> the loss sum of the micro-batch
LossFn = Callable[[Any, jax.Array, dict], jax.Array]


@dataclasses.dataclass(frozen=True)
class Loop:
  layer_fn: ring.LayerFn
  loss_fn: LossFn
  sched: Schedule
  dtype: Any  # the compute dtype of the activations in the loop
  policy: str
  skip: bool

  def chunk(self, params_r: Any, x: jax.Array, side_u: dict) -> jax.Array:
    return ring.run_layers(self.layer_fn, params_r, x, 'none', side=side_u)

  def chunk_vjp(self, params_r: Any, x: jax.Array, side_u: dict) -> tuple[jax.Array, Callable]:
    """(y, back): the chunk on x (its micro-batch's side arrays `side_u`), and back(ct_y) -> (its
    weight gradients [lc, ...], ct_x)."""
    if self.policy not in ring.WRITTEN_OUT:
      return jax.vjp(lambda p, h: ring.run_layers(self.layer_fn, p, h, self.policy, side=side_u), params_r, x)
    layer_fn = lambda p, h: self.layer_fn(p, h, side_u)

    def keep(h, p):
      return layer_fn(p, h), h

    y, h_l = jax.lax.scan(keep, x, params_r)

    def back(ct):
      def one(ct_h, p_h):
        g_p, ct_h = jax.vjp(layer_fn, *p_h)[1](ct_h)
        return ct_h, g_p

      ct_x, g_l = jax.lax.scan(one, ct, (params_r, h_l), reverse=True)
      return g_l, ct_x

    return y, back

  def run(self, chunks: Any, head: Any, xs: jax.Array, side: dict, grads: bool) -> tuple:
    """chunks [v, lc, ...]; xs [m, b, t, d] (fp32); side: dict of [m, b, t], read by the loss and
    the layers (each unit those of its micro-batch). Returns the loss sum
    on this stage (0 but on the last) and, with `grads`, (d chunks, d head, d xs)."""
    p, s = self.sched.p, jax.lax.axis_index(PP)
    fwd_ring = [(i, (i + 1) % p) for i in range(p)]
    bwd_ring = [((i + 1) % p, i) for i in range(p)]
    x0 = jnp.zeros_like(xs[0], dtype=self.dtype)
    rows = jnp.asarray(self.sched.table)
    # sorted, not the set's order: that follows the hash seed, and the collectives' device groups
    # with it (two processes of one run could compile different programs; pipeline.py's `axes`)
    varying = tuple(sorted(jax.typeof(xs).manual_axis_type.varying))
    zero = lambda: vary(jnp.zeros((), jnp.float32), varying)

    def forward(c, r, x, mb):
      return self.chunk(jax.tree.map(lambda a: a[r], c), x, _at(side, mb))

    def backward(c, hd, r, x, ct, mb, last):
      params_r = jax.tree.map(lambda a: a[r], c)
      y, back = self.chunk_vjp(params_r, x, _at(side, mb))
      loss, (g_head, ct_y) = jax.value_and_grad(self.loss_fn, argnums=(0, 1))(hd, y, _at(side, mb))
      g_p, ct_x = back(jnp.where(last, ct_y.astype(y.dtype), ct))
      loss = jnp.where(last, loss.astype(jnp.float32), 0.0)
      return g_p, ct_x, jax.tree.map(lambda g: jnp.where(last, g, 0), g_head), loss

    def middle(c, hd, r, x, ct, mb):  # no head: the cotangent came from the next stage
      params_r = jax.tree.map(lambda a: a[r], c)
      g_p, ct_x = self.chunk_vjp(params_r, x, _at(side, mb))[1](ct)
      return g_p, ct_x, jax.tree.map(jnp.zeros_like, hd), zero()

    def idle(c, hd, r, x, ct, mb):
      g_p = jax.tree.map(lambda a: jnp.zeros_like(a[0]), c)
      return g_p, jnp.zeros_like(x), jax.tree.map(jnp.zeros_like, hd), zero()

    def loss_only(hd, r, x, mb):
      return self.loss_fn(hd, forward(chunks, r, x, mb), _at(side, mb))

    def tick(carry, row_all):
      stash, gbuf, acc, hacc, dx, loss = carry
      row = {k: row_all[s, i] for k, i in COL.items()}
      # forward
      x_f = jnp.where(row['f_fresh'] == 1, xs[row['f_mb']].astype(self.dtype), stash[row['f_slot']])
      f_args = (chunks, row['f_chunk'], x_f, row['f_mb'])
      if self.skip:
        y = jax.lax.cond(row['f_valid'] == 1, forward, lambda c, r, x, mb: x, *f_args)
      else:
        y = forward(*f_args)
      # backward (or, for the primal alone, the loss)
      first, last, valid = row['b_first'] == 1, row['b_last'] == 1, row['b_valid'] == 1
      x_b = jnp.where(first, xs[row['b_mb']].astype(self.dtype), stash[row['b_slot']])
      if not grads:
        step = lambda: loss_only(head, row['b_chunk'], x_b, row['b_mb']).astype(jnp.float32)
        got = jax.lax.cond(valid & last, step, zero) if self.skip else jnp.where(valid & last, step(), 0.0)
        recv = jax.lax.ppermute(y, PP, fwd_ring)
        stash = _put(stash, row['a_slot'], recv, row['a_valid'] == 1)
        return (stash, gbuf, acc, hacc, dx, loss + got.astype(jnp.float32)), None
      args = (chunks, head, row['b_chunk'], x_b, gbuf[row['b_gslot']], row['b_mb'])
      if self.skip:
        branch = jnp.where(valid, jnp.where(last, 2, 1), 0)
        lastb = lambda *a: backward(*a, True)
        g_p, ct_x, g_head, got = jax.lax.switch(branch, (idle, middle, lastb), *args)
      else:
        g_p, ct_x, g_head, got = backward(*args, last)
      acc = jax.tree.map(lambda a, g: ring._add_at(a, jnp.where(valid, g, 0), (row['b_chunk'],)), acc, g_p)
      hacc = jax.tree.map(lambda a, g: a + jnp.where(valid, g, 0).astype(a.dtype), hacc, g_head)
      loss = loss + jnp.where(valid, got, 0.0).astype(jnp.float32)
      dx = _put(dx, row['b_mb'], ct_x.astype(dx.dtype), valid & first)
      # send
      recv = jax.lax.ppermute(y, PP, fwd_ring)
      recv_ct = jax.lax.ppermute(ct_x, PP, bwd_ring)
      stash = _put(stash, row['a_slot'], recv, row['a_valid'] == 1)
      gbuf = _put(gbuf, row['g_slot'], recv_ct, row['g_valid'] == 1)
      return (stash, gbuf, acc, hacc, dx, loss), None

    stash = ring._zeros(x0, (self.sched.stash, *x0.shape))
    gbuf = ring._zeros(x0, (self.sched.grads, *x0.shape))
    acc = jax.tree.map(ring._zeros, chunks) if grads else None
    hacc = jax.tree.map(lambda a: vary(jnp.zeros_like(a), varying), head) if grads else None
    dx = ring._zeros(xs) if grads else None
    loss = zero()
    init = (stash, gbuf, acc, hacc, dx, loss)
    (_, _, acc, hacc, dx, loss), _ = jax.lax.scan(tick, init, rows)
    return loss, (acc, hacc, dx)

  def loss(self) -> Callable:
    """(chunks, head, xs, side) -> the loss sum, differentiable: its backward is the loop's own."""

    @jax.custom_vjp
    def pipelined(chunks, head, xs, side):
      return self.run(chunks, head, xs, side, grads=False)[0]

    def fwd(chunks, head, xs, side):
      loss, grads = self.run(chunks, head, xs, side, grads=True)
      return loss, grads

    def bwd(grads, ct):
      scaled = jax.tree.map(lambda g: (g * ct).astype(g.dtype), grads)
      return (*scaled, None)

    pipelined.defvjp(fwd, bwd)
    return pipelined


def _at(side: dict, mb: jax.Array) -> dict:
  """Micro-batch mb of each side input."""
  return {k: v[mb] for k, v in side.items()}


def _put(buf: jax.Array, slot: jax.Array, value: jax.Array, valid: jax.Array) -> jax.Array:
  """buf with `value` written at `slot` where `valid` (else unchanged): one slot read and written."""
  return buf.at[slot].set(jnp.where(valid, value.astype(buf.dtype), buf[slot]))
