"""The dp gradient sum written out, in 32, 16 or 8 bits on the wire (`train.grad_reduce_dtype`).

`reduce` runs inside the explicit path's shard_map manual over dp (jax3d/parallel/data_parallel.py);
with context parallelism over dp and cp together (n = dp*cp ranks, one collective over both).
The reduction of one gradient leaf g (varying over dp, n = dp ranks, k its `zero_dim`):

  bfloat16  all-to-all of the bf16 chunks along k (each rank receives the n copies of its 1/n),
            a local sum in fp32, and (unless ZeRO-1 keeps the shard) an all-gather of the bf16
            sum. The same wire bytes as a bf16 ring all-reduce (2(n-1)/n * P * 2 bytes), but the
            n terms are added in fp32, not in bf16 along the ring.
  int8      h = g + residual (error feedback). h is quantised to int8 with one fp32 scale per
            block (up to 256 consecutive elements of one axis, absmax / 127) - each rank its own
            scales, sent beside the int8 values (1/64 of them or less). All-to-all of the int8
            chunks and scales; each rank dequantises the n chunks it received and adds them in
            fp32, so the sum can never overflow (the alternative - a shared scale from a pmax and
            an int32 sum - costs one more collective and the worse of n scales for every rank).
            Unless ZeRO-1 keeps the shard, the summed shard is quantised again (its own scales)
            and all-gathered as int8. The new residual is h - dequant(q) on every rank, plus, on
            the rank that owns a shard, that shard's second rounding error: what was not delivered
            this step is delivered later, so nothing is lost over a run.
  float32   psum (or psum_scatter under ZeRO-1) on the explicit path.

Leaves with no dimension divisible by dp (none in practice: every weight has a replicated d_model
axis) fall back to a plain psum (f32/bf16) or an int8 all-gather and a local fp32 sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax3d.parallel.sharding import DP

Axis = str | tuple[str, ...]  # the reduction's mesh axes: dp, or (dp, cp) with context parallelism

PyTree = Any  # nested dicts of arrays
BLOCK = 256  # int8 block length (elements of one axis sharing a scale)


def reduce(
  grads: PyTree, residual: PyTree | None, dims: PyTree, dtype: str, n: int, shard: bool, axis: Axis = DP
) -> tuple[PyTree, PyTree | None]:
  """The dp sum of every gradient leaf (inside a shard_map manual over dp).

  grads: varying per-rank gradients; residual: the int8 error-feedback tree (local [..., 1]) or
  None; dims: a tree of `zero_dim`s (-1 for none, as `data_parallel.dims_tree` gives). Returns
  (reduced grads, new residual or None): full arrays, or under `shard` the rank's slice along its
  zero_dim (the ZeRO-1 layout). `axis`: the n ranks' mesh axes (dp, or dp and cp together)."""
  leaves, tdef = jax.tree.flatten(grads)
  dim_leaves = tdef.flatten_up_to(dims)
  res_leaves = tdef.flatten_up_to(residual) if residual is not None else [None] * len(leaves)
  out, new_res = [], []
  for g, k, r in zip(leaves, dim_leaves, res_leaves, strict=True):
    k = None if k < 0 else k
    r_local = None if r is None else r[..., 0]
    red, nr = _reduce_leaf(g.astype(jnp.float32), r_local, dtype, k, n, shard, axis)
    out.append(red.astype(g.dtype))  # the optimizer sees the parameters' dtype
    new_res.append(None if nr is None else nr[..., None])
  reduced = tdef.unflatten(out)
  return reduced, (tdef.unflatten(new_res) if residual is not None else None)


def reduce_scatter(g: jax.Array, dtype: str, k: int, axis: Axis = DP) -> jax.Array:
  """One varying gradient leaf summed over `axis` and scattered along dimension k, in fp32 or on
  the bf16 wire (summed in fp32): ZeRO-3's per-layer reduction (jax3d/parallel/zero3.py)."""
  n = jax.lax.axis_size(axis)
  return _reduce_leaf(g.astype(jnp.float32), None, dtype, k, n, True, axis)[0]


def gather_16bit(x: jax.Array, k: int, axis: Axis = DP) -> jax.Array:
  """all_gather of a bf16 array along k with its bits as uint16, so that XLA cannot move a
  conversion across it and send fp32 (XLA:CPU does)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
  return jax.lax.bitcast_convert_type(jax.lax.all_gather(bits, axis, axis=k, tiled=True), x.dtype)


def _reduce_leaf(g, r, dtype: str, k: int | None, n: int, shard: bool, axis: Axis):
  """Sum over dp of one varying gradient leaf. Returns (reduced, new_residual or None)."""
  if dtype == 'float32':
    if shard and k is not None:
      return jax.lax.psum_scatter(g, axis, scatter_dimension=k, tiled=True), None
    return jax.lax.psum(g, axis), None
  if dtype == 'bfloat16':
    return _reduce_bf16(g, k, n, shard, axis), None
  return _reduce_int8(g, r, k, n, shard, axis)


def _reduce_bf16(g, k: int | None, n: int, shard: bool, axis: Axis):
  """The bf16 wire, summed in fp32. The bf16 bits travel as uint16: XLA would otherwise move the
  fp32 conversion across the (type-agnostic) all-to-all / all-gather and send fp32 (XLA:CPU does)."""
  gb = _to_u16(g)
  if k is None:
    parts = jax.lax.all_gather(gb, axis, to='invarying')  # tiny leaves only
    return jnp.sum(_from_u16(parts), axis=0)
  recv = _all_to_all_sum(gb, k, n, axis)  # [.., n, S_k/n, ..]
  mine = jnp.sum(_from_u16(recv), axis=k)
  if shard:
    return mine
  full = jax.lax.all_gather(_to_u16(mine), axis, axis=k, tiled=True, to='invarying')
  return _from_u16(full)


def _reduce_int8(g, r, k: int | None, n: int, shard: bool, axis: Axis):
  """The int8 wire with error feedback. Returns (reduced, new residual)."""
  orig_shape, k_orig = g.shape, k
  if g.ndim == 1:  # one axis: view it as [n, S/n] (or [1, S]) so that blocks and chunks differ
    g = g.reshape((n, -1) if k == 0 else (1, -1))
    r = r.reshape(g.shape)
    k = 0 if k == 0 else None
  h = g + r
  q, scale, kb, restore = quantize(h, k)
  new_r = h - restore(q.astype(jnp.float32) * scale)
  if k is None:
    qs, ss = (jax.lax.all_gather(x, axis, to='invarying') for x in (q, scale))
    total = restore(jnp.sum(qs.astype(jnp.float32) * ss, axis=0))
    return total.reshape(orig_shape), new_r.reshape(orig_shape)
  recv_q, recv_s = _all_to_all_sum(q, kb, n, axis), _all_to_all_sum(scale, kb, n, axis)
  mine_b = jnp.sum(recv_q.astype(jnp.float32) * recv_s, axis=kb)
  mine = restore(mine_b)  # this rank's 1/n of the sum along k
  if shard:
    return mine.reshape(_shard_shape(orig_shape, k_orig, n)), new_r.reshape(orig_shape)
  full, new_r = _gather_int8(mine, new_r, k, axis)
  return full.reshape(orig_shape), new_r.reshape(orig_shape)


def _gather_int8(mine, new_r, k: int, axis: Axis):
  """This rank's summed shard `mine` quantised again and all-gathered as int8. Returns (the full
  sum, the residual `new_r` with the second rounding's error added where this rank owns it)."""
  q2, s2, kb2, restore2 = quantize(mine, k)
  sent = restore2(q2.astype(jnp.float32) * s2)
  delta = mine - sent  # the second rounding's error, owned by this rank
  idx = jax.lax.axis_index(axis) * mine.shape[k]
  own = jax.lax.dynamic_slice_in_dim(new_r, idx, mine.shape[k], axis=k)
  new_r = jax.lax.dynamic_update_slice_in_dim(new_r, own + delta, idx, axis=k)
  full_q = jax.lax.all_gather(q2, axis, axis=kb2, tiled=True, to='invarying')
  full_s = jax.lax.all_gather(s2, axis, axis=kb2, tiled=True, to='invarying')
  return restore2(full_q.astype(jnp.float32) * full_s), new_r


def _block_axis(ndim: int, k: int | None) -> int:
  """The axis the int8 blocks run along: the last one, unless that is the scatter axis k."""
  return ndim - 1 if k != ndim - 1 else ndim - 2


def quantize(h: jax.Array, k: int | None) -> tuple[jax.Array, jax.Array, int | None, Callable]:
  """int8 values and fp32 per-block scales of h (ndim >= 2); blocks along `_block_axis` (BLOCK
  elements, or the whole axis when BLOCK does not divide it). Returns (q, scale, k_blocked,
  restore): q and scale in a blocked shape (axis a split into [n_blocks, block] when there are
  several blocks), `restore` maps a blocked array back to h's shape."""
  a = _block_axis(h.ndim, k)
  n_a = h.shape[a]
  if n_a > BLOCK and n_a % BLOCK == 0:
    hb = h.reshape(h.shape[:a] + (n_a // BLOCK, BLOCK) + h.shape[a + 1 :])
    red, kb = a + 1, (None if k is None else (k + 1 if k > a else k))
    restore = lambda x: x.reshape(x.shape[:a] + (x.shape[a] * x.shape[a + 1],) + x.shape[a + 2 :])
  else:  # one block spans the axis (no size-1 axis is created: XLA:CPU's all-to-all crashes on
    hb, red, kb, restore = h, a, k, (lambda x: x)  # some shapes with them)
  amax = jnp.max(jnp.abs(hb), axis=red, keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(jnp.float32)
  q = jnp.clip(jnp.round(hb / scale), -127, 127).astype(jnp.int8)
  return q, scale, kb, restore


def _all_to_all_sum(x, k: int, n: int, axis: Axis):
  """Sends chunk i (along k) to rank i; returns the n received chunks [.., n, S_k/n, ..] at k."""
  xr = x.reshape(x.shape[:k] + (n, x.shape[k] // n) + x.shape[k + 1 :])
  return jax.lax.all_to_all(xr, axis, split_axis=k, concat_axis=k, tiled=True)


def _to_u16(x):
  return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def _from_u16(x):
  return jax.lax.bitcast_convert_type(x, jnp.bfloat16).astype(jnp.float32)


def _shard_shape(shape, k, n):
  return tuple(d // n if i == k else d for i, d in enumerate(shape))
