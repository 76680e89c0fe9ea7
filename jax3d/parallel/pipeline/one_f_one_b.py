"""The 1F1B loop on one stage, inside the pipeline's `shard_map`: `lax.scan`s over the ticks of
timetable.py, with the head and the loss inside and the backward written out (chunk.py).

Each tick a stage reads its row of the timetable (indexed by its pp rank) and does:
  forward   its unit's chunk on the input (the loop's own micro-batch for k = 0, else the stash
            slot the previous stage sent), `chunk.Chunk.forward`: its VJP residuals (what the
            remat policy saves; the chunk's weights excepted) are written into the unit's
            residual slot. No forward is run twice.
  head      where the last virtual stage forwards (k = V-1): its output, shared over pp by one
            reduce-scatter, gives each stage 1/p of the micro-batch's rows; each computes the head
            and the loss of its rows, with their gradients, and the output's gradient is
            all-gathered back into the last stage's gradient buffer: the head and the loss cost
            what they cost once per micro-batch, split over pp.
  backward  its unit's residuals and output gradient through the VJP (`chunk.Chunk.backward`):
            the chunk's weight gradient is added in place into one accumulator of the stage's weights.
  send      the forward's output to stage s+1 and the backward's input gradient to stage s-1, one
            `ppermute` each, written into the receivers' stash and gradient-buffer slots.
Which of forward, head and backward some stage runs in a tick is known from the table: the loop is
one scan per run of ticks with the same three flags (`segments`), each computing only those, on
every path. With `skip` (CPU) a stage also skips its own idle forward or backward (`lax.cond`).

The loop returns the loss and, as `jax.custom_vjp` residuals, the gradients it computed; the
caller's cotangent (the scale of the loss) multiplies them. The primal alone (evaluation) runs each
forward once and the head where the last virtual stage forwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax3d.parallel.layer_fn import LayerFn
from jax3d.parallel.pipeline.chunk import Chunk, add_at, kept as chunk_kept, put, zeros
from jax3d.parallel.pipeline.timetable import COL, Timetable
from jax3d.parallel.sharding import PP, vary

# (head params, y of (a piece of) one micro-batch [b, t, d], its side inputs) -> its loss sum
LossFn = Callable[[Any, jax.Array, dict], jax.Array]

# At most this many scans (runs of ticks with the same flags): more are merged, the merged run
# computing the union of their flags (interleaved schedules alternate head and no-head ticks).
MAX_SEGMENTS = 6


def segments(flags: np.ndarray, limit: int = MAX_SEGMENTS) -> list[tuple[int, int, tuple]]:
  """[(start, stop, (forward, backward, head))]: the runs of equal rows of `flags` [T, 3], the
  cheapest neighbours merged while there are more than `limit` (a forward 1, a backward 2, the
  head 1 per tick added)."""
  runs = []
  for t, row in enumerate(map(tuple, flags.astype(bool).tolist())):
    if runs and runs[-1][2] == row:
      runs[-1][1] = t + 1
    else:
      runs.append([t, t + 1, row])
  cost = lambda r: (r[1] - r[0]) * (r[2][0] + 2 * r[2][1] + r[2][2])
  while len(runs) > limit:
    merged = [
      [a[0], b[1], tuple(x or y for x, y in zip(a[2], b[2], strict=True))]
      for a, b in zip(runs, runs[1:], strict=False)
    ]
    j = min(range(len(merged)), key=lambda i: cost(merged[i]) - cost(runs[i]) - cost(runs[i + 1]))
    runs[j : j + 2] = [merged[j]]
  return [(a, b, f) for a, b, f in runs]


@dataclasses.dataclass(frozen=True)
class Loop:
  layer_fn: LayerFn
  loss_fn: LossFn
  timetable: Timetable
  dtype: Any  # the compute dtype of the activations in the loop
  policy: str
  skip: bool
  btd: tuple[int, int, int]  # a micro-batch's shape as the head reads it (the loop may carry rows)

  def head(self, hd: Any, y: jax.Array, side_u: dict, grads: bool) -> tuple:
    """The last stage's y shared over pp, each stage's rows through the head and the loss:
    (this stage's loss, its head gradient, the gradient of y, whole) or the loss alone."""
    p, s = self.timetable.p, jax.lax.axis_index(PP)
    b, t, d = self.btd
    last = s == p - 1
    y = jnp.where(last, y.reshape(b, t, d).astype(jnp.float32), 0.0)
    axis = 0 if b % p == 0 else 1 if t % p == 0 else None
    if axis is None:  # the rows do not split: every stage the whole micro-batch, counted on the last
      piece, side_p, mask = jax.lax.psum(y, PP), side_u, last
    else:
      piece = jax.lax.psum_scatter(y, PP, scatter_dimension=axis, tiled=True)
      n = piece.shape[axis]
      side_p = {k: jax.lax.dynamic_slice_in_dim(a, s * n, n, axis) for k, a in side_u.items()}
      mask = True
    fn = lambda hd, y: jnp.where(mask, self.loss_fn(hd, y, side_p).astype(jnp.float32), 0.0)
    piece = piece.astype(self.dtype)
    if not grads:
      return fn(hd, piece)
    loss, (g_head, ct_piece) = jax.value_and_grad(fn, argnums=(0, 1))(hd, piece)
    ct_y = ct_piece if axis is None else jax.lax.all_gather(ct_piece, PP, axis=axis, tiled=True)
    return loss, g_head, ct_y

  def run(self, chunks: Any, head: Any, xs: jax.Array, side: dict, grads: bool) -> tuple:
    """chunks [v, lc, ...]; xs [m, ...] (fp32); side: dict of [m, b, t], read by the loss and the
    layers (each unit those of its micro-batch). Returns this stage's share of the loss sum and,
    with `grads`, (d chunks, d head, d xs)."""
    p, s = self.timetable.p, jax.lax.axis_index(PP)
    fwd_ring = [(i, (i + 1) % p) for i in range(p)]
    bwd_ring = [((i + 1) % p, i) for i in range(p)]
    x0 = jnp.zeros_like(xs[0], dtype=self.dtype)
    varying = tuple(sorted(jax.typeof(xs).manual_axis_type.varying))  # sorted: not the hash seed's order
    zero = lambda: vary(jnp.zeros((), jnp.float32), varying)
    chunk_of = lambda r: jax.tree.map(lambda a: a[r], chunks)
    chunk = Chunk(self.layer_fn, self.policy, self.dtype)
    n = self.timetable.residuals
    res, layout = chunk.slots(chunk_of(0), x0, _at(side, 0), n, varying) if grads else ([], None)

    def forward(r, x, mb):
      if not grads:
        return chunk.apply(chunk_of(r), x, _at(side, mb)), []
      y, kept, _ = chunk.forward(chunk_of(r), x, _at(side, mb))
      return y, chunk_kept(kept, res)

    def backward(r, kept, ct):
      return chunk.backward(chunk_of(r), kept, layout, ct)

    def tick(flags, carry, row_all):
      do_f, do_b, do_h = flags
      stash, gbuf, res, acc, hacc, dx, loss = carry
      row = {k: row_all[s, i] for k, i in COL.items()}
      y = ct_x = None
      if do_f:
        x_f = jnp.where(row['f_fresh'] == 1, xs[row['f_mb']].astype(self.dtype), stash[row['f_slot']])
        f_args = (row['f_chunk'], x_f, row['f_mb'])
        if self.skip:
          none = lambda r, x, mb: (x, [jnp.zeros_like(a[0]) for a in res])
          y, kept = jax.lax.cond(row['f_valid'] == 1, forward, none, *f_args)
        else:
          y, kept = forward(*f_args)
      if do_b:
        valid = row['b_valid'] == 1
        b_args = (row['b_chunk'], [a[row['b_rslot']] for a in res], gbuf[row['b_gslot']])
        if self.skip:
          none = lambda r, kept, ct: (jax.tree.map(lambda a: jnp.zeros_like(a[0]), chunks), ct)
          g_p, ct_x = jax.lax.cond(valid, backward, none, *b_args)
        else:
          g_p, ct_x = backward(*b_args)
        acc = jax.tree.map(lambda a, g: add_at(a, jnp.where(valid, g, 0), (row['b_chunk'],)), acc, g_p)
        dx = put(dx, row['b_mb'], ct_x, valid & (row['b_first'] == 1))
      if do_f:
        res = [put(a, row['f_rslot'], k, row['f_valid'] == 1) for a, k in zip(res, kept, strict=True)]
      if do_h:  # the last stage forwards its last chunk: every stage takes rows of its output
        mb = row_all[p - 1, COL['f_mb']]
        real = (row_all[p - 1, COL['f_valid']] == 1) & (row_all[p - 1, COL['f_last']] == 1)  # not merged
        if grads:
          got, g_head, ct_y = self.head(head, y, _at(side, mb), True)
          hacc = jax.tree.map(lambda a, g: a + jnp.where(real, g, 0).astype(a.dtype), hacc, g_head)
          to_head = (row['f_valid'] == 1) & (row['f_last'] == 1)
          gbuf = put(gbuf, row['h_gslot'], ct_y.reshape(x0.shape), to_head)
        else:
          got = self.head(head, y, _at(side, mb), False)
        loss = loss + jnp.where(real, got, 0.0)
      if do_f:
        stash = put(stash, row['a_slot'], jax.lax.ppermute(y, PP, fwd_ring), row['a_valid'] == 1)
      if do_b:
        gbuf = put(gbuf, row['g_slot'], jax.lax.ppermute(ct_x, PP, bwd_ring), row['g_valid'] == 1)
      return (stash, gbuf, res, acc, hacc, dx, loss), None

    stash = zeros(x0, (self.timetable.stash, *x0.shape))
    gbuf = zeros(x0, (self.timetable.grads, *x0.shape))
    acc = jax.tree.map(zeros, chunks) if grads else None
    hacc = jax.tree.map(lambda a: vary(jnp.zeros_like(a), varying), head) if grads else None
    dx = zeros(xs) if grads else None
    carry = (stash, gbuf, res, acc, hacc, dx, zero())
    rows = jnp.asarray(self.timetable.table)
    for start, stop, flags in segments(self.timetable.phases):
      if not grads:
        flags = (flags[0], False, flags[2])
      if any(flags):
        carry = jax.lax.scan(lambda c, r, f=flags: tick(f, c, r), carry, rows[start:stop])[0]
    _, _, _, acc, hacc, dx, loss = carry
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
