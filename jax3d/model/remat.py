"""Named rematerialisation (`jax.checkpoint`) policies: what a layer keeps for the backward pass.

none  keep every intermediate (fastest, most memory)
full  keep only each layer's input; recompute the whole layer in the backward pass
      (and, in the pipeline, keep only each loop iteration's input)
dots  keep the outputs of matmuls without batch dimensions (projections); recompute the rest
      (norms, rotary, softmax, SwiGLU): most of the saving at little recompute
attn  keep only the attention output (named 'attn_out'); recompute projections and MLP
"""

from __future__ import annotations

from collections.abc import Callable

import jax

POLICIES = {
  'none': None,
  'full': jax.checkpoint_policies.nothing_saveable,
  'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  'attn': jax.checkpoint_policies.save_only_these_names('attn_out'),
}


def wrap_layer(fn: Callable, policy: str) -> Callable:
  """The layer function under the named policy (unchanged for 'none')."""
  if policy == 'none':
    return fn
  return jax.checkpoint(fn, policy=POLICIES[policy], prevent_cse=False)


def wrap_iteration(fn: Callable, policy: str) -> Callable:
  """The pipeline iteration under 'full' keeps only its carry; other policies act per layer."""
  if policy != 'full':
    return fn
  return jax.checkpoint(fn, policy=POLICIES['full'], prevent_cse=False)
