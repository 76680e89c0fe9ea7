"""Causal attention with the sequence split over 'cp' (mesh.cp > 1): the blockwise kernel
(jax3d/model/blockwise.py) on rows in the cp layout (jax3d/parallel/context.py).

`attend` runs in a shard_map manual over 'cp' alone (dp and tp stay with GSPMD, as for the
blockwise attention without cp), as the other kernels run: forward and backward are two per-device
regions with a custom VJP (`sharding.device_local_vjp`, attention.py's mechanism), the backward
reusing the forward's logsumexp. Each rank's queries have as causal positions their tokens' indices
in the row (`context.positions`). train.cp_strategy=allgather: each rank all-gathers K, V and the
key segment ids over cp (`context.gather`) and runs the blockwise attention of its queries against
all keys; the all-gather's transpose is a reduce-scatter of dK and dV (`context.scatter_sum`).
train.cp_strategy=ring: K, V and the key segments go round the cp ring (`context.rotate`), one
rank's block per step, the online softmax continued over each; the backward sends them round again
with their dK/dV accumulators (`_ring`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax3d.model import blockwise
from jax3d.parallel import context, sharding

Q_NAMES = ('batch', 'seq', 'heads', 'head_dim')
KV_NAMES = ('batch', 'seq', 'kv_heads', 'head_dim')
LSE_NAMES = ('seq', 'batch', 'kv_heads', None, None)  # [nq, b, kv, g, bq]: this rank's query blocks


def attend(
  q_btnh: jax.Array,
  k_btkh: jax.Array,
  v_btkh: jax.Array,
  seg_bt: jax.Array | None,
  strategy: str = 'allgather',
) -> jax.Array:
  """Causal attention [b, t, n, h] of rows in the cp layout, the sequence split over 'cp', by
  `strategy` ('allgather' or 'ring'), with blocks of blockwise.BLOCK. Where cp is manual already
  (`context.manual`: the pipeline's loop, the explicit reduction) the t tokens are this rank's
  own: the whole row is t*cp, and the ranks' positions come from their cp rank as ever. Both
  regions run without shard_map's vma check: differentiating one region, or a region manual over
  cp alone, makes the kernel's residuals outputs split over a free axis (dp) before the manual
  one, which Shardy rejects."""
  cp = context.cp_size()
  t = q_btnh.shape[1] * (cp if context.manual() else 1)  # the whole row's tokens
  fwd_local, bwd_local = (_ring if strategy == 'ring' else _allgather)(t, cp, blockwise.BLOCK)
  segs: tuple[Any, ...] = () if seg_bt is None else (seg_bt,)
  in_logical = (Q_NAMES, KV_NAMES, KV_NAMES) + (('batch', 'seq'),) * len(segs)
  run = sharding.device_local_vjp(fwd_local, in_logical, Q_NAMES, len(segs), bwd_local, saved=(LSE_NAMES,))
  return run(q_btnh, k_btkh, v_btkh, *segs)


def _allgather(t: int, cp: int, block: int) -> tuple[Callable, Callable]:
  """(forward, backward) per device: K, V and the key segments all-gathered over cp and put in
  their natural order (a static gather, so that the kernel's block skipping sees contiguous needed
  blocks), all keys at once; dK and dV reduce-scattered (the all-gather's transpose)."""

  def operands(q, k, v, seg):
    qp = context.positions(context.rank(), q.shape[0], t, cp)
    kp = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (q.shape[0], t))
    gather = lambda a: context.gather(a, t, cp)
    ids = () if seg is None else (seg, gather(seg))
    return q, gather(k), gather(v), qp, kp, *(ids or (None, None))

  def fwd_local(q, k, v, *seg):
    return blockwise.forward(*operands(q, k, v, seg[0] if seg else None), block=block)

  def bwd_local(q, k, v, *rest):  # rest: (segment ids?, out, lse, g)
    *seg, out, lse, g = rest
    dq, dk, dv = blockwise.backward(*operands(q, k, v, seg[0] if seg else None), out, lse, g, block=block)
    return dq, context.scatter_sum(dk, t, cp), context.scatter_sum(dv, t, cp)

  return fwd_local, bwd_local


def _ring(t: int, cp: int, block: int) -> tuple[Callable, Callable]:
  """(forward, backward) per device: each rank's K, V and key segments passed round the cp ring
  (rank r -> r+1, `context.rotate`), cp steps; at step s rank i holds rank i-s's keys, whose
  positions it computes (`context.positions`). The forward continues the online softmax of its
  queries over each visiting block (blockwise.accumulate: one softmax, as if all keys came at
  once). The backward (with the finished logsumexp) passes the K/V round again with each block's
  fp32 dK/dV accumulator: every rank adds its part, and after the last step one more rotation
  brings each accumulator home. Each step issues the next transfer before its block computation,
  so that XLA can overlap them; no rank holds more than its own, the visiting and the arriving
  K/V."""
  rotate = lambda tree: context.rotate(tree, cp)

  def keys(q, s, kv):  # the operands of step s: the visiting block's K, V, positions, segments
    src = (context.rank() - s) % cp
    k, v, *ks = kv
    return k, v, context.positions(src, q.shape[0], t, cp), (ks[0] if ks else None)

  def fwd_local(q, k, v, *seg):
    qp, qs = context.positions(context.rank(), q.shape[0], t, cp), (seg[0] if seg else None)

    def visit(s, kv, state):
      k_s, v_s, kp, ks = keys(q, s, kv)
      return blockwise.accumulate(q, k_s, v_s, qp, kp, qs, ks, block, state)

    def step(s, carry):  # the transfer for step s+1 first, then step s's blocks
      kv, state = carry
      return rotate(kv), visit(s, kv, state)

    kv, state = jax.lax.fori_loop(0, cp - 1, step, ((k, v, *seg), blockwise.start(q, k.shape[2], block)))
    return blockwise.finish(visit(cp - 1, kv, state), q)

  def bwd_local(q, k, v, *rest):  # rest: (segment ids?, out, lse, g)
    *seg, out, lse, g = rest
    qp, qs = context.positions(context.rank(), q.shape[0], t, cp), (seg[0] if seg else None)

    def grads(s, kv):  # (dq part, (dk, dv) of the visiting block's keys), fp32
      k_s, v_s, kp, ks = keys(q, s, kv)
      dq, dk, dv = blockwise.backward(q, k_s, v_s, qp, kp, qs, ks, out, lse, g, block, jnp.float32)
      return dq, (dk, dv)

    def step(s, carry):  # both transfers first: the next K/V, and the visiting block's accumulator
      kv, acc, dq = carry
      nxt, acc_in = rotate(kv), rotate(acc)
      dq_s, d = grads(s, kv)
      return nxt, jax.tree.map(jnp.add, acc_in, d), dq + dq_s

    own = (k, v, *seg)
    nxt = rotate(own)
    dq, acc = grads(0, own)  # step 0: the own block, its accumulator started here
    kv, acc, dq = jax.lax.fori_loop(1, cp - 1, step, (nxt, acc, dq))
    acc_in = rotate(acc)
    dq_s, d = grads(cp - 1, kv)
    dk, dv = rotate(jax.tree.map(jnp.add, acc_in, d))  # each block's accumulator home to its owner
    return (dq + dq_s).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

  return fwd_local, bwd_local
