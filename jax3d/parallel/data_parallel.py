"""Data parallelism, all of it: the replicas, ZeRO-1, and the compressed gradient reduction.

By default data parallelism is the compiler's: the batch is sharded over dp
(jax3d/parallel/sharding.py), the weights are replicated, and XLA sums the weight gradients over
dp once per step (the pipeline loop is manual over dp so that this sum happens after it, not once
per iteration; jax3d/parallel/pipeline.py). Two
settings, and bf16 parameters, make the reduction explicit, done here by hand (`explicit`):

  train.shard_optimizer=True   ZeRO-1. Adam's moments are sharded over dp on the first dimension of
                               each parameter that is replicated and divisible by dp (`zero_dim`);
                               the gradients arrive reduce-scattered to that layout, the update runs
                               on the shard, and the updated parameters are all-gathered.
  train.grad_reduce_dtype      float32 (the compiler's all-reduce), bfloat16 or int8: the
                               per-dp-rank gradients are reduced here, in a `shard_map` manual over
                               dp (and nested over tp, so each device reduces its own tp block), so
                               the bytes on the wire are 16 or 8 bits.
  train.param_dtype=bfloat16   the bf16 gradients are summed here in float32 (`float32` below, then
                               cast back): the compiler would sum them in bf16 along the ring
                               (bits lost with every rank; Megatron also reduces in fp32), and
                               XLA:CPU aborts on that bf16 sum inside a shard_map ('Invalid binary
                               instruction opcode copy': its reducer ends in a sharding copy).
                               grad_reduce_dtype=bfloat16 keeps the 16-bit wire.

`value_and_grad` computes the loss and gradients per device inside one shard_map manual over dp and
pp (tp stays automatic): the parameters are made varying over dp before differentiation, so no
automatic dp sum is inserted, and `reduce` sums them once per step. (Under ZeRO-1 alone the
explicit path exists because XLA:CPU keeps an all-reduce followed by a slice, where an explicit
reduce-scatter moves half the bytes.)

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

The int8 residual is train state: `state['grad_residual']`, a tree like the parameters with a
trailing axis of size dp sharded over 'dp' (trailing, so that the layer axis stays first and a
checkpoint's pipeline relayout still finds it). It is per-rank by nature: a run resumed with a
different dp cannot reuse it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax3d.config import RunPlan
from jax3d.parallel.sharding import DP, PP, TP

PyTree = Any  # nested dicts of arrays (or of their abstract shapes / shardings)
AXIS = DP
BLOCK = 256  # int8 block length (elements of one axis sharing a scale)


def _spec_tuple(spec: P, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(tuple(spec)))


def zero_dim(shape: tuple[int, ...], spec: P, dp: int) -> int | None:
  """The dimension ZeRO-1 shards over dp: the first one replicated and divisible by dp."""
  for i, (n, ax) in enumerate(zip(shape, _spec_tuple(spec, len(shape)), strict=True)):
    if ax is None and n % dp == 0 and n >= dp:
      return i
  return None


def zero_spec(shape: tuple[int, ...], spec: P, dp: int) -> P:
  """`spec` with dp added on the leaf's `zero_dim` (unchanged when it has none)."""
  k = zero_dim(shape, spec, dp)
  t = list(_spec_tuple(spec, len(shape)))
  if k is not None:
    t[k] = AXIS
  return P(*t)


def zero_shardings(abstract_params: PyTree, params_sh: PyTree, mesh: Mesh, dp: int) -> PyTree:
  """Parameter shardings with dp added on each leaf's `zero_dim` (the ZeRO-1 layout)."""
  return jax.tree.map(
    lambda a, sh: NamedSharding(mesh, zero_spec(a.shape, sh.spec, dp)), abstract_params, params_sh
  )


def residual_shardings(params_sh: PyTree, mesh: Mesh) -> PyTree:
  """The int8 residual's shardings: each parameter's, with a trailing axis over dp."""
  return jax.tree.map(lambda sh: NamedSharding(mesh, P(*sh.spec, AXIS)), params_sh)


def init_residual(params: PyTree, dp: int) -> PyTree:
  """A zero int8 residual: each parameter's shape with a trailing axis of size dp, fp32."""
  return jax.tree.map(lambda a: jnp.zeros((*a.shape, dp), jnp.float32), params)


# --- inside a shard_map manual over dp ----------------------------------------------------------
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


def _all_to_all_sum(x, k: int, n: int):
  """Sends chunk i (along k) to rank i; returns the n received chunks [.., n, S_k/n, ..] at k."""
  xr = x.reshape(x.shape[:k] + (n, x.shape[k] // n) + x.shape[k + 1 :])
  return jax.lax.all_to_all(xr, AXIS, split_axis=k, concat_axis=k, tiled=True)


def _reduce_leaf(g, r, dtype: str, k: int | None, n: int, shard: bool):
  """Sum over dp of one varying gradient leaf. Returns (reduced, new_residual or None)."""
  if dtype == 'float32':
    if shard and k is not None:
      return jax.lax.psum_scatter(g, AXIS, scatter_dimension=k, tiled=True), None
    return jax.lax.psum(g, AXIS), None

  if dtype == 'bfloat16':
    # The bf16 bits travel as uint16: XLA would otherwise move the fp32 conversion across the
    # (type-agnostic) all-to-all / all-gather and send fp32 (XLA:CPU does).
    gb = _to_u16(g)
    if k is None:
      parts = jax.lax.all_gather(gb, AXIS, to='invarying')  # tiny leaves only
      return jnp.sum(_from_u16(parts), axis=0), None
    recv = _all_to_all_sum(gb, k, n)  # [.., n, S_k/n, ..]
    mine = jnp.sum(_from_u16(recv), axis=k)
    if shard:
      return mine, None
    full = jax.lax.all_gather(_to_u16(mine), AXIS, axis=k, tiled=True, to='invarying')
    return _from_u16(full), None

  # int8 with error feedback
  orig_shape, k_orig = g.shape, k
  if g.ndim == 1:  # one axis: view it as [n, S/n] (or [1, S]) so that blocks and chunks differ
    g = g.reshape((n, -1) if k == 0 else (1, -1))
    r = r.reshape(g.shape)
    k = 0 if k == 0 else None
  h = g + r
  q, scale, kb, restore = quantize(h, k)
  new_r = h - restore(q.astype(jnp.float32) * scale)
  if k is None:
    qs, ss = (jax.lax.all_gather(x, AXIS, to='invarying') for x in (q, scale))
    total = restore(jnp.sum(qs.astype(jnp.float32) * ss, axis=0))
    return total.reshape(orig_shape), new_r.reshape(orig_shape)
  recv_q, recv_s = _all_to_all_sum(q, kb, n), _all_to_all_sum(scale, kb, n)
  mine_b = jnp.sum(recv_q.astype(jnp.float32) * recv_s, axis=kb)
  mine = restore(mine_b)  # this rank's 1/n of the sum along k
  if shard:
    return mine.reshape(_shard_shape(orig_shape, k_orig, n)), new_r.reshape(orig_shape)
  q2, s2, kb2, restore2 = quantize(mine, k)
  sent = restore2(q2.astype(jnp.float32) * s2)
  delta = mine - sent  # the second rounding's error, owned by this rank
  idx = jax.lax.axis_index(AXIS) * mine.shape[k]
  own = jax.lax.dynamic_slice_in_dim(new_r, idx, mine.shape[k], axis=k)
  new_r = jax.lax.dynamic_update_slice_in_dim(new_r, own + delta, idx, axis=k)
  full_q = jax.lax.all_gather(q2, AXIS, axis=kb2, tiled=True, to='invarying')
  full_s = jax.lax.all_gather(s2, AXIS, axis=kb2, tiled=True, to='invarying')
  full = restore2(full_q.astype(jnp.float32) * full_s)
  return full.reshape(orig_shape), new_r.reshape(orig_shape)


def _to_u16(x):
  return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def _from_u16(x):
  return jax.lax.bitcast_convert_type(x, jnp.bfloat16).astype(jnp.float32)


def _shard_shape(shape, k, n):
  return tuple(d // n if i == k else d for i, d in enumerate(shape))


def reduce(
  grads: PyTree, residual: PyTree | None, dims: PyTree, dtype: str, n: int, shard: bool
) -> tuple[PyTree, PyTree | None]:
  """The dp sum of every gradient leaf (inside a shard_map manual over dp).

  grads: varying per-rank gradients; residual: the int8 error-feedback tree (local [..., 1]) or
  None; dims: a tree of `zero_dim`s (-1 for none, as `dims_tree` gives). Returns (reduced grads,
  new residual or None): full arrays, or under `shard` the rank's slice along its zero_dim (the
  ZeRO-1 layout)."""
  leaves, tdef = jax.tree.flatten(grads)
  dim_leaves = tdef.flatten_up_to(dims)
  res_leaves = tdef.flatten_up_to(residual) if residual is not None else [None] * len(leaves)
  out, new_res = [], []
  for g, k, r in zip(leaves, dim_leaves, res_leaves, strict=True):
    k = None if k < 0 else k
    r_local = None if r is None else r[..., 0]
    red, nr = _reduce_leaf(g.astype(jnp.float32), r_local, dtype, k, n, shard)
    out.append(red.astype(g.dtype))  # the optimizer sees the parameters' dtype
    new_res.append(None if nr is None else nr[..., None])
  reduced = tdef.unflatten(out)
  return reduced, (tdef.unflatten(new_res) if residual is not None else None)


def dims_tree(abstract_params: PyTree, params_sh: PyTree, dp: int) -> PyTree:
  """Each leaf's `zero_dim`, -1 for none (a None would not be a pytree leaf)."""

  def k(a, sh):
    d = zero_dim(a.shape, sh.spec, dp)
    return -1 if d is None else d

  return jax.tree.map(k, abstract_params, params_sh)


# --- the decisions -----------------------------------------------------------------------------
def zero1(cfg: ml_collections.ConfigDict, plan: RunPlan) -> bool:
  """ZeRO-1: Adam's moments sharded over dp (train.shard_optimizer, when there are dp ranks)."""
  return bool(cfg.train.shard_optimizer) and plan.dp > 1


def explicit(cfg: ml_collections.ConfigDict, plan: RunPlan) -> bool:
  """Whether the dp gradient sum is done here by hand rather than by the compiler: for a 16-/8-bit
  wire format, under ZeRO-1, and for bf16 parameters (summed in float32)."""
  return plan.dp > 1 and (
    cfg.train.grad_reduce_dtype != 'float32' or zero1(cfg, plan) or cfg.train.param_dtype != 'float32'
  )


def has_residual(cfg: ml_collections.ConfigDict, plan: RunPlan) -> bool:
  """int8 error feedback keeps a residual per dp rank in the train state."""
  return plan.dp > 1 and cfg.train.grad_reduce_dtype == 'int8'


# --- the explicit path ---------------------------------------------------------------------------
def _manual_spec(spec: P, ndim: int, manual: set) -> P:
  """A PartitionSpec restricted to the `manual` mesh axes (shard_map specs name no others)."""
  out = []
  for e in tuple(spec) + (None,) * (ndim - len(tuple(spec))):
    names = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a in manual)
    out.append(names[0] if len(names) == 1 else (names or None))
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def vary(x: jax.Array) -> jax.Array:
  """Marks x as differing per dp rank (inside the explicit path's shard_map)."""
  return jax.lax.pcast(x, (AXIS,), to='varying')


def value_and_grad(
  local_grads: Callable,
  params: Any,
  batch: dict,
  residual: Any,
  *,
  mesh: Mesh,
  params_sh: Any,
  grads_sh: Any,
  dtype: str,
  shard: bool,
) -> tuple:
  """Loss, dp-reduced gradients and the new int8 residual (or None), by hand.

  `local_grads(params, batch)` returns (loss, grads) of this device's rows, traced inside a
  shard_map manual over dp and pp; `params` arrive varying over dp, so the gradients come back
  un-reduced. `reduce` then sums them over dp in `dtype`, in a shard_map nested over tp so each
  device reduces its own tp block (sums over pp, for the embedding and head, are psums in fp32).
  `grads_sh` is the layout the gradients leave in (ZeRO-1's when `shard`)."""
  dp = mesh.shape[AXIS]
  manual = {ax for ax in (DP, PP) if mesh.shape[ax] > 1}
  dims = dims_tree(params, params_sh, dp)
  specs = lambda tree, shs, axes: jax.tree.map(lambda x, sh: _manual_spec(sh.spec, x.ndim, axes), tree, shs)
  res_sh = None if residual is None else residual_shardings(params_sh, mesh)
  r_specs = None if residual is None else specs(residual, res_sh, manual)

  def local(params, batch, residual):
    # The weights every stage holds (embedding, head) are made varying over pp too, and their
    # gradient sum over pp is done here in float32: for bf16 weights the automatic sum would be a
    # bf16 all-reduce in a shard_map, which XLA:CPU aborts on (its reducer ends in a sharding copy).
    leaves, tdef = jax.tree.flatten(params)
    over_pp = [PP in manual and PP not in jax.typeof(a).manual_axis_type.varying for a in leaves]
    varied = [
      jax.lax.pcast(vary(a), (PP,), to='varying') if o else vary(a)
      for a, o in zip(leaves, over_pp, strict=True)
    ]
    loss, grads = local_grads(tdef.unflatten(varied), batch)
    grads = tdef.unflatten(
      [
        jax.lax.psum(g.astype(jnp.float32), PP).astype(g.dtype) if o else g
        for g, o in zip(tdef.flatten_up_to(grads), over_pp, strict=True)
      ]
    )
    loss = jax.lax.psum(
      loss, tuple(ax for ax in (DP, PP) if ax in manual and ax in jax.typeof(loss).manual_axis_type.varying)
    )
    return (loss, *reduce_keep_tp(grads, residual))

  def reduce_keep_tp(grads, residual):
    """`reduce` on each device's own tp block: in a shard_map nested over tp, so the partitioner
    cannot gather tp-sharded gradients before the dp collectives (which would put full-tp arrays on
    the dp wire, and add tp all-gathers)."""
    fn = lambda g, r: reduce(g, r, dims, dtype, dp, shard)
    if mesh.shape[TP] == 1:
      return fn(grads, residual)
    r_tp = None if residual is None else specs(residual, res_sh, {TP})
    nested = jax.shard_map(
      fn,
      in_specs=(specs(params, params_sh, {TP}), r_tp),
      out_specs=(specs(params, grads_sh, {TP}), r_tp),
      axis_names={TP},
      check_vma=True,
    )
    return nested(grads, residual)

  fn = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(specs(params, params_sh, manual), P(AXIS), r_specs),
    out_specs=(P(), specs(params, grads_sh, manual), r_specs),
    axis_names=manual,
    check_vma=True,
  )
  return fn(params, batch, residual)
