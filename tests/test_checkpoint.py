"""Checkpoints: exact resume, resume onto other layouts, integrity, shape checks, NaN safety."""

import json
import os
import signal
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jax3d import config as config_lib
from jax3d.parallel import placement
from jax3d.trainer import checkpoint as ckpt_lib
from jax3d.trainer.trainer import Trainer, TrainingError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {
  'model.n_layers': 8,
  'model.d_model': 64,
  'model.n_heads': 4,
  'model.n_kv_heads': 4,
  'model.d_ff': 128,
  'train.seq_len': 32,
  'train.global_batch_size': 16,
  'train.steps': 10,
  'train.warmup_steps': 2,
  'log.every': 1,
  'eval.every': 0,
  'eval.batches': 1,
  'checkpoint.every': 5,
  'log.progress': False,
}
CLI_SMALL = [f'--config.{k}={v}' for k, v in SMALL.items()]


def cfg_for(dp, pp, tp, m=None, **over):
  ov = dict(SMALL, **{'mesh.dp': dp, 'mesh.pp': pp, 'mesh.tp': tp, 'pipeline.microbatches': m or max(pp, 1)})
  ov.update({k.replace('__', '.'): v for k, v in over.items()})
  return config_lib.load_config('tiny', ov)


def canonical_state(t: Trainer):
  """The train state on the host with layer axes in canonical order (layout-independent)."""
  perm = np.argsort(placement.layer_order(t.cfg.model.n_layers, t.plan.pp, t.plan.repeats))
  return jax.device_get(ckpt_lib.permute_layers(t.state, perm, jax.tree.map(lambda a: a.sharding, t.state)))


def losses(workdir):
  out = {}
  for line in open(os.path.join(workdir, 'metrics.jsonl')):
    r = json.loads(line)
    if 'loss' in r and 'event' not in r:
      out[r['step']] = r['loss']
  return out


def read_ckpt(workdir, step):
  mgr = ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'), item_names=('state', 'meta'))
  r = mgr.restore(
    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
  )
  mgr.close()
  return r['state'], r['meta']


def cli(workdir, *args, timeout=300, wrap=(), **kw):
  """`python -m jax3d.train` on the small model (its output merged into stdout), run through the
  command prefix `wrap` if one is given."""
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8')
  return subprocess.Popen(
    [*wrap, sys.executable, '-m', 'jax3d.train', f'--workdir={workdir}', *CLI_SMALL, *args],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    **kw,
  )


RESUME_SCRIPT = """
import sys
from jax3d import config as c
from jax3d.trainer.trainer import Trainer
cfg = c.load_config('tiny', {overrides!r})
t = Trainer(cfg, workdir={workdir!r}, console=False)
print(t.init_state())
t.train(steps={steps})
t.close()
"""


def run_python(code):
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8')
  r = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout


@pytest.mark.slow
def test_resume_in_a_new_process_is_bit_identical(tmp_path):
  ov = dict(SMALL, **{'mesh.dp': 2, 'mesh.pp': 2, 'mesh.tp': 2, 'pipeline.microbatches': 2})
  straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
  run_python(RESUME_SCRIPT.format(overrides=ov, workdir=straight, steps=10))
  out1 = run_python(RESUME_SCRIPT.format(overrides=ov, workdir=split, steps=5))
  assert 'initialised' in out1
  out2 = run_python(RESUME_SCRIPT.format(overrides=ov, workdir=split, steps=5))
  assert 'resumed from' in out2 and 'next step 5' in out2
  a, b = losses(straight), losses(split)
  assert sorted(a) == sorted(b) == list(range(1, 11))
  assert [a[i] for i in a] == [b[i] for i in a]  # bit-identical
  sa, ma = read_ckpt(straight, 10)
  sb, mb = read_ckpt(split, 10)
  chex.assert_trees_all_equal(sa, sb)  # params, optimizer state (schedule count), step
  assert ma['data_step'] == mb['data_step'] == 10


@pytest.mark.parametrize(
  'target',
  [
    pytest.param((8, 1, 1, 1), marks=pytest.mark.slow),
    (1, 8, 1, 8),
    pytest.param((1, 2, 4, 2), marks=pytest.mark.slow),
    pytest.param((2, 2, 2, 'circular'), marks=pytest.mark.slow),
  ],
)
def test_resume_onto_another_layout(tmp_path, target):
  src = Trainer(cfg_for(2, 2, 2, m=2), workdir=str(tmp_path), console=False)
  src.train(steps=3)
  saved = canonical_state(src)
  src.train(steps=1)  # the loss of step 4 from the uninterrupted run
  ref_loss = losses(str(tmp_path))[4]
  src.close()
  os.remove(str(tmp_path / 'metrics.jsonl'))
  for step in (4,):  # restore step 3: drop the later checkpoint
    import shutil

    shutil.rmtree(str(tmp_path / 'checkpoints' / str(step)))
  if target[3] == 'circular':
    cfg = cfg_for(2, 2, 2, m=2, pipeline__repeats=2, pipeline__schedule='circular')
  else:
    cfg = cfg_for(*target[:3], m=target[3])
  dst = Trainer(cfg, workdir=str(tmp_path), console=False)
  assert 'resumed' in dst.init_state()
  chex.assert_trees_all_equal(canonical_state(dst), saved)
  want = dst.setup.state_shardings
  for arr, sh in zip(jax.tree.leaves(dst.state), jax.tree.leaves(want), strict=True):
    assert arr.sharding.is_equivalent_to(sh, arr.ndim)
  dst.train(steps=1)
  np.testing.assert_allclose(losses(str(tmp_path))[4], ref_loss, rtol=1e-5)
  dst.close()


def test_damaged_latest_checkpoint_falls_back(tmp_path, capsys):
  t = Trainer(cfg_for(2, 2, 2, m=2, checkpoint__every=2), workdir=str(tmp_path), console=False)
  t.train(steps=4)
  t.close()
  steps = sorted(int(s) for s in os.listdir(tmp_path / 'checkpoints') if s.isdigit())
  assert steps[-2:] == [2, 4]
  files = [
    os.path.join(d, f)
    for d, _, fs in os.walk(tmp_path / 'checkpoints' / '4' / 'state')
    for f in fs
    if os.path.getsize(os.path.join(d, f)) > 64
  ]
  biggest = max(files, key=os.path.getsize)
  with open(biggest, 'r+b') as f:  # truncate the largest data file
    f.truncate(os.path.getsize(biggest) // 3)
  t2 = Trainer(cfg_for(2, 2, 2, m=2), workdir=str(tmp_path), console=False)
  msg = t2.init_state()
  assert 'resumed from' in msg and msg.split('resumed from ')[1].split(' ')[0].endswith('/2')
  assert 'checkpoints/4' in capsys.readouterr().err
  t2.close()
  # a deleted file: the step folder of 2 loses its metadata
  meta_files = [
    os.path.join(d, f) for d, _, fs in os.walk(tmp_path / 'checkpoints' / '2' / 'state') for f in fs
  ]
  for f in meta_files:
    os.remove(f)
  t3 = Trainer(cfg_for(2, 2, 2, m=2), workdir=str(tmp_path), console=False)
  assert t3.init_state().startswith('initialised')  # nothing usable left: a fresh start, said so
  err = capsys.readouterr().err
  assert 'checkpoints/4' in err and 'checkpoints/2' in err
  t3.close()


def test_checkpoint_from_another_model_is_refused(tmp_path):
  t = Trainer(cfg_for(2, 2, 2, m=2), workdir=str(tmp_path), console=False)
  t.train(steps=1)
  t.close()
  other = Trainer(
    cfg_for(2, 2, 2, m=2, model__d_ff=256, train__param_dtype='bfloat16'),
    workdir=str(tmp_path),
    console=False,
  )
  with pytest.raises(ckpt_lib.CheckpointError) as e:
    other.init_state()
  msg = str(e.value)
  assert (
    'params/layers/gate_up/kernel: checkpoint (8, 64, 2, 128) float32, config (8, 64, 2, 256) bfloat16'
  ) in msg
  assert 'params/embed/embedding: checkpoint (256, 64) float32, config (256, 64) bfloat16' in msg
  other.close()


@pytest.mark.slow
def test_int8_residual_resumes_exactly(tmp_path):
  """The int8 error-feedback residual is train state: a resumed run continues bit-identically."""
  straight = Trainer(
    cfg_for(2, 2, 2, m=2, train__grad_reduce_dtype='int8'), workdir=str(tmp_path / 'a'), console=False
  )
  straight.train(steps=4)
  straight.close()
  first = Trainer(
    cfg_for(2, 2, 2, m=2, train__grad_reduce_dtype='int8', checkpoint__every=2),
    workdir=str(tmp_path / 'b'),
    console=False,
  )
  first.train(steps=2)
  residual = jax.device_get(first.state['grad_residual'])
  first.close()
  second = Trainer(
    cfg_for(2, 2, 2, m=2, train__grad_reduce_dtype='int8'), workdir=str(tmp_path / 'b'), console=False
  )
  assert 'resumed' in second.init_state()
  assert max(float(np.abs(x).max()) for x in jax.tree.leaves(residual)) > 0
  chex.assert_trees_all_equal(jax.device_get(second.state['grad_residual']), residual)
  second.train(steps=2)
  second.close()
  a, b = losses(str(tmp_path / 'a')), losses(str(tmp_path / 'b'))
  assert [a[i] for i in (3, 4)] == [b[i] for i in (3, 4)]


@pytest.mark.slow
def test_residual_is_restarted_when_the_reduction_or_dp_changes(tmp_path, capsys):
  """float32 -> int8 (no residual saved), int8 at dp=2 -> dp=4, int8 -> float32: each resumes the
  parameters and optimizer state; the residual starts at zero with a warning where it is needed."""
  Trainer(cfg_for(2, 2, 2, m=2), workdir=str(tmp_path), console=False).train(steps=1)
  t = Trainer(
    cfg_for(2, 2, 2, m=2, train__grad_reduce_dtype='int8', checkpoint__every=1),
    workdir=str(tmp_path),
    console=False,
  )
  assert 'next step 1' in t.init_state()
  assert 'has none: the int8 gradient residual (error feedback) starts at zero' in capsys.readouterr().err
  t.train(steps=1)
  t.close()
  t = Trainer(cfg_for(4, 1, 2, train__grad_reduce_dtype='int8'), workdir=str(tmp_path), console=False)
  assert 'next step 2' in t.init_state()
  assert 'has one for dp=2' in capsys.readouterr().err
  assert all(float(np.abs(x).max()) == 0 for x in jax.tree.leaves(jax.device_get(t.state['grad_residual'])))
  t.close()
  t = Trainer(cfg_for(2, 2, 2, m=2), workdir=str(tmp_path), console=False)
  assert 'next step 2' in t.init_state() and 'grad_residual' not in t.state
  t.close()


@pytest.mark.slow  # the default suite keeps the NaN stop's exit status (test_nan_stop_exit_status_is_3)
def test_nan_steps_are_skipped_logged_and_stop_the_run(tmp_path):
  t = Trainer(
    cfg_for(2, 2, 2, m=2, train__inject_nan_at='3', checkpoint__every=2), workdir=str(tmp_path), console=False
  )
  t.train(steps=2)
  before = jax.device_get(t.state['params'])
  t.train(steps=1)  # step 3 is NaN: skipped
  chex.assert_trees_all_equal(jax.device_get(t.state['params']), before)
  records = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  assert any(r.get('event') == 'nonfinite' and r['step'] == 3 for r in records)
  t.train(steps=1)  # step 4 trains again
  assert not np.allclose(
    jax.device_get(t.state['params'])['head']['out']['kernel'], before['head']['out']['kernel']
  )
  t.close()
  t = Trainer(
    cfg_for(2, 2, 2, m=2, train__inject_nan_at='6,7,8', train__max_bad_steps=3, checkpoint__every=1),
    workdir=str(tmp_path / 'b'),
    console=False,
  )
  with pytest.raises(TrainingError, match='stopping at step 8: 3 consecutive non-finite steps'):
    t.train()
  t.close()
  for step in sorted(int(s) for s in os.listdir(tmp_path / 'b' / 'checkpoints') if s.isdigit()):
    state, _ = read_ckpt(str(tmp_path / 'b'), step)
    assert all(
      np.isfinite(x).all() for x in jax.tree.leaves(state) if np.issubdtype(np.asarray(x).dtype, np.floating)
    )


def test_nan_stop_exit_status_is_3(tmp_path):
  p = cli(str(tmp_path), '--config.train.inject_nan_at=2,3', '--config.train.max_bad_steps=2')
  out, _ = p.communicate(timeout=300)
  assert p.returncode == 3, out[-2000:]
  assert 'stopping at step 3: 2 consecutive non-finite steps' in out


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_and_resume_is_exact(tmp_path):
  ref = str(tmp_path / 'ref')
  p = cli(ref)
  assert p.wait(timeout=300) == 0
  w = str(tmp_path / 'w')
  p = cli(w, '--config.checkpoint.every=100')
  lines = []
  for line in p.stdout:
    lines.append(line)
    if line.startswith('step      3/'):
      p.send_signal(signal.SIGTERM)
      break
  out = ''.join(lines) + p.communicate(timeout=120)[0]
  assert p.returncode == 0, out[-2000:]
  assert 'SIGTERM: saved step' in out
  saved = sorted(int(s) for s in os.listdir(os.path.join(w, 'checkpoints')) if s.isdigit())
  assert len(saved) == 1 and 3 <= saved[0] < 10
  p = cli(w)
  out = p.communicate(timeout=300)[0]
  assert p.returncode == 0 and 'resumed from' in out
  assert losses(w) == losses(ref)
  chex.assert_trees_all_equal(read_ckpt(w, 10)[0], read_ckpt(ref, 10)[0])


@pytest.mark.slow
def test_sigkill_during_checkpoint_writes_never_corrupts_the_run(tmp_path):
  """Killed at several points while checkpoints are written every step: each rerun resumes from
  the last complete step, and the final parameters equal those of an uninterrupted run."""
  ref = str(tmp_path / 'ref')
  assert cli(ref).wait(timeout=300) == 0
  w = str(tmp_path / 'w')
  for kill_after_lines in (2, 5):
    p = cli(w, '--config.checkpoint.every=1')
    seen = 0
    for line in p.stdout:
      if line.startswith('step '):
        seen += 1
        if seen == kill_after_lines:
          time.sleep(0.05 * kill_after_lines)  # land inside an asynchronous write
          p.send_signal(signal.SIGKILL)
          break
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    steps = sorted(int(s) for s in os.listdir(os.path.join(w, 'checkpoints')) if s.isdigit())
    for s in steps:  # every listed step is complete and readable
      read_ckpt(w, s)
  p = cli(w, '--config.checkpoint.every=1')
  out = p.communicate(timeout=300)[0]
  assert p.returncode == 0, out[-2000:]
  chex.assert_trees_all_equal(read_ckpt(w, 10)[0], read_ckpt(ref, 10)[0])
