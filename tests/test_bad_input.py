"""Bad input: exit status 2 and one line naming the setting, its value and what is valid,
before anything compiles."""
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = [
    # (overrides, words the one line must contain)
    (['--config.mesh.dp=3'], ['mesh dp*pp*tp', '3*2*2 = 12', '8 devices']),
    (['--config.mesh.dp=-1', '--config.mesh.tp=-1'], ['mesh.dp=-1 and mesh.tp=-1', 'at most one']),
    (['--config.mesh.dp=-1', '--config.mesh.pp=3', '--config.mesh.tp=1'], ['mesh.dp=-1 cannot be filled', '3']),
    (['--config.mesh.dp=1', '--config.mesh.pp=1', '--config.mesh.tp=8', '--config.model.n_heads=8'],
     ['model.n_kv_heads=2', 'mesh.tp=8']),
    (['--config.model.n_heads=6', '--config.model.n_kv_heads=6', '--config.model.d_model=384',
      '--config.mesh.dp=2', '--config.mesh.pp=1', '--config.mesh.tp=4'], ['model.n_heads=6', 'mesh.tp=4']),
    (['--config.model.d_ff=771'], ['model.d_ff=771', 'mesh.tp=2']),
    (['--config.model.vocab_multiple=1', '--config.model.vocab_size=257'], ['model.vocab_size=257', 'padded to 257']),
    (['--config.model.n_layers=3'], ['model.n_layers=3', 'mesh.pp*pipeline.repeats = 2*1 = 2']),
    (['--config.train.global_batch_size=20'], ['train.global_batch_size=20', '2*4*1 = 8']),
    (['--config.train.grad_accum=3'], ['train.global_batch_size=16', '2*4*3 = 24']),
    (['--config.train.compute_dtype=float16'], ["train.compute_dtype='float16'", 'float32, bfloat16']),
    (['--config.train.param_dtype=int8'], ["train.param_dtype='int8'", 'float32, bfloat16']),
    (['--config.train.remat=some'], ["train.remat='some'", 'none, full, dots, attn']),
    (['--config.train.seq_len=4096'], ['train.seq_len=4096', 'model.max_seq_len=2048']),
    (['--config.data.path=/nonexistent/corpus'], ["data.path='/nonexistent/corpus'", 'does not exist']),
    (['--config.model.nlayers=4'], ["unknown config key 'model.nlayers'", 'n_layers']),
    (['--config.trian.steps=4'], ["unknown config key 'trian'", 'train']),
    (['--config.pipeline.microbatches=0'], ['pipeline.microbatches=0', '>= 1']),
    (['--config.pipeline.microbatches=3', '--config.train.global_batch_size=15'],
     ['train.global_batch_size=15', '2*3*1 = 6', 'split over dp']),
    (['--config.pipeline.schedule=circular', '--config.pipeline.repeats=2', '--config.pipeline.microbatches=1',
      '--config.train.global_batch_size=16'], ['pipeline.microbatches=1', 'circular', 'mesh.pp=2']),
    (['--config.pipeline.schedule=circular', '--config.pipeline.repeats=3'],
     ['model.n_layers=4', '2*3 = 6']),
    (['--config.pipeline.schedule=1f1b'], ["pipeline.schedule='1f1b'", 'gpipe, circular']),
    (['--config.pipeline.repeats=2'], ['pipeline.repeats=2', 'schedule=circular']),
]


def run_cli(args, tmp_path, env_extra=None):
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8')
  env.update(env_extra or {})
  return subprocess.run([sys.executable, '-m', 'jax3d.train', f'--workdir={tmp_path}/w', *args],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize('args,words', CASES, ids=[' '.join(c[0])[:60] for c in CASES])
def test_bad_input_exits_2_with_one_clear_line(args, words, tmp_path):
  t0 = time.time()
  r = run_cli(args, tmp_path)
  assert r.returncode == 2, r.stderr[-2000:]
  lines = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1, r.stderr
  for w in words:
    assert w in lines[0], (w, lines[0])
  assert 'Compiling' not in r.stderr and time.time() - t0 < 60
  assert not os.path.exists(f'{tmp_path}/w/checkpoints')  # nothing was written


def test_data_path_without_usable_data(tmp_path):
  empty = tmp_path / 'corpus'
  empty.mkdir()
  (empty / 'a.txt').write_text('tiny')
  r = run_cli([f'--config.data.path={empty}'], tmp_path)
  assert r.returncode == 2
  assert 'holds no usable training data' in r.stderr and str(empty) in r.stderr


def test_unknown_flag(tmp_path):
  r = run_cli(['--wrkdir=x'], tmp_path)
  assert r.returncode == 2 and 'unknown flag --wrkdir' in r.stderr


def test_validation_raises_real_exceptions_not_asserts():
  """Validation survives `python -O` (which strips assert statements)."""
  r = subprocess.run([sys.executable, '-O', '-c', (
      'from jax3d import config as c\n'
      'cfg = c.load_config("tiny", {"mesh.dp": 3})\n'
      'try:\n  c.validate(cfg, 8)\nexcept c.ConfigError as e:\n  print("raised", e)\n')],
      cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert 'raised mesh dp*pp*tp' in r.stdout, r.stderr
