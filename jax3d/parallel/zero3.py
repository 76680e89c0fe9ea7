"""ZeRO-3 (train.shard_params): the parameters stored sharded over dp (over dp x cp with context
parallelism), gathered where they are used.

Every parameter leaf is stored in the ZeRO layout (jax3d/parallel/data_parallel.py `zero_shardings`:
dp added on its first replicated dimension divisible by dp, never the stacked layer axis), and so
are its gradient and Adam's moments: the optimizer updates each rank's slice, and nothing is
all-gathered after the update. The stacked layers enter the pipeline's `shard_map` (manual over
dp and pp) as this rank's dp slice of this stage's layers, and are all-gathered over dp with a
tiled `all_gather` on that dimension:

  'layer'  inside the loop, each layer's weights just before it runs (and again where the
           backward pass recomputes or differentiates it). Autodiff's transpose of the gather is a
           `psum_scatter`: each use's weight gradient is reduce-scattered at once, and the loop
           accumulates slices. A layer's gathered weights are never kept for the backward pass
           (`Gather.layer`), so at most a layer's weights and their gradient exist whole at a
           time. dp wire per step: each use gathers the layer and reduce-scatters its gradient,
           and the backward gathers again.
  'step'   at the loop's entry, the stage's layers once per step; its transpose reduce-scatters
           their summed gradient once, after the loop. The same dp bytes as an all-reduce, but
           the stage's weights and their gradient exist whole during the step.

The embedding, head and final norm are used outside the loop: constrained to the layers' own
layout there (jax3d/step.py), so the compiler all-gathers them once per step and
reduce-scatters their gradients. The explicit path (16-/8-bit
reductions, bf16 parameters) gathers everything once at its entry and reduce-scatters with
`compression.reduce` (data_parallel.value_and_grad).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax3d.parallel import compression, remat
from jax3d.parallel.layer_fn import LayerFn
from jax3d.parallel.sharding import DP, TP


def gather_leaf(
  a: jax.Array, k: int, axes: str | tuple[str, ...] = DP, dtype: Any = None, reduce: str = 'float32'
) -> jax.Array:
  """The whole of leaf `a` from its slices over `axes` (dp, or dp and cp: `zero_axes`) on
  dimension `k` (-1: it is not sharded); with `dtype` (narrower than a's) cast before the gather,
  and its gradient reduce-scattered in `reduce` (train.grad_reduce_dtype: float32 or bfloat16;
  `_cast_gather`)."""
  if k < 0:
    return a
  dtype = a.dtype if dtype is None else jnp.dtype(dtype)
  if dtype == a.dtype and reduce == 'float32':
    return jax.lax.all_gather(a, axes, axis=k, tiled=True)  # its transpose: an fp32 reduce-scatter
  return _cast_gather(a, k, axes, dtype, reduce)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _cast_gather(a: jax.Array, k: int, axes: str | tuple[str, ...], dtype: Any, reduce: str) -> jax.Array:
  """all_gather(a.astype(dtype)): a weight the layer casts to the compute dtype anyway, gathered
  in it (bf16 bits as uint16, so no platform moves the cast past the gather: half fp32's wire).
  Its gradient is reduce-scattered in `reduce` (compression.reduce_scatter: fp32, or the bf16
  wire summed in fp32), not in the compute dtype autodiff would give the transpose of the cast
  gather; with fp32 it is the same sum as a gather of `a`, so the numbers do not change."""
  x = a.astype(dtype)
  if x.dtype.itemsize == 2:
    return compression.gather_16bit(x, k, axes)
  return jax.lax.all_gather(x, axes, axis=k, tiled=True)


def _cast_gather_fwd(a: jax.Array, k: int, axes: Any, dtype: Any, reduce: str) -> tuple[jax.Array, Any]:
  return _cast_gather(a, k, axes, dtype, reduce), jnp.zeros((), a.dtype)  # the residual: a's dtype


def _cast_gather_bwd(k: int, axes: Any, dtype: Any, reduce: str, like: jax.Array, g: jax.Array) -> tuple:
  return (compression.reduce_scatter(g, reduce, k, axes).astype(like.dtype),)


_cast_gather.defvjp(_cast_gather_fwd, _cast_gather_bwd)


def gather_tree(
  tree: Any,
  dims: Any,
  tp_specs: Any = None,
  axes: str | tuple[str, ...] = DP,
  dtypes: Any = None,
  reduce: str = 'float32',
) -> Any:
  """`gather_leaf` of every leaf of `tree`, `dims` its tree of sharded dimensions, `dtypes` (None:
  as stored) a tree of the dtype each leaf is gathered in (model.llama.gather_dtypes), `reduce`
  the dtype its gradient is reduce-scattered in (autodiff's transpose). `tp_specs`
  (tp > 1): each leaf's PartitionSpec over tp; the gathers then run in a `shard_map` nested over
  tp, so each device gathers its own tp block over dp (left to the partitioner, the tp-sharded
  weights were gathered whole over tp first: twice the dp bytes at tp=2)."""
  dtypes = jax.tree.map(lambda a: a.dtype, tree) if dtypes is None else dtypes
  gather = lambda t: jax.tree.map(lambda a, k, dt: gather_leaf(a, k, axes, dt, reduce), t, dims, dtypes)
  if tp_specs is None:
    return gather(tree)
  return jax.shard_map(gather, in_specs=(tp_specs,), out_specs=tp_specs, axis_names={TP}, check_vma=True)(
    tree
  )


@dataclasses.dataclass(frozen=True)
class Gather:
  """How the pipeline loop gathers its stacked layers: `dims`, a tree like the layers with each
  leaf's dp-sharded dimension in the stacked array (-1: none), the `mode`, and with tp > 1
  `tp_specs`, each stacked leaf's PartitionSpec over tp (`gather_tree`)."""

  dims: Any
  mode: str
  tp_specs: Any = None
  axes: str | tuple[str, ...] = DP  # the mesh axes of the slices: dp, or (dp, cp) (data_parallel.zero_axes)
  dtypes: Any = None  # a tree like `dims`: the dtype each leaf is gathered in (None: as stored)
  reduce: str = 'float32'  # train.grad_reduce_dtype of the gradients: float32 or bfloat16

  def specs(self, pp: str | None) -> Any:
    """The layers' in_specs over the loop's manual axes: the layer axis over `pp` (None: pp is
    not manual), the sharded dimension over dp."""

    def spec(k):
      t = [pp] + [None] * max(k, 0)
      if k > 0:
        t[k] = self.axes
      return P(*t)

    return jax.tree.map(spec, self.dims)

  def stage(self, layers: Any) -> Any:
    """The stage's layers as the loop runs them: gathered here ('step') or left as slices."""
    if self.mode != 'step':
      return layers
    return gather_tree(layers, self.dims, self.tp_specs, self.axes, self.dtypes, self.reduce)

  def layer(self, layer_fn: LayerFn, policy: str) -> LayerFn:
    """`layer_fn` gathering its layer's weights first ('layer'; unchanged under 'step'). One
    layer's weights have the stacked dimension minus the layer axis.

    No remat policy but 'none' saves a gathered weight (they save matmul outputs, names, or
    nothing), so the backward pass gathers the layer again from its slices. Under 'none' the layer
    keeps what 'dots' keeps (its matmul outputs): a policy that keeps everything but the gathered
    weights would still keep their reshaped and transposed copies, and one that names values
    inside sequence parallelism's nested tp `shard_map` (jax3d/parallel/tensor.py) fails to lower."""
    if self.mode != 'layer':
      return layer_fn
    one = jax.tree.map(lambda k: k - 1 if k > 0 else -1, self.dims)
    one_tp = None
    if self.tp_specs is not None:  # one layer: the stacked spec less the layer axis
      one_tp = jax.tree.map(lambda sp: P(*tuple(sp)[1:]), self.tp_specs, is_leaf=lambda x: isinstance(x, P))

    def gathered(p, h, side):
      # Tied to the layer's input, so the gather is not loop-invariant: a scan over micro-batches
      # around the layers' scan (pp=1) would otherwise have JAX compute every layer's gather
      # once, before it, and keep them all for the backward pass.
      p, h = jax.lax.optimization_barrier((p, h))
      return layer_fn(gather_tree(p, one, one_tp, self.axes, self.dtypes, self.reduce), h, side)

    if policy != 'none':
      return gathered
    return jax.checkpoint(gathered, policy=remat.POLICIES['dots'], prevent_cse=False)
