"""Weighted mixtures (data.mixture, data.mixture_stages; jax3d/data/mixture.py, schedule.py): the
realised proportions against the weights, each source in its own epoch order, the same rows for
every layout and process count, stage changes that keep the cursors, resume (the same mixture: the
same losses; another: logged, the cursors go on), the per-source metrics and the bad inputs."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d.config import ConfigError
from jax3d.data import corpus as data_lib, mixture, schedule

from helpers import small_cfg

MIX = 'web=0.7:/d/web,code=0.2:/d/code,math=0.1:/d/math'


def _source(seed: int, n_docs: int) -> data_lib.Corpus:
  """Documents whose token ids are `seed * 100_000` + their positions (a target names its source
  and its token)."""
  lens = np.random.default_rng(seed).integers(2, 60, n_docs)
  starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
  tokens = (seed * 100_000 + np.arange(starts[-1])).astype(np.uint32)
  return data_lib.Corpus(tokens, tokens, 1 << 20, f'source {seed}', starts, starts, packing='concat')


def _mixture(spec: str = MIX, stages: str = '', docs=(400, 30, 8)) -> mixture.Mixture:
  return mixture.Mixture(schedule.parse(spec, stages), [_source(i + 1, n) for i, n in enumerate(docs)])


def _draws(sched: schedule.Schedule, steps: range) -> tuple[np.ndarray, np.ndarray]:
  got = [sched.draws(s) for s in steps]
  return np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])


def test_three_sources_give_their_weights_within_1pct_over_1000_steps():
  """Over 1,000 steps of 16 rows the realised shares are the weights (within 1%, in fact within a
  row); at every step each source's count is within 3 rows of its target, and its rows are its
  cursor 0, 1, 2, ... in turn (no row skipped or repeated)."""
  sched = schedule.Schedule(schedule.parse(MIX), 16)
  src, k = _draws(sched, range(1000))
  share = np.bincount(src, minlength=3) / src.size
  np.testing.assert_allclose(share, [0.7, 0.2, 0.1], atol=0.01)
  np.testing.assert_allclose(share, [0.7, 0.2, 0.1], atol=1 / src.size)
  for i in range(3):
    np.testing.assert_array_equal(k[src == i], np.arange((src == i).sum()))
  counts = np.cumsum(np.eye(3, dtype=np.int64)[src], axis=0)[15::16]  # after each step
  target = np.arange(1, 1001)[:, None] * 16 * np.array([0.7, 0.2, 0.1])
  assert np.abs(counts - target).max() < 3
  np.testing.assert_array_equal(sched.cursors(1000), counts[-1])
  np.testing.assert_array_equal(sched.cursors(437), counts[436])


def test_each_source_reads_its_own_epoch_order():
  """A small source repeats (a new permutation each epoch) while a large one is not exhausted;
  the rows of source i are its epoch order's entries at its cursors."""
  m = _mixture()
  seq, batch = 16, 16
  lay, order = m.layout(seq), m.order(5, seq)
  rows = np.concatenate([order.rows(s, batch) for s in range(40)])
  src = np.searchsorted(lay.offsets, rows, side='right') - 1
  for i, n_rows in enumerate(lay.offsets[1:] - lay.offsets[:-1]):
    mine = rows[src == i] - lay.offsets[i]
    want = order.orders[i].at(np.arange(mine.size))
    np.testing.assert_array_equal(mine, want)
    if mine.size >= n_rows:  # a whole epoch: every row once
      assert sorted(mine[:n_rows]) == list(range(n_rows))
  epochs = m.per_source(5, 40, batch, seq)
  assert epochs['epoch/math'] >= 2 and epochs['epoch/web'] == 0  # small repeats, large not exhausted
  assert sum(epochs[f'tokens/{n}'] for n in m.names) == 40 * batch * seq
  b = data_lib.batch_at(m, 5, 7, batch, seq)
  np.testing.assert_array_equal(b['inputs'][:, 0] // 100_000 - 1, b['source'])  # the row's own source


class _OneProcess:
  def __init__(self, sharding, devices):
    self.sharding, self.devices = sharding, set(devices)

  def addressable_devices_indices_map(self, shape):
    return {d: i for d, i in self.sharding.devices_indices_map(shape).items() if d in self.devices}


@pytest.mark.parametrize('mesh_shape', [(1, 1, 1), (2, 2, 2), (8, 1, 1), (1, 2, 4)])
@pytest.mark.parametrize('processes', [1, 2, 4])
def test_every_layout_and_process_count_reads_the_same_rows(mesh_shape, processes):
  """The global batch put together from the rows each process reads equals the one-process
  batch (every key, `source` too), for 4 layouts and 1, 2 or 4 processes, across a stage change."""
  n_dev = int(np.prod(mesh_shape))
  if processes > n_dev:
    pytest.skip('fewer devices than processes')
  m = _mixture(stages='3:web=0.2,code=0.2,math=0.6')
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n_dev]).reshape(mesh_shape), ('dp', 'pp', 'tp'))
  sh = NamedSharding(mesh, P('dp'))
  devices, per = list(mesh.devices.flat), n_dev // processes
  for step in (2, 3, 40):
    ref = data_lib.batch_at(m, 0, step, 16, 16)
    got = {k: np.full_like(v, -7) for k, v in ref.items()}
    for p in range(processes):
      rows = data_lib.process_rows(_OneProcess(sh, devices[p * per : (p + 1) * per]), 16)
      for k, v in data_lib.batch_at(m, 0, step, 16, 16, rows).items():
        got[k][rows] = v
    for k in ref:
      np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_stages_change_the_weights_and_keep_the_cursors():
  """From step 100 the shares are the new stage's (within 1%); each source's cursor runs on across
  the change (rows 0, 1, 2, ... with none skipped); a source left out of a stage gets no rows."""
  sched = schedule.Schedule(schedule.parse(MIX, '100:web=0.2,code=0.8;300:math=1'), 16)
  src, k = _draws(sched, range(400))
  for lo, hi, want in ((0, 100, [0.7, 0.2, 0.1]), (100, 300, [0.2, 0.8, 0]), (300, 400, [0, 0, 1])):
    part = src[lo * 16 : hi * 16]
    np.testing.assert_allclose(np.bincount(part, minlength=3) / part.size, want, atol=0.01)
  for i in range(3):
    np.testing.assert_array_equal(k[src == i], np.arange((src == i).sum()))
