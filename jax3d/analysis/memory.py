"""Device memory per device, sampled during training, and a detector for steady growth (a leak).

On GPU (and TPU) the runtime's allocator reports `bytes_in_use` and `peak_bytes_in_use`. The CPU
backend reports nothing, so there we add up the live jax arrays that have a shard on each device:
what the program holds, not what the allocator has reserved, and no peak (XLA's temporaries are
not arrays). That is exactly what a Python-side leak grows, so the detector works on both.

A leak in a training loop is memory that grows every step and is never given back. The usual
causes: intermediates kept alive across steps (a Python list of step outputs or metrics still
holding device arrays), and gradient accumulation done wrong (accumulators rebuilt or appended
to every step instead of being carried in the jitted state). Steady state after the first steps
(compilation, optimizer state, prefetch buffers) is flat, so a least-squares slope over a
window of steps separates the two.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import jax
import numpy as np

MB = 2**20


def _live_array_bytes(devices: Sequence[jax.Device]) -> list[int]:
  """Bytes of live jax arrays per device (each device's own shards; replicas count on each)."""
  index = {d: i for i, d in enumerate(devices)}
  total = [0] * len(devices)
  for a in jax.live_arrays():
    if a.is_deleted():
      continue
    try:
      shard_bytes = int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
      for d in a.sharding.addressable_devices:
        if d in index:
          total[index[d]] += shard_bytes
    except Exception:  # uneven shards: ask each shard for its size
      for shard in a.addressable_shards:
        if shard.device in index:
          total[index[shard.device]] += shard.data.nbytes
  return total


def sample(devices: Sequence[jax.Device]) -> dict[str, list]:
  """{'bytes_in_use': [...], 'peak_bytes': [... or None]}, one entry per device, in the order given
  (pass `mesh.devices.flat` for mesh order). Uses the allocator's numbers where it has them.
  Devices of other processes are skipped: a process can only read its own."""
  devices = [d for d in devices if d.process_index == jax.process_index()]
  stats = [d.memory_stats() if hasattr(d, 'memory_stats') else None for d in devices]
  if all(s and 'bytes_in_use' in s for s in stats):
    return {
      'bytes_in_use': [int(s['bytes_in_use']) for s in stats],
      'peak_bytes': [int(s['peak_bytes_in_use']) if 'peak_bytes_in_use' in s else None for s in stats],
    }
  return {'bytes_in_use': _live_array_bytes(devices), 'peak_bytes': [None] * len(devices)}


def device_memory_limit(device: jax.Device) -> int | None:
  """Bytes the device can hold (GPU/TPU allocators report it; CPU does not)."""
  try:
    stats = device.memory_stats() or {}
  except Exception:  # noqa: BLE001 - backends without memory stats raise their own errors
    return None
  return stats.get('bytes_limit')


def slope(steps: Sequence[float], values: Sequence[float]) -> float:
  """Least-squares slope of values against steps (0 when the steps do not vary)."""
  x, y = np.asarray(steps, np.float64), np.asarray(values, np.float64)
  dx = x - x.mean()
  denom = float((dx * dx).sum())
  return float((dx * (y - y.mean())).sum() / denom) if denom else 0.0


class LeakDetector:
  """Warns when device memory grows steadily: a least-squares slope per device over the last
  `window` samples, and over each half of them, above `threshold_mb_per_step` (a one-off jump then
  flat is not a leak). After a warning the window starts afresh, so a
  persisting leak warns once per window of samples, not on every step.

    leak = LeakDetector(window=20, threshold_mb_per_step=1.0)
    event = leak.update(step, sample(devices)['bytes_in_use'])
    if event: log(event)
  """

  def __init__(self, window: int = 20, threshold_mb_per_step: float = 1.0):
    if window < 3:
      raise ValueError(f'window={window}: at least 3 samples are needed to call growth sustained')
    self.window, self.threshold = window, threshold_mb_per_step
    self.history: collections.deque = collections.deque(maxlen=window)

  def update(self, step: int, per_device_bytes: Sequence[int]) -> dict | None:
    """Records one sample; returns a 'memory_leak' event (a metrics record with a message) when the
    last `window` samples grow steadily, else None."""
    self.history.append((step, list(per_device_bytes)))
    if len(self.history) < self.window:
      return None
    steps = [s for s, _ in self.history]
    per_dev = np.array([b for _, b in self.history], np.float64) / MB  # [window, devices]
    slopes = [slope(steps, per_dev[:, i]) for i in range(per_dev.shape[1])]
    # Sustained: the fitted slope is above the threshold over the whole window and over each of its
    # two halves (which share one sample, so no step-to-step change lies in both). A single jump,
    # e.g. a checkpoint buffer, lies in one half at most and leaves the other flat: not a leak.
    half = self.window // 2
    first, second = slice(0, half + 1), slice(half, None)
    halves = [
      min(slope(steps[first], per_dev[first, i]), slope(steps[second], per_dev[second, i]))
      for i in range(per_dev.shape[1])
    ]
    growing = [
      i
      for i, (sl, hv) in enumerate(zip(slopes, halves, strict=True))
      if sl > self.threshold and hv > self.threshold
    ]
    if not growing:
      return None
    self.history.clear()
    worst = max(slopes[i] for i in growing)
    return {
      'event': 'memory_leak',
      'step': int(step),
      'slope_mb_per_step': round(worst, 3),
      'devices': growing,
      'window_steps': [int(steps[0]), int(steps[-1])],
      'message': (
        f'device memory grew {worst:.2f} MB/step on device(s) {growing} over steps '
        f'{steps[0]}-{steps[-1]} (threshold {self.threshold} MB/step). Likely causes: '
        'intermediates kept alive across steps (e.g. a Python list of step outputs or '
        'metrics still holding device arrays; store float(x) / jax.device_get(x) instead), '
        'or gradient accumulation done wrong (accumulators rebuilt or appended to every '
        'step instead of carried in the jitted state).'
      ),
    }


def fmt_bytes(n: float) -> str:
  """'512 B', '1.5 KiB', ... '2.0 TiB' (binary units)."""
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.1f} {unit}' if unit != 'B' else f'{int(n)} B'
    n /= 1024


def fmt_duration(s: float) -> str:
  """'m:ss', or 'h:mm:ss' from an hour on (negative durations show as 0:00)."""
  s = int(max(s, 0))
  return f'{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}' if s >= 3600 else f'{s // 60}:{s % 60:02d}'
