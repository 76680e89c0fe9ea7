"""Issue 16, configuration and reporting defects: the memory budget (hardware.memory_gb) through the
CLI, the logged learning rate after a skipped step, configs shipped in the package, the batch
shape check at the step boundary, `plan --json --verify`, and pipeline.repeats alone."""

import json
import os
import shutil
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

from jax3d import config as config_lib, step as step_lib

from helpers import fixed_batches, setup_for, small_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_CLI = [
  '--config.mesh.dp=8',
  '--config.mesh.pp=1',
  '--config.mesh.tp=1',
  '--config.pipeline.microbatches=1',
  '--config.model.n_layers=2',
  '--config.model.d_model=64',
  '--config.model.d_ff=128',
  '--config.train.seq_len=32',
  '--config.train.steps=2',
]


def _env():
  return dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8', JAX_PLATFORMS='cpu')


def test_memory_budget_too_small_exits_2_with_the_ladder(tmp_path):
  r = subprocess.run(
    [
      sys.executable,
      '-m',
      'jax3d.train',
      f'--workdir={tmp_path}/w',
      *SMALL_CLI,
      '--config.hardware.memory_gb=0.001',
    ],
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 2, r.stderr[-3000:]
  lines = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1, r.stderr[-3000:]
  assert 'Traceback' not in r.stderr
  assert 'hardware.memory_gb=0.001' in lines[0] and 'recompute activations' in lines[0], lines[0]
  ckpts = f'{tmp_path}/w/checkpoints'
  assert not os.path.isdir(ckpts) or not [s for s in os.listdir(ckpts) if s.isdigit()]  # nothing saved


def test_memory_budget_must_not_be_negative():
  cfg = config_lib.load_config('tiny', {'hardware.memory_gb': -1.0})
  with pytest.raises(config_lib.ConfigError, match=r'hardware.memory_gb=-1.0'):
    config_lib.validate(cfg, 8)


def test_logged_lr_is_the_optimizers_after_a_skipped_step():
  cfg = small_cfg(train__warmup_steps=10, train__steps=20, train__inject_nan_at='2')
  s = setup_for(cfg)
  state = step_lib.make_init(s)(0)
  train = step_lib.make_train_step(s)
  lrs, finite = [], []
  for b in fixed_batches(cfg, 3):
    state, m = train(state, b)
    lrs.append(float(m['lr']))
    finite.append(bool(m['finite']))
  assert finite == [True, False, True]
  # Step 2 was skipped: optax's count stayed at 1, so step 3 updated with schedule(1), not schedule(2).
  assert lrs[2] == pytest.approx(float(s.lr_schedule(1)))
  assert lrs[2] != pytest.approx(float(s.lr_schedule(2)))


def test_a_batch_of_the_wrong_shape_is_refused_at_the_step_boundary():
  cfg = small_cfg()
  s = setup_for(cfg)
  state = jax.eval_shape(lambda: step_lib.init_state(jax.random.key(0), s))
  b = fixed_batches(cfg, 1)[0]
  bad = {k: v[: cfg.train.global_batch_size // 2] for k, v in b.items()}
  with pytest.raises(AssertionError, match=r'inputs'):
    jax.eval_shape(lambda st, bt: step_lib.train_step(st, bt, s), state, bad)
  with pytest.raises(AssertionError, match=r'inputs'):
    jax.eval_shape(lambda p, bt: step_lib.eval_step(p, bt, s), state['params'], bad)
  chex.assert_shape(jax.eval_shape(lambda p, bt: step_lib.eval_step(p, bt, s), state['params'], b), ())


def test_plan_json_verify_is_one_json_document_with_the_compiled_memory():
  r = subprocess.run(
    [sys.executable, '-m', 'jax3d.plan', '--fixed', '--verify', '--json', *SMALL_CLI[:-1]],
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  rows = json.loads(r.stdout)  # the whole of stdout
  verified = [row for row in rows if 'compiled_memory_gb' in row]
  assert len(verified) == 1 and verified[0]['rank'] == 1
  assert verified[0]['compiled_memory_gb'] > 0 and verified[0]['estimate_memory_gb'] > 0


def test_repeats_alone_means_the_circular_schedule():
  cfg = config_lib.load_config('tiny', {'pipeline.repeats': 2})
  plan = config_lib.validate(cfg, 8)
  assert plan.repeats == 2 and plan.iterations == 2 * 4 + 2 - 1


def test_repeats_alone_trains_a_step():
  cfg = small_cfg(mesh__pp=2, pipeline__microbatches=2, pipeline__repeats=2)
  s = setup_for(cfg)
  state = step_lib.make_init(s)(0)
  state, m = step_lib.make_train_step(s)(state, fixed_batches(cfg, 1)[0])
  assert bool(m['finite']) and np.isfinite(float(m['loss']))


def test_configs_ship_inside_the_package(tmp_path):
  """What a non-editable install copies (setuptools' build_py: the packages and their package
  data, as a wheel holds them), offline, into a folder outside the repository: the default
  config and `tiny` are found there."""
  src, target = tmp_path / 'src', tmp_path / 'site'
  shutil.copytree(
    ROOT, src, symlinks=True, ignore=shutil.ignore_patterns('.git', '.venv', 'runs', 'build', '*.egg-info')
  )
  r = subprocess.run(
    [
      sys.executable,
      '-c',
      'import setuptools; setuptools.setup()',
      '-q',
      'build_py',
      f'--build-lib={target}',
    ],
    cwd=src,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  code = (
    'import jax3d.config as c, os\n'
    'assert c.__file__.startswith(os.environ["TARGET"]), c.__file__\n'
    'print(c.load_config().model.n_layers, c.load_config("tiny").train.steps, os.path.exists(c.default_config_path()))\n'
  )
  r = subprocess.run(
    [sys.executable, '-c', code],
    cwd=tmp_path,
    env=dict(os.environ, PYTHONPATH=str(target), TARGET=str(target)),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.split() == ['4', '300', 'True']
