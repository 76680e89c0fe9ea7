"""Context parallelism in the planner, the formulas and the placement (issue 43): the planner splits
the sequence over cp where nothing else fits and not where it needs not; cp's K/V traffic in the
compiled step and the start-up line equals docs/formulas.md's; cp groups stay inside a host."""

import re
import types

import numpy as np
import pytest

from jax3d import config as config_lib
from jax3d.config import ConfigError
from jax3d.devices import gpu_target
from jax3d.parallel import mesh as mesh_lib
from jax3d.planning import explain, planner
from jax3d.planning.hardware import Hardware

from helpers import small_cfg


def _tiny(seq: int):
  return config_lib.load_config(
    'tiny',
    {
      'model.n_layers': 2,
      'model.d_model': 64,
      'model.n_heads': 4,
      'model.n_kv_heads': 1,
      'model.d_ff': 128,
      'model.vocab_size': 256,
      'train.seq_len': seq,
      'model.max_seq_len': seq,
      'train.global_batch_size': 2,
      'train.attention': 'blockwise',
      'mesh.dp': 2,
      'mesh.pp': 1,
      'mesh.tp': 1,
      'pipeline.microbatches': 1,
    },
  )


def test_planner_splits_the_sequence_only_where_nothing_else_fits():
  """On 2 GPUs of 40 MB: at 4096 tokens no layout without cp fits (activations grow with the
  sequence), the pick is cp=2; at 64 tokens on 80 GB everything fits and the pick has cp=1 (its
  K/V gathers and gradient all-reduce over cp cost time for memory that is not needed)."""
  search = lambda seq, gb, cps=None: planner.search(
    _tiny(seq), Hardware(gpus_per_node=2, memory_gb=gb, attention='blockwise'), ('none',), ('off',), cps
  )
  long = search(4096, 0.04)
  assert not any(c.est.fits for c in long if c.plan.cp == 1)
  assert long[0].est.fits and long[0].plan.cp == 2 and long[0].overrides['mesh.cp'] == 2
  assert long[0].est.times['cp'] > 0
  hw = Hardware(gpus_per_node=2, memory_gb=0.04, attention='blockwise')
  why = '\n'.join(explain.explain(_tiny(4096), long[0], long, hw))
  assert 'cp = 2: each sequence of 4096 tokens split over 2 GPUs' in why and 'does not fit' in why
  assert 'dp = 2/(tp*cp*pp) = 2/(1*2*1) = 1' in why
  assert not any(c.plan.cp > 1 for c in search(64, 80))  # layouts without cp fit: cp not searched
  short = search(64, 80, cps=(1, 2))
  assert short[0].est.fits and short[0].plan.cp == 1
  assert any(c.plan.cp == 2 and c.est.fits for c in short)  # searched, priced slower


def _plan(dp: int, pp: int, cp: int, tp: int) -> config_lib.RunPlan:
  return config_lib.RunPlan(dp, pp, tp, 1, 1, 1, dp, 16, 256, cp=cp)


def _fake_devices(hosts: int, per_host: int) -> list:
  """Devices of `hosts` processes, listed out of order, ids interleaved across hosts."""
  devs = [
    types.SimpleNamespace(id=k * hosts + h, process_index=h) for h in range(hosts) for k in range(per_host)
  ]
  return devs[::-1]


def test_cp_groups_stay_inside_a_host():
  """2 hosts of 8 and 4 of 4, every (dp, pp, cp, tp) with cp*tp <= devices per host: each cp group
  and each tp group is one host's, tp varies fastest (neighbouring ids of the host); cp*tp above a
  host's devices is refused."""
  for hosts, per_host in ((2, 8), (4, 4)):
    _check_placement(hosts, per_host)


def _check_placement(hosts: int, per_host: int) -> None:
  n = hosts * per_host
  for cp in (2, 4):
    for tp in (1, 2, 4):
      if cp * tp > per_host:
        plan = _plan(1, n // (cp * tp), cp, tp)
        with pytest.raises(ConfigError, match='span hosts'):
          mesh_lib.device_grid(plan, _fake_devices(hosts, per_host))
        continue
      for pp in (1, 2):
        plan = _plan(n // (cp * tp * pp), pp, cp, tp)
        grid = mesh_lib.device_grid(plan, _fake_devices(hosts, per_host))
        assert grid.shape == (plan.dp, pp, cp, tp)
        host = np.vectorize(lambda d: d.process_index)(grid)
        assert (host == host[:, :, :1, :1]).all(), (cp, tp, pp)  # cp x tp blocks: one host each
        ids = np.vectorize(lambda d: d.id)(grid)
        assert (np.diff(ids, axis=-1) == hosts).all()  # tp: the host's next device each
        assert sorted(ids.ravel()) == list(range(n))


@pytest.mark.slow
def test_startup_line_cp_traffic_is_the_formula():
  """The compiled step at dp2 cp4 (2 layers, 2 KV heads of 8, 8 rows of 64 tokens per dp rank,
  fp32): the start-up line's K/V figure over cp, and inspect's cp check, against docs/formulas.md
  computed here: per layer K and V all-gathered forward and backward and dK, dV reduce-scattered,
  3 (c-1)/c * 2*b*s*k*d_head*4 bytes (and the key segment ids' gather, (c-1)/c * b*s*4, once)."""
  from jax3d import assemble
  from jax3d.analysis import inspection

  from helpers import setup_for

  over = {'mesh__dp': 2, 'mesh__cp': 4, 'model__n_layers': 2, 'model__n_kv_heads': 2, 'train__seq_len': 64}
  s = setup_for(small_cfg(train__attention='blockwise', train__global_batch_size=16, **over))
  r = assemble.compile_train_step(s).analysis()
  layers, cp, b, seq, kv, hd = 2, 4, 8, 64, 2, 64 // 8
  formula = layers * 3 * (cp - 1) / cp * 2 * b * seq * kv * hd * 4
  (line,) = [x for x in inspection.summary_lines(r) if x.startswith('comm per device')]
  got = float(re.search(r'cp [\d.]+ MiB \(K/V ([\d.]+) MiB\)', line).group(1))
  assert got == pytest.approx(formula / 2**20, abs=0.006), line
  (check,) = [c for c in r['checks'] if c['axis'] == 'cp']
  assert check['formula'] == pytest.approx(formula, rel=1e-12)
  segments = (cp - 1) / cp * b * seq * 4  # the key segment ids, gathered once (out of the layer loop)
  assert check['measured'] == pytest.approx(formula + segments, rel=1e-9)


@pytest.mark.slow
@pytest.mark.skipif(not gpu_target.plugin_installed(), reason="needs JAX's CUDA plugin: '.[cuda12]'")
def test_1b_at_64k_on_h100x8_with_cp8():
  """scripts/bench_cp_gpu.py's row: the 1B-shaped model at 65536 tokens, cp=8, compiled by XLA:GPU
  for 8 x H100 (no GPU; about 20 s): it fits, in less than half of what the memory model prices
  the same step without cp (dp=8: 72.7 GiB, 68.7 by XLA:GPU in docs/plan.md), and within 3% of its
  own estimate (28.79 GiB: the optimizer update's peak, memory_model._update_peak)."""
  from jax3d.planning import costmodel

  bench = _script('bench_cp_gpu')
  r = bench.one('h100x8', 65536, 8)
  cfg = config_lib.load_config('tiny', bench.shape(65536, 1, 8))
  without = costmodel.estimate(cfg, config_lib.validate(cfg, 8), hw=Hardware(attention='blockwise'))
  assert r['fits'] and r['compiled_total_gib'] * 2**30 < 0.5 * without.total_bytes, r
  assert r['estimate_gib'] == pytest.approx(r['compiled_total_gib'], rel=0.03), r


def _script(name: str):
  import os
  import sys

  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts'))
  return __import__(name)


def test_startup_lines_of_a_ring_run():
  """train.cp_strategy=ring at dp2 cp4 (2 layers, 2 KV heads of 8, 8 rows of 64 tokens per dp
  rank, fp32): the mesh line names cp, the compiled step's attention line says blockwise as the
  parameters line does, and the K/V figure is the ring's formula of docs/formulas.md computed here:
  per layer the blocks (own: b*s/c tokens) go c-1 steps round forward and c-1 backward, their fp32
  dK/dV accumulators c steps, 2 (c-1)/c * 2*b*s*k*d_head*4 + 2*b*s*k*d_head*4 bytes; the key
  segment ids (b*s/c int32) ride with the blocks, at most 2 (c-1) steps per layer."""
  from jax3d import assemble
  from jax3d.analysis import inspection
  from jax3d.trainer import metrics

  from helpers import setup_for

  over = {'mesh__dp': 2, 'mesh__cp': 4, 'model__n_layers': 2, 'model__n_kv_heads': 2, 'train__seq_len': 64}
  cfg = small_cfg(
    train__attention='blockwise', train__global_batch_size=16, train__cp_strategy='ring', **over
  )
  s = setup_for(cfg)
  r = assemble.compile_train_step(s).analysis()
  start = metrics.summary_lines(s, 'data')
  assert 'mesh dp=2 x pp=1 x cp=4 x tp=1' in start[0], start[0]
  assert 'attention blockwise over cp=4 (ring)' in start[2], start[2]
  lines = inspection.summary_lines(r)
  assert any(x.endswith(f'attention: {inspection.KERNEL_NAMES["blockwise"]}') for x in lines), lines
  layers, cp, b, seq, kv, hd = 2, 4, 8, 64, 2, 64 // 8
  whole = 2 * b * seq * kv * hd * 4
  formula = layers * (2 * (cp - 1) / cp * whole + whole)
  segments = layers * 2 * (cp - 1) * b * seq // cp * 4
  (line,) = [x for x in lines if x.startswith('comm per device')]
  got = float(re.search(r'cp [\d.]+ MiB \(K/V ([\d.]+) MiB\)', line).group(1))
  assert got == pytest.approx((formula + segments) / 2**20, abs=0.005), line  # printed to 0.01 MiB
  (check,) = [c for c in r['checks'] if c['axis'] == 'cp']
  assert check['formula'] == pytest.approx(formula, rel=1e-12)
  # the blocks' bytes exactly, plus at most the segment ids' (XLA shares some of their transfers)
  assert formula < check['measured'] <= formula + segments, (check, segments)
  assert not any('note: K/V' in x for x in lines), lines
