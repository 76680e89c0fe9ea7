"""An int8 frozen base for LoRA (lora.base_dtype=int8, QLoRA-style): the decoder's projection
kernels stored as int8 with one float32 absmax scale per output channel; the rest of the base
(embedding, head, norms, biases) in bfloat16.

A kernel W [layers, in..., out...] is stored as q = round(W / s) in [-127, 127] (int8, the kernel's
own layout) and s = max|W| over its input features / 127 (float32 [layers, out...], a sibling leaf
`kernel_scale` sharded like the output features), so |W - q s| <= s / 2 entry by entry. Each layer
is dequantized where it runs (`dequantized`, called by llama.block_apply inside the pipeline's
loop, in the compute dtype), so only one layer's float kernels exist at a time; the stored
tree holds the int8 kernels. The export's merge dequantizes (lora.merged).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

INT8 = 'int8'  # lora.base_dtype's value
FLOAT = jnp.bfloat16  # the rest of the base, and the float form of the kernels (Dims.param_dtype)
SCALE = 'kernel_scale'  # the scale's leaf, next to the kernel
# the quantized kernels (Block's projections) -> how many input-feature axes follow the layer axis
IN_AXES = {'qkv': 1, 'o': 2, 'gate_up': 1, 'down': 1}


def quantize_kernel(w: jax.Array, n_in: int, stacked: bool = True) -> tuple[jax.Array, jax.Array]:
  """(q int8, scale float32) of the kernel `w` [layers, in..., out...] (`stacked`) or [in..., out...]
  with `n_in` input axes: per output channel, scale = max|w| / 127 (1 where w is all zero)."""
  first = 1 if stacked else 0
  w = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w), axis=tuple(range(first, first + n_in)), keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
  return q, jnp.squeeze(scale, axis=tuple(range(first, first + n_in)))


def dequantize_kernel(q: jax.Array, scale: jax.Array, n_in: int, dtype: Any, stacked: bool) -> jax.Array:
  """q * scale in `dtype`: the kernel's float form (the scale broadcast over the input axes)."""
  first = 1 if stacked else 0
  return (q.astype(jnp.float32) * jnp.expand_dims(scale, tuple(range(first, first + n_in)))).astype(dtype)


def quantized(dims: Any, params: Any) -> Any:
  """The full (or the frozen) parameters with the projection kernels quantized (dims.base_int8),
  else `params` unchanged."""
  if not dims.base_int8:
    return params
  layers = dict(params['layers'])
  for name, n_in in IN_AXES.items():
    q, s = quantize_kernel(layers[name]['kernel'], n_in)
    layers[name] = {**layers[name], 'kernel': q, SCALE: s}
  return {**params, 'layers': layers}


def dequantized(params: Any, dtype: Any, stacked: bool = True) -> Any:
  """`params` (full, or one layer's with `stacked` False) with every quantized kernel in float
  `dtype` and no scales; parameters without int8 kernels are returned as they are."""
  root = params['layers'] if stacked else params
  if not any(isinstance(v, dict) and SCALE in v for v in root.values()):
    return params
  out = dict(root)
  for name, n_in in IN_AXES.items():
    sub = root.get(name)
    if isinstance(sub, dict) and SCALE in sub:
      w = dequantize_kernel(sub['kernel'], sub[SCALE], n_in, dtype, stacked)
      out[name] = {k: v for k, v in sub.items() if k != SCALE} | {'kernel': w}
  return {**params, 'layers': out} if stacked else out


def logical_axes(dims: Any, axes: Any) -> Any:
  """The parameters' logical axis names (llama.param_logical_axes) of the quantized tree: each
  scale takes its kernel's layer axis and output-feature axes."""
  if not dims.base_int8:
    return axes
  layers = dict(axes['layers'])
  for name, n_in in IN_AXES.items():
    names = layers[name]['kernel']
    layers[name] = {**layers[name], SCALE: names[:1] + names[1 + n_in :]}
  return {**axes, 'layers': layers}


def without_scales(tree: Any) -> Any:
  """A parameter-shaped tree (shardings, shapes) of the float form: the scales' leaves dropped."""
  if not isinstance(tree, dict):
    return tree
  return {k: without_scales(v) for k, v in tree.items() if k != SCALE}
