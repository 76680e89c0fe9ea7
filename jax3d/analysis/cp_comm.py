"""Context parallelism's bytes (mesh.cp > 1, either train.cp_strategy; jax3d/model/cp_attention.py),
per device, as docs/formulas.md states them: the memory model (jax3d/planning/memory_model.py), the
step-time model (jax3d/planning/time_model.py) and `python -m jax3d.inspect`'s check of the
compiled step (jax3d/analysis/inspection.py) all read them here. Pure arithmetic, no jax.

Wire bytes as jax3d/analysis/hlo.py defines them: an all-gather or reduce-scatter over a group of
c devices sends (c-1)/c of its whole buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from jax3d.config import RunPlan


# train.cp_strategy -> the collectives over cp that carry the attention's K/V (and dK/dV), and their words
KV_KINDS = {'allgather': ('all-gather', 'reduce-scatter'), 'ring': ('collective-permute',)}
KV_WHAT = {
  'allgather': 'K/V all-gathers and dK/dV reduce-scatters (in the layers)',
  'ring': 'K/V and dK/dV ring transfers (collective-permutes in the layers)',
}


def kv_gather_bytes(rows: int, seq: int, kv_heads: int, head_dim: int, itemsize: int) -> float:
  """One layer's K and V of `rows` sequences gathered whole over cp (`kv_heads`: this device's,
  n_kv_heads/tp): 2*b*s*(k/t)*d_head bytes, held while the layer's attention runs."""
  return 2.0 * rows * seq * kv_heads * head_dim * itemsize


def layer_wire_bytes(gathered: float, cp: int) -> float:
  """Wire bytes one device sends over cp per layer per micro-batch: the forward's all-gather of K
  and V, the backward's (its region gathers them again) and the reduce-scatter of dK and dV, each
  (c-1)/c of the gathered buffer: 3 (c-1)/c * gathered."""
  return 3.0 * (cp - 1) / cp * gathered


def ring_layer_wire_bytes(gathered: float, cp: int, itemsize: int) -> float:
  """train.cp_strategy=ring: wire bytes one device sends over cp per layer per micro-batch. Its own
  K/V block is gathered/c; the forward passes the blocks c-1 steps round the ring, the backward
  again c-1 steps, and the blocks' fp32 dK/dV accumulators c steps (the last brings each home):
  2 (c-1)/c * gathered + gathered * 4/bytes_per_element."""
  return 2.0 * (cp - 1) / cp * gathered + gathered * 4 / itemsize


def cp_attention_bytes(
  plan: RunPlan, n_layers: int, n_kv_heads: int, head_dim: int, itemsize: int, strategy: str = 'allgather'
) -> dict:
  """Wire bytes over cp per device per step of the attention's K/V collectives under `strategy`
  (train.cp_strategy), two ways (as jax3d/analysis/comm_checks.py's `expected_comm`): 'formula' the
  useful work (m micro-batches through L/p layers, times the accumulation), 'spmd' what the SPMD
  pipeline executes (every one of its v*m+p-1 iterations runs its chunk's layers); with
  'gathered', one layer's whole K/V (the all-gather's buffer), and the strategy."""
  if plan.cp == 1:
    return {'formula': 0.0, 'spmd': 0.0, 'gathered': 0.0, 'strategy': strategy}
  rows = plan.micro_batch // plan.dp
  gathered = kv_gather_bytes(rows, plan.seq_len, n_kv_heads // plan.tp, head_dim, itemsize)
  if strategy == 'ring':
    layer = ring_layer_wire_bytes(gathered, plan.cp, itemsize) * plan.grad_accum
  else:
    layer = layer_wire_bytes(gathered, plan.cp) * plan.grad_accum
  per_chunk = n_layers // (plan.pp * plan.repeats)
  return {
    'formula': layer * (n_layers // plan.pp) * plan.microbatches,
    'spmd': layer * per_chunk * plan.iterations,
    'gathered': gathered,
    'strategy': strategy,
  }


def cp_grad_bytes(n_grads: float, cp: int, itemsize: int) -> float:
  """Wire bytes of the weight gradients' all-reduce over cp (the parameters are replicated over
  cp): 2 (c-1)/c * P_local * bytes, on top of dp's."""
  return 2.0 * (cp - 1) / cp * n_grads * itemsize
