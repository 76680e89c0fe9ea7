"""Rotary position embeddings: the frequencies (plain, or scaled for a longer context) and the
rotation, the same for training, prefill and the KV-cache decoder.

Scaling, as transformers computes it (`ROPE_INIT_FUNCTIONS`):
  none     inv_freq_i = 1 / theta^(2i/h)
  linear   inv_freq_i / factor                              (position interpolation)
  llama3   per wavelength w_i = 2 pi / inv_freq_i, with L = the original context:
           w_i < L / high_freq_factor  -> inv_freq_i          (high frequencies kept)
           w_i > L / low_freq_factor   -> inv_freq_i / factor  (low frequencies interpolated)
           between: (1 - a) inv_freq_i / factor + a inv_freq_i, a = (L / w_i - low) / (high - low)
Both scalings leave the attention scale at 1 (transformers' attention_factor for them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """model.rope_scaling and its parameters (only `factor` for linear)."""

  kind: str = 'none'
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_seq_len: int = 8192


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling()) -> np.ndarray:
  """The rotation frequencies (h/2,) in fp32, computed like transformers (fp32 powers of theta)."""
  exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  freq = (1.0 / np.power(np.float32(theta), exponent)).astype(np.float32)
  if scaling.kind == 'linear':
    return (freq / np.float32(scaling.factor)).astype(np.float32)
  if scaling.kind == 'llama3':
    s, length = scaling, np.float32(scaling.original_max_seq_len)
    wavelen = np.float32(2 * np.pi) / freq
    scaled = np.where(wavelen > length / np.float32(s.low_freq_factor), freq / np.float32(s.factor), freq)
    a = (length / wavelen - np.float32(s.low_freq_factor)) / np.float32(
      s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - a) * scaled / np.float32(s.factor) + a * scaled
    medium = ~(wavelen < length / np.float32(s.high_freq_factor)) & ~(
      wavelen > length / np.float32(s.low_freq_factor)
    )
    return np.where(medium, smoothed, scaled).astype(np.float32)
  return freq


def rope(x_btnh: jax.Array, freq_h: np.ndarray, positions_t: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding (half-split form) of `x` with frequencies `freq_h` (h/2,), in fp32.
  `positions_t` (int, [t], or [b, t] per row) are the tokens' positions; None means 0..t-1 (then
  the angles are constants of the trace)."""
  t = x_btnh.shape[1]
  pos = np.arange(t, dtype=np.float32) if positions_t is None else positions_t.astype(jnp.float32)
  ang = pos[..., None] * freq_h  # (t, h/2) or (b, t, h/2)
  ang_bth = ang[None] if ang.ndim == 2 else ang
  cos, sin = jnp.cos(ang_bth)[:, :, None, :], jnp.sin(ang_bth)[:, :, None, :]
  x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_btnh.dtype)
