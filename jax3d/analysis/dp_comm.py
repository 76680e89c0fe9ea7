"""The dp traffic per device per step of a compiled layout (`dp_comm`, for the inspection's checks,
jax3d/analysis/inspection.py), in wire bytes of a ring (jax3d/analysis/hlo.py); ZeRO-3's part
(train.shard_params, jax3d/parallel/zero3.py) is shared with the planner's time model
(jax3d/planning/time_model.py).

ZeRO-3 on the compiler's path:
With r = (d-1)/d, L the stage's layer bytes and S the other parameters' (embedding, head, final
norm), both in their tp/pp layout (what a device holds without ZeRO-3):

  'step'   the stage's layers all-gathered once at the loop's entry and their summed gradient
           reduce-scattered once after it: 2rL, an all-reduce's bytes.
  'layer'  each use of a layer (every iteration the loop runs, bubble iterations and 1F1B's idle
           halves included, times grad_accum) gathers its weights (rL/layers), the backward pass
           gathers them again `REGATHERS[policy]` times, and its weight gradient is
           reduce-scattered (rL/layers).
  S        all-gathered once before use (rS); its gradient all-reduced over dp (2rS), or over dp
           and pp at once (2(dp*pp-1)/(dp*pp) S) where the batch outside the loop is split over pp:
           XLA sums these small gradients whole, then keeps the slice.

REGATHERS was read off the compiled HLO (tiny, 8-1-1, 2-2-2 and 2-4-1): 'none' (under the layer
gather the layer keeps what 'dots' keeps, zero3.Gather.layer), 'dots', 'attn' and 'full' recompute
the layer once; 'stage' recomputes the iteration and, inside it, each checkpointed layer: twice.
1F1B's backward recomputes its chunk from the stashed input, one gather more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jax3d.model import lora

if TYPE_CHECKING:
  from jax3d.setup import Setup

REGATHERS = {'none': 1, 'dots': 1, 'attn': 1, 'full': 1, 'stage': 2}


def regathers(policy: str) -> int:
  """All-gathers of a layer's weights in the backward pass of one use, besides the forward's (both
  schedules: 1F1B keeps its chunks' VJP residuals as GPipe does)."""
  return REGATHERS[policy]


def layer_uses(n_layers: int, pp: int, repeats: int, loop_steps: int, grad_accum: int) -> int:
  """Layer runs per device per step: `loop_steps` (the loop's iterations) times
  the layers each runs (n_layers / (pp*repeats)), times grad_accum."""
  return loop_steps * (n_layers // (pp * repeats)) * grad_accum


def dp_bytes(
  mode: str,
  *,
  dp: int,
  layers: float,
  shared: float,
  layers_per_stage: int,
  uses: int,
  gathers_back: int,
  shared_group: int,
  grad_accum: int = 1,
  layers_grad: float | None = None,
) -> dict:
  """{'wire': wire bytes over groups with dp, 'reduced': the gradient buffer bytes that enter a dp
  reduction (reduce-scatter operands, all-reduce buffers), 'gathered': the all-gathers' wire
  bytes}. `layers`/`shared`: L and S in bytes as gathered; `layers_grad`: L's gradient in bytes
  as reduced (None: L; the matmul weights are gathered in the compute dtype and reduced in
  train.grad_reduce_dtype, jax3d/parallel/zero3.py); `shared_group`: the group S's gradient is summed
  over (dp, or dp*pp). Gathers of loop-invariant weights are hoisted out of the loops by XLA: the
  'step' gather and S's; reductions are not (one per grad_accum chunk, or per use). A 'layer'
  gather is tied to its layer's input (zero3.Gather.layer), so it runs per use even where a stage
  holds one layer (the same weights in every iteration)."""
  r = (dp - 1) / dp
  g = shared_group
  grad = layers if layers_grad is None else layers_grad
  if mode == 'step':
    gathered, reduced = r * layers, grad_accum * grad
  else:
    gathered = uses * (1 + gathers_back) * r * layers / layers_per_stage
    reduced = uses * grad / layers_per_stage
  gathered += r * shared
  wire = gathered + r * reduced + grad_accum * 2 * (g - 1) / g * shared
  return {'wire': wire, 'reduced': reduced + grad_accum * shared, 'gathered': gathered}


def dp_comm(s: Setup) -> dict:
  """expected_comm's dp part: {'wire': wire bytes over groups with dp, 'shared_wire': those of the
  weights every pp stage holds, 'grads': the gradient bytes entering the dp reduction, 'p_local'
  and 'layers_local': the parameter bytes this device holds in the layers' own (tp, pp) layout
  (all, the layers'): under ZeRO-3 it stores 1/dp of them and gathers them, `zero3_bytes`)."""
  plan = s.plan
  p, d = plan.pp, plan.dp
  params = s.abstract_state['params']
  own = s.compute_shardings if s.compute_shardings is not None else jax.tree.map(lambda x: x.sharding, params)
  elems = lambda x, sh: int(np.prod(sh.shard_shape(x.shape)))
  p_local = sum(elems(x, sh) * x.dtype.itemsize for x, sh in zip(*_leaves(params, own), strict=True))
  layers_local = sum(
    elems(x, sh) * x.dtype.itemsize for x, sh in zip(*_leaves(params['layers'], own['layers']), strict=True)
  )
  # the gradients reduced over dp: every parameter's, or with LoRA the adapters' (jax3d/model/lora.py)
  trained, trained_own = lora.trainable(s.dims, params)[0], lora.trainable(s.dims, own)[0]
  n_local = sum(elems(x, sh) for x, sh in zip(*_leaves(trained, trained_own), strict=True))
  ring = 2 * (d - 1) / d
  pb = jax.tree.leaves(trained)[0].dtype.itemsize  # one param_dtype for every trained parameter
  explicit = s.explicit_dp
  reduce_b = {'float32': 4, 'bfloat16': 2, 'int8': 1}[s.cfg.train.grad_reduce_dtype] if explicit else pb
  gather_b = pb if s.zero1 else reduce_b
  grads = n_local * reduce_b if d > 1 else 0  # the gradient bytes that enter the dp reduction
  dp_wire = ring / 2 * n_local * (reduce_b + gather_b)
  split = p > 1 and plan.pp_batch_split is not None
  if s.zero3 and not explicit:
    cfg = s.cfg
    # the layers as gathered (matmul weights in the compute dtype) and their gradients as reduced
    layer_leaves = _leaves(params['layers'], own['layers'])
    dtypes = s.gather.dtypes or jax.tree.map(lambda x: x.dtype, params['layers'])
    as_gathered = sum(
      elems(x, sh) * jnp.dtype(dt).itemsize
      for x, sh, dt in zip(*layer_leaves, jax.tree.leaves(dtypes), strict=True)
    )
    reduce_b = 2 if s.gather.reduce == 'bfloat16' else None
    as_reduced = sum(
      elems(x, sh) * (reduce_b or x.dtype.itemsize) for x, sh in zip(*layer_leaves, strict=True)
    )
    z = zero3_bytes(
      s.gather.mode,
      plan,
      s.dims.n_layers,
      cfg.train.remat,
      cfg.pipeline.schedule,
      as_gathered,
      p_local - layers_local,
      d * p if split else d,
      as_reduced,
    )
    return {'wire': z['wire'], 'shared_wire': 0.0, 'grads': z['reduced']} | {
      'p_local': p_local,
      'layers_local': layers_local,
    }
  # The weights every stage holds (embedding, head, final norm) get a partial gradient on each pp
  # rank when the batch outside the loop is split over pp: XLA sums those over dp and pp at once
  # (in a group with dp when dp > 1, else over pp alone).
  shared_wire = 0.0
  if not explicit and split and not s.dims.lora_rank:  # (LoRA: the shared weights are frozen)
    shared_wire = 2 * (d * p - 1) / (d * p) * (p_local - layers_local)
    if d > 1:
      dp_wire += shared_wire - ring * (p_local - layers_local)
  return {
    'wire': dp_wire,
    'shared_wire': shared_wire,
    'grads': grads,
    'p_local': p_local,
    'layers_local': layers_local,
  }


def _leaves(tree: Any, shardings: Any) -> tuple[list, list]:
  """The leaves of `tree` and of its tree of `shardings`, in the same order."""
  return jax.tree.leaves(tree), jax.tree.leaves(
    shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
  )


def zero3_bytes(
  mode: str,
  plan: Any,
  n_layers: int,
  remat: str,
  schedule: str,
  layers: float,
  shared: float,
  shared_group: int,
  layers_grad: float | None = None,
) -> dict:
  """`dp_bytes` of ZeRO-3 on the compiler's path for a layout (`plan`: a RunPlan), the loop's
  steps and uses from its schedule: what `jax3d.inspect` checks and the time model prices."""
  steps = plan.iterations  # 1F1B: forwards (and backwards) in v*m+p-1 ticks, GPipe's count
  return dp_bytes(
    mode,
    dp=plan.dp,
    layers=layers,
    shared=shared,
    layers_per_stage=n_layers // plan.pp,
    uses=layer_uses(n_layers, plan.pp, plan.repeats, steps, plan.grad_accum),
    gathers_back=regathers(remat),
    shared_group=shared_group,
    grad_accum=plan.grad_accum,
    layers_grad=layers_grad,
  )
