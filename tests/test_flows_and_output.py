"""Issue 50, through the real commands (subprocesses, tiny models, shared runs): the two valid flows
that failed, and output that must never lose what is on disk.

  * a relative workdir (and data path, and warm start): train -> sample -> export --verify;
  * a fine-tune of an hf: model whose config vocabulary (512) exceeds its tokenizer's (334) by more
    than the padding, as Qwen2/3's does: imported, trained, sampled, exported with --verify, the
    export keeping the base model's vocab_size and shapes;
  * export's --out: never a folder the run reads, never a file, a non-empty folder that is not an
    earlier export only with --overwrite, written whole (no stale shard of an earlier export);
  * checkpoint.keep=0 and a run whose every step was non-finite: an error, the checkpoints on disk
    byte-identical;
  * a damaged checkpoint is passed over with a warning; any other error reading one is not called
    damage.

Every refusal: its exit status, exactly one `error:` line naming the input, no traceback, and the
files that could be lost byte-identical.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flags(keys: str) -> list[str]:
  """--config.KEY=VALUE flags of 'KEY=VALUE KEY=VALUE ...'."""
  return [f'--config.{kv}' for kv in keys.split()]


# 2 layers, d 32, 8 data-parallel devices, 2 steps with a checkpoint each: a compile of seconds.
TINY = flags('model.n_layers=2 model.d_model=32 model.n_heads=2 model.n_kv_heads=2 model.d_ff=64')
RUN = flags(
  'train.steps=2 train.seq_len=16 train.global_batch_size=8 train.warmup_steps=1 mesh.dp=8 mesh.pp=1 '
  'mesh.tp=1 pipeline.microbatches=1 log.every=1 eval.every=0 eval.batches=1 checkpoint.every=1 '
  'sample.tokens=4 data.path=corpus.txt'  # a relative data path, as the workdirs
)
BASE_VOCAB, TOKENIZER_VOCAB = 512, 334  # padded to 384: the gap is past the padding


def run(cwd: str, command: str, *args: str, traceback: bool = False) -> subprocess.CompletedProcess:
  """`python -m jax3d.COMMAND ARGS` in `cwd` (this checkout's jax3d; compiles logged: JAX_LOG_COMPILES);
  no traceback in its output unless `traceback`."""
  path = os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')])
  env = dict(os.environ, PYTHONPATH=path, JAX_LOG_COMPILES='1')
  r = subprocess.run(
    [sys.executable, '-m', f'jax3d.{command}', *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert traceback or 'Traceback' not in r.stdout + r.stderr, r.stderr[-3000:]
  return r


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'error:' not in r.stderr and 'damaged' not in r.stderr, r.stderr[-3000:]
  return r


def one_error(r: subprocess.CompletedProcess, status: int, *words: str) -> str:
  """The one `error:` line of a command that exited with `status`, holding every word."""
  assert r.returncode == status, (r.returncode, r.stderr[-3000:])
  lines = [line for line in r.stderr.splitlines() if line.startswith('error:')]
  assert len(lines) == 1, r.stderr[-3000:]
  for w in words:
    assert w in lines[0], (w, lines[0])
  return lines[0]


def files(folder: str) -> dict[str, bytes]:
  """Every file under `folder` (relative path -> bytes)."""
  out = {}
  for d, _, names in os.walk(folder):
    for n in names:
      p = os.path.join(d, n)
      with open(p, 'rb') as f:
        out[os.path.relpath(p, folder)] = f.read()
  return out


def tensors(folder: str) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file

  out = {}
  for n in sorted(os.listdir(folder)):
    if n.endswith('.safetensors'):
      out |= load_file(os.path.join(folder, n))
  return out


@pytest.fixture(scope='module')
def cwd(tmp_path_factory) -> str:
  """The folder every command runs in: corpus.txt, and base/, a random transformers-written Llama
  of vocab_size 512 with a 334-token byte-level BPE tokenizer beside its weights."""
  import hf_helpers as H

  from jax3d.data import bpe

  d = str(tmp_path_factory.mktemp('flows'))
  text = open(inspect.getsourcefile(os)).read()[:60000]
  with open(os.path.join(d, 'corpus.txt'), 'w') as f:
    f.write(text)
  base = os.path.join(d, 'base')
  H.make_hf_model(
    base,
    tied=False,
    vocab_size=BASE_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
  )
  bpe.train_tokenizer(iter([text]), TOKENIZER_VOCAB, os.path.join(base, 'tokenizer.json'))
  return d


@pytest.fixture(scope='module')
def byte_run(cwd) -> str:
  """runs/bytes: the byte-level tiny model trained 2 steps in a relative workdir."""
  r = ok(run(cwd, 'train', '--workdir=runs/bytes', *TINY, *RUN))
  assert 'sample: ' in r.stdout
  assert sorted(os.listdir(os.path.join(cwd, 'runs/bytes/checkpoints'))) == ['1', '2']
  return 'runs/bytes'


@pytest.fixture(scope='module')
def gap_run(cwd) -> str:
  """runs/gap: base/ imported (hf:, relative) and fine-tuned 2 steps in a relative workdir."""
  r = ok(run(cwd, 'train', '--workdir=runs/gap', '--config.checkpoint.init_from=hf:base', *RUN))
  assert f'parameters imported from {cwd}/base' in r.stdout
  return 'runs/gap'


@pytest.fixture(scope='module')
def gap_export(cwd, gap_run) -> str:
  r = ok(run(cwd, 'export', f'--workdir={gap_run}', '--out=out/gap', '--verify'))
  assert 'verified out/gap' in r.stdout
  return 'out/gap'


# ------------------------------------------------------------------------- the two valid flows
def test_relative_workdir_trains_samples_and_exports(cwd, byte_run):
  """The healthy checkpoint of a relative workdir is read (never called damaged): sample gives the
  text it gives from the absolute path, export --verify matches transformers."""
  args = ['--prompt=def', '--greedy', '--tokens=8']
  rel = ok(run(cwd, 'sample', f'--workdir={byte_run}', *args)).stdout
  absolute = ok(run(cwd, 'sample', f'--workdir={os.path.join(cwd, byte_run)}', *args)).stdout
  assert rel == absolute and rel.startswith('def') and len(rel.rstrip('\n')) > len('def')
  r = ok(run(cwd, 'export', f'--workdir={byte_run}', '--out=out/bytes', '--verify'))
  assert 'verified out/bytes' in r.stdout and 'within' in r.stdout
  with open(os.path.join(cwd, 'out/bytes/config.json')) as f:
    assert json.load(f)['vocab_size'] == 256


def test_relative_warm_start(cwd, byte_run):
  """checkpoint.init_from=<relative workdir>: the parameters of its step 2, and the saved config
  records the absolute path."""
  r = ok(run(cwd, 'train', '--workdir=runs/warm', f'--config.checkpoint.init_from={byte_run}', *TINY, *RUN))
  assert f'parameters warm-started from {os.path.join(cwd, byte_run)} (step 2)' in r.stdout


def test_vocabulary_gap_fine_tune_samples_and_exports_the_base_model(cwd, gap_run, gap_export):
  """The fine-tune of a model whose config vocabulary (512) is past its tokenizer's (334) and the
  padding (384) samples, and exports (verified by transformers) with the base model's vocab_size
  and every tensor's name and shape; the rows the tokenizer never uses are still the base's
  vocabulary (the embedding rows 334..511 are those of the import, bar weight decay)."""
  r = ok(run(cwd, 'sample', f'--workdir={gap_run}', '--prompt=def', '--greedy', '--tokens=4'))
  assert r.stdout.startswith('def')
  with open(os.path.join(cwd, 'base/config.json')) as f:
    base_cfg = json.load(f)
  with open(os.path.join(cwd, gap_export, 'config.json')) as f:
    out_cfg = json.load(f)
  assert out_cfg['vocab_size'] == base_cfg['vocab_size'] == BASE_VOCAB
  for key in ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads'):
    assert out_cfg[key] == base_cfg[key], key
  base, out = tensors(os.path.join(cwd, 'base')), tensors(os.path.join(cwd, gap_export))
  assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in base.items()}
  unused = slice(TOKENIZER_VOCAB, BASE_VOCAB)
  emb_out, emb_base = out['model.embed_tokens.weight'][unused], base['model.embed_tokens.weight'][unused]
  np.testing.assert_allclose(emb_out, emb_base, rtol=1e-3, atol=1e-6)


# ------------------------------------------------------------------------- export's --out
@pytest.mark.parametrize(
  'out, overwrite, words',
  [
    ('base', True, ['--out=base', 'the model the run was imported from']),
    ('runs/gap', True, ['--out=runs/gap', "the run's workdir"]),
    ('runs', True, ['--out=runs', "holds the run's workdir"]),
    ('runs/gap/checkpoints', True, ['--out=runs/gap/checkpoints', "lies inside the run's workdir"]),
    ('corpus.txt', True, ['--out=corpus.txt', "the run's data"]),
    ('notes', False, ['--out=notes', 'not an earlier jax3d export', 'config.json and 1 more', '--overwrite']),
    ('a_file', False, ['--out=a_file', 'is a file']),
  ],
)
def test_export_refuses_an_out_that_would_lose_data(cwd, gap_run, out, overwrite, words):
  """Exit 2, one line naming --out, before anything is read; every file byte-identical."""
  os.makedirs(os.path.join(cwd, 'notes'), exist_ok=True)
  for name, text in (('notes/todo.txt', 'mine'), ('notes/config.json', '{}'), ('a_file', 'x')):
    with open(os.path.join(cwd, name), 'w') as f:
      f.write(text)
  before = files(cwd)
  r = run(cwd, 'export', f'--workdir={gap_run}', f'--out={out}', *(['--overwrite'] if overwrite else []))
  one_error(r, 2, *words)
  assert files(cwd) == before
  assert 'Compiling' not in r.stderr


def test_export_over_a_folder_with_overwrite_replaces_all_of_it(cwd, gap_run, gap_export):
  other = os.path.join(cwd, 'other_model')
  shutil.copytree(os.path.join(cwd, 'base'), other)
  with open(os.path.join(other, 'special_tokens_map.json'), 'w') as f:
    f.write('{}')
  one_error(run(cwd, 'export', f'--workdir={gap_run}', '--out=other_model'), 2, '--out=other_model')
  ok(run(cwd, 'export', f'--workdir={gap_run}', '--out=other_model', '--overwrite'))
  assert files(other) == files(os.path.join(cwd, gap_export))  # nothing of the other model left


def test_export_over_an_earlier_sharded_export_leaves_no_stale_shard(cwd, gap_run, gap_export):
  """An earlier export in 4 shards (the API's max_shard_bytes), then the command's into the same
  folder: the folder is exactly what an export into an empty folder is, byte for byte."""
  code = f"from jax3d import api; print(api.export_hf({gap_run!r}, 'out/sharded', max_shard_bytes=60_000))"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
  r = subprocess.run(
    [sys.executable, '-c', code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
  )
  assert r.returncode == 0, r.stderr[-3000:]
  shards = [n for n in os.listdir(os.path.join(cwd, 'out/sharded')) if n.startswith('model-0000')]
  assert len(shards) >= 3 and os.path.exists(os.path.join(cwd, 'out/sharded/model.safetensors.index.json'))
  ok(run(cwd, 'export', f'--workdir={gap_run}', '--out=out/sharded'))
  assert files(os.path.join(cwd, 'out/sharded')) == files(os.path.join(cwd, gap_export))
  assert not [n for n in os.listdir(os.path.join(cwd, 'out')) if n.startswith('.')]  # no temporary left


# ------------------------------------------------------------------------- checkpoints kept
def test_keep_zero_deletes_nothing(cwd, byte_run):
  w = 'runs/keep0'
  shutil.copytree(os.path.join(cwd, byte_run), os.path.join(cwd, w))
  before = files(os.path.join(cwd, w, 'checkpoints'))
  r = run(cwd, 'train', f'--workdir={w}', '--config.checkpoint.keep=0', *TINY, *RUN, '--config.train.steps=3')
  one_error(r, 2, 'checkpoint.keep=0')
  assert files(os.path.join(cwd, w, 'checkpoints')) == before
  assert 'Compiling' not in r.stderr


def test_a_run_whose_every_step_is_non_finite_fails_and_saves_nothing(cwd, byte_run):
  """Resumed at step 2, steps 3 and 4 non-finite (under train.max_bad_steps=5), a checkpoint due
  at each: exit 3, one line, and the checkpoints byte-identical (no step 3 or 4)."""
  w = 'runs/nan'
  shutil.copytree(os.path.join(cwd, byte_run), os.path.join(cwd, w))
  before = files(os.path.join(cwd, w, 'checkpoints'))
  nan = ['--config.train.steps=4', '--config.train.inject_nan_at=3,4']
  r = run(cwd, 'train', f'--workdir={w}', *TINY, *RUN, *nan)
  one_error(r, 3, 'steps 3..4', 'non-finite', 'nothing was saved')
  assert files(os.path.join(cwd, w, 'checkpoints')) == before


# ------------------------------------------------------------------------- damaged, or not
def test_a_truncated_checkpoint_is_passed_over_with_its_path(cwd, byte_run):
  """Step 2's data files truncated: sample warns naming it and the tensorstore read error,
  and gives step 1's text (that of a workdir holding only step 1)."""
  w, only1 = 'runs/damaged', 'runs/only1'
  for d in (w, only1):
    shutil.copytree(os.path.join(cwd, byte_run), os.path.join(cwd, d))
  shutil.rmtree(os.path.join(cwd, only1, 'checkpoints', '2'))
  state = os.path.join(cwd, w, 'checkpoints', '2', 'state')
  # Every OCDBT data file (ocdbt.process_*/d/*) cut to a third: under load Orbax may spread a step
  # over several, and the largest alone can hold only optimizer state, which sample never reads.
  data = [os.path.join(d, n) for d, _, ns in os.walk(state) for n in ns if os.path.basename(d) == 'd']
  assert data
  for f in data:
    os.truncate(f, os.path.getsize(f) // 3)
  args = ['--prompt=def', '--greedy', '--tokens=8']
  # Orbax's other reads of the step, left pending when the first failed, may print their errors as
  # they are finalised ('Exception ignored in: <coroutine ...>'; orbax-checkpoint 0.12.8).
  r = run(cwd, 'sample', f'--workdir={w}', *args, traceback=True)
  assert r.returncode == 0, r.stderr[-3000:]
  assert f'checkpoint {os.path.join(cwd, w)}/checkpoints/2 is damaged or incomplete (' in r.stderr
  assert 'OUT_OF_RANGE' in r.stderr and 'error:' not in r.stderr
  assert r.stdout == ok(run(cwd, 'sample', f'--workdir={only1}', *args)).stdout


def test_only_a_read_error_of_the_files_is_called_damage(tmp_path):
  """skip_damaged: a file missing or short (in an exception's chain) warns; anything else (Orbax's
  error for a relative path, the one a relative workdir met) is raised as CheckpointError naming
  the step and the real error; a state without its _METADATA is damage whatever Orbax raised."""
  from jax3d.errors import CheckpointError
  from jax3d.trainer import readonly

  step = str(tmp_path / '2')
  os.makedirs(os.path.join(step, 'state'))
  open(os.path.join(step, 'state', '_METADATA'), 'w').close()
  warned = []
  short = ValueError('OUT_OF_RANGE: Error reading "params.x/0" in OCDBT database at local file "/x/"')
  try:
    raise Exception('Encountered error while reading array index') from short
  except Exception as e:  # noqa: BLE001
    readonly.skip_damaged(e, step, warned.append)
  readonly.skip_damaged(FileNotFoundError(2, 'No such file', 'meta/metadata'), step, warned.append)
  readonly.skip_damaged(KeyError('Item "meta" was not found in the checkpoint.'), step, warned.append)
  assert len(warned) == 3 and all(f'checkpoint {step} is damaged or incomplete' in w for w in warned)
  assert 'OUT_OF_RANGE' in warned[0] and 'FileNotFoundError' in warned[1]
  relative = ValueError('Checkpoint path should be absolute. Got runs/x/checkpoints/2/state')
  with pytest.raises(CheckpointError, match=f'could not read checkpoint {step}: ValueError: Checkpoint path'):
    readonly.skip_damaged(relative, step, warned.append)
  with pytest.raises(CheckpointError, match='PermissionError'):  # the files may be whole
    readonly.skip_damaged(PermissionError(13, 'Permission denied'), step, warned.append)
  os.remove(os.path.join(step, 'state', '_METADATA'))
  readonly.skip_damaged(ValueError('pytree structure error'), step, warned.append)
  assert len(warned) == 4 and 'state/_METADATA is missing' in warned[3]


def test_a_failed_export_leaves_out_as_it_was_and_an_added_file_is_kept(tmp_path):
  """outdir.staged: an export that fails half-way (a --verify above tolerance, a full disk) leaves
  the earlier export byte-identical and no temporary folder; outdir.check: a file added to an
  earlier export makes it a folder that only --overwrite replaces."""
  from jax3d.errors import UsageError
  from jax3d.hf import outdir

  out = str(tmp_path / 'hf')
  with outdir.staged(out) as folder:
    with open(os.path.join(folder, 'model.safetensors'), 'wb') as f:
      f.write(b'first')
  before = files(out)
  assert json.loads(before[outdir.MARKER]) == {'files': ['model.safetensors']}
  outdir.check(out, [], overwrite=False)  # an earlier export: replaced without --overwrite
  with pytest.raises(RuntimeError, match='verify failed'):
    with outdir.staged(out) as folder:
      with open(os.path.join(folder, 'model.safetensors'), 'wb') as f:
        f.write(b'second')
      raise RuntimeError('verify failed')
  assert files(out) == before and os.listdir(tmp_path) == ['hf']
  with open(os.path.join(out, 'README.md'), 'w') as f:
    f.write('my notes')
  with pytest.raises(
    UsageError, match=f'--out={out} is a folder that is not an earlier jax3d export .*README.md'
  ):
    outdir.check(out, [], overwrite=False)
  outdir.check(out, [], overwrite=True)
