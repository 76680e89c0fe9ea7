"""`python -m jax3d.train` end to end on a few steps: metrics written, loss falls, text printed."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_cli_end_to_end(tmp_path):
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)  # the command itself exposes 8 fake CPU devices
  env.pop('JAX_PLATFORMS', None)  # as a user runs it: with the CUDA plugin and no GPU, the command hides it
  r = subprocess.run(
    [
      sys.executable,
      '-m',
      'jax3d.train',
      f'--workdir={tmp_path}',
      '--config.train.steps=40',
      '--config.log.every=5',
      '--config.eval.every=20',
      '--config.eval.batches=2',
      '--config.model.d_model=128',
      '--config.model.d_ff=256',
      '--config.train.seq_len=64',
      '--config.sample.tokens=20',
      '--config.checkpoint.every=20',
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'Traceback' not in r.stderr and 'plugin configuration error' not in r.stderr, r.stderr[-3000:]
  out = r.stdout
  assert 'jax3d: 8 cpu devices, mesh dp=2 x pp=2 x tp=2' in out
  assert 'bubble 20.0%' in out and 'compiled the train step' in out and 'sample: ' in out
  recs = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  steps = [r for r in recs if 'loss' in r and 'event' not in r]
  assert [r['step'] for r in steps] == list(range(5, 41, 5))
  for rec in steps:
    for key in ('loss', 'lr', 'grad_norm', 'tokens_per_sec', 'step_time_s', 'tokens', 'mfu', 'memory'):
      assert key in rec
    assert len(rec['memory']['bytes_in_use']) == 8
  assert steps[-1]['loss'] < steps[0]['loss'] - 1.0
  evals = {r['step']: r['eval_loss'] for r in recs if 'eval_loss' in r}
  assert sorted(evals) == [0, 20, 40] and evals[40] < evals[0] - 1.5
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['20', '40']


def test_a_checkpoint_write_failing_at_close_is_one_error_line_and_exit_3(tmp_path, monkeypatch, capsys):
  """An async save's write that fails after the last step surfaces when the trainer closes: one
  `error:` line and exit 3, as during training (it escaped as a traceback, exit 1)."""
  from jax3d import errors, train
  from jax3d.trainer import trainer as trainer_lib

  class Closing:
    preempted = True  # no sample after training

    def __init__(self, cfg, workdir):
      pass

    def summary(self):
      return []

    def log(self, line):
      pass

    def train(self):
      pass

    def close(self):
      raise errors.CheckpointError('could not write checkpoint step 4: the disk is full')

  monkeypatch.setattr(trainer_lib, 'Trainer', Closing)
  assert train.main([f'--workdir={tmp_path / "w"}', '--config=tiny']) == 3
  err = capsys.readouterr().err
  assert err.count('error:') == 1 and 'disk is full' in err and 'Traceback' not in err, err
