"""GPipe on one stage: the circulating loop of p stages inside the pipeline's `shard_map`.

`circulate` runs the schedule of jax3d/parallel/pipeline/__init__.py (GPipe, or circular with v
chunks per stage) as one `lax.scan` over its v*m + p - 1 iterations, each running one chunk
(chunk.py). Under remat 'full' and 'stage' the loop's backward pass is written out
(`GPipe.with_backward`, a `jax.custom_vjp`): each iteration keeps its chunk's VJP residuals
(`chunk.Chunk.forward`: each layer's input, or the chunk's input), and the backward runs the
iterations in reverse, the ring's `ppermute` reversed, each chunk's VJP rebuilt from them
(`chunk.Chunk.backward`) and its weight gradient added in place into one accumulator of the
stage's weights. Other policies keep what the policy saves, so JAX differentiates the loop itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax3d.parallel import remat
from jax3d.parallel.layer_fn import LayerFn, Side
from jax3d.parallel.pipeline.chunk import Chunk, add_at, kept, run_layers, zeros
from jax3d.parallel.sharding import PP, vary


@dataclasses.dataclass(frozen=True)
class GPipe:
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

  @property
  def first_done(self) -> int:
    """The iteration at which stage 0 receives micro-batch 0's last pass: the outputs are the m
    iterations from it."""
    return (self.v - 1) * self.m + self.p - 1

  def done(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(slot, flag): what stage 0 receives at iteration t is micro-batch `slot`'s output where
    `flag` (its last pass round the ring). Only stage 0 holds outputs."""
    k = t - self.first_done
    return jnp.clip(k, 0, self.m - 1), (jax.lax.axis_index(PP) == 0) & (k >= 0) & (k < self.m)

  def side_at(self, side: Side, u: jax.Array) -> Side:
    """The side arrays of micro-batch u mod m (the one this stage works on)."""
    return {k: a[jnp.mod(u, self.m)] for k, a in side.items()}

  def forward(
    self, chunks: Any, xs: jax.Array, side: Side, stage: Callable, bubble: Callable
  ) -> tuple[jax.Array, Any]:
    """The circulating loop: returns its outputs and each iteration's `aux`. The outputs: with one
    chunk (v = 1) what each iteration received from the previous stage [n, b, t, d] (the scan's ys;
    `circulate` slices the finished m); with v > 1 the m finished micro-batches [m, b, t, d], written
    into a carried buffer as they arrive (an [n] stack and its gradient would hold v*m + p - 1
    micro-batches each: 23 GB per GPU for Llama 3 70B at pp 8, v 5, m 16).
    `stage(chunks, r, x, side_u) -> (y, aux)` runs chunk r on the stage's input x (side_u: its
    micro-batch's side arrays, of `side` [m, b, t]); `bubble(x)` gives a bubble iteration's (y, aux)
    when bubbles are skipped. xs: the inputs padded with p-1 zero micro-batches (v = 1, taken by the
    scan as they come) or the stage-0 queue (v > 1)."""
    s = jax.lax.axis_index(PP)
    ring = [(i, (i + 1) % self.p) for i in range(self.p)]

    def iteration(carry, t_x):
      state_btd, queue_mbtd, out_mbtd = carry
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
        slot, finished = self.done(t)
        out_mbtd = out_mbtd.at[slot].set(jnp.where(finished, recv_btd, out_mbtd[slot]))
        return (recv_btd, queue_mbtd, out_mbtd), aux
      return (recv_btd, None, None), (recv_btd, aux)

    state = vary(jnp.zeros_like(xs[0], dtype=self.dtype), (PP,))  # the carry differs per stage
    ts = jnp.arange(self.iterations)
    if self.v == 1:
      return jax.lax.scan(iteration, (state, None, None), (ts, xs))[1]
    out = zeros(state, (self.m, *state.shape))
    (_, _, out_mbtd), aux_n = jax.lax.scan(iteration, (state, xs, out), (ts, None))
    return out_mbtd, aux_n

  def backward(
    self, chunks: Any, kept_n: list, layout: tuple, ct_out: jax.Array, policy: str
  ) -> tuple[Any, jax.Array]:
    """The loop's backward pass, written out: iterations in reverse, each chunk's VJP rebuilt from
    its residuals and its weight gradient added in place into one accumulator of the stage's
    weights. `ct_out`: the gradient of `forward`'s outputs. Returns the gradients of the weights
    and of `forward`'s xs."""
    s = jax.lax.axis_index(PP)
    back = [((i + 1) % self.p, i) for i in range(self.p)]
    chunk = Chunk(self.layer_fn, policy, self.dtype)

    def chunk_back(acc, r, ct_btd, kept):
      g, ct_x = chunk.backward(jax.tree.map(lambda a: a[r], chunks), kept, layout, ct_btd)
      return ct_x.astype(self.dtype), jax.tree.map(lambda a, g: add_at(a, g, (r,)), acc, g)

    def iteration(carry, inp):
      ct_state, ct_queue, acc = carry
      t, ct_recv_btd, kept = inp
      u, r, busy = self.at(t)
      if ct_queue is not None:  # the output's write, transposed: each slot is written once
        slot, finished = self.done(t)
        ct_recv_btd = jnp.where(finished, ct_out[slot], jnp.zeros_like(ct_state))
      ct_recv_btd = ct_recv_btd + ct_state
      if ct_queue is not None:  # the queue's write, transposed: the slot's gradient goes to recv
        slot, again = self.again(t)
        ct_slot = ct_queue[slot]
        ct_recv_btd = ct_recv_btd + jnp.where(again, ct_slot, 0.0).astype(self.dtype)
        ct_queue = ct_queue.at[slot].set(jnp.where(again, 0.0, ct_slot))
      ct_y_btd = jax.lax.ppermute(ct_recv_btd, PP, back)
      args = (acc, r, ct_y_btd, kept)
      if self.skip_bubbles:
        ct_x_btd, acc = jax.lax.cond(busy, chunk_back, lambda a, r, c, k: (c, a), *args)
      else:
        ct_x_btd, acc = chunk_back(*args)
      zero = jnp.zeros_like(ct_x_btd)
      ct_first = jnp.where(s == 0, ct_x_btd, zero).astype(jnp.float32)
      ct_state = jnp.where(s == 0, zero, ct_x_btd)
      if ct_queue is None:
        return (ct_state, None, acc), ct_first
      return (ct_state, add_at(ct_queue, ct_first, (jnp.mod(u, self.m),)), acc), None

    ct_queue = None if self.v == 1 else zeros(ct_out, dtype=jnp.float32)
    init = (zeros(ct_out[0]), ct_queue, jax.tree.map(zeros, chunks))
    ts = jnp.arange(self.iterations)
    ct_recv = ct_out if self.v == 1 else None  # v > 1: read from ct_out at each output's iteration
    (_, ct_queue, acc), ct_xs = jax.lax.scan(iteration, init, (ts, ct_recv, kept_n), reverse=True)
    return acc, ct_xs if ct_queue is None else ct_queue

  def with_backward(self, policy: str) -> Callable[[Any, jax.Array, Side], jax.Array]:
    """`forward` of the plain layers as a function of (chunks, xs, side) whose backward pass is
    `backward`: each iteration keeps its chunk's VJP residuals (under 'full' each layer's input,
    under 'stage' its own input). The side arrays (integers) get no gradient."""
    chunk = Chunk(self.layer_fn, policy, self.dtype)
    of = lambda chunks, r: jax.tree.map(lambda a: a[r], chunks)

    def plain(chunks, r, x_btd, side_u):
      return run_layers(self.layer_fn, chunks, x_btd, 'none', chunk=r, side=side_u), None

    ring = jax.custom_vjp(
      lambda chunks, xs, side: self.forward(chunks, xs, side, plain, lambda x: (x, None))[0]
    )

    def slots(chunks, x_btd, side):  # the residuals' zero slot and layout (traced, not run)
      axes = tuple(sorted(jax.typeof(x_btd).manual_axis_type.varying))
      return chunk.slots(
        of(chunks, 0), jnp.zeros_like(x_btd, dtype=self.dtype), self.side_at(side, 0), 1, axes
      )

    def fwd(chunks, xs, side):
      zero = [a[0] for a in slots(chunks, xs[0], side)[0]]
      keeping = lambda c, r, x, sd: (lambda y, k, _: (y, kept(k, zero)))(*chunk.forward(of(c, r), x, sd))
      outs, kept_n = self.forward(chunks, xs, side, keeping, lambda x: (x, zero))
      return outs, (chunks, kept_n, side)

    def bwd(res, ct_outs):
      chunks, kept_n, side = res
      layout = slots(chunks, ct_outs[0], side)[1]
      return (*self.backward(chunks, kept_n, layout, ct_outs, policy), None)

    ring.defvjp(fwd, bwd)
    return ring


# Policies whose pipeline loop has its backward pass written out (`GPipe.backward`): they keep a
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

  Under 'full' and 'stage' remat the backward pass is `GPipe.backward`: JAX's transpose of the
  scan would zero a stage-sized gradient buffer in every iteration and add it to the loop's
  accumulator (its transpose of a loop-invariant operand)."""
  m = x_mbtd.shape[0]
  # layers_local: this stage's v chunks, [v * lc, ...] -> [v, lc, ...]
  chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers_local)
  ring = GPipe(layer_fn, dtype, p, v, m, skip_bubbles)
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
  out_mbtd = (recv_nbtd[p - 1 : p - 1 + m] if v == 1 else recv_nbtd).astype(jnp.float32)
  # only stage 0's are the outputs: the sum over pp
  return jnp.where(jax.lax.axis_index(PP) == 0, out_mbtd, 0.0)
