"""Context parallelism (mesh.cp > 1): each row's tokens split over the devices of the 'cp' axis.

Layout (load balance, as Megatron-LM and MaxText): a row of t tokens is cut into 2*cp chunks of
c = t/(2cp) and laid out so that cp rank i holds chunks i and 2cp-1-i; under causal attention
every rank then has the same work (an early chunk with few keys, a late one with many). `order`
is that permutation; `lay_out` applies it to every [B, T] array of a batch on entering the step
(the batch arrives with its rows over dp and replicated over cp, so this is a local slice per
device, no communication), and adds the rotary positions 0..t-1 when the batch has none: the
positions travel with the tokens, so RoPE is right in any order. The loss is a sum over tokens
divided by the batch's weight sum, so the order changes neither; `natural` puts per-token outputs
(logits) back in the rows' own order.

Attention (`attend`): a shard_map manual over 'cp' alone (dp and tp stay with GSPMD, as for the
blockwise attention without cp); each rank's queries have as causal positions their tokens'
indices in the row. train.cp_strategy=allgather: each rank all-gathers K, V and the key segment
ids over cp and runs the blockwise attention of its queries against all keys; the all-gather's
transpose is a reduce-scatter of dK and dV. train.cp_strategy=ring: K, V and the key segments go
round the cp ring (ppermute), one rank's block per step, the online softmax continued over each;
the backward sends them round again with their dK/dV accumulators (`_ring`). The parameters are
replicated over cp, so their gradients are summed over dp x cp by the compiler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax3d.parallel import sharding
from jax3d.parallel.sharding import CP

POSITIONS = 'positions'


def order(t: int, cp: int) -> np.ndarray:
  """int [t]: the row index of the token at each place of the cp layout (rank i: chunks i and
  2cp-1-i of c = t/(2cp) tokens each, ranks in order)."""
  c = t // (2 * cp)
  chunks = np.arange(t).reshape(2 * cp, c)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def lay_out(batch: dict[str, jax.Array], cp: int) -> dict[str, jax.Array]:
  """Every [B, T] array of `batch` in the cp layout (`order`), with rotary positions 0..T-1 added
  where the batch has none (rows of one sequence)."""
  if cp == 1:
    return batch
  b, t = batch['inputs'].shape
  if POSITIONS not in batch:
    batch = {**batch, POSITIONS: jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))}
  idx = order(t, cp)
  return {k: v[:, idx] for k, v in batch.items()}


def natural(x_bt: jax.Array, cp: int) -> jax.Array:
  """[B, T, ...] in the cp layout -> the rows' own order (the inverse of `lay_out`)."""
  return x_bt if cp == 1 else x_bt[:, np.argsort(order(x_bt.shape[1], cp))]


def in_layout(fn: Callable, tokens_bt: jax.Array, doc: dict[str, jax.Array] | None, cp: int) -> jax.Array:
  """fn(tokens, doc) -> [B, T, ...] per token, run on the rows in the cp layout and returned in
  their own order (logits for scoring and verification)."""
  if cp == 1:
    return fn(tokens_bt, doc)
  laid = lay_out({'inputs': tokens_bt, **(doc or {})}, cp)
  return natural(fn(laid.pop('inputs'), laid), cp)


def cp_size() -> int:
  """The size of the 'cp' axis of the mesh in context (1 when it has none)."""
  mesh = jax.sharding.get_abstract_mesh()
  return dict(mesh.shape).get(CP, 1) if not mesh.empty else 1


def manual() -> bool:
  """Whether 'cp' is a manual axis here (the pipeline's loop, the explicit dp x cp reduction): each
  device then holds its own tokens of every row, in the cp layout."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and CP in mesh.manual_axes


def split(t: int) -> int:
  """The cp ranks a sequence of length t is split over by the compiler: the mesh's cp, or 1 where t
  does not divide into 2*cp chunks (the parameters' initialisation traces a layer on one token;
  training's seq_len always divides, train.seq_len's rule) or where cp is manual (`manual`: the t
  tokens are this rank's own)."""
  cp = cp_size()
  return cp if t % (2 * cp) == 0 and not manual() else 1


def active(t: int) -> bool:
  """Whether attention over t tokens runs split over cp (`attend`): the compiler's split, or this
  rank's own tokens where cp is manual."""
  return split(t) > 1 or (manual() and cp_size() > 1)


def rows(x_bt: jax.Array) -> jax.Array:
  """[b, t, ...] -> the layer's flattened rows [b*t, ...]: b-major, or with cp > 1 cp-major
  ([cp, b, t/cp] flattened), so that rows split over (cp, dp) are each device's own tokens (a
  b-major flattening of a sequence split over cp is no split of the rows: GSPMD would reshard)."""
  b, t = x_bt.shape[:2]
  cp = split(t)
  if cp == 1:
    return x_bt.reshape(b * t, *x_bt.shape[2:])
  return x_bt.reshape(b, cp, t // cp, *x_bt.shape[2:]).swapaxes(0, 1).reshape(b * t, *x_bt.shape[2:])


def unrows(x_r: jax.Array, b: int, t: int) -> jax.Array:
  """The inverse of `rows`: [b*t, ...] -> [b, t, ...]."""
  cp = split(t)
  if cp == 1:
    return x_r.reshape(b, t, *x_r.shape[1:])
  return x_r.reshape(cp, b, t // cp, *x_r.shape[1:]).swapaxes(0, 1).reshape(b, t, *x_r.shape[1:])


def attend(
  q_btnh: jax.Array,
  k_btkh: jax.Array,
  v_btkh: jax.Array,
  seg_bt: jax.Array | None,
  kernel: Any,
  block: int,
  strategy: str = 'allgather',
) -> jax.Array:
  """Causal attention [b, t, n, h] of rows in the cp layout, the sequence split over 'cp' (the
  module docstring), by `strategy` ('allgather' or 'ring'). Forward and backward are two
  per-device regions (`sharding.device_local`, a custom VJP, as attention._per_device_vjp):
  differentiating one region, or a region manual over cp alone, makes the kernel's residuals
  outputs split over a free axis (dp) before the manual one, which Shardy rejects. The backward
  reuses the forward's logsumexp. `kernel` is jax3d/model/blockwise.py (the module: forward,
  backward, and the ring's start, accumulate, finish), run with blocks of `block`. Where cp is
  manual already (`manual`: the pipeline's loop, the explicit reduction) the t tokens are this
  rank's own: the whole row is t*cp, and the ranks' positions come from axis_index(cp) as ever."""
  cp = cp_size()
  t = q_btnh.shape[1] * (cp if manual() else 1)  # the whole row's tokens
  fwd_local, bwd_local = (_ring if strategy == 'ring' else _allgather)(t, cp, kernel, block)
  segs: tuple[Any, ...] = () if seg_bt is None else (seg_bt,)
  q_names, kv_names = ('batch', 'seq', 'heads', 'head_dim'), ('batch', 'seq', 'kv_heads', 'head_dim')
  lse_names = ('seq', 'batch', 'kv_heads', None, None)  # [nq, b, kv, g, bq]: this rank's query blocks
  seg_names = (('batch', 'seq'),) * len(segs)
  fwd = sharding.device_local(
    fwd_local, (q_names, kv_names, kv_names, *seg_names), (q_names, lse_names), check_vma=False
  )
  bwd_in = (q_names, kv_names, kv_names, q_names, lse_names, q_names, *seg_names)
  bwd = sharding.device_local(bwd_local, bwd_in, (q_names, kv_names, kv_names), check_vma=False)

  # unchecked regions return values varying over no manual axis: marked as their inputs were
  like = sharding.vary_like

  @jax.custom_vjp
  def run(q, k, v, *seg):
    return like(fwd(q, k, v, *seg)[0], q)

  def run_fwd(q, k, v, *seg):
    out, lse = fwd(q, k, v, *seg)
    return like(out, q), (q, k, v, out, lse, seg)

  def run_bwd(res, g):
    q, k, v, out, lse, seg = res
    grads = bwd(q, k, v, out, lse, g, *seg)
    return (*(like(d, x) for d, x in zip(grads, (q, k, v), strict=True)), *(jnp.zeros_like(x) for x in seg))

  run.defvjp(run_fwd, run_bwd)
  return run(q_btnh, k_btkh, v_btkh, *segs)


def _positions(rank: Any, b: int, t: int, cp: int) -> jax.Array:
  """int [b, t/cp]: the row indices of the tokens cp rank `rank` holds (chunks rank and
  2cp-1-rank), the causal positions of its queries and keys."""
  p = jnp.asarray(order(t, cp).reshape(cp, t // cp), jnp.int32)[rank]  # the layout, from `order`
  return jnp.broadcast_to(p, (b, t // cp))


def _allgather(t: int, cp: int, kernel: Any, block: int) -> tuple[Callable, Callable]:
  """(forward, backward) per device: K, V and the key segments all-gathered over cp and put in
  their natural order (a static gather, so that the kernel's block skipping sees contiguous needed
  blocks), all keys at once; dK and dV reduce-scattered (the all-gather's transpose)."""
  natural_of = np.argsort(order(t, cp))  # gathered (rank-major) keys -> natural order
  gather = lambda a: jax.lax.all_gather(a, CP, axis=1, tiled=True)[:, natural_of]

  def operands(q, k, v, seg):
    qp = _positions(jax.lax.axis_index(CP), q.shape[0], t, cp)
    kp = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (q.shape[0], t))
    ids = () if seg is None else (seg, gather(seg))
    return q, gather(k), gather(v), qp, kp, *(ids or (None, None))

  def fwd_local(q, k, v, *seg):
    return kernel.forward(*operands(q, k, v, seg[0] if seg else None), block=block)

  def bwd_local(q, k, v, out, lse, g, *seg):
    dq, dk, dv = kernel.backward(*operands(q, k, v, seg[0] if seg else None), out, lse, g, block=block)
    scatter = lambda d: jax.lax.psum_scatter(d[:, order(t, cp)], CP, scatter_dimension=1, tiled=True)
    return dq, scatter(dk), scatter(dv)

  return fwd_local, bwd_local


def _ring(t: int, cp: int, kernel: Any, block: int) -> tuple[Callable, Callable]:
  """(forward, backward) per device: each rank's K, V and key segments passed round the cp ring
  (rank r -> r+1, `ppermute`), cp steps; at step s rank i holds rank i-s's keys, whose positions
  it computes (`_positions`). The forward continues the online softmax of its queries over each
  visiting block (kernel.accumulate: one softmax, as if all keys came at once). The backward
  (with the finished logsumexp) passes the K/V round again with each block's fp32 dK/dV
  accumulator: every rank adds its part, and after the last step one more rotation brings each
  accumulator home. Each step issues the next transfer before its block computation, so that XLA
  can overlap them; no rank holds more than its own, the visiting and the arriving K/V."""
  perm = [(r, (r + 1) % cp) for r in range(cp)]
  rotate = lambda tree: jax.tree.map(lambda a: jax.lax.ppermute(a, CP, perm), tree)

  def keys(q, s, kv):  # the operands of step s: the visiting block's K, V, positions, segments
    src = (jax.lax.axis_index(CP) - s) % cp
    k, v, *ks = kv
    return k, v, _positions(src, q.shape[0], t, cp), (ks[0] if ks else None)

  def fwd_local(q, k, v, *seg):
    qp, qs = _positions(jax.lax.axis_index(CP), q.shape[0], t, cp), (seg[0] if seg else None)

    def visit(s, kv, state):
      k_s, v_s, kp, ks = keys(q, s, kv)
      return kernel.accumulate(q, k_s, v_s, qp, kp, qs, ks, block, state)

    def step(s, carry):  # the transfer for step s+1 first, then step s's blocks
      kv, state = carry
      return rotate(kv), visit(s, kv, state)

    kv, state = jax.lax.fori_loop(0, cp - 1, step, ((k, v, *seg), kernel.start(q, k.shape[2], block)))
    return kernel.finish(visit(cp - 1, kv, state), q)

  def bwd_local(q, k, v, out, lse, g, *seg):
    qp, qs = _positions(jax.lax.axis_index(CP), q.shape[0], t, cp), (seg[0] if seg else None)

    def grads(s, kv):  # (dq part, (dk, dv) of the visiting block's keys), fp32
      k_s, v_s, kp, ks = keys(q, s, kv)
      dq, dk, dv = kernel.backward(q, k_s, v_s, qp, kp, qs, ks, out, lse, g, block, jnp.float32)
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
