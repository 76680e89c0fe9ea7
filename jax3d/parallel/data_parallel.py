"""Data parallelism: the replicas, ZeRO-1, and the explicit gradient reduction.

By default data parallelism is the compiler's: the batch is sharded over dp
(jax3d/parallel/sharding.py), the weights are replicated, and XLA sums the weight gradients over
dp once per step (the pipeline loop is manual over dp so that this sum happens after it, not once
per iteration; jax3d/parallel/pipeline/stages.py). Two settings, and bf16 parameters, make the
reduction explicit, done here by hand (`explicit`):

  train.shard_optimizer=True   ZeRO-1. Adam's moments are sharded over dp on the first dimension of
                               each parameter that is replicated and divisible by dp (`zero_dim`);
                               the gradients arrive reduce-scattered to that layout, the update runs
                               on the shard, and the updated parameters are all-gathered.
  train.grad_reduce_dtype      float32 (the compiler's all-reduce), bfloat16 or int8: the
                               per-dp-rank gradients are reduced here, in a `shard_map` manual over
                               dp (and nested over tp, so each device reduces its own tp block), so
                               the bytes on the wire are 16 or 8 bits (jax3d/parallel/compression.py).
  train.param_dtype=bfloat16   the bf16 gradients are summed here in float32 (`float32` below, then
                               cast back): the compiler would sum them in bf16 along the ring
                               (bits lost with every rank; Megatron also reduces in fp32), and
                               XLA:CPU aborts on that bf16 sum inside a shard_map ('Invalid binary
                               instruction opcode copy': its reducer ends in a sharding copy).
                               grad_reduce_dtype=bfloat16 keeps the 16-bit wire.

`value_and_grad` computes the loss and gradients per device inside one shard_map manual over dp and
pp (tp stays automatic): the parameters are made varying over dp before differentiation, so no
automatic dp sum is inserted, and `compression.reduce` sums them once per step. (Under ZeRO-1 alone
the explicit path exists because XLA:CPU keeps an all-reduce followed by a slice, where an explicit
reduce-scatter moves half the bytes.)

The int8 residual is train state: `state['grad_residual']`, a tree like the parameters with a
trailing axis of size dp sharded over 'dp' (trailing, so that the layer axis stays first and a
checkpoint's pipeline relayout still finds it). It is per-rank by nature: a run resumed with a
different dp cannot reuse it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax3d.config import Config, RunPlan
from jax3d.parallel import compression, zero3
from jax3d.parallel.sharding import CP, DP, EP, PP, TP, vary

PyTree = Any  # nested dicts of arrays (or of their abstract shapes / shardings)


# --- the layouts ---------------------------------------------------------------------------------
def _spec_tuple(spec: P, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(tuple(spec)))


def zero_dim(shape: tuple[int, ...], spec: P, dp: int) -> int | None:
  """The dimension ZeRO shards over dp: the first one replicated and divisible by dp. Never the
  stacked layer axis, which is pp's even where pp is 1: a dp shard is a slice of every layer, so
  ZeRO-3 gathers one layer at a time (jax3d/parallel/zero3.py)."""
  for i, (n, ax) in enumerate(zip(shape, _spec_tuple(spec, len(shape)), strict=True)):
    if ax is None and n % dp == 0 and n >= dp:
      return i
  return None


def zero_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes ZeRO shards over and the gradients are reduced over: dp, and cp with context
  parallelism (its ranks hold the same parameters: Megatron's and torchtitan's data x context
  group); those of size > 1 (dp alone when none is)."""
  return tuple(a for a in (DP, CP) if mesh.shape.get(a, 1) > 1) or (DP,)


def zero_size(mesh: Mesh) -> int:
  """The ranks of `zero_axes` (dp * cp)."""
  return math.prod(mesh.shape[a] for a in zero_axes(mesh))


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...]:
  return axes[0] if len(axes) == 1 else axes


def zero_spec(shape: tuple[int, ...], spec: P, n: int, axes: tuple[str, ...] = (DP,)) -> P:
  """`spec` with `axes` (n ranks) added on the leaf's `zero_dim` (unchanged when it has none)."""
  k = zero_dim(shape, spec, n)
  t = list(_spec_tuple(spec, len(shape)))
  if k is not None:
    t[k] = _entry(axes)
  return P(*t)


def zero_shardings(abstract_params: PyTree, params_sh: PyTree, mesh: Mesh) -> PyTree:
  """Parameter shardings with `zero_axes` added on each leaf's `zero_dim` (the ZeRO layout:
  ZeRO-1's moments and gradients, ZeRO-3's parameters too). `params_sh`: the layers' own (tp, pp)
  layout."""
  n, axes = zero_size(mesh), zero_axes(mesh)
  return jax.tree.map(
    lambda a, sh: NamedSharding(mesh, zero_spec(a.shape, sh.spec, n, axes)), abstract_params, params_sh
  )


def dims_tree(abstract_params: PyTree, params_sh: PyTree, dp: int) -> PyTree:
  """Each leaf's `zero_dim` in the layers' own layout `params_sh`, -1 for none (a None would not
  be a pytree leaf)."""

  def k(a, sh):
    d = zero_dim(a.shape, sh.spec, dp)
    return -1 if d is None else d

  return jax.tree.map(k, abstract_params, params_sh)


def residual_shardings(params_sh: PyTree, mesh: Mesh) -> PyTree:
  """The int8 residual's shardings: each parameter's, with a trailing axis over `zero_axes`."""
  return jax.tree.map(lambda sh: NamedSharding(mesh, P(*sh.spec, _entry(zero_axes(mesh)))), params_sh)


def init_residual(params: PyTree, dp: int) -> PyTree:
  """A zero int8 residual: each parameter's shape with a trailing axis of size dp (dp * cp), fp32."""
  return jax.tree.map(lambda a: jnp.zeros((*a.shape, dp), jnp.float32), params)


# --- the decisions -----------------------------------------------------------------------------
def shard_params(cfg: Config, plan: RunPlan) -> bool:
  """ZeRO-3: the parameters themselves stored sharded over dp (train.shard_params, with dp ranks);
  jax3d/parallel/zero3.py gathers them where the layers use them."""
  return bool(cfg.train.shard_params) and plan.zero_ranks > 1


def zero1(cfg: Config, plan: RunPlan) -> bool:
  """Adam's moments and the reduced gradients in the ZeRO layout (train.shard_optimizer, or
  train.shard_params, which shards them with the parameters), when there are dp ranks."""
  return (bool(cfg.train.shard_optimizer) or shard_params(cfg, plan)) and plan.zero_ranks > 1


def explicit(cfg: Config, plan: RunPlan) -> bool:
  """Whether the dp gradient sum is done here by hand rather than by the compiler: for a 16-/8-bit
  wire format, under ZeRO-1, and for bf16 parameters (summed in float32). ZeRO-3 alone is the
  compiler's: its reduce-scatter is the transpose of the gather (jax3d/parallel/zero3.py), in
  bfloat16 too where each layer is gathered where it runs (`layer_reduces_bf16`)."""
  return plan.zero_ranks > 1 and (
    (cfg.train.grad_reduce_dtype != 'float32' and not layer_reduces_bf16(cfg, plan))
    or (zero1(cfg, plan) and not shard_params(cfg, plan))
    or cfg.train.param_dtype != 'float32'
  )


def layer_reduces_bf16(cfg: Config, plan: RunPlan) -> bool:
  """ZeRO-3 gathering per layer with train.grad_reduce_dtype=bfloat16 (fp32 parameters): each
  layer's weight gradients are reduce-scattered on the bf16 wire by the gather's own VJP
  (zero3.gather_leaf), once per use, as MaxText does; the embedding, head and final norm
  (gathered outside the loop by the compiler) in fp32."""
  t = cfg.train
  return (
    shard_params(cfg, plan)
    and t.grad_reduce_dtype == 'bfloat16'
    and t.param_dtype == 'float32'
    and t.shard_params_gather in ('layer', 'auto')
  )


def gather_mode(cfg: Config, plan: RunPlan) -> str | None:
  """ZeRO-3's gather (train.shard_params_gather; None without ZeRO-3): 'layer' gathers each layer's
  weights where it runs, 'step' a stage's layers once per step; 'auto' = 'layer', or 'step' on the
  explicit path (a 16-/8-bit reduction, bf16 parameters), which reduces each rank's whole gradient
  once per step."""
  if not shard_params(cfg, plan):
    return None
  mode = cfg.train.shard_params_gather
  if mode == 'auto':
    return 'step' if explicit(cfg, plan) else 'layer'
  return mode


def layer_gather(
  layers: PyTree, layers_sh: PyTree, cfg: Config, plan: RunPlan, mesh: Mesh, dtypes: PyTree = None
) -> zero3.Gather:
  """ZeRO-3's gather of the stacked layers (abstract `layers` in their tp/pp shardings
  `layers_sh`): each leaf's ZeRO dimension, the gather mode, with tp > 1 the tp specs, and
  `dtypes` the dtype each leaf is gathered in (model.llama.gather_dtypes; None: as stored)."""
  tp = manual_specs(layers, layers_sh, {TP}) if plan.tp > 1 else None
  dims = dims_tree(layers, layers_sh, zero_size(mesh))
  reduce = 'bfloat16' if layer_reduces_bf16(cfg, plan) else 'float32'
  return zero3.Gather(dims, gather_mode(cfg, plan), tp, _entry(zero_axes(mesh)), dtypes, reduce)


def has_residual(cfg: Config, plan: RunPlan) -> bool:
  """int8 error feedback keeps a residual per dp rank in the train state."""
  return plan.zero_ranks > 1 and cfg.train.grad_reduce_dtype == 'int8'


# --- the explicit path ---------------------------------------------------------------------------
def value_and_grad(
  local_grads: Callable,
  params: Any,
  batch: dict,
  residual: Any,
  scale: jax.Array,
  *,
  mesh: Mesh,
  params_sh: Any,
  grads_sh: Any,
  dtype: str,
  shard: bool,
  gather: bool = False,
  frozen: tuple[Any, Any, Any] | None = None,
) -> tuple:
  """Loss, dp-reduced gradients and the new int8 residual (or None), by hand.

  `local_grads(params, batch, scale)` returns (loss, grads) of this device's rows, traced inside a
  shard_map manual over dp and pp (`scale`: a scalar of the global batch, the same on every
  device: the loss's normaliser); `params` arrive varying over dp, so the gradients come back
  un-reduced. `compression.reduce` then sums them over dp in `dtype`, in a shard_map nested over tp
  so each device reduces its own tp block (sums over pp, for the embedding and head, are psums in
  fp32). `grads_sh` is the layout the gradients leave in (ZeRO-1's when `shard`). `params_sh` is
  the layers' own (tp, pp) layout; with `gather` (ZeRO-3) the parameters arrive in the ZeRO layout
  (`grads_sh`) and are all-gathered over dp once, at the entry (the 'step' gather: this path reduces
  each rank's whole gradient once per step). `frozen` (LoRA's base): (the parameters that get no
  gradient, their layers' layout, their ZeRO layout), passed to `local_grads(params, frozen, batch,
  scale)` as they are (gathered too under `gather`), never reduced."""
  dp, axes = zero_size(mesh), _entry(zero_axes(mesh))  # dp * cp ranks reduce together
  manual = {ax for ax in (DP, PP, CP) if mesh.shape.get(ax, 1) > 1}
  dims = dims_tree(params, params_sh, dp)
  res_sh = None if residual is None else residual_shardings(params_sh, mesh)
  r_specs = None if residual is None else manual_specs(residual, res_sh, manual)
  tp_specs = None
  tp_params = manual_specs(params, params_sh, {TP}) if mesh.shape[TP] > 1 else None
  blocks = {ax for ax in (TP, EP) if mesh.shape.get(ax, 1) > 1}  # each device reduces its own block
  if blocks:
    r_own = None if residual is None else manual_specs(residual, res_sh, blocks)
    own = (manual_specs(params, params_sh, blocks), manual_specs(params, grads_sh, blocks), r_own)
    tp_specs = (*own, blocks)
  reduce_dp = lambda g, r: compression.reduce(g, r, dims, dtype, dp, shard, axes)
  reduce_fn = functools.partial(_reduce_own_tp_blocks, reduce_dp, tp_specs)
  fixed, fixed_sh, fixed_zero_sh = frozen if frozen is not None else ({}, {}, {})
  gathers = None
  if gather:
    tp_fixed = manual_specs(fixed, fixed_sh, {TP}) if mesh.shape[TP] > 1 else None
    gathers = ((dims, tp_params, axes), (dims_tree(fixed, fixed_sh, dp), tp_fixed, axes))
  fn = jax.shard_map(
    functools.partial(_local_value_and_grad, local_grads, reduce_fn, manual, gathers),
    mesh=mesh,
    in_specs=(
      manual_specs(params, grads_sh if gather else params_sh, manual),
      manual_specs(fixed, fixed_zero_sh if gather else fixed_sh, manual),
      P(*(a if a in manual else None for a in (DP, CP))),  # the rows over dp, their tokens over cp
      r_specs,
      P(),
    ),
    out_specs=(P(), manual_specs(params, grads_sh, manual), r_specs),
    axis_names=manual,
    check_vma=True,
  )
  return fn(params, fixed, batch, residual, scale)


def _local_value_and_grad(
  local_grads: Callable,
  reduce_fn: Callable,
  manual: set,
  gather: tuple | None,
  params: Any,
  frozen: Any,
  batch: dict,
  residual: Any,
  scale: jax.Array,
) -> tuple:
  """One device's loss and gradients (inside the shard_map manual over dp and pp), summed over
  dp by `reduce_fn(grads, residual)`, which also returns the new residual.

  The weights every stage holds (embedding, head) are made varying over pp too, and their gradient
  sum over pp is done here in float32: for bf16 weights the automatic sum would be a bf16
  all-reduce in a shard_map, which XLA:CPU aborts on (its reducer ends in a sharding copy).
  `gather` (ZeRO-3): (dims, tp specs) of `zero3.gather_tree` for the parameters and for `frozen`,
  which arrive as dp shards and are gathered here (outside the differentiated function: the
  gradients stay per-rank for `reduce_fn`). `frozen` is passed on, not differentiated."""
  if gather is not None:
    params, frozen = zero3.gather_tree(params, *gather[0]), zero3.gather_tree(frozen, *gather[1])
  leaves, tdef = jax.tree.flatten(params)
  over_pp = [PP in manual and PP not in jax.typeof(a).manual_axis_type.varying for a in leaves]
  zero = tuple(a for a in (DP, CP) if a in manual)
  varied = [vary(a, (*zero, PP) if o else zero) for a, o in zip(leaves, over_pp, strict=True)]
  loss, grads = local_grads(tdef.unflatten(varied), frozen, batch, scale)
  grads = tdef.unflatten(
    [
      jax.lax.psum(g.astype(jnp.float32), PP).astype(g.dtype) if o else g
      for g, o in zip(tdef.flatten_up_to(grads), over_pp, strict=True)
    ]
  )
  loss = jax.lax.psum(
    loss, tuple(ax for ax in (DP, PP, CP) if ax in manual and ax in jax.typeof(loss).manual_axis_type.varying)
  )
  return (loss, *reduce_fn(grads, residual))


def _reduce_own_tp_blocks(reduce_fn: Callable, tp_specs: tuple | None, grads: Any, residual: Any) -> tuple:
  """`reduce_fn(grads, residual)` on each device's own tp (and ep) block: in a shard_map nested over
  tp and ep (specs `tp_specs` = (grads in, grads out, residual, the axes); None when both are 1),
  so the partitioner cannot gather tp-sharded gradients before the dp collectives (which would put
  full-tp arrays on the dp wire, and add tp all-gathers), nor the experts split over ep (Mixtral
  8x7B at dp 2 x ep 8 on 16 x H100: each device's reduce-scatter of every expert's gradient, 223 GB
  compiled)."""
  if tp_specs is None:
    return reduce_fn(grads, residual)
  g_in, g_out, r_tp, axes = tp_specs
  nested = jax.shard_map(
    reduce_fn, in_specs=(g_in, r_tp), out_specs=(g_out, r_tp), axis_names=axes, check_vma=True
  )
  return nested(grads, residual)


def manual_specs(tree: PyTree, shardings: PyTree, manual: set) -> PyTree:
  """Each leaf's PartitionSpec restricted to the `manual` mesh axes (shard_map specs name no
  others)."""
  return jax.tree.map(lambda x, sh: _manual_spec(sh.spec, x.ndim, manual), tree, shardings)


def _manual_spec(spec: P, ndim: int, manual: set) -> P:
  """A PartitionSpec restricted to the `manual` mesh axes."""
  out = []
  for e in _spec_tuple(spec, ndim):
    names = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a in manual)
    out.append(names[0] if len(names) == 1 else (names or None))
  while out and out[-1] is None:
    out.pop()
  return P(*out)
