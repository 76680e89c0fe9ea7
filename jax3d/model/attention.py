"""Training attention: which kernel (`train.attention`) and where it runs.

  auto       On NVIDIA GPUs in bf16/fp16 with a head size cuDNN takes: `fused` (below); everywhere
             else (CPU, fp32) the blockwise attention. `resolve` decides once, when the run is
             built (`assemble.build`); the start-up line names it.
  xla        XLA's attention (`jax.nn.dot_product_attention(implementation='xla')`) with a dense
             [b, 1, t, t] mask of the documents: the reference; memory grows with t^2.
  cudnn      cuDNN's fused kernel (`__cudnn$fmha*` custom calls); refused where it cannot run.
             Documents reach it as a dense [b, 1, t, t] bias (jax 0.10's public API has no packed
             layout), kept for the backward pass.
  pallas     JAX's Pallas Triton flash attention (jax3d/model/pallas.py): segment ids, never a
             [t, t] array; K/V repeated per query group. NVIDIA GPUs only (refused elsewhere).
  blockwise  jax3d/model/blockwise.py: blocks of queries and keys, online softmax, a backward that
             recomputes block scores; documents from segment ids and positions, never a mask;
             memory linear in t. Run per device like cuDNN's (no collective to skip a block).
  fused      (`auto`'s on GPUs) per layer call: cuDNN with no mask where the rows hold one
             document each (no segment ids), Pallas where they hold documents; so documents never
             become a [b, 1, t, t] array (BUILD_NOTES.md: the GPU compile's numbers).

cuDNN's kernel is called where the sharding is manual: a `shard_map` over every mesh axis not
manual yet (`sharding.device_local`), so each device runs it on its own rows and heads. Left to
GSPMD, its custom partitioner fails on jax 0.10 (dp: an assertion in `get_num_ways_dim_sharded`;
under the pipeline's shard_map: 'GSPMDSharding' object has no attribute 'spec'). Attention needs no
communication (rows over dp, heads over tp, every KV head of a query head on the same rank), so
nothing changes but who partitions it. Its forward runs again in the backward
(`sharding.device_local_vjp`).

Documents: for `xla` and `cudnn` the rows' segment ids become a boolean mask [b, 1, t, t] (a query
sees the keys of its own segment; causality is `is_causal`'s); cuDNN takes it as an additive bf16
bias of that size. `blockwise` takes the segment ids and, as causal positions, each token's index in
its row: query i sees key j iff same segment and j <= i, exactly the mask's rule, padding included
(the rotary positions restart at 0 on every document and are 0 on all padding, so on padding they
would not order the tokens). A row of one document (no segment ids) passes neither.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax3d.errors import ConfigError
from jax3d.model import blockwise, cp_attention, pallas
from jax3d.parallel import context, sharding

FUSED_DTYPES = ('bfloat16', 'float16')
# The bias of a masked-out key: jax's cudnn wrapper's own values (cuDNN mishandles -inf - -inf);
# fp16's range is smaller. exp of it is exactly 0 in every dtype, as a masked key's weight is.
CUDNN_NEG = {'float16': -float(2 << 14)}
CUDNN_NEG_DEFAULT = -float(2 << 40)
CUDNN_MAX_HEAD_DIM = 256  # Hopper (sm_90) and later; 128 before (jax's check_is_flash_attention)


def cudnn_supported(platform: str, compute_dtype: str, head_dim: int, compute_capability: float) -> str:
  """'' when cuDNN's fused attention runs for these, else why not (one phrase)."""
  if platform not in ('gpu', 'cuda'):
    return f'it needs NVIDIA GPUs (these devices are {platform})'
  if compute_dtype not in FUSED_DTYPES:
    return f'it takes bf16 or fp16, not train.compute_dtype={compute_dtype}'
  max_h = CUDNN_MAX_HEAD_DIM if compute_capability >= 9.0 else 128
  if head_dim % 8 or head_dim > max_h:
    return f'it takes a head size that is a multiple of 8 and at most {max_h}, not {head_dim}'
  return ''


def device_facts(devices: list[jax.Device]) -> tuple[str, float]:
  """(platform, compute capability: 0.0 where it does not apply) of the run's devices."""
  d = devices[0]
  cc = getattr(d, 'compute_capability', None)
  try:
    cc = float(cc) if cc is not None else 0.0
  except (TypeError, ValueError):
    cc = 0.0
  return d.platform, cc


def resolve(choice: str, devices: list[jax.Device], compute_dtype: str, head_dim: int) -> str:
  """The kernel train.attention=`choice` runs on these devices: 'xla', 'cudnn', 'pallas',
  'blockwise' or 'fused'. `auto` is `fused` wherever cuDNN runs, else blockwise; `cudnn` or
  `pallas` where it cannot run is a ConfigError naming why."""
  platform, cc = device_facts(devices)
  why = cudnn_supported(platform, compute_dtype, head_dim, cc)
  if choice == 'auto':
    return 'blockwise' if why else 'fused'
  if choice == 'cudnn' and why:
    raise ConfigError(f"train.attention='cudnn' cannot run here: {why}; use 'auto' or 'xla'")
  if choice == 'pallas' and platform not in ('gpu', 'cuda'):
    raise ConfigError(
      f"train.attention='pallas' cannot run here: it needs NVIDIA GPUs (these devices are {platform}); "
      "use 'auto' or 'blockwise'"
    )
  return choice


def segment_mask(segment_ids_bt: jax.Array | None) -> jax.Array | None:
  """The attention mask [b, 1, t, t] of rows of documents: query i sees key j of the same segment
  (the causal part is `is_causal`'s); None without segments."""
  if segment_ids_bt is None:
    return None
  return (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])[:, None]


def attend(
  q_btnh: jax.Array,
  k_btkh: jax.Array,
  v_btkh: jax.Array,
  segment_ids_bt: jax.Array | None,
  kernel: str,
  cp_strategy: str = 'allgather',
) -> jax.Array:
  """Causal grouped-query attention [b, t, n, h] of the rows' own documents with `kernel` ('xla',
  'cudnn', 'pallas', 'blockwise' or 'fused': cuDNN for rows of one document, Pallas for rows of
  documents; 'auto' is resolved before, by `resolve`, and reads as 'xla' here); a sequence split
  over cp (blockwise only) by `cp_strategy` (train.cp_strategy)."""
  if kernel == 'fused':
    kernel = 'cudnn' if segment_ids_bt is None else 'pallas'
  if kernel == 'blockwise':
    return _blockwise(q_btnh, k_btkh, v_btkh, segment_ids_bt, cp_strategy)
  names = (('batch', 'seq', 'heads', 'head_dim'), ('batch', 'seq', 'kv_heads', 'head_dim'))
  if kernel == 'pallas':
    seg = () if segment_ids_bt is None else (segment_ids_bt,)
    in_logical = (names[0], names[1], names[1]) + (('batch', 'seq'),) * len(seg)
    lse = (('batch', 'heads', None),)  # the kernel's logsumexp [b, n, t padded], kept for the backward
    run = sharding.device_local_vjp(
      pallas.attention_lse, in_logical, names[0], len(seg), pallas.backward, saved=lse
    )
    return run(q_btnh, k_btkh, v_btkh, *seg)
  impl = 'cudnn' if kernel == 'cudnn' else 'xla'

  mask = segment_mask(segment_ids_bt)
  if impl == 'xla':
    return jax.nn.dot_product_attention(
      q_btnh, k_btkh, v_btkh, mask=mask, is_causal=True, implementation='xla'
    )

  # The documents as the additive bias cuDNN takes (the values jax's wrapper would use), made
  # outside the per-device region: an input there, never a value made inside it.
  bias = (
    None
    if mask is None
    else jnp.where(mask, 0, CUDNN_NEG.get(q_btnh.dtype.name, CUDNN_NEG_DEFAULT)).astype(q_btnh.dtype)
  )
  operands = (q_btnh, k_btkh, v_btkh) + (() if bias is None else (bias,))
  in_logical = (names[0], names[1], names[1]) + (() if bias is None else (('batch', None, 'seq', None),))
  return sharding.device_local_vjp(_cudnn, in_logical, names[0], len(operands) - 3)(*operands)


def _cudnn(q, k, v, bias=None):
  return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True, implementation='cudnn')


def _blockwise(
  q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, seg_bt: jax.Array | None, cp_strategy: str
) -> jax.Array:
  """blockwise.attention of rows in their natural order: causal positions are the tokens' indices
  in their row (with the sequence split over cp: `cp_attention.attend` by `cp_strategy`). Left to
  GSPMD (rows over dp, heads over tp; it partitions the block loops): run per device instead
  (`sharding.device_local`, as cuDNN's), it failed to lower inside the pipeline's shard_map on
  jax 0.10 (BUILD_NOTES.md)."""
  if context.active(q_btnh.shape[1]):  # the sequence over 'cp' (jax3d/parallel/context.py)
    return cp_attention.attend(q_btnh, k_btkh, v_btkh, seg_bt, cp_strategy)
  b, t = q_btnh.shape[:2]
  pos_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return blockwise.attention(q_btnh, k_btkh, v_btkh, pos_bt, pos_bt, seg_bt, seg_bt, blockwise.BLOCK)
