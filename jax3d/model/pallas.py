"""JAX's Pallas Triton flash attention (`jax.experimental.pallas.ops.gpu.attention.mha`) for one
device's rows of documents: `train.attention=pallas` (jax3d/model/attention.py runs it per device).

The kernel takes segment ids (a query sees the keys of its own segment) and causality by index
(key j <= query i): jax3d's rule for rows in their natural order, padding included; no [t, t]
array exists, forward or backward (its backward is Pallas too: dK/dV and dQ from the saved
logsumexp). It has no grouped-query attention: K/V are repeated per query group here (their
gradients summed back by `jnp.repeat`'s transpose). Rows are padded at the end to whole blocks
(the kernel needs the length to be a multiple of its block); causality keeps real queries off
the padded keys and the padded outputs are dropped.

Lowered per platform (`jax.lax.platform_dependent`): Triton on NVIDIA GPUs; elsewhere Pallas's
interpreter, which only tests reach (`attention.resolve` refuses `pallas` off GPUs).

`backward` calls the kernel's own backward rule (`mha.bwd`) on the residuals the forward kept
(`attention_lse`: the output and the logsumexp, so the forward runs once, or twice under remat,
not once more for the backward), rather than differentiating `mha`: a Pallas call's outputs
carry no manual-axis (vma) type, so inside the pipeline's shard_map jax's check of `mha`'s custom
VJP rejects its gradients (and the region runs without the check, where they cannot be typed
back); attention.py's per-device region owns the VJP.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

BLOCK, BWD_BLOCK = 128, 32  # query/key rows of the forward's blocks and the backward's (jax's defaults)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None = None) -> jax.Array:
  """Causal attention [b, t, n, h] of q [b, t, n, h] over k, v [b, t, kv, h] within the documents
  of `seg` int [b, t] (None: one document per row)."""
  return attention_lse(q, k, v, seg)[0]


def attention_lse(
  q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """(`attention`'s output, the kernel's logsumexp [b, n, t padded]): the forward whose residual
  `backward` takes, so that the backward does not run the forward again for it."""
  t = q.shape[1]
  args, static = _prepare(q, k, v, seg)
  run = lambda interpret, *a: _mha()(*a, **_options(static, interpret, residuals=True))
  out, lse = _per_platform(run, *args)
  return out[:, :t], lse


def backward(q: jax.Array, k: jax.Array, v: jax.Array, *rest: jax.Array) -> tuple[jax.Array, ...]:
  """(dq, dk, dv) of `attention(q, k, v, seg)`'s output for its cotangent g, `rest` = ([seg,] out,
  lse, g) with out and lse as `attention_lse` returned them: the kernel's backward from the
  forward's own residuals; dK/dV summed over each query group. The padded rows' output is taken
  as zero: their cotangent is zero, so they add nothing to dK/dV."""
  *seg, out, lse, g = rest
  seg = seg[0] if seg else None
  b, t, n, h = q.shape
  kv = k.shape[2]
  args, static = _prepare(q, k, v, seg)
  padded = args[0].shape[1]
  out, g = _pad(out, padded), _pad(g, padded)

  def run(interpret, args, out, lse, g):
    return _mha().bwd(**_options(static, interpret), res=(*args, out, lse), do=g)[:3]

  dq, dk, dv = _per_platform(run, args, out, lse, g)
  fold = lambda d: d[:, :t].reshape(b, t, kv, n // kv, h).sum(3).astype(k.dtype)
  return dq[:, :t].astype(q.dtype), fold(dk), fold(dv)


def _prepare(q, k, v, seg):
  """The kernel's operands (K/V repeated per query group, all padded to whole blocks) and its
  static block sizes."""
  t, n, h = q.shape[1:]
  g = n // k.shape[2]
  k, v = (jnp.repeat(x, g, axis=2) if g > 1 else x for x in (k, v))
  # the forward's blocks fit a GPU's shared memory (A100: 164 KiB) when block x h x bytes <= 128 x 256
  fit = max(16, BLOCK * 256 // (h * q.dtype.itemsize))
  block = min(BLOCK, 1 << (fit.bit_length() - 1), max(16, 1 << (t - 1).bit_length()))
  padded = -(-t // block) * block
  args = tuple(None if x is None else _pad(x, padded) for x in (q, k, v, seg))
  return args, (h**-0.5, block, min(BWD_BLOCK, block))


def _pad(x: jax.Array, length: int) -> jax.Array:
  """x [b, t, ...] zero-padded on axis 1 to `length`."""
  extra = length - x.shape[1]
  return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2)) if extra else x


def _options(static: tuple, interpret: bool, residuals: bool = False) -> dict:
  """The kernel's static arguments, by name (those of `mha` after its operands); `residuals`: the
  forward returns (out, logsumexp)."""
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention

  scale, block, bwd = static
  return dict(
    sm_scale=scale,
    causal=True,
    block_sizes=pallas_attention.BlockSizes(block, block, bwd, bwd, bwd, bwd),
    backward_pass_impl='triton',
    num_warps=None,
    num_stages=2,
    grid=None,
    interpret=interpret,
    debug=False,
    return_residuals=residuals,
  )


def _per_platform(fn: Any, *args: Any) -> Any:
  """`fn(interpret, *args)`: Triton where the program is lowered for CUDA, the interpreter elsewhere."""
  return jax.lax.platform_dependent(
    *args, cuda=functools.partial(fn, False), default=functools.partial(fn, True)
  )


def _mha() -> Any:
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention

  return pallas_attention.mha
