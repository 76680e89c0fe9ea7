"""A mixture of experts' tensors (Mixtral, Qwen3-MoE) <-> jax3d's: the router [d, E] and the experts'
gate/up [E, d, 2, f] and down [E, f, d] of each stacked layer (jax3d/model/moe.py), from and to
one tensor per expert and projection (the hub's layout: Mixtral's block_sparse_moe.experts.e.w1/w3/w2,
Qwen3-MoE's mlp.experts.e.gate_proj/up_proj/down_proj, [out, in] each) or transformers 5's fused
tensors (mlp.experts.gate_up_proj [E, 2f, d], gate's f rows first; mlp.experts.down_proj
[E, d, f]). Import reads one block of experts at a time (jax3d/hf/weights.py); export fetches one
layer's tensor at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jax3d.hf import families
from jax3d.hf.config import HFModel, expert_tensor_names, fused_experts

if TYPE_CHECKING:
  from jax3d.setup import Setup

Fetch = Callable[[], np.ndarray]


def read_block(
  hf: HFModel, dims: Any, read: Callable[..., np.ndarray], leaf: str, i: int, idx: tuple[slice, ...]
) -> np.ndarray:
  """The block idx of canonical layer i's router [d, E] or experts' gate/up [E, d, 2, f] or down
  [E, f, d], from one tensor per expert or transformers 5's fused tensors (fused_experts)."""
  router, *_ = expert_tensor_names(hf.model_type, i, 0)
  fused, p = fused_experts(hf), f'model.layers.{i}.mlp.experts.'
  if leaf == 'moe/router':
    sd, se = idx
    return read(p[: -len('experts.')] + 'gate.weight' if fused else router, se, sd).T
  e0, e1 = idx[0].indices(dims.n_experts)[:2]
  if leaf == 'moe/experts_gate_up':
    _, sd, s2, sf = idx
    if fused:  # [E, 2f, d]: gate's f rows, then up's
      f = dims.expert_ff
      gu = read(p + 'gate_up_proj', slice(e0, e1), slice(None), sd).reshape(e1 - e0, 2, f, -1)
    else:
      names = [expert_tensor_names(hf.model_type, i, e) for e in range(e0, e1)]
      gu = np.stack([np.stack([read(n[j], slice(None), sd) for j in (1, 2)]) for n in names])
    return gu.transpose(0, 3, 1, 2)[:, :, s2, sf]
  if leaf == 'moe/experts_down':
    _, sf, sd = idx
    if fused:  # [E, d, f]
      return read(p + 'down_proj', slice(e0, e1), sd, sf).transpose(0, 2, 1)
    names = [expert_tensor_names(hf.model_type, i, e)[3] for e in range(e0, e1)]
    return np.stack([read(n, sd, sf).T for n in names])
  raise KeyError(f'no Hugging Face tensor for layers/{leaf}')


def hf_tensors(
  params: Any, setup: Setup, i: int, j: int, fused: bool
) -> Iterator[tuple[str, tuple[int, ...], np.dtype, Fetch]]:
  """Canonical layer i's (stored at j) router and experts in the family's tensors."""
  dm, m = setup.dims, params['layers']['moe']
  d, e_n, f, dtype = dm.d_model, dm.n_experts, dm.expert_ff, np.dtype(dm.param_dtype)
  get = lambda a: np.asarray(jax.device_get(a), np.float32)
  model_type = families.family_of(dm.qkv_bias, dm.qk_norm, setup.cfg.model.hf_model_type, moe=True)
  router, *_ = expert_tensor_names(model_type, i, 0)
  if fused:
    p = f'model.layers.{i}.mlp.'
    yield p + 'gate.weight', (e_n, d), dtype, lambda: get(m['router'][j]).T
    gu = lambda: get(m['experts_gate_up'][j]).transpose(0, 2, 3, 1).reshape(e_n, 2 * f, d)
    yield p + 'experts.gate_up_proj', (e_n, 2 * f, d), dtype, gu
    yield p + 'experts.down_proj', (e_n, d, f), dtype, lambda: get(m['experts_down'][j]).transpose(0, 2, 1)
    return
  yield router, (e_n, d), dtype, lambda: get(m['router'][j]).T
  for e in range(e_n):
    _, gate, up, down = expert_tensor_names(model_type, i, e)
    yield gate, (f, d), dtype, lambda e=e: get(m['experts_gate_up'][j, e, :, 0]).T
    yield up, (f, d), dtype, lambda e=e: get(m['experts_gate_up'][j, e, :, 1]).T
    yield down, (d, f), dtype, lambda e=e: get(m['experts_down'][j, e]).T
