"""Memory sampling and the leak detector, with real arrays on the 8 fake CPU devices."""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax3d.analysis import memory

MB = 2**20


@pytest.fixture(scope='module')
def mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ('a', 'b'))


def _step_output(mesh, i):
  """A 'step' producing 1 MiB per device (8 MiB sharded over all 8 devices)."""
  make = jax.jit(
    lambda v: jnp.full((8 * 2048, 128), v, jnp.float32),  # 2048*128*4 B = 1 MiB per device
    out_shardings=NamedSharding(mesh, P(('a', 'b'))),
  )
  return make(float(i))


def test_sample_counts_shards_per_device(mesh):
  devices = list(mesh.devices.flat)
  before = memory.sample(devices)
  assert len(before['bytes_in_use']) == 8 and before['peak_bytes'] == [None] * 8  # CPU: no peak
  sharded = _step_output(mesh, 0)
  replicated = jax.device_put(jnp.ones((512, 512), jnp.float32), NamedSharding(mesh, P()))  # 1 MiB each
  after = memory.sample(devices)
  grown = np.array(after['bytes_in_use']) - np.array(before['bytes_in_use'])
  np.testing.assert_array_equal(grown, [2 * MB] * 8)
  del sharded, replicated


def test_leak_detected_once_per_window(mesh):
  devices = list(mesh.devices.flat)
  leak = memory.LeakDetector(window=6, threshold_mb_per_step=0.5)
  kept, events = [], []
  for step in range(18):
    out = _step_output(mesh, step)
    kept.append(out)  # the bug: every step's device arrays stay alive
    ev = leak.update(step, memory.sample(devices)['bytes_in_use'])
    if ev:
      events.append(ev)
  assert [e['step'] for e in events] == [5, 11, 17]  # once per window, not every step
  e = events[0]
  assert e['event'] == 'memory_leak' and e['devices'] == list(range(8))
  assert e['slope_mb_per_step'] == pytest.approx(1.0, rel=1e-6)
  assert 'Python list' in e['message'] and 'gradient accumulation' in e['message']
  del kept


def test_steady_loop_raises_nothing(mesh):
  devices = list(mesh.devices.flat)
  leak = memory.LeakDetector(window=6, threshold_mb_per_step=0.5)
  losses = []
  for step in range(18):
    out = _step_output(mesh, step)
    losses.append(float(out[0, 0]))  # a Python float, not a device array
    del out
    assert leak.update(step, memory.sample(devices)['bytes_in_use']) is None


def test_single_jump_is_not_a_leak():
  """A one-off jump then flat (e.g. a buffer allocated once) never warns, wherever the jump falls
  in the window; steady growth of the same total does."""
  for window in (3, 6, 7, 20):
    for before in range(1, window + 2):
      leak = memory.LeakDetector(window=window, threshold_mb_per_step=1.0)
      series = [100 * MB] * before + [400 * MB] * (2 * window)
      events = [leak.update(i * 10, [b]) for i, b in enumerate(series)]
      assert not any(events), (window, before, [e for e in events if e])


def test_steady_growth_is_a_leak():
  """Growth every step (2 MB/step here, threshold 1) warns once the window is full."""
  leak = memory.LeakDetector(window=6, threshold_mb_per_step=1.0)
  events = [leak.update(i, [100 * MB + 2 * MB * i, 100 * MB]) for i in range(6)]
  assert events[:5] == [None] * 5
  assert events[5]['devices'] == [0] and events[5]['slope_mb_per_step'] == pytest.approx(2.0)
