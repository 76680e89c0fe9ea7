"""Bad input: exit status 2 and one line naming the setting, its value and what is valid,
before anything compiles."""

import importlib
import os
import subprocess
import sys
import time

import pytest

from jax3d import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = [
  # (overrides, words the one line must contain)
  (['--config.mesh.dp=3'], ['mesh dp*pp*tp', '3*2*2 = 12', '8 devices']),
  (['--config.mesh.dp=-1', '--config.mesh.tp=-1'], ['mesh.dp=-1 and mesh.tp=-1', 'at most one']),
  (['--config.mesh.dp=-1', '--config.mesh.pp=3', '--config.mesh.tp=1'], ['mesh.dp=-1 cannot be filled', '3']),
  (
    ['--config.mesh.dp=1', '--config.mesh.pp=1', '--config.mesh.tp=8', '--config.model.n_heads=8'],
    ['model.n_kv_heads=2', 'mesh.tp=8'],
  ),
  (
    [
      '--config.model.n_heads=6',
      '--config.model.n_kv_heads=6',
      '--config.model.d_model=384',
      '--config.mesh.dp=2',
      '--config.mesh.pp=1',
      '--config.mesh.tp=4',
    ],
    ['model.n_heads=6', 'mesh.tp=4'],
  ),
  (['--config.model.d_ff=771'], ['model.d_ff=771', 'mesh.tp=2']),
  (
    ['--config.model.vocab_multiple=1', '--config.model.vocab_size=257'],
    ['model.vocab_size=257', 'padded to 257'],
  ),
  (['--config.model.n_layers=3'], ['model.n_layers=3', 'mesh.pp*pipeline.repeats = 2*1 = 2']),
  (['--config.train.global_batch_size=20'], ['train.global_batch_size=20', '2*4*1 = 8']),
  (['--config.train.grad_accum=3'], ['train.global_batch_size=16', '2*4*3 = 24']),
  (['--config.train.compute_dtype=float16'], ["train.compute_dtype='float16'", 'float32, bfloat16']),
  (['--config.train.param_dtype=int8'], ["train.param_dtype='int8'", 'float32, bfloat16']),
  (['--config.train.remat=some'], ["train.remat='some'", 'none, dots, attn, full, stage']),
  (['--config.train.seq_len=4096'], ['train.seq_len=4096', 'model.max_seq_len=2048']),
  (['--config.data.path=/nonexistent/corpus'], ["data.path='/nonexistent/corpus'", 'does not exist']),
  (['--config.model.nlayers=4'], ["unknown config key 'model.nlayers'", 'n_layers']),
  (['--config.trian.steps=4'], ["unknown config key 'trian'", 'train']),
  (['--config.pipeline.microbatches=0'], ['pipeline.microbatches=0', '>= 1']),
  (
    ['--config.pipeline.microbatches=3', '--config.train.global_batch_size=15'],
    ['train.global_batch_size=15', '2*3*1 = 6', 'split over dp'],
  ),
  (
    [
      '--config.pipeline.schedule=circular',
      '--config.pipeline.repeats=2',
      '--config.pipeline.microbatches=1',
      '--config.train.global_batch_size=16',
    ],
    ['pipeline.microbatches=1', 'circular', 'mesh.pp=2'],
  ),
  (['--config.pipeline.schedule=circular', '--config.pipeline.repeats=3'], ['model.n_layers=4', '2*3 = 6']),
  (['--config.pipeline.schedule=1f2b'], ["pipeline.schedule='1f2b'", 'gpipe, circular, 1f1b']),
  (
    [
      '--config.train.sequence_parallel=true',
      '--config.train.seq_len=127',
      '--config.train.global_batch_size=8',
    ],
    ["train.sequence_parallel='true'", 'train.seq_len = 127', 'divisible by mesh.tp=2'],
  ),
  (['--config.train.sequence_parallel=maybe'], ["train.sequence_parallel='maybe'", 'true, false, auto']),
  (['--config.pipeline.skip_bubbles=sometimes'], ["pipeline.skip_bubbles='sometimes'", 'true, false, auto']),
]


def run_cli(args, tmp_path, env_extra=None):
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8', JAX_LOG_COMPILES='1')
  env.update(env_extra or {})
  return subprocess.run(
    [sys.executable, '-m', 'jax3d.train', f'--workdir={tmp_path}/w', *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )


@pytest.mark.parametrize('args,words', CASES, ids=[' '.join(c[0])[:60] for c in CASES])
def test_bad_input_exits_2_with_one_clear_line(args, words, tmp_path):
  t0 = time.time()
  r = run_cli(args, tmp_path)
  assert r.returncode == 2, r.stderr[-2000:]
  lines = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1, r.stderr
  for w in words:
    assert w in lines[0], (w, lines[0])
  # JAX_LOG_COMPILES=1 (run_cli) logs 'Compiling <name>' for every compile: nothing compiled.
  assert 'Compiling' not in r.stderr and time.time() - t0 < 60


def test_compile_log_shows_a_compile(tmp_path):
  """The sentinel the bad-input tests rely on: with run_cli's JAX_LOG_COMPILES=1, a compile does
  print 'Compiling' on stderr (without it jax prints nothing, and 'no Compiling' proved nothing)."""
  env = dict(os.environ, JAX_LOG_COMPILES='1')
  code = 'import jax.numpy as jnp; (jnp.ones(3) + 1).block_until_ready()'
  r = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and 'Compiling' in r.stderr, r.stderr[-2000:]
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
  r = subprocess.run(
    [
      sys.executable,
      '-O',
      '-c',
      (
        'from jax3d import config as c\n'
        'cfg = c.load_config("tiny", {"mesh.dp": 3})\n'
        'try:\n  c.validate(cfg, 8)\nexcept c.ConfigError as e:\n  print("raised", e)\n'
      ),
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
    check=False,
  )
  assert 'raised mesh dp*pp*tp' in r.stdout, r.stderr


# ---------------------------------------------------------------------------------------------
# One command-line convention for the five commands (jax3d/cli.py)
# ---------------------------------------------------------------------------------------------
COMMANDS = ['train', 'plan', 'inspect', 'report', 'sample', 'prepare', 'export']
WITH_CONFIG = ['train', 'plan', 'inspect', 'sample', 'export']
REQUIRED = {  # so that the error is about the flag tested
  'sample': ['--workdir=/nonexistent/run'],
  'prepare': ['--out=/nonexistent/out'],
  'export': ['--workdir=/nonexistent/run', '--out=/nonexistent/out'],
}

# `python -m jax3d.COMMAND ARGS...`, then one more line on stdout: was jax imported?
RUN_AS_MAIN = (
  'import runpy, sys\n'
  'sys.argv = sys.argv[1:]\n'
  'try:\n'
  '  runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)\n'
  'finally:\n'
  '  print("jax imported" if "jax" in sys.modules else "jax not imported")\n'
)


def run_command(command, *args):
  r = subprocess.run(
    [sys.executable, '-c', RUN_AS_MAIN, f'jax3d.{command}', *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
    check=False,
  )
  return r, r.stdout.rstrip().splitlines()[-1]


def one_error_line(r):
  """The single stderr line of a usage error (exit status 2, nothing else on stderr)."""
  assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), r.stderr
  return lines[0]


@pytest.mark.parametrize('command', COMMANDS)
def test_every_command_rejects_an_unknown_flag(command):
  r, jax_line = run_command(command, *REQUIRED.get(command, []), '--bogus-flag=1')
  line = one_error_line(r)
  assert 'unknown flag --bogus-flag=1' in line and 'valid: ' in line and '--help' in line, line
  assert jax_line == 'jax not imported'


@pytest.mark.parametrize('command', WITH_CONFIG)
@pytest.mark.parametrize(
  'override,words',
  [
    ('--config.model.nlayers=4', ["unknown config key 'model.nlayers'", 'n_layers']),
    ('--config.train.steps=many', ["train.steps='many' is invalid", 'int']),
  ],
)
def test_every_command_with_a_config_rejects_a_bad_key(command, override, words):
  r, jax_line = run_command(command, *REQUIRED.get(command, []), override)
  line = one_error_line(r)
  assert all(w in line for w in words), line
  assert jax_line == 'jax not imported'


@pytest.mark.parametrize(
  'command,args,words',
  [
    ('train', ['--num_processes=two'], ["--num_processes='two' is invalid", 'integer']),
    ('train', ['--distributed=maybe'], ['--distributed=maybe is invalid', 'auto, on, off']),
    ('train', ['--config=configs/none.py'], ['--config=configs/none.py', 'no such file']),
    ('plan', ['--gpus-per-node=0'], ['--gpus_per_node=0 is invalid', 'an integer > 0']),
    ('plan', ['--nodes'], ['--nodes needs a value']),
    ('inspect', ['--json=maybe'], ["--json='maybe' is invalid", 'true or false']),
    ('inspect', ['configs/tiny.py'], ["unexpected argument 'configs/tiny.py'"]),
    ('report', [], ['expected WORKDIR', '0 argument']),
    ('report', ['a', 'b'], ['expected WORKDIR', "['a', 'b']"]),
    ('report', ['--config=tiny', 'a'], ['unknown flag --config=tiny']),
    ('sample', ['--prompt=x'], ['give --workdir=DIR', 'or --config.checkpoint.init_from=hf:PATH']),
    ('sample', ['--workdir=.', '--tokens=-1'], ['--tokens=-1 is invalid', 'an integer >= 0']),
  ],
)
def test_bad_flag_values_name_the_flag_value_and_what_is_valid(command, args, words):
  r, jax_line = run_command(command, *args)
  line = one_error_line(r)
  assert all(w in line for w in words), line
  assert jax_line == 'jax not imported'


@pytest.mark.parametrize('command', COMMANDS)
def test_every_command_prints_its_docstring_for_help(command):
  first = importlib.import_module(f'jax3d.{command}').__doc__.strip().splitlines()[0]
  for flag in ('--help', '-h'):
    r, jax_line = run_command(command, '--bogus', flag)  # --help wins wherever it is
    assert r.returncode == 0 and r.stderr == '', r.stderr
    assert r.stdout.startswith(first) and '\nArguments and flags:\n' in r.stdout, r.stdout
    assert jax_line == 'jax not imported'


def test_flag_spellings_and_types():
  """--a-b and --a_b alike, --name VALUE, bare and explicit bools, --noNAME; converted types."""
  from jax3d import plan

  args = cli.parse(
    [
      '--gpus-per-node=4',
      '--gpu_memory_gb',
      '40',
      '--json',
      '--fixed=false',
      '--noemit',
      '--config=tiny',
      '--config.mesh.tp=4',
      '--config.mesh.pp=1',
    ],
    plan.__doc__,
    plan.FLAGS,
  )
  assert isinstance(args, cli.Args)
  f = args.flags
  assert (f['gpus_per_node'], f['gpu_memory_gb'], f['json'], f['fixed'], f['emit'], f['nodes']) == (
    4,
    40.0,
    True,
    False,
    False,
    1,
  )
  assert type(f['gpu_memory_gb']) is float and args.config_name == 'tiny'
  assert (
    args.overrides == {'mesh.tp': '4', 'mesh.pp': '1'} and args.cfg.mesh.tp == 4 and args.positional == []
  )


def test_train_declares_every_distributed_flag():
  from jax3d import train
  from jax3d.trainer import distributed

  assert set(train.FLAGS) == {'workdir', *distributed.FLAGS}


def test_sequence_parallel_setting_resolves():
  """train.sequence_parallel: a bool is stored as its string; 'auto' is on where tp > 1 divides the
  rows of a layer and off elsewhere (never an error); 'true' needs tp > 1 to mean anything."""
  from jax3d import config as c

  sp = lambda **o: c.validate(c.load_config('tiny', {k.replace('__', '.'): v for k, v in o.items()}), 8)
  assert sp(train__sequence_parallel=True).sequence_parallel  # tiny: 2x2x2, 2 rows * 128
  assert not sp().sequence_parallel  # the default is off
  assert sp(train__sequence_parallel='auto').sequence_parallel
  odd = {'train__seq_len': 127, 'train__global_batch_size': 8}
  assert not sp(train__sequence_parallel='auto', **odd).sequence_parallel
  assert not sp(train__sequence_parallel=True, mesh__dp=4, mesh__tp=1).sequence_parallel
