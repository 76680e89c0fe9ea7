"""One build path: what `jax3d.inspect`, `jax3d.plan --verify` and the API report for an hf:
import is the model the trainer trains (all of them go through `assemble.build`), and an import
builds its state from the folder's tensors, with no random initialisation first."""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import json
import subprocess
import sys

import hf_helpers as H
import jax
import numpy as np
import pytest

import jax3d
from jax3d import assemble, config, step as step_lib
from jax3d.planning import costmodel
from jax3d.planning.costmodel import GB
from jax3d.trainer.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = (2, 2, 2)


def _flags(folder: str) -> list[str]:
  """The command-line overrides of hf_helpers.jax3d_cfg(folder, LAYOUT), without the import."""
  cfg = H.jax3d_cfg(folder, LAYOUT)
  keys = (
    'mesh.dp',
    'mesh.pp',
    'mesh.tp',
    'pipeline.microbatches',
    'train.global_batch_size',
    'train.seq_len',
  )
  return [f'--config.{k}={cfg[k.split(".")[0]][k.split(".")[1]]}' for k in keys]


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('hf') / 'llama')
  H.make_hf_model(path, tied=False)
  return path


@pytest.fixture(scope='module')
def trained_args(folder):
  """The argument bytes per device of the step the trainer compiles for the import."""
  t = Trainer(H.jax3d_cfg(folder, LAYOUT), console=False)
  try:
    t.compile()
    return t.compiled.memory['argument'], t.setup.dims
  finally:
    t.close()


def _command(*args: str) -> str:
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8')
  r = subprocess.run(
    [sys.executable, '-m', *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
  )
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout


def test_build_resolves_the_import(folder, trained_args):
  s = assemble.build(H.jax3d_cfg(folder, LAYOUT), jax.devices())
  assert s.hf is not None and s.hf.path == os.path.abspath(folder)
  assert (s.dims.d_model, s.dims.n_layers, s.dims.vocab_size) == (
    H.TINY['hidden_size'],
    H.TINY['num_hidden_layers'],
    H.TINY['vocab_size'],
  )
  assert s.dims == trained_args[1]


def test_inspect_reports_the_imported_model(folder, trained_args):
  args = trained_args[0]
  flags = _flags(folder)
  out = json.loads(_command('jax3d.inspect', f'--config.checkpoint.init_from=hf:{folder}', *flags, '--json'))
  assert out['memory_bytes']['argument'] == args
  default = json.loads(_command('jax3d.inspect', *flags, '--json'))  # the tiny config's own model
  assert default['memory_bytes']['argument'] != args


def test_plan_verify_compiles_the_imported_model(folder, trained_args):
  rows = json.loads(
    _command(
      'jax3d.plan',
      f'--config.checkpoint.init_from=hf:{folder}',
      *_flags(folder),
      '--nodes=1',
      '--gpus_per_node=8',
      '--fixed',
      '--verify',
      '--json',
    )
  )
  assert rows[0]['compiled_breakdown_gb']['argument'] == round(trained_args[0] / GB, 6)
  # The planner's own estimate is of the imported model too (not of the config's default model).
  cfg = assemble.resolve(H.jax3d_cfg(folder, LAYOUT))
  est = costmodel.estimate(
    cfg,
    config.validate(cfg, 8),
    hw=costmodel.Hardware(flash_attention=True, attention='blockwise', gpu=False),
  )
  assert rows[0]['estimate_memory_gb'] == round(est.total_bytes / GB, 6)


def test_api_compiled_memory_of_an_import(folder, trained_args):
  assert jax3d.compiled_memory(H.jax3d_cfg(folder, LAYOUT))['argument'] == trained_args[0]


def test_an_import_builds_its_state_without_a_random_init(folder, monkeypatch):
  """The parameters are the folder's, the moments zero, and the seed's init never runs."""

  def no_random_init(s):
    raise AssertionError('an import must not initialise random parameters first')

  monkeypatch.setattr(step_lib, 'make_init', no_random_init)
  t = Trainer(H.jax3d_cfg(folder, LAYOUT), console=False)
  try:
    assert 'imported from' in t.init_state()
    _, ref = H.imported(folder, LAYOUT)
    for a, b in zip(jax.tree.leaves(t.state['params']), jax.tree.leaves(ref), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moments = [x for x in jax.tree.leaves(t.state['opt_state']) if getattr(x, 'ndim', 0) > 0]
    assert moments and all(not np.any(np.asarray(x)) for x in moments)
    assert int(t.state['step']) == 0
  finally:
    t.close()
