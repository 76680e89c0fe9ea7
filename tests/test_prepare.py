"""jax3d.prepare: a BPE tokenizer trained on the standard library, token shards that equal a direct
`tokenizers` encode, held-out documents never in training, reruns that redo nothing, and the
memory-mapped shard view that gives the batches of one token stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from jax3d import assemble, config as config_lib
from jax3d.data import bpe as bpe_lib, corpus as corpus_lib, documents, prefetch, shards, tokenizer as tok_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STDLIB = sysconfig.get_paths()['stdlib']


def _prepare(*args):
  return subprocess.run(
    [sys.executable, '-m', 'jax3d.prepare', '--noprogress', *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )


@pytest.fixture(scope='module')
def bpe(tmp_path_factory):
  """A 1000-token BPE tokenizer trained by jax3d.prepare on three standard-library packages, and
  their shards (small units, 20% held out)."""
  corpus = tmp_path_factory.mktemp('corpus')
  for pkg in ('json', 'email', 'logging'):
    for name in os.listdir(os.path.join(STDLIB, pkg)):
      if name.endswith('.py'):
        (corpus / f'{pkg}_{name}').write_bytes(open(os.path.join(STDLIB, pkg, name), 'rb').read())
  out = tmp_path_factory.mktemp('shards')
  r = _prepare(
    f'--input={corpus}', f'--out={out}', '--train_tokenizer=1000', '--shard_mb=0.15', '--eval_fraction=0.2'
  )
  assert r.returncode == 0, r.stderr
  assert 'trained a BPE tokenizer' in r.stdout and 'MB/s on' in r.stdout
  return str(corpus), str(out)


def test_bpe_round_trip_on_the_standard_library(bpe):
  """decode(encode(text)) == text for every .py file of the standard library's top level and of
  the packages it was trained on (byte-level BPE is lossless)."""
  tok = tok_lib.load(os.path.join(bpe[1], 'tokenizer.json'))
  assert tok.vocab_size == 1000 and tok.eos_id == 0 and tok.bos_id is None
  files = [os.path.join(STDLIB, n) for n in sorted(os.listdir(STDLIB)) if n.endswith('.py')]
  files += [os.path.join(bpe[0], n) for n in sorted(os.listdir(bpe[0]))]
  texts = [open(f, encoding='utf-8', errors='replace').read() for f in files]
  ids = tok.encode_batch(texts)
  assert sum(map(len, ids)) < 0.5 * sum(map(len, texts))  # it compresses: real subwords
  bad = [f for f, t, i in zip(files, texts, ids, strict=True) if tok.decode(i) != t]
  assert not bad, bad[:5]


def test_shards_equal_a_direct_encode(bpe):
  """Concatenated, the train (val) shards are encode(document) + EOS of every training (held-out)
  document in input order, with the library's own Tokenizer."""
  from tokenizers import Tokenizer

  corpus, out = bpe
  index = shards.read_index(out)
  assert index['dtype'] == 'uint16' and index['vocab_size'] == 1000 and len(index['train']) > 3
  direct = Tokenizer.from_file(os.path.join(out, 'tokenizer.json'))
  want, lens = {'train': [], 'val': []}, {'train': [], 'val': []}
  for path in documents.iter_files(corpus, documents.TEXT_SUFFIXES + ('.jsonl',)):
    rel = os.path.relpath(path, corpus)
    ids = direct.encode(open(path, encoding='utf-8', errors='replace').read(), add_special_tokens=False).ids
    want['val' if documents.held_out(rel, 0.2) else 'train'] += ids + [0]
    lens['val' if documents.held_out(rel, 0.2) else 'train'].append(len(ids) + 1)
  train, val = shards.streams(index)
  assert want['val'] and want['train']
  np.testing.assert_array_equal(train[0 : train.size], want['train'])
  np.testing.assert_array_equal(val[0 : val.size], want['val'])
  # The index records each document's start (no EOS scan): one document per file here.
  assert all(s['starts'] for s in index['train'])
  for split, name in (('train', 'train'), ('val', 'val')):
    starts, weights = shards.documents(index, name)
    np.testing.assert_array_equal(starts, np.cumsum([0] + lens[split]))
    assert weights is None  # plain text: weight 1 everywhere


def test_rerun_redoes_nothing_and_a_changed_file_redoes_its_shard(bpe, tmp_path):
  corpus, out = bpe
  before = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in os.listdir(out) if n.endswith('.bin')}
  r = _prepare(f'--input={corpus}', f'--out={out}', '--shard_mb=0.15', '--eval_fraction=0.2')
  assert r.returncode == 0 and ' 0 shard(s) tokenized' in r.stdout, r.stdout
  after = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in os.listdir(out) if n.endswith('.bin')}
  assert before == after
  # A copy of the corpus with one file changed: only that file's unit is redone.
  import shutil

  corpus2, out2 = tmp_path / 'c', tmp_path / 'o'
  shutil.copytree(corpus, corpus2)
  shutil.copytree(out, out2)
  _prepare(
    f'--input={corpus2}', f'--out={out2}', '--shard_mb=0.15', '--eval_fraction=0.2'
  )  # new paths' mtimes
  last = sorted(os.listdir(corpus2))[-1]
  with open(corpus2 / last, 'a') as f:
    f.write('\n# changed\n')
  r = _prepare(f'--input={corpus2}', f'--out={out2}', '--shard_mb=0.15', '--eval_fraction=0.2')
  assert r.returncode == 0 and ' 1 shard(s) tokenized' in r.stdout, r.stdout


def test_jsonl_held_out_documents_are_never_trained_on(tmp_path):
  """Unique JSONL records, bytes tokenizer: every record lands in exactly one split."""
  src = tmp_path / 'docs.jsonl'
  records = [f'record {i:04d}: ' + 'x' * (i % 37) for i in range(400)]
  src.write_text(''.join(json.dumps({'body': r, 'id': i}) + '\n' for i, r in enumerate(records)))
  out = tmp_path / 'out'
  r = _prepare(f'--input={src}', f'--out={out}', '--field=body', '--shard_mb=0.002', '--workers=2')
  assert r.returncode == 0, r.stderr
  index = shards.read_index(str(out))
  assert index['eos_id'] is None and len(index['train']) > 2  # bytes: documents end with nothing
  # Bytes tokenizer has no EOS: split the decoded streams on the record prefix.
  split = lambda s: {
    'record ' + p for p in s[0 : s.size].astype(np.uint8).tobytes().decode().split('record ') if p
  }
  train, val = (split(s) for s in shards.streams(index))
  assert val and train and not train & val and train | val == set(records)


def test_uint32_shards_for_a_large_vocabulary(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers

  tok = Tokenizer(
    models.WordLevel({f'w{i}': i for i in range(70_000)} | {'[UNK]': 70_000}, unk_token='[UNK]')
  )
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / 'tokenizer.json'))
  (tmp_path / 'in.txt').write_text('w1 w69999 w5 zz\n')
  r = _prepare(
    f'--input={tmp_path / "in.txt"}',
    f'--out={tmp_path / "o"}',
    f'--tokenizer={tmp_path}',
    '--eval_fraction=0',
  )
  assert r.returncode == 0, r.stderr
  index = shards.read_index(str(tmp_path / 'o'))
  assert index['dtype'] == 'uint32'
  np.testing.assert_array_equal(shards.streams(index)[0][0:4], [1, 69999, 5, 70000])


def test_token_stream_batches_equal_the_concatenated_stream(bpe):
  """The memory-mapped view over many shards gives the batches of the one concatenated array
  (rows that cross shard boundaries included), for any rows, in both packings."""
  index = shards.read_index(bpe[1])
  train, _ = shards.streams(index)
  starts, _ = shards.documents(index, 'train')
  flat = train[0 : train.size].copy()
  assert len(train.maps) > 3
  for how in ('concat', 'pack'):
    mapped = corpus_lib.Corpus(train, train, 1000, 'shards', starts, starts, packing=how)
    copied = corpus_lib.Corpus(flat, flat, 1000, 'array', starts, starts, packing=how)
    for step in range(5):
      a = corpus_lib.batch_at(mapped, 7, step, 16, 64)
      b = corpus_lib.batch_at(copied, 7, step, 16, 64)
      for k in a:
        np.testing.assert_array_equal(a[k], b[k])
      rows = np.array([3, 9])
      np.testing.assert_array_equal(
        corpus_lib.batch_at(mapped, 7, step, 16, 64, rows)['targets'], b['targets'][rows]
      )


def test_a_run_on_shards_takes_their_tokenizer_and_vocabulary(bpe):
  cfg = assemble.resolve(config_lib.load_config('tiny', {'data.path': bpe[1]}))
  assert cfg.data.tokenizer == os.path.join(bpe[1], 'tokenizer.json') and cfg.model.vocab_size == 1000
  corpus = corpus_lib.load_corpus(cfg.data.path, 0.05, 129, tok_lib.load(cfg.data.tokenizer))
  assert corpus.vocab_size == 1000 and isinstance(corpus.train, shards.TokenStream)


def test_shards_that_disagree_with_their_index_exit_2(bpe, tmp_path):
  import shutil

  from test_bad_input import run_cli

  out = tmp_path / 'shards'
  shutil.copytree(bpe[1], out)
  with open(out / 'train-00001.bin', 'ab') as f:
    f.write(b'\0')
  r = run_cli([f'--config.data.path={out}'], tmp_path)
  lines = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
  assert 'train-00001.bin' in lines[0] and 'disagree' in lines[0]
  index = json.loads((out / 'index.json').read_text())
  (out / 'train-00001.bin').write_bytes((out / 'train-00001.bin').read_bytes()[:-1])
  index['dtype'] = 'int8'
  (out / 'index.json').write_text(json.dumps(index))
  r = run_cli([f'--config.data.path={out}'], tmp_path)
  assert r.returncode == 2 and "dtype 'int8'" in r.stderr, r.stderr[-2000:]


def test_prepare_bad_input_exits_2(tmp_path):
  r = _prepare('--input=/nonexistent', f'--out={tmp_path}')
  assert (
    r.returncode == 2
    and r.stderr.strip()
    == 'error: --input=/nonexistent is invalid: an existing file or folder, '
    'or hf:NAME (a dataset in the Hugging Face cache)'
  )
  r = _prepare(f'--out={tmp_path}', '--train_tokenizer=100')
  assert r.returncode == 2 and '--train_tokenizer=100' in r.stderr and '>= 257' in r.stderr
  assert bpe_lib.EOS_TOKEN == '<|endoftext|>'


def test_a_truncated_shard_is_a_data_error(bpe, tmp_path):
  """The prefetcher watches every mapped shard: one cut short mid-run is a DataError naming it
  (reading past the end of a memory map would be a SIGBUS)."""
  import shutil

  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  out = tmp_path / 'shards'
  shutil.copytree(bpe[1], out)
  corpus = corpus_lib.load_corpus(str(out), 0.05, 65)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ('dp', 'pp', 'tp'))
  pf = prefetch.Prefetcher(corpus, 0, 0, 100, 4, 64, NamedSharding(mesh, P('dp')), depth=1)
  try:
    pf.next(0)
    with open(out / 'train-00002.bin', 'r+b') as f:
      f.truncate(10)
    with pytest.raises(corpus_lib.DataError, match='train-00002.bin was truncated'):
      for i in range(1, 100):
        pf.next(i)
  finally:
    pf.close()
