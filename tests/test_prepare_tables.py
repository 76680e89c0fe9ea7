"""jax3d.prepare on tables: the same documents as Parquet (several row groups), an Arrow file
(Feather), an Arrow stream, a `datasets` save_to_disk folder, a DatasetDict's split and a dataset
in the Hugging Face cache (read offline) give the tokens of the `tokenizers` library over the
texts, byte for byte the shards of the same documents as JSONL; the worker count changes no byte;
bad rows are named (file, row) and fail (exit 2, the dataset there untouched) or are skipped and
counted; chat conversations in a table column give the ids and weights of the same JSONL."""

from __future__ import annotations

import glob
import json
import os
import sysconfig

import numpy as np
import pytest

from jax3d import prepare as prepare_cli
from jax3d.data import shards, tokenizer as tok_lib

STDLIB = os.path.join(sysconfig.get_paths()['stdlib'], 'json')
TEXTS = [
  open(os.path.join(STDLIB, n), encoding='utf-8').read()
  for n in sorted(os.listdir(STDLIB))
  if n.endswith('.py')
]
TEXTS = [t[i : i + 700] for t in TEXTS for i in range(0, min(len(t), 2800), 700)] + ['Ça va ? 日本語 ✓']


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  """A 300-token byte-level BPE tokenizer with an EOS, trained on the texts."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  t = Tokenizer(models.BPE())
  t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  t.decoder = decoders.ByteLevel()
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=['<|endoftext|>'], initial_alphabet=alphabet)
  t.train_from_iterator(TEXTS, trainer)
  path = str(tmp_path_factory.mktemp('tok') / 'tokenizer.json')
  t.save(path)
  return path


def _tables(d, texts: list[str], column: str = 'text', values: list | None = None) -> dict[str, str]:
  """The documents written in every layout: {kind: --input}."""
  import datasets
  import pyarrow as pa
  import pyarrow.feather as feather
  import pyarrow.parquet as pq

  values = texts if values is None else values
  table = pa.table({'id': list(range(len(values))), column: values})
  os.makedirs(d, exist_ok=True)
  pq.write_table(table, f'{d}/a.parquet', row_group_size=7)
  feather.write_feather(table, f'{d}/a.feather', chunksize=5, compression='uncompressed')
  with pa.ipc.new_stream(f'{d}/a.arrows', table.schema) as w:
    for b in table.to_batches(max_chunksize=6):
      w.write_batch(b)
  with open(f'{d}/a.jsonl', 'w') as f:
    f.writelines(json.dumps({column: v}) + '\n' for v in values)
  ds = datasets.Dataset.from_dict({'id': table['id'].to_pylist(), column: values})
  ds.save_to_disk(f'{d}/saved', max_shard_size='5KB')
  other = datasets.Dataset.from_dict({'id': [0], column: values[:1]})
  datasets.DatasetDict({'train': other, 'test': ds}).save_to_disk(f'{d}/dict')
  return {
    'parquet': f'{d}/a.parquet',
    'feather': f'{d}/a.feather',
    'stream': f'{d}/a.arrows',
    'save_to_disk': f'{d}/saved',
    'dataset_dict': f'{d}/dict',
    'jsonl': f'{d}/a.jsonl',
  }


def _hub_cache(d, texts: list[str]) -> str:
  """The folder a download of the Hub dataset 'someone/tiny' leaves in HF_DATASETS_CACHE."""
  import shutil

  import pyarrow as pa
  import pyarrow.parquet as pq
  from datasets.packaged_modules.parquet.parquet import Parquet

  pq.write_table(pa.table({'text': texts}), f'{d}/src.parquet')
  cache = f'{d}/cache'
  Parquet(
    cache_dir=cache, dataset_name='tiny', data_files={'train': f'{d}/src.parquet'}, hash='0'
  ).download_and_prepare()
  (config,) = glob.glob(f'{cache}/tiny/default-*')
  shutil.move(config, f'{cache}/tiny/default')
  shutil.move(f'{cache}/tiny', f'{cache}/someone___tiny')
  return cache


def _run(inp: str, out: str, tok: str, *extra: str) -> int:
  argv = [f'--input={inp}', f'--out={out}', f'--tokenizer={tok}', '--noprogress', '--eval_fraction=0']
  return prepare_cli.main(argv + ['--workers=1', *extra])


def _bins(out: str) -> bytes:
  return b''.join(open(f, 'rb').read() for f in sorted(glob.glob(f'{out}/train-?????.bin')))


def test_every_table_layout_gives_the_tokenizers_ids(tmp_path, tok, monkeypatch):
  import datasets

  inputs = _tables(tmp_path / 'in', TEXTS)
  monkeypatch.setattr(datasets.config, 'HF_DATASETS_CACHE', _hub_cache(tmp_path, TEXTS))
  t = tok_lib.load(tok)
  want = np.array([i for ids in t.encode_batch(TEXTS) for i in ids + [t.eos_id]], np.uint16)
  got = {}
  for kind, inp in [*inputs.items(), ('hub', 'hf:someone/tiny')]:
    extra = ['--split=test'] if kind == 'dataset_dict' else []
    assert _run(inp, str(tmp_path / kind), tok, '--shard_mb=0.01', *extra) == 0, kind
    got[kind] = _bins(str(tmp_path / kind))
    index = shards.read_index(str(tmp_path / kind))
    train, _ = shards.streams(index)
    np.testing.assert_array_equal(train[0 : train.size], want, err_msg=kind)
    starts, _ = shards.documents(index, 'train')
    assert len(starts) == len(TEXTS) + 1, kind  # and the end
  assert len({len(v) for v in got.values()}) == 1 and all(v == got['jsonl'] for v in got.values())
  assert len(shards.read_index(str(tmp_path / 'parquet'))['train']) == 3  # several work units


def test_the_worker_count_changes_no_byte(tmp_path, tok):
  """1 worker and 2 (processes) over 3 work units, a share of the rows held out: the same files."""
  inp = _tables(tmp_path / 'in', TEXTS)['parquet']
  outs = []
  for workers in (1, 2):
    out = str(tmp_path / f'w{workers}')
    argv = [f'--input={inp}', f'--out={out}', f'--tokenizer={tok}', '--noprogress', '--eval_fraction=0.3']
    assert prepare_cli.main(argv + ['--shard_mb=0.004', f'--workers={workers}']) == 0
    outs.append({os.path.basename(f): open(f, 'rb').read() for f in sorted(glob.glob(f'{out}/*-*.bin'))})
  assert len(outs[0]) == 12 and outs[0] == outs[1]  # 3 units (row groups) x train/val x tokens/starts
  index = shards.read_index(str(tmp_path / 'w1'))
  assert 0 < sum(s['documents'] for s in index['val']) < len(TEXTS)


def test_bad_rows_fail_naming_the_row_or_are_skipped_and_counted(tmp_path, tok, capsys):
  """A null, a non-UTF-8 value (binary column), a missing field (JSONL): --on_bad=fail exits 2
  naming file and row (line) and leaves the dataset already there as it was; skip leaves exactly
  those rows out (the tokens of the good ones) and names them."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  good = TEXTS[:6]
  raw = [t.encode() for t in good[:2]] + [None, b'caf\xe9'] + [t.encode() for t in good[2:]]
  pq.write_table(pa.table({'text': pa.array(raw, pa.binary())}), f'{tmp_path}/bad.parquet', row_group_size=3)
  lines = [{'text': t} for t in good[:3]] + [{'body': 'x'}] + [{'text': t} for t in good[3:]]
  with open(f'{tmp_path}/bad.jsonl', 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in lines)
  with open(f'{tmp_path}/good.jsonl', 'w') as f:
    f.write(json.dumps({'text': 'an earlier dataset'}) + '\n')
  t = tok_lib.load(tok)
  want = [i for ids in t.encode_batch(good) for i in ids + [t.eos_id]]
  for name, named in [
    (
      'bad.parquet',
      ["bad.parquet: row 2 (field 'text' is null)", "bad.parquet: row 3 (field 'text' is not UTF-8"],
    ),
    ('bad.jsonl', ["bad.jsonl:4 (no field 'text' (its fields: body"]),
  ]:
    out = str(tmp_path / f'out_{name}')
    assert _run(f'{tmp_path}/good.jsonl', out, tok) == 0  # a dataset there already
    before = _bins(out)
    capsys.readouterr()
    assert _run(f'{tmp_path}/{name}', out, tok) == 2
    err = capsys.readouterr().err.strip().splitlines()
    first = named[0].replace(' (', ': ', 1).rstrip(')')
    assert len(err) == 1 and err[0].startswith(f'error: {tmp_path}/{first}'), err
    assert _bins(out) == before and not os.path.exists(out + '.partial/index.json')
    assert _run(f'{tmp_path}/{name}', out, tok, '--on_bad=skip') == 0
    train, _ = shards.streams(shards.read_index(out))
    np.testing.assert_array_equal(train[0 : train.size], want)
    err = capsys.readouterr().err
    assert f'note: {len(named)} bad row(s) skipped (--on_bad=skip): ' in err, err
    for n in named:
      assert f'{tmp_path}/{n}' in err, (n, err)


def test_chat_conversations_in_a_table_column(tmp_path):
  """--format=chat on a Parquet column of conversations (list of structs; or their JSON text) and
  on the same as JSONL: the same ids and weights; a row with an unknown role is skipped."""
  from test_chat import CONVERSATIONS, SPECIALS, make_folder
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  b = Tokenizer(models.BPE())
  b.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(
    vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  b.train_from_iterator(TEXTS, trainer)
  b.save(f'{tmp_path}/base.json')
  folder = make_folder(tmp_path / 'tok', f'{tmp_path}/base.json', 'chatml')
  convs = [[{'role': m['role'], 'content': m['content']} for m in c] for c in CONVERSATIONS]
  rows = {'inp': [convs[0], [{'role': 'narrator', 'content': 'x'}], *convs[1:]]}
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.table({'conversation': rows['inp']}), f'{tmp_path}/chat.parquet', row_group_size=2)
  with open(f'{tmp_path}/chat.jsonl', 'w') as f:
    f.writelines(json.dumps({'conversation': c}) + '\n' for c in convs)
  common = [f'--tokenizer={folder}', '--format=chat', '--field=conversation', '--noprogress', '--workers=1']
  common += ['--eval_fraction=0']
  assert (
    prepare_cli.main([f'--input={tmp_path}/chat.parquet', f'--out={tmp_path}/p', '--on_bad=skip', *common])
    == 0
  )
  assert prepare_cli.main([f'--input={tmp_path}/chat.jsonl', f'--out={tmp_path}/j', *common]) == 0
  as_text = pa.table({'conversation': [json.dumps(c) for c in convs]})  # the JSON text in a string column
  pq.write_table(as_text, f'{tmp_path}/text.parquet')
  assert prepare_cli.main([f'--input={tmp_path}/text.parquet', f'--out={tmp_path}/t', *common]) == 0
  for kind in ('train-00000.bin', 'train-00000.weights.bin', 'train-00000.starts.bin'):
    assert open(f'{tmp_path}/p/{kind}', 'rb').read() == open(f'{tmp_path}/j/{kind}', 'rb').read(), kind
    assert open(f'{tmp_path}/t/{kind}', 'rb').read() == open(f'{tmp_path}/j/{kind}', 'rb').read(), kind
  assert np.fromfile(f'{tmp_path}/p/train-00000.weights.bin', np.uint8).sum() > 0
