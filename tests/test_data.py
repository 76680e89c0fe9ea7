"""The batch of step i depends only on (seed, i): never on the layout or the process split.
(The epoch order and the packings themselves: tests/test_epoch.py, tests/test_packing.py.)"""

import re
import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d import assemble, config as config_lib
from jax3d.data import corpus as corpus_lib, global_batch as global_batch_lib, packing, prefetch


@pytest.fixture(scope='module')
def corpus():
  return corpus_lib.load_corpus('', 0.05, 129)


def global_batch(corpus, dp, pp, tp, step, batch=16, seq=32, n=8):
  cfg = config_lib.load_config(
    'tiny',
    {
      'model.n_kv_heads': 4,
      'model.n_layers': 8,
      'mesh.dp': dp,
      'mesh.pp': pp,
      'mesh.tp': tp,
      'pipeline.microbatches': 1,
      'train.global_batch_size': batch,
    },
  )
  s = assemble.build(cfg, jax.devices()[:n])
  sh = s.batch_sharding
  rows = global_batch_lib.process_rows(sh, batch)
  local = corpus_lib.batch_at(corpus, 0, step, batch, seq, rows)
  return jax.device_get(global_batch_lib.to_global(local, sh, batch))


@pytest.mark.parametrize('layout', [(8, 1, 1), (2, 2, 2), (1, 2, 4), (4, 2, 1), (1, 8, 1)])
def test_layout_never_changes_the_batch(corpus, layout):
  """Every key of the batch (inputs, targets, weights, segment ids, positions), through the
  process's rows and the global array, equals the one-device batch."""
  ref = global_batch(corpus, 1, 1, 1, step=7, n=1)
  got = global_batch(corpus, *layout, step=7)
  assert set(got) == set(packing.KEYS)
  for k in packing.KEYS:
    np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
  same_doc = got['segment_ids'][:, 1:] == got['segment_ids'][:, :-1]
  assert (got['inputs'][:, 1:] == got['targets'][:, :-1])[same_doc].all()  # targets are the next tokens


def test_steps_and_seeds_differ_and_repeat(corpus):
  a = corpus_lib.batch_at(corpus, 0, 3, 8, 32)
  assert (a['inputs'] == corpus_lib.batch_at(corpus, 0, 3, 8, 32)['inputs']).all()
  assert (a['inputs'] != corpus_lib.batch_at(corpus, 0, 4, 8, 32)['inputs']).any()
  assert (a['inputs'] != corpus_lib.batch_at(corpus, 1, 3, 8, 32)['inputs']).any()
  rows = np.array([1, 2, 5, 6])  # a process holding two non-adjacent blocks of rows
  part = corpus_lib.batch_at(corpus, 0, 3, 8, 32, rows)
  for k in packing.KEYS:
    np.testing.assert_array_equal(part[k], a[k][rows])


def test_a_stream_of_one_sequence_gives_its_one_row():
  """A stream of exactly seq_len + 1 tokens (the smallest the validation accepts) is one row, in
  every batch row: inputs 0..31, targets 1..32."""
  c = corpus_lib.Corpus(np.arange(33, dtype=np.uint16), np.arange(33, dtype=np.uint16), 33, 'x')
  b = corpus_lib.batch_at(c, 0, 0, 4, 32)
  np.testing.assert_array_equal(b['inputs'], np.tile(np.arange(32), (4, 1)))
  np.testing.assert_array_equal(b['targets'], np.tile(np.arange(1, 33), (4, 1)))
  assert (b['weights'] == 1).all() and (b['segment_ids'] == 1).all()


class _OneProcess:
  """A sharding as one process of a multi-process run sees it: only `devices` are addressable."""

  def __init__(self, sharding, devices):
    self.sharding, self.devices = sharding, set(devices)

  def addressable_devices_indices_map(self, shape):
    return {d: i for d, i in self.sharding.devices_indices_map(shape).items() if d in self.devices}


def test_process_rows_of_a_sharding():
  """The rows a process holds are the union of its devices' row blocks in the sharding's own index
  map, in global order: all of them with every device, its dp blocks when it holds part of dp
  (also non-adjacent ones), and each block once however many pp/tp devices replicate it."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 1, 2), ('dp', 'pp', 'tp'))
  sh = NamedSharding(mesh, P('dp'))
  assert global_batch_lib.process_rows(sh, 16).tolist() == list(range(16))
  devs = mesh.devices
  assert global_batch_lib.process_rows(_OneProcess(sh, devs[1].flat), 16).tolist() == [4, 5, 6, 7]
  assert global_batch_lib.process_rows(_OneProcess(sh, devs[[0, 2]].flat), 16).tolist() == [
    0,
    1,
    2,
    3,
    8,
    9,
    10,
    11,
  ]
  assert global_batch_lib.process_rows(_OneProcess(sh, devs[:, :, 1].flat), 16).tolist() == list(range(16))
  sh2 = NamedSharding(mesh, P(('dp', 'tp')))  # rows over dp and tp: device (1, 0, 1) holds block 3
  rows = global_batch_lib.process_rows(_OneProcess(sh2, [devs[1, 0, 1], devs[3, 0, 0]]), 16)
  assert rows.tolist() == [6, 7, 12, 13]


def test_default_corpus_is_the_standard_library_split_by_file(corpus):
  assert corpus.vocab_size == 256 and corpus.train.size > 5_000_000 and corpus.held_out.size > 100_000
  assert 'standard library' in corpus.source
  assert 0.02 < corpus.held_out.size / (corpus.train.size + corpus.held_out.size) < 0.1


def test_text_and_token_files(tmp_path):
  text = tmp_path / 'a.txt'
  text.write_bytes(b'hello world, ' * 2000)
  c = corpus_lib.load_corpus(str(text), 0.1, 33)
  assert c.vocab_size == 256 and c.train.size == int(26000 * 0.9)
  tokens = np.arange(10000, dtype=np.uint16) % 1000
  tokens.tofile(tmp_path / 'train.bin')
  (tokens[:2000]).tofile(tmp_path / 'val.bin')
  c = corpus_lib.load_corpus(str(tmp_path), 0.1, 33)
  assert c.vocab_size == 1000 and c.train.size == 10000 and c.held_out.size == 2000
  with pytest.raises(config_lib.ConfigError, match='model.vocab_size=256 is smaller'):
    corpus_lib.check_vocab(c, 256)


def _records(arr: np.ndarray) -> set[bytes]:
  """The whole 7-digit records in a byte stream (a record split by a cut counts on neither side)."""
  return set(re.findall(rb'\d{7}', np.asarray(arr, np.uint8).tobytes()))


def _write_records(path, first: int, n: int) -> None:
  path.write_bytes(b''.join(b'%07d\n' % i for i in range(first, first + n)))


@pytest.mark.parametrize('kind', ['stdlib', 'text_file', 'text_folder', 'text_folder_tail', 'bin', 'bin_val'])
def test_held_out_is_never_trained_on(tmp_path, monkeypatch, kind):
  """Every corpus kind: no record (or token, for .bin) of the held-out stream is in the training
  stream. The text corpora are made of unique 7-digit records, the token corpora of unique tokens."""
  root = tmp_path / 'data'
  root.mkdir()
  if kind == 'bin' or kind == 'bin_val':
    np.arange(10_000, dtype=np.uint16).tofile(root / 'train.bin')
    if kind == 'bin_val':
      np.arange(10_000, 12_000, dtype=np.uint16).tofile(root / 'val.bin')
    c = corpus_lib.load_corpus(str(root), 0.1, 33)
    assert np.intersect1d(np.asarray(c.train), np.asarray(c.held_out)).size == 0
    assert c.held_out.size == (2000 if kind == 'bin_val' else 1000)
    assert c.train.size + (0 if kind == 'bin_val' else c.held_out.size) == 10_000
    return
  if kind == 'text_file':
    _write_records(root / 'a.txt', 0, 3000)
    path = str(root / 'a.txt')
  else:
    n_files = 1 if kind == 'text_folder_tail' else 40  # one file: too few to split by file
    for j in range(n_files):
      sub = root / f'd{j % 4}'
      sub.mkdir(exist_ok=True)
      _write_records(sub / f'f{j}.py', j * 1000, 1000)
    path = str(root)
    if kind == 'stdlib':
      monkeypatch.setattr(corpus_lib.sysconfig, 'get_paths', lambda: {'stdlib': str(root)})
      path = ''
  c = corpus_lib.load_corpus(path, 0.1, 33)
  train, held = _records(c.train), _records(c.held_out)
  assert held and train and not train & held
  assert len(train) + len(held) >= (3000 if kind == 'text_file' else 1000 * n_files) - 1


def test_corpus_cap_stops_the_whole_walk(tmp_path, monkeypatch):
  """The size cap ends the walk over all directories, not only the current one's files."""
  monkeypatch.setattr(corpus_lib, 'MAX_CORPUS_BYTES', 1500)
  for d in 'abcd':
    (tmp_path / d).mkdir()
    for j in range(3):
      (tmp_path / d / f'{j}.txt').write_bytes(b'x' * 1000)
  train, held = corpus_lib._read_files(str(tmp_path), 0.0)
  assert held == []
  assert [len(raw) for _, raw in train] == [1000, 1000]  # the file that crossed the cap is the last one read


def test_prefetch_error_reaches_the_caller(monkeypatch):
  """A batch that fails on the prefetch thread raises in `next` (with its cause), within seconds."""

  def broken(*args, **kwargs):
    raise ValueError('disk on fire')

  monkeypatch.setattr(corpus_lib, 'batch_at', broken)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ('dp', 'pp', 'tp'))
  corpus = corpus_lib.Corpus(np.zeros(1000, np.uint16), np.zeros(1000, np.uint16), 1, 'zeros')
  pf = prefetch.Prefetcher(corpus, 0, 0, 5, 4, 8, NamedSharding(mesh, P('dp')))
  out = {}

  def call():
    try:
      pf.next(0)
    except BaseException as e:  # noqa: BLE001 - the test reports whatever came
      out['error'] = e

  t = threading.Thread(target=call, daemon=True)
  t.start()
  t.join(timeout=20)
  pf.close()
  assert not t.is_alive(), 'Prefetcher.next hung after the prefetch thread failed'
  e = out['error']
  assert isinstance(e, corpus_lib.DataError) and 'disk on fire' in str(e) and 'step 0' in str(e)
  assert isinstance(e.__cause__, ValueError)


@pytest.mark.slow
def test_train_cli_exits_3_when_the_prefetch_thread_fails(tmp_path, monkeypatch, capsys):
  """End to end: `python -m jax3d.train` (its main, in this process) ends with status 3 and one
  `error:` line naming the cause, instead of waiting forever for a batch."""
  from jax3d import train as train_cli

  def broken(*args, **kwargs):
    raise ValueError('disk on fire')

  monkeypatch.setattr(corpus_lib, 'batch_at', broken)
  argv = [
    '--config=configs/tiny.py',
    f'--workdir={tmp_path}',
    '--config.train.steps=2',
    '--config.eval.every=0',
  ]
  assert train_cli.main(argv) == 3
  errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'disk on fire' in errors[0] and 'ValueError' in errors[0]


def test_data_without_held_out_trains_without_evaluating(tmp_path):
  """Shards prepared with --eval_fraction=0 train (eval.every set too): the start-up lines say
  there is no held-out data, no evaluation record is written, and an explicit evaluate() is one
  clear error. Data of fewer tokens than a row fills one padded row; one token is refused."""
  import jax3d
  from jax3d.data import shard_writer

  from helpers import small_cfg

  (tmp_path / 'a.txt').write_text('the quick brown fox jumps over the lazy dog. ' * 40)
  shard_writer.tokenize(
    str(tmp_path / 'a.txt'), str(tmp_path / 's'), 'bytes', eval_fraction=0.0, workers=1, progress=False
  )
  over = dict(data__path=str(tmp_path / 's'), train__steps=2, eval__every=1, log__progress=False)
  over |= dict(model__n_layers=2, train__global_batch_size=8, train__seq_len=16)
  t = jax3d.build(small_cfg(**over), devices=jax.devices()[:1])
  try:
    assert any('no held-out data' in line and 'trains without evaluating' in line for line in t.summary())
    records = t.train()
    assert [r['step'] for r in records if 'loss' in r][-1] == 2
    assert not any('eval_loss' in r for r in records), records
    with pytest.raises(config_lib.ConfigError, match='holds no held-out data'):
      t.evaluate()
  finally:
    t.close()
  (tmp_path / 'b.txt').write_bytes(b'hello worl')  # 10 tokens: less than one row of 33, 1 held out
  c = corpus_lib.load_corpus(str(tmp_path / 'b.txt'), 0.1, 33)
  assert c.layout(32).n_rows == 1 and not c.evaluable  # its 1 held-out token: nothing to evaluate
  (tmp_path / 'c.txt').write_bytes(b'h')
  with pytest.raises(config_lib.ConfigError, match='holds no usable training data: 0 tokens'):
    corpus_lib.load_corpus(str(tmp_path / 'c.txt'), 0.1, 33)
