"""The tensor- and sequence-parallel collectives of a layer.

Plain tensor parallelism needs none written here: the model annotates its weights and activations
in logical names (jax3d/parallel/sharding.py), and XLA inserts the all-reduce after each
row-parallel projection. Sequence parallelism (Megatron-SP, `train.sequence_parallel`) splits the
residual stream's rows over tp as well; its collectives are written out, on each tp rank's blocks
(`sharding.tp_local`), because XLA:CPU keeps an all-reduce and a slice where a reduce-scatter is
meant:

  column-parallel projection (kernel names start with 'embed'): all-gather the input's rows, then
    the local matmul. The gather sits inside a checkpoint, so the backward pass keeps the rows
    split and gathers them again, as Megatron-LM does (its transpose reduce-scatters the input
    gradient).
  row-parallel projection (kernel names end with 'embed'): the local matmul, then reduce-scatter
    its partial sums over the rows.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from jax3d.parallel import sharding
from jax3d.parallel.sharding import TP, constrain

SP_PROJECTION = 'sp_projection'  # checkpoint name of a sequence-parallel projection's output


def sequence_parallel_dense(
  x: jax.Array, kernel: jax.Array, axes: tuple[int, ...], names: tuple[str, ...], dtype: Any
) -> jax.Array:
  """`x` contracted over its `axes` with `kernel` (logical axis names `names`, the contracted ones
  first), in `dtype`, under sequence parallelism: column-parallel when `names` start with 'embed'
  (rows gathered first), row-parallel when they end with it (partial sums reduce-scattered over
  the rows). The output is named SP_PROJECTION, so remat 'dots' keeps it."""
  n_in, row = len(axes), names[-1] == 'embed'

  def local(x, w):
    x, w = x.astype(dtype), w.astype(dtype)
    if not row:
      x = jax.lax.all_gather(x, TP, axis=0, tiled=True)
    y = jax.lax.dot_general(x, w, ((axes, tuple(range(n_in))), ((), ())))
    return jax.lax.psum_scatter(y, TP, scatter_dimension=0, tiled=True) if row else y

  # whole rows over tp ('rows': split over cp where the mesh has it), or split over tp ('rows_sp')
  x_names = ('rows' if row else 'rows_sp',) + names[:n_in]
  out_names = ('rows_sp', 'embed') if row else ('rows',) + names[n_in:]
  # Nothing inside is a residual (a policy's residual inside a nested shard_map fails to lower);
  # the output is named, so remat 'dots' still keeps the projections.
  fn = jax.checkpoint(local, prevent_cse=False)
  x = constrain(x, x_names)  # a saved input (remat 'attn') arrives with the outer loops' sharding
  return checkpoint_name(sharding.tp_local(fn, (x_names, names), out_names)(x, kernel), SP_PROJECTION)
