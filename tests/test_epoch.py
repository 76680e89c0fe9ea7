"""The epoch order (jax3d/data/epochs.py, corpus.batch_at): one epoch trains every token exactly
once, in both packings; the batch of a step is the same for every layout and process count;
resuming mid-epoch gives the same batches; the trainer records the epoch of each step."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d.data import corpus as corpus_lib, epochs, global_batch, packing, prefetch


def _docs_corpus(how: str, seed: int = 0, n_docs: int = 60) -> corpus_lib.Corpus:
  """Documents of 1 to 70 tokens whose token ids are their positions in the stream (so a target
  names the token it is)."""
  lens = np.random.default_rng(seed).integers(1, 70, n_docs)
  starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
  tokens = np.arange(starts[-1], dtype=np.uint32)
  return corpus_lib.Corpus(tokens, tokens, int(starts[-1]), 'hand-built', starts, starts, packing=how)


def _targets_of_one_epoch(c: corpus_lib.Corpus, batch: int, seq: int) -> np.ndarray:
  """Every weighted target of the first epoch's rows (the steps until n_rows rows are taken)."""
  n_rows = c.layout(seq).n_rows
  got = []
  for step in range(-(-n_rows // batch)):
    b = corpus_lib.batch_at(c, 3, step, batch, seq)
    take = min(batch, n_rows - step * batch)  # the last step's later rows are the next epoch's
    got.append(b['targets'][:take][b['weights'][:take] > 0])
  return np.concatenate(got)


@pytest.mark.parametrize('how', ['concat', 'pack'])
def test_one_epoch_trains_every_token_exactly_once(how):
  """Each token that is not its document's first is a weighted target exactly once per epoch (and
  a first token never is); the next epoch is another order of the same rows."""
  c = _docs_corpus(how)
  starts = c.train_starts
  got = _targets_of_one_epoch(c, batch=8, seq=16)
  want = np.setdiff1d(np.arange(starts[-1]), starts[:-1])
  np.testing.assert_array_equal(np.sort(got), want)  # sorted equal: each exactly once
  order = c.order(3, 16)
  e0, e1 = order.permutation(0), order.permutation(1)
  assert sorted(e0) == sorted(e1) == list(range(order.n_rows)) and (e0 != e1).any()


def test_a_batch_straddling_two_epochs_ends_one_and_starts_the_next():
  order = epochs.Order(10, seed=5)
  rows = order.rows(2, 4)  # entries 8..11: the last two of epoch 0, the first two of epoch 1
  np.testing.assert_array_equal(rows, [*order.permutation(0)[8:], *order.permutation(1)[:2]])
  assert [order.epoch(s, 4) for s in range(6)] == [0, 0, 0, 1, 1, 2]
  np.testing.assert_array_equal(order.rows(2, 4, np.array([1, 3])), rows[[1, 3]])


class _OneProcess:
  """A sharding as one process of a multi-process run sees it: only `devices` are addressable."""

  def __init__(self, sharding, devices):
    self.sharding, self.devices = sharding, set(devices)

  def addressable_devices_indices_map(self, shape):
    return {d: i for d, i in self.sharding.devices_indices_map(shape).items() if d in self.devices}


@pytest.mark.parametrize('how', ['concat', 'pack'])
@pytest.mark.parametrize('mesh_shape', [(8, 1, 1), (2, 2, 2), (4, 1, 2), (1, 2, 4)])
@pytest.mark.parametrize('processes', [1, 2, 4])
def test_every_layout_and_process_count_reads_the_same_batch(how, mesh_shape, processes):
  """The global batch assembled from the rows each process reads (its own devices' rows) equals
  the one-process batch, for every layout and 1, 2 or 4 processes."""
  c = _docs_corpus(how, seed=1)
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(mesh_shape), ('dp', 'pp', 'tp'))
  sh = NamedSharding(mesh, P('dp'))
  batch, seq = 16, 16
  ref = corpus_lib.batch_at(c, 0, 5, batch, seq)
  devices = list(mesh.devices.flat)
  per = len(devices) // processes
  got = {k: np.full_like(v, -7) for k, v in ref.items()}
  for p in range(processes):
    rows = global_batch.process_rows(_OneProcess(sh, devices[p * per : (p + 1) * per]), batch)
    local = corpus_lib.batch_at(c, 0, 5, batch, seq, rows)
    for k in got:
      got[k][rows] = local[k]
  for k in ref:
    np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def _prefetched(c, start, stop, batch=4, seq=16):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(2, 1, 1), ('dp', 'pp', 'tp'))
  pf = prefetch.Prefetcher(c, 11, start, stop, batch, seq, NamedSharding(mesh, P('dp')))
  try:
    return {i: jax.device_get(pf.next(i)) for i in range(start, stop)}, [
      pf.epoch(i) for i in range(start, stop)
    ]
  finally:
    pf.close()


def test_resume_mid_epoch_gives_the_same_batches():
  """A prefetcher started mid-epoch (epoch 1; the run goes on into epoch 2), on the corpus loaded
  afresh as a resumed process loads it, gives exactly the batches and epochs of one started at
  step 0, and only the keys the step takes."""
  c = _docs_corpus('concat', n_docs=20)
  n_rows = c.layout(16).n_rows
  start, stop = (n_rows + 6) // 4, 2 * n_rows // 4 + 3
  whole, whole_epochs = _prefetched(c, 0, stop)
  resumed, resumed_epochs = _prefetched(_docs_corpus('concat', n_docs=20), start, stop)
  assert (
    set(whole[0]) == set(corpus_lib.STEP_KEYS) == {'inputs', 'targets', 'weights', 'segment_ids', 'positions'}
  )
  assert start * 4 % n_rows and whole_epochs[start] == 1 and max(whole_epochs) == 2
  for i in range(start, stop):
    for k in corpus_lib.STEP_KEYS:
      np.testing.assert_array_equal(resumed[i][k], whole[i][k])
  assert resumed_epochs == whole_epochs[start:]
  full = corpus_lib.batch_at(c, 11, start, 4, 16)
  np.testing.assert_array_equal(whole[start]['inputs'], full['inputs'])


def test_packing_is_auto_by_weights_and_checked():
  assert packing.resolve('auto', weighted=True) == 'pack' and packing.resolve('auto', False) == 'concat'
  assert packing.resolve('concat', weighted=True) == 'concat'
  with pytest.raises(corpus_lib.ConfigError, match="data.packing='rows' is invalid"):
    corpus_lib.load_corpus('', 0.05, 129, packing='rows')


@pytest.mark.slow
def test_the_trainer_trains_on_the_epoch_order_and_records_the_epoch(tmp_path, monkeypatch):
  """A short run on text files of a few rows (data.packing=pack): the prefetcher asks batch_at for
  each step's batch (the step gets inputs and targets only) and every metric record names its
  epoch."""
  from jax3d.trainer.trainer import Trainer

  from helpers import small_cfg

  for i in range(3):
    (tmp_path / f'f{i}.txt').write_text(f'document {i}: ' + 'abc ' * (20 + 9 * i))
  cfg = small_cfg(
    **{
      'data.path': str(tmp_path),
      'eval.every': 0,
      'log.every': 1,
      'train.steps': 4,
      'mesh.dp': 2,
      'model.n_layers': 2,
      'data.packing': 'pack',
    }
  )
  asked = []
  real = corpus_lib.batch_at
  monkeypatch.setattr(
    corpus_lib, 'batch_at', lambda *a, **k: asked.append((k.get('split', 'train'), a[2])) or real(*a, **k)
  )
  t = Trainer(cfg, devices=jax.devices()[:2], console=False)
  try:
    records = [r for r in t.train() if 'loss' in r and 'event' not in r]
  finally:
    t.close()
  assert t.corpus.packing == 'pack'  # data.packing reaches the trainer's corpus
  n_rows = t.corpus.layout(cfg.train.seq_len).n_rows
  batch = cfg.train.global_batch_size
  assert sorted({step for split, step in asked if split == 'train'}) == [0, 1, 2, 3]
  assert [r['epoch'] for r in records] == [i * batch // n_rows for i in range(4)]
  assert records[-1]['epoch'] >= 1 and all(np.isfinite(r['loss']) for r in records)


def test_the_trainer_feeds_step_i_the_batch_of_jax3d_batch(tmp_path):
  """What the training loop hands the compiled step at step i (stood in for by a recorder: nothing
  compiles) is `jax3d.batch(cfg, i)`, every array equal, for steps 0-2 and after a second
  `train` call that starts at step 3 (as a resumed run does), across epoch boundaries."""
  import jax3d
  from jax3d.trainer.trainer import Trainer

  from helpers import small_cfg

  rng = np.random.default_rng(0)
  for i in range(3):
    (tmp_path / f'f{i}.txt').write_text(''.join(rng.choice(list('abcdefgh \n'), 60 + 30 * i)))
  over = {'data.path': str(tmp_path), 'data.packing': 'pack', 'eval.every': 0, 'mesh.dp': 2}
  cfg = small_cfg(**over, **{'model.n_layers': 2, 'train.global_batch_size': 8, 'train.steps': 6})
  fed = {}

  def step(state, batch):  # the compiled train step's place in the loop
    i = int(state['step'])
    fed[i] = jax.device_get(batch)
    return {'step': i + 1}, {'loss': 1.0, 'lr': 0.0, 'grad_norm': 0.0, 'finite': True}

  t = Trainer(cfg, devices=jax.devices()[:2], console=False)
  t.state, t.compiled, t.evaluate = {'step': 0}, step, lambda: 0.0
  try:
    t.train(steps=3)
    t.train(steps=3)
  finally:
    t.close()
  assert sorted(fed) == list(range(6))
  epoch = lambda i: corpus_lib.epoch_at(t.corpus, cfg.train.seed, i, 8, cfg.train.seq_len)
  assert epoch(0) == 0 and epoch(5) >= 2  # the epoch order, reshuffled, is crossed
  for i in range(6):
    want = jax3d.batch(cfg, i)
    assert set(fed[i]) == set(want) == set(corpus_lib.STEP_KEYS)
    for k in want:
      np.testing.assert_array_equal(fed[i][k], want[k], err_msg=f'step {i}: {k}')
    if i:  # neighbouring steps differ: a batch one step off cannot pass
      assert (fed[i]['inputs'] != fed[i - 1]['inputs']).any()
