"""The batch of step i depends only on (seed, i): never on the layout or the process split."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d import config as config_lib, run
from jax3d.training import data as data_lib


@pytest.fixture(scope='module')
def corpus():
  return data_lib.load_corpus('', 0.05, 129)


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
  s = run.setup(cfg, jax.devices()[:n])
  sh = s.batch_sharding
  rows = data_lib.local_rows(sh, batch)
  local = data_lib.batch_rows(corpus.train, 0, step, batch, seq, rows)
  return jax.device_get(data_lib.to_global(local, sh, batch))


@pytest.mark.parametrize('layout', [(8, 1, 1), (2, 2, 2), (1, 2, 4), (4, 2, 1), (1, 8, 1)])
def test_layout_never_changes_the_batch(corpus, layout):
  ref = global_batch(corpus, 1, 1, 1, step=7, n=1)
  got = global_batch(corpus, *layout, step=7)
  np.testing.assert_array_equal(got['inputs'], ref['inputs'])
  np.testing.assert_array_equal(got['targets'], ref['targets'])
  assert (got['inputs'][:, 1:] == got['targets'][:, :-1]).all()  # targets are the next tokens


def test_steps_and_seeds_differ_and_repeat(corpus):
  a = data_lib.batch_rows(corpus.train, 0, 3, 8, 32)
  assert (a['inputs'] == data_lib.batch_rows(corpus.train, 0, 3, 8, 32)['inputs']).all()
  assert (a['inputs'] != data_lib.batch_rows(corpus.train, 0, 4, 8, 32)['inputs']).any()
  assert (a['inputs'] != data_lib.batch_rows(corpus.train, 1, 3, 8, 32)['inputs']).any()
  rows = np.array([1, 2, 5, 6])  # a process holding two non-adjacent blocks of rows
  part = data_lib.batch_rows(corpus.train, 0, 3, 8, 32, rows)
  np.testing.assert_array_equal(part['inputs'], a['inputs'][rows])


def test_local_rows_of_a_sharding():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 2), ('dp', 'pp', 'tp'))
  assert data_lib.local_rows(NamedSharding(mesh, P('dp')), 16).tolist() == list(range(16))


def test_default_corpus_is_the_standard_library_split_by_file(corpus):
  assert corpus.vocab_size == 256 and corpus.train.size > 5_000_000 and corpus.held_out.size > 100_000
  assert 'standard library' in corpus.source
  assert 0.02 < corpus.held_out.size / (corpus.train.size + corpus.held_out.size) < 0.1


def test_text_and_token_files(tmp_path):
  text = tmp_path / 'a.txt'
  text.write_bytes(b'hello world, ' * 2000)
  c = data_lib.load_corpus(str(text), 0.1, 33)
  assert c.vocab_size == 256 and c.train.size == int(26000 * 0.9)
  tokens = np.arange(10000, dtype=np.uint16) % 1000
  tokens.tofile(tmp_path / 'train.bin')
  (tokens[:2000]).tofile(tmp_path / 'val.bin')
  c = data_lib.load_corpus(str(tmp_path), 0.1, 33)
  assert c.vocab_size == 1000 and c.train.size == 10000 and c.held_out.size == 2000
  with pytest.raises(config_lib.ConfigError, match='model.vocab_size=256 is smaller'):
    data_lib.check_vocab(c, 256)
