"""Named rematerialisation (`jax.checkpoint`) policies: what a layer keeps for the backward pass.

none  keep every intermediate (fastest, most memory)
full  keep only each layer's input; recompute the whole layer once in the backward pass
stage keep only each pipeline iteration's input (the stage's chunk of layers on one micro-batch);
      the backward pass recomputes the iteration, and inside it each layer once more (its layers
      are checkpointed as under 'full'): the least memory, two extra forwards
dots  keep the outputs of matmuls without batch dimensions (projections); recompute the rest
      (norms, rotary, softmax, SwiGLU): most of the saving at little recompute
attn  keep only the attention output (named 'attn_out'); recompute projections and MLP
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jax3d.parallel.tensor import SP_PROJECTION

POLICIES = {
  'none': None,
  'full': jax.checkpoint_policies.nothing_saveable,
  'stage': jax.checkpoint_policies.nothing_saveable,  # per layer, inside the iteration's checkpoint
  'dots': jax.checkpoint_policies.save_from_both_policies(  # and sequence parallelism's projections
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(SP_PROJECTION),
  ),
  'attn': jax.checkpoint_policies.save_only_these_names('attn_out'),
}


def wrap_layer(fn: Callable, policy: str) -> Callable:
  """The layer function under the named policy (unchanged for 'none')."""
  if policy == 'none':
    return fn
  return jax.checkpoint(fn, policy=POLICIES[policy], prevent_cse=False)


def wrap_iteration(fn: Callable, policy: str) -> Callable:
  """The pipeline iteration under 'stage' keeps only its input; other policies act per layer only
  (a checkpoint around checkpointed layers would compute the forward three times)."""
  if policy != 'stage':
    return fn
  return jax.checkpoint(fn, policy=POLICIES['stage'], prevent_cse=False)
