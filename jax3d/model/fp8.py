"""FP8 matmuls for the decoder's projections (train.matmul_dtype=fp8): per-tensor current scaling,
E4M3 in the forward pass, E5M2 for the gradients, as NVIDIA's Transformer Engine does.

Each projection's dot (`dot_general`, the `dot_general` of flax's DenseGeneral and of the
sequence-parallel projection) quantizes its two operands to float8_e4m3fn, each with one scale of
its own current values, s = amax / 448 (448 the format's largest value), and contracts their
dequantized forms q * s; the backward pass quantizes the incoming gradient to float8_e5m2
(s = amax / 57344) and computes the input gradient (dgrad: gradient x kernel) and the kernel
gradient (wgrad: input x gradient) from the saved fp8 operands. The residuals kept for the backward
pass are the fp8 operands and their scales (a byte per entry).

On GPUs XLA's GEMM rewriter matches convert(f8) * scale feeding a dot and turns each of these
three dots per projection into one cuBLASLt FP8 GEMM (`__cublas$lt$matmul$f8`, the scales applied
in fp32 inside it, the output in the compute dtype); tests/test_fp8.py counts them in the H100
program. Elsewhere (CPU) the same program runs the dots on the dequantized values: the numbers of
FP8 GEMMs, up to the rounding of q * s to the compute dtype. The embedding, the head, attention's
own matmuls and LoRA's adapters stay in the compute dtype.

A scale is rounded to the compute dtype before it is used, so that quantizing (x / s) and the
GEMM's scaling (q * s) use the same number; values past the format's range after that rounding are
clipped to it (float8_e4m3fn has no infinity: a cast past 448 would be NaN).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax3d.errors import ConfigError
from jax3d.model import attention

FP8 = 'fp8'  # train.matmul_dtype's value
FORWARD = jnp.float8_e4m3fn  # operands: 3 mantissa bits, largest 448
GRADIENT = jnp.float8_e5m2  # gradients: 2 mantissa bits, largest 57344
MIN_COMPUTE_CAPABILITY = 8.9  # Ada (sm_89) and Hopper (sm_90): the first GPUs with FP8 tensor cores
DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def check_devices(devices: Sequence[jax.Device]) -> None:
  """A ConfigError (exit 2, before anything compiles) naming train.matmul_dtype when FP8 matmuls
  cannot run on these devices: NVIDIA GPUs before compute capability 8.9. Other platforms (CPU)
  run the same program, emulated."""
  platform, cc = attention.device_facts(list(devices))
  if platform in ('gpu', 'cuda') and cc < MIN_COMPUTE_CAPABILITY:
    raise ConfigError(
      f"train.matmul_dtype='fp8' is invalid on {devices[0].device_kind} (compute capability {cc:g}): "
      f'FP8 GEMMs need compute capability {MIN_COMPUTE_CAPABILITY} or later (H100, H200, L40S); '
      "valid here: '' (train.compute_dtype)"
    )


def quantize(x: jax.Array, fp8_dtype: Any, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """(q, s): `x` as `fp8_dtype` values q and its per-tensor scale s (a float32 scalar holding a
  `dtype` number: amax / the format's largest value, 1 where x is all zero), x ~ q * s."""
  top = float(jnp.finfo(fp8_dtype).max)
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  scale = jnp.where(amax > 0, amax / top, 1.0).astype(dtype).astype(jnp.float32)
  q = jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(fp8_dtype)
  return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """q * s in `dtype`: the pattern XLA:GPU folds into an FP8 GEMM's operand."""
  return q.astype(dtype) * scale.astype(dtype)


def _dot(x: jax.Array, w: jax.Array, dims: DimensionNumbers) -> jax.Array:
  return jax.lax.dot_general(x, w, dims, preferred_element_type=x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_dot(x: jax.Array, w: jax.Array, dims: DimensionNumbers) -> jax.Array:
  return _fp8_dot_fwd(x, w, dims)[0]


def _fp8_dot_fwd(x: jax.Array, w: jax.Array, dims: DimensionNumbers) -> tuple[jax.Array, tuple]:
  # One barrier over both operands keeps the kernel's quantization beside the dot: without it, a
  # layer loop's linearization computes what depends on the weights alone in a loop of its own and
  # hands this one the dequantized kernel, where XLA sees no FP8 operand (a bf16 GEMM on GPUs).
  x, w = jax.lax.optimization_barrier((x, w))
  (xq, sx), (wq, sw) = quantize(x, FORWARD, x.dtype), quantize(w, FORWARD, x.dtype)
  return _dot(dequantize(xq, sx, x.dtype), dequantize(wq, sw, x.dtype), dims), (xq, sx, wq, sw)


def _fp8_dot_bwd(dims: DimensionNumbers, res: tuple, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
  xq, sx, wq, sw = res
  dtype = dy.dtype
  gq, sg = quantize(dy, GRADIENT, dtype)
  # the transposes of the forward's dot (dgrad and wgrad), on the E4M3 operands and the E5M2 gradient
  _, transpose = jax.vjp(
    functools.partial(_dot, dims=dims), dequantize(xq, sx, dtype), dequantize(wq, sw, dtype)
  )
  return transpose(dequantize(gq, sg, dtype))


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: DimensionNumbers,
  precision: Any = None,
  preferred_element_type: Any = None,
) -> jax.Array:
  """`jax.lax.dot_general` as an FP8 matmul (the signature flax's DenseGeneral calls): the result
  in the operands' dtype (the compute dtype)."""
  del precision, preferred_element_type  # FP8 GEMMs accumulate in fp32 and write the compute dtype
  rhs = rhs.astype(lhs.dtype)
  dims = tuple(tuple(tuple(int(a) for a in axes) for axes in pair) for pair in dimension_numbers)
  return _fp8_dot(lhs, rhs, dims)
