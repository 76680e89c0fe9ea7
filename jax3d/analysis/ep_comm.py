"""Expert parallelism's bytes (mesh.ep > 1; jax3d/parallel/expert.py), per device, as
docs/formulas.md states them: `python -m jax3d.inspect`'s check of the compiled step
(jax3d/analysis/comm_checks.py) reads them here. Pure arithmetic, no jax.

Per mixture-of-experts layer and micro-batch, a device dispatches its rows' slots [b, E, C, d]
(b = its rows, C = moe.capacity per sequence, or per cp rank's share of one with mesh.cp > 1): the
forward sends them to the experts' ranks and the outputs back (two all-to-alls), the written-out
backward sends the slots again, the outputs' gradient there and the slots' gradient back (three):
5 (e-1)/e * b*E*C*d * bytes_per_element, wire bytes as jax3d/analysis/hlo.py defines them for an
all-to-all over e devices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jax3d.model import formulas

if TYPE_CHECKING:
  from jax3d.config import RunPlan

ALL_TO_ALLS_PER_LAYER = 5  # forward: there and back; backward: slots there, gradient there, back
# train.remat policies that recompute a layer's forward in the backward: one all-to-all more
# (measured: the recomputed forward's dispatch is shared with the backward's, its return is not)
RECOMPUTING = ('full', 'stage')


def group_capacity(plan: RunPlan, capacity_factor: float, top_k: int, n_experts: int) -> int:
  """Slots per expert and capacity group: a sequence, or with mesh.cp > 1 a cp rank's share of one
  (jax3d/model/moe.py), by formulas.capacity."""
  return formulas.capacity(capacity_factor, plan.seq_len // plan.cp, top_k, n_experts)


def dispatch_buffer_bytes(plan: RunPlan, n_experts: int, cap: int, d_model: int, itemsize: int) -> float:
  """One layer's dispatched slots on one device for one micro-batch: b*E*C*d*bytes, b its rows."""
  rows = plan.micro_batch // (plan.dp * plan.ep)
  return float(rows * n_experts * cap * d_model * itemsize)


def ep_dispatch_bytes(
  plan: RunPlan, n_layers: int, n_experts: int, cap: int, d_model: int, itemsize: int, remat: str = 'none'
) -> dict:
  """Wire bytes over ep per device per step of the experts' all-to-alls, 'formula' (m micro-batches
  through L/p layers, 5 per layer) and 'spmd' (every one of the pipeline's v*m+p-1 iterations, and
  the one a recomputing remat policy adds), and the buffer."""
  if plan.ep == 1 or not n_experts:
    return {'formula': 0.0, 'spmd': 0.0, 'buffer': 0.0}
  buffer = dispatch_buffer_bytes(plan, n_experts, cap, d_model, itemsize)
  one = (plan.ep - 1) / plan.ep * buffer * plan.grad_accum
  per_chunk = n_layers // (plan.pp * plan.repeats)
  spmd_count = ALL_TO_ALLS_PER_LAYER + (remat in RECOMPUTING)
  return {
    'formula': ALL_TO_ALLS_PER_LAYER * one * (n_layers // plan.pp) * plan.microbatches,
    'spmd': spmd_count * one * per_chunk * plan.iterations,
    'buffer': buffer,
  }
