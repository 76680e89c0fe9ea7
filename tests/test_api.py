"""The public API (jax3d/api.py): each function against the numbers it must give."""

import math
import os
import subprocess
import sys

import jax
import pytest

import jax3d
from jax3d import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {
  'model.d_model': 64,
  'model.d_ff': 128,
  'train.seq_len': 32,
  'train.global_batch_size': 16,
  'train.steps': 5,
  'train.warmup_steps': 1,
  'log.every': 1,
  'eval.every': 0,
  'eval.batches': 2,
  'checkpoint.every': 0,
}


@pytest.fixture(scope='module')
def trained():
  """The tiny model, small, on its own layout dp=2 pp=2 tp=2 with 4 micro-batches, 5 steps."""
  t = jax3d.build(jax3d.load_config('tiny', SMALL))
  records = t.train()
  return t, records


def _python(code: str, env_extra=None):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env.update(
    PYTHONPATH=os.pathsep.join([ROOT, env.get('PYTHONPATH', '')]), JAX_PLATFORMS='cpu', **(env_extra or {})
  )
  r = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert r.returncode == 0, r.stderr
  return r.stdout.split()


def test_import_is_cheap_and_fake_devices_work():
  """`import jax3d` imports no jax (the device count is still open), and use_fake_cpu_devices then
  gives 8 devices. Submodules whose names the API could shadow stay modules."""
  out = _python(
    'import sys, jax3d\n'
    'print("jax" in sys.modules, jax3d.bubble(2, 4))\n'
    'jax3d.use_fake_cpu_devices(8)\n'
    'import jax, types\n'
    'print(jax.device_count())\n'
    'from jax3d import plan\n'
    'print(isinstance(plan, types.ModuleType), isinstance(jax3d.inspect, types.ModuleType))\n'
  )
  assert out == ['False', '0.2', '8', 'True', 'True']


def test_trainer_is_reexported():
  from jax3d.trainer.trainer import Trainer

  assert jax3d.Trainer is Trainer and 'Trainer' in dir(jax3d)


def test_use_fake_cpu_devices_after_the_backend_started():
  jax.devices()  # started, with the 8 devices of conftest
  assert jax3d.use_fake_cpu_devices(8) == 8
  with pytest.raises(RuntimeError, match='already started with 8'):
    jax3d.use_fake_cpu_devices(4)


def test_load_config_overrides():
  cfg = jax3d.load_config('tiny', {'mesh.tp': 4}, model__n_kv_heads=4, train__lr=1e-3)
  assert (cfg.mesh.tp, cfg.model.n_kv_heads, cfg.train.lr) == (4, 4, 1e-3)
  assert cfg.model.d_model == 256  # the rest is configs/tiny.py
  with pytest.raises(config_lib.ConfigError, match='model.d_modle'):
    jax3d.load_config('tiny', model__d_modle=64)


def test_bubble_formula():
  assert jax3d.bubble(1, 8) == 0.0
  assert jax3d.bubble(2, 4) == pytest.approx(1 / 5)
  assert jax3d.bubble(4, 8) == pytest.approx(3 / 11)
  assert jax3d.bubble(4, 8, repeats=2) == pytest.approx(3 / 19)
  assert jax3d.bubble(8, 1) == pytest.approx(7 / 8)
  # The trainer's own run plan says the same for every layout it accepts.
  for pp, m, v in [(2, 4, 1), (4, 4, 1), (4, 8, 2), (8, 8, 1)]:
    cfg = jax3d.load_config(
      'tiny',
      {
        'mesh.pp': pp,
        'mesh.tp': 1,
        'mesh.dp': 8 // pp,
        'pipeline.microbatches': m,
        'pipeline.repeats': v,
        'pipeline.schedule': 'circular' if v > 1 else 'gpipe',
        'model.n_layers': 16,
        'train.global_batch_size': 64,
      },
    )
    assert config_lib.validate(cfg, 8).bubble == pytest.approx(jax3d.bubble(pp, m, v))
  with pytest.raises(ValueError):
    jax3d.bubble(0, 4)


def test_build_and_train_returns_losses(trained):
  t, records = trained
  losses = jax3d.losses(records)
  assert [r['step'] for r in records if 'loss' in r] == [1, 2, 3, 4, 5]
  assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
  # Initial logits of std ~1 over 256 bytes: about ln(256) + 1/2; five steps at lr 3e-3 learn.
  assert abs(losses[0] - (math.log(256) + 0.5)) < 0.3, losses
  assert losses[-1] < losses[0] - 0.3, losses
  assert t.step == 5
  evals = [r['eval_loss'] for r in records if 'eval_loss' in r]
  assert len(evals) == 1 and abs(evals[0] - losses[-1]) < 0.5
  assert t.evaluate() == pytest.approx(evals[0], rel=1e-6)  # the same held-out batches


def test_sharding_table_matches_the_state(trained):
  """Rows agree with Setup.param_shardings and with the arrays the trainer really holds."""
  t, _ = trained
  rows = {r['param']: r for r in jax3d.sharding_table(t)}
  shardings = t.setup.param_shardings
  params = t.state['params']
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_sh = jax.tree.leaves(shardings)
  assert len(rows) == len(flat) == 9
  for (path, arr), sh in zip(flat, flat_sh, strict=True):
    r = rows['/'.join(k.key for k in path)]
    assert r['spec'] == sh.spec == arr.sharding.spec
    assert r['shape'] == arr.shape
    assert r['per_device'] == arr.addressable_shards[0].data.shape == sh.shard_shape(arr.shape)
  # Megatron on dp=2 pp=2 tp=2: columns / rows over tp, layers over pp, nothing over dp.
  qkv = rows['layers/qkv/kernel']
  assert qkv['shape'] == (4, 64, 2, 4, 16) and qkv['per_device'] == (2, 64, 1, 4, 16)
  assert qkv['logical'] == ('layers', 'embed', 'kv_heads', 'qkv', 'head_dim')
  assert rows['layers/down/kernel']['spec'] == jax.sharding.PartitionSpec('pp', 'tp', None)
  assert rows['embed/embedding']['per_device'] == (128, 64)
  assert not any('dp' in str(r['spec']) for r in rows.values())
  # Bytes per device: what device 0 holds.
  held = sum(
    s.data.nbytes
    for a in jax.tree.leaves(params)
    for s in a.addressable_shards
    if s.device == t.mesh.devices.flat[0]
  )
  assert sum(r['bytes_per_device'] for r in rows.values()) == held
  text = jax3d.format_table(list(rows.values()), ['param', 'per_device'])
  assert 'layers/qkv/kernel' in text and '2x64x1x4x16' in text


def test_placement_tp_fastest(trained):
  t, _ = trained
  lines = jax3d.placement(t)
  assert len(lines) == 8
  assert lines[1].startswith('(dp=0, pp=0, tp=1)') and 'device 1 ' in lines[1]
  assert lines[4].startswith('(dp=1, pp=0, tp=0)') and 'device 4 ' in lines[4]


def test_compiled_memory_remat(trained):
  """XLA's bytes per device: the state (params + Adam m and v) and the batch are the arguments
  under both policies; recomputation shrinks the temporaries (the saved activations)."""
  t, _ = trained
  none = jax3d.compiled_memory(t)  # the trainer's own compiled step
  assert none == jax3d.compiled_memory(t.cfg)  # compiled again from the config: the same step
  full = jax3d.compiled_memory(t.cfg, train__remat='full')
  assert full['argument'] == none['argument']
  assert full['temp'] < 0.5 * none['temp'], (none, full)
  params = sum(r['bytes_per_device'] for r in jax3d.sharding_table(t))
  batch = 2 * (16 // 2) * 32 * 4  # inputs and targets, the dp shard of one device, int32
  assert 3 * params + batch <= none['argument'] <= 1.05 * (3 * params + batch)
  assert none['total'] == none['argument'] + none['temp'] + none['output'] - none['alias']


def test_plan_layouts_llama3_8b():
  p = jax3d.plan_layouts('llama3_8b', nodes=8, gpus_per_node=8, gpu_memory_gb=80)
  best = p.best
  assert best['fits'] and best['dp'] * best['pp'] * best['tp'] == 64
  assert best['tp'] <= 8 and best['memory_gb'] <= 80
  assert best == {k: v for k, v in p.layouts[0].items()}  # ranked: the best fitting layout first
  fitting = [r for r in p.layouts if r['fits']]
  assert all(r['step_time_s'] >= best['step_time_s'] for r in fitting)
  assert any(not r['fits'] for r in p.layouts)  # tp=1 layouts of an 8B model do not fit 80 GB
  # The flags reproduce the layout through the config validation the trainer uses.
  over = dict(f[len('--config.') :].split('=') for f in p.flags.split())
  plan = config_lib.validate(jax3d.load_config('llama3_8b', over), 64)
  assert (plan.dp, plan.pp, plan.tp, plan.microbatches) == (
    best['dp'],
    best['pp'],
    best['tp'],
    best['microbatches'],
  )
  assert 'Why dp=' in str(p)
  import types

  assert isinstance(jax3d.plan, types.ModuleType)  # the planner module is not shadowed
  assert jax3d.api.plan is jax3d.plan_layouts


def test_losses_helper():
  recs = [
    {'event': 'start', 'step': 0},
    {'step': 1, 'loss': 2.0},
    {'step': 1, 'eval_loss': 1.5},
    {'step': 2, 'event': 'nonfinite', 'loss': 9.0},
    {'step': 3, 'loss': 1.0},
  ]
  assert jax3d.losses(recs) == [2.0, 1.0]
