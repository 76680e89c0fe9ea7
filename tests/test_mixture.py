"""Weighted mixtures (data.mixture, data.mixture_stages; jax3d/data/mixture.py, apportion.py): the
realised proportions against the weights, each source in its own epoch order, the same rows for
every layout and process count, stage changes that keep the cursors, resume (the same mixture: the
same losses; another: logged, the cursors go on), the per-source metrics and the bad inputs."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d.config import ConfigError
from jax3d.data import apportion, corpus as corpus_lib, global_batch, mixture, tokenizer as tok_lib

from helpers import small_cfg

MIX = 'web=0.7:/d/web,code=0.2:/d/code,math=0.1:/d/math'


def _source(seed: int, n_docs: int) -> corpus_lib.Corpus:
  """Documents whose token ids are `seed * 100_000` + their positions (a target names its source
  and its token)."""
  lens = np.random.default_rng(seed).integers(2, 60, n_docs)
  starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
  tokens = (seed * 100_000 + np.arange(starts[-1])).astype(np.uint32)
  return corpus_lib.Corpus(tokens, tokens, 1 << 20, f'source {seed}', starts, starts, packing='concat')


def _mixture(spec: str = MIX, stages: str = '', docs=(400, 30, 8)) -> mixture.Mixture:
  return mixture.Mixture(apportion.parse(spec, stages), [_source(i + 1, n) for i, n in enumerate(docs)])


def _draws(appt: apportion.Apportionment, steps: range) -> tuple[np.ndarray, np.ndarray]:
  got = [appt.draws(s) for s in steps]
  return np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])


def test_three_sources_give_their_weights_within_1pct_over_1000_steps():
  """Over 1,000 steps of 16 rows the realised shares are the weights (within 1%, in fact within a
  row); at every step each source's count is within 3 rows of its target, and its rows are its
  cursor 0, 1, 2, ... in turn (no row skipped or repeated)."""
  appt = apportion.Apportionment(apportion.parse(MIX), 16)
  src, k = _draws(appt, range(1000))
  share = np.bincount(src, minlength=3) / src.size
  np.testing.assert_allclose(share, [0.7, 0.2, 0.1], atol=0.01)
  np.testing.assert_allclose(share, [0.7, 0.2, 0.1], atol=1 / src.size)
  for i in range(3):
    np.testing.assert_array_equal(k[src == i], np.arange((src == i).sum()))
  counts = np.cumsum(np.eye(3, dtype=np.int64)[src], axis=0)[15::16]  # after each step
  target = np.arange(1, 1001)[:, None] * 16 * np.array([0.7, 0.2, 0.1])
  assert np.abs(counts - target).max() < 3
  np.testing.assert_array_equal(appt.cursors(1000), counts[-1])
  np.testing.assert_array_equal(appt.cursors(437), counts[436])


def test_each_source_reads_its_own_epoch_order():
  """A small source repeats (a new permutation each epoch) while a large one is not exhausted;
  the rows of source i are its epoch order's entries at its cursors."""
  m = _mixture()
  seq, batch = 16, 16
  lay, order = m.layout(seq), m.order(5, seq)
  rows = np.concatenate([order.rows(s, batch) for s in range(40)])
  src = np.searchsorted(lay.offsets, rows, side='right') - 1
  for i, n_rows in enumerate(lay.offsets[1:] - lay.offsets[:-1]):
    mine = rows[src == i] - lay.offsets[i]
    want = order.orders[i].at(np.arange(mine.size))
    np.testing.assert_array_equal(mine, want)
    if mine.size >= n_rows:  # a whole epoch: every row once
      assert sorted(mine[:n_rows]) == list(range(n_rows))
  epochs = m.per_source(5, 40, batch, seq)
  assert epochs['epoch/math'] >= 2 and epochs['epoch/web'] == 0  # small repeats, large not exhausted
  assert sum(epochs[f'tokens/{n}'] for n in m.names) == 40 * batch * seq
  b = corpus_lib.batch_at(m, 5, 7, batch, seq)
  np.testing.assert_array_equal(b['inputs'][:, 0] // 100_000 - 1, b['source'])  # the row's own source


def test_sources_of_the_same_size_have_their_own_epoch_orders():
  """Two sources with the same number of rows are shuffled by different permutations (each
  source's epoch-order seed comes from the run's seed and its name), and the same run seed and
  names give the same orders again."""
  spec = 'a=0.5:/d/a,b=0.5:/d/b'
  make = lambda: mixture.Mixture(apportion.parse(spec), [_source(1, 300), _source(1, 300)])
  m = make()
  a, b = (m.order(5, 16).orders[i].at(np.arange(m.layout(16).layouts[i].n_rows)) for i in (0, 1))
  assert sorted(a) == sorted(b) and (a != b).mean() > 0.9
  np.testing.assert_array_equal(make().order(5, 16).orders[1].at(np.arange(b.size)), b)


class _OneProcess:
  def __init__(self, sharding, devices):
    self.sharding, self.devices = sharding, set(devices)

  def addressable_devices_indices_map(self, shape):
    return {d: i for d, i in self.sharding.devices_indices_map(shape).items() if d in self.devices}


@pytest.mark.parametrize('mesh_shape', [(1, 1, 1), (2, 2, 2), (8, 1, 1), (1, 2, 4)])
@pytest.mark.parametrize('processes', [1, 2, 4])
def test_every_layout_and_process_count_reads_the_same_rows(mesh_shape, processes):
  """The global batch put together from the rows each process reads equals the one-process
  batch (every key, `source` too), for 4 layouts and 1, 2 or 4 processes, across a stage change."""
  n_dev = int(np.prod(mesh_shape))
  if processes > n_dev:
    pytest.skip('fewer devices than processes')
  m = _mixture(stages='3:web=0.2,code=0.2,math=0.6')
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n_dev]).reshape(mesh_shape), ('dp', 'pp', 'tp'))
  sh = NamedSharding(mesh, P('dp'))
  devices, per = list(mesh.devices.flat), n_dev // processes
  for step in (2, 3, 40):
    ref = corpus_lib.batch_at(m, 0, step, 16, 16)
    got = {k: np.full_like(v, -7) for k, v in ref.items()}
    for p in range(processes):
      rows = global_batch.process_rows(_OneProcess(sh, devices[p * per : (p + 1) * per]), 16)
      for k, v in corpus_lib.batch_at(m, 0, step, 16, 16, rows).items():
        got[k][rows] = v
    for k in ref:
      np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_stages_change_the_weights_and_keep_the_cursors():
  """From step 100 the shares are the new stage's (within 1%); each source's cursor runs on across
  the change (rows 0, 1, 2, ... with none skipped); a source left out of a stage gets no rows."""
  appt = apportion.Apportionment(apportion.parse(MIX, '100:web=0.2,code=0.8;300:math=1'), 16)
  src, k = _draws(appt, range(400))
  for lo, hi, want in ((0, 100, [0.7, 0.2, 0.1]), (100, 300, [0.2, 0.8, 0]), (300, 400, [0, 0, 1])):
    part = src[lo * 16 : hi * 16]
    np.testing.assert_allclose(np.bincount(part, minlength=3) / part.size, want, atol=0.01)
  for i in range(3):
    np.testing.assert_array_equal(k[src == i], np.arange((src == i).sum()))


def _folders(root) -> str:
  """Three text folders (sources of different sizes) and the data.mixture naming them."""
  rng = np.random.default_rng(0)
  for name, n in (('web', 12), ('code', 6), ('math', 3)):
    os.makedirs(root / name)
    for i in range(n):
      words = rng.choice(['alpha', 'beta', 'gamma', name], 30 + 7 * i)
      (root / name / f'f{i}.txt').write_text(f'{name} {i}: ' + ' '.join(words))
  return f'web=0.6:{root}/web,code=0.3:{root}/code,math=0.1:{root}/math'


def _train(cfg, workdir, steps):
  from jax3d.trainer.trainer import Trainer

  t = Trainer(cfg, workdir=str(workdir), devices=jax.devices()[:1], console=False)
  try:
    return t.train(steps=steps), t
  finally:
    t.close()


def _records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_resume_mid_mixture_is_exact_and_a_changed_mixture_goes_on_from_the_cursors(tmp_path):
  """8 steps in one go and 4 + 4 (a resume) give the same losses and per-source tokens; metrics
  record tokens/NAME (summing to tokens); a resume with other weights is logged (one record naming
  old and new) and each source's rows go on from its saved cursor."""
  mix = _folders(tmp_path)
  over = {'data.mixture': mix, 'eval.every': 4, 'eval.batches': 4, 'log.every': 1, 'checkpoint.every': 4}
  over |= {'checkpoint.async_save': False, 'train.steps': 8, 'model.n_layers': 1, 'sample.tokens': 1}
  cfg = small_cfg(**over)
  _train(cfg, tmp_path / 'one', 8)
  _train(cfg, tmp_path / 'two', 4)
  _, t = _train(cfg, tmp_path / 'two', 4)
  one, two = (
    {r['step']: r for r in _records(tmp_path / d) if 'loss' in r and 'event' not in r} for d in ('one', 'two')
  )
  assert sorted(one) == sorted(two) == list(range(1, 9))
  for s in one:
    assert one[s]['loss'] == two[s]['loss'], s
    assert {k: v for k, v in one[s].items() if '/' in k} == {k: v for k, v in two[s].items() if '/' in k}
  evals = {d: [r for r in _records(tmp_path / d) if 'eval_loss' in r] for d in ('one', 'two')}
  assert [r['step'] for r in evals['one']] == [0, 4, 8] and evals['one'][1:] == evals['two'][-2:]
  ev = evals['one'][-1]  # the mixture's held-out loss is over its sources' batches (2, 1, 1 of 4)
  assert set(ev) == {'step', 'eval_loss', 'eval_loss/web', 'eval_loss/code', 'eval_loss/math'}
  each = [ev[f'eval_loss/{n}'] for n in ('web', 'code', 'math')]
  lo, hi = min(each), max(each)
  assert lo < ev['eval_loss'] < hi
  last = one[8]
  assert sum(last[f'tokens/{n}'] for n in ('web', 'code', 'math')) == last['tokens'] == 8 * 32 * 16
  assert last['tokens/web'] > last['tokens/code'] > last['tokens/math'] > 0
  meta = t.checkpointer.read_meta(8)['mixture']
  assert meta['cursors'] == {n: last[f'tokens/{n}'] // 16 for n in ('web', 'code', 'math')}
  # The mixture changed on resume: logged, and each source's next row is the one at its cursor.
  cfg2 = small_cfg(**(over | {'data.mixture': mix.replace('web=0.6', 'web=0.1'), 'train.steps': 10}))
  _, t2 = _train(cfg2, tmp_path / 'two', 2)
  changed = [r for r in _records(tmp_path / 'two') if r.get('event') == 'mixture_changed']
  assert len(changed) == 1 and changed[0]['step'] == 8
  assert 'was data.mixture web=0.6' in changed[0]['message'] and 'now web=0.2' in changed[0]['message']
  order = t2.corpus.order(cfg.train.seed, 16)
  src, k = order.draws(8, 32)
  for i, n in enumerate(t2.corpus.names):
    assert k[src == i].min(initial=meta['cursors'][n]) == meta['cursors'][n]
  after = t2.checkpointer.read_meta(10)['mixture']
  assert after['origin'] == 8 and after['base'] == meta['cursors']
  assert abs(after['cursors']['web'] - meta['cursors']['web'] - 0.2 * 64) < 1  # web now 0.2 of 2 x 32 rows


def test_resume_keeps_the_schedule_and_a_changed_mixture_goes_on_from_the_cursors():
  """A mixture loaded afresh and resumed from step 37's metadata gives the rows of the run that
  never stopped; other weights on resume (logged: old and new) start each source at its saved
  cursor, and a resume of that run keeps the new schedule (origin and base) exactly."""
  m = _mixture(stages='30:web=0.5,code=0.5')
  meta = m.meta(3, 37, 16, 16)
  fresh = _mixture(stages='30:web=0.5,code=0.5')
  assert fresh.resume(json.loads(json.dumps(meta)), 37) is None
  for s in (37, 38, 90):
    np.testing.assert_array_equal(fresh.order(3, 16).rows(s, 16), m.order(3, 16).rows(s, 16))
  changed = _mixture('web=0.1:/d/web,code=0.1:/d/code,math=0.8:/d/math')
  note = changed.resume(meta, 37)
  assert note.startswith('data.mixture changed on resume at step 37: was data.mixture web=0.7')
  assert 'now web=0.1:/d/web,code=0.1:/d/code,math=0.8:/d/math' in note
  src, k = changed.order(3, 16).draws(37, 16)
  for i, n in enumerate(changed.names):
    assert k[src == i].min(initial=meta['cursors'][n]) == meta['cursors'][n]
  later = changed.meta(3, 60, 16, 16)
  drawn = np.bincount(
    np.concatenate([changed.order(3, 16).draws(s, 16)[0] for s in range(37, 60)]), minlength=3
  )
  assert later['cursors'] == {n: meta['cursors'][n] + int(drawn[i]) for i, n in enumerate(changed.names)}
  again = _mixture('web=0.1:/d/web,code=0.1:/d/code,math=0.8:/d/math')
  assert again.resume(later, 60) is None and (again.origin, list(again.base)) == (
    37,
    list(meta['cursors'].values()),
  )
  np.testing.assert_array_equal(again.order(3, 16).rows(61, 16), changed.order(3, 16).rows(61, 16))
  share = np.bincount(
    np.concatenate([changed.order(3, 16).draws(s, 16)[0] for s in range(37, 137)]), minlength=3
  )
  np.testing.assert_allclose(share / share.sum(), [0.1, 0.1, 0.8], atol=0.01)
  with pytest.raises(ConfigError, match='step 36 is before step 37, where this run changed data.mixture'):
    changed.order(3, 16).rows(36, 16)


@pytest.mark.parametrize(
  'mix, stages, match',
  [
    ('web:', '', r"data.mixture='web:': 'web:' is not NAME=WEIGHT:PATH \(the form is NAME=WEIGHT:PATH"),
    ('web=0:/d/w', '', r"the weight of 'web' is '0'; a weight is a number > 0"),
    ('web=-1:/d/w', '', r"the weight of 'web' is '-1'; a weight is a number > 0"),
    ('web=x:/d/w', '', r"the weight of 'web' is 'x'"),
    ('web=1:/d/a,web=2:/d/b', '', r"the name 'web' is given twice"),
    ('w b=1:/d/a', '', r"the name 'w b' may hold only letters, digits"),
    ('web=1:/d/a,code:/d/b', '', r'give every source a weight, or none'),
    ('web:/d/a,code:/d/b', '', r'gives no weights: give them .* or start data.mixture_stages at step 0'),
    ('web=1:/d/a', '0:web=1', r'step 0 has weights in data.mixture already'),
    ('web=1:/d/a,c=1:/d/c', '10:web=1;5:c=1', r'the steps must increase \(5 after 10\)'),
    ('web=1:/d/a', '10:math=1', r"'math' is no source of data.mixture \(its sources: web\)"),
    ('web=1:/d/a', '10:web=1,web=2', r"'web=2' in step 10 \(the form is STEP:NAME=WEIGHT"),
    ('web=1:/d/a', 'x:web=1', r"'x:web=1' is not STEP:NAME=WEIGHT"),
  ],
)
def test_bad_mixtures_are_refused_naming_the_setting_and_the_valid_form(mix, stages, match):
  with pytest.raises(ConfigError, match=match):
    apportion.parse(mix, stages)


def test_a_mixture_of_sources_that_cannot_mix_is_refused(tmp_path):
  """A missing folder (named with its source), data.path beside data.mixture, stages without a
  mixture, token shards of another tokenizer: ConfigError before anything compiles."""
  from jax3d import prepare

  mix = _folders(tmp_path)
  for name in ('web', 'code'):
    assert (
      prepare.main([f'--input={tmp_path / name}', f'--out={tmp_path / (name + "_t")}', '--noprogress']) == 0
    )
  cases = [
    (
      {'data.mixture': mix.replace('/math', '/nowhere')},
      r"data.mixture source 'math' \(.*/nowhere\): data.path=.* does not exist",
    ),
    (
      {'data.mixture': mix, 'data.path': str(tmp_path / 'web')},
      'data.path=.* and data.mixture=.* are both set',
    ),
    ({'data.mixture_stages': '10:web=1'}, r"data.mixture_stages='10:web=1' needs data.mixture"),
  ]
  index = tmp_path / 'code_t' / 'index.json'
  meta = json.loads(index.read_text())
  meta['tokenizer'] = {'path': '/elsewhere/tokenizer.json', 'sha256': 'f' * 64}
  index.write_text(json.dumps(meta))
  shard_mix = f'web=1:{tmp_path}/web_t,code=1:{tmp_path}/code_t'
  cases.append(
    ({'data.mixture': shard_mix}, "sources 'web' and 'code' were tokenized with different tokenizers")
  )
  for over, match in cases:
    with pytest.raises(ConfigError, match=match):
      mixture.for_config(small_cfg(**over))
  with pytest.raises(
    ConfigError, match="data.mixture source 'code' .* was tokenized with /elsewhere/tokenizer.json"
  ):
    mixture.for_config(small_cfg(**{'data.mixture': shard_mix}), tok_lib.load('bytes'))  # as a run loads it


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_two_and_four_processes_train_on_the_same_mixture(tmp_path):
  """The same mixture run as 1 process x 8 devices, 2 x 4 and 4 x 2 (scripts/launch_local.py): the
  same losses and the same tokens per source at every step."""
  from test_multihost import finish, launch, single, train_cmd

  mix = _folders(tmp_path)
  args = [f'--config.data.mixture={mix}', '--config.data.mixture_stages=3:web=0.2,code=0.2,math=0.6']
  runs = {}
  for n in (1, 2, 4):
    wd = str(tmp_path / f'p{n}')
    cmd = train_cmd(wd, *args, steps=6)
    finish(single(cmd) if n == 1 else launch(n, cmd))
    runs[n] = {r['step']: r for r in _records(wd) if 'loss' in r and 'event' not in r}
  assert sorted(runs[1]) == list(range(1, 7))
  for n in (2, 4):
    for s, r in runs[1].items():
      np.testing.assert_allclose(runs[n][s]['loss'], r['loss'], rtol=1e-5, err_msg=f'{n} processes, step {s}')
      assert {k: v for k, v in runs[n][s].items() if '/' in k} == {k: v for k, v in r.items() if '/' in k}
  assert runs[1][6]['tokens/math'] > runs[1][3]['tokens/math'] * 2  # the stage at step 3 took effect


def test_jax3d_batch_names_each_rows_source(tmp_path, capsys):
  """`python -m jax3d.batch` on a mixture: each row's source (the one its tokens come from) and
  each source's rows in the batch; the Python API's batch carries `source`."""
  import jax3d
  from jax3d import batch as batch_cmd, config as config_lib

  mix = _folders(tmp_path)
  assert (
    batch_cmd.main(['--step=2', '--rows=0', f'--config.data.mixture={mix}', '--config.train.seq_len=16']) == 0
  )
  out = capsys.readouterr().out
  b = jax3d.batch(config_lib.load_config('tiny', {'data.mixture': mix, 'train.seq_len': 16}), 2)
  names = ('web', 'code', 'math')
  for r, s in enumerate(b['source']):
    assert f'row {r} ({names[s]}):' in out
  counts = np.bincount(b['source'], minlength=3)
  assert f'sources: web {counts[0]} rows' in out and f'math {counts[2]} rows' in out
  np.testing.assert_allclose(counts / counts.sum(), [0.6, 0.3, 0.1], atol=1.5 / counts.sum())


def test_held_out_batches_are_shared_among_the_sources_by_weight():
  """eval.batches=8 of a 0.7/0.2/0.1 mixture: 6, 1 and 1 batches (largest remainder), each the
  source's own held-out batches (those a run of that source alone evaluates on); at least one each."""
  m = _mixture()
  got = mixture.eval_batches(m, 3, 8, 16, 16)
  assert [n for n, _ in got] == ['web'] * 6 + ['code', 'math']
  for i, name in enumerate(m.names):
    mine = [b for n, b in got if n == name]
    want = corpus_lib.eval_batches(m.sources[i], 3, len(mine), 16, 16)
    for b, w in zip(mine, want, strict=True):
      for k in corpus_lib.STEP_KEYS:
        np.testing.assert_array_equal(b[k], w[k])
  assert [n for n, _ in mixture.eval_batches(m, 3, 1, 16, 16)] == ['web', 'code', 'math']
