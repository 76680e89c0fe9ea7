"""A SentencePiece `.model` through jax3d's tokenizer loader (jax3d/data/tokenizer.py): a tiny
model trained here with the `sentencepiece` library on standard-library source, loaded as a file
and as a folder; its vocabulary, BOS/EOS ids and encodings are the library's own, decode inverts
encode on text the model represents, and `jax3d.prepare --tokenizer=X.model` and the trainer's
vocabulary rule (`assemble.resolve`) take it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from jax3d import assemble, config as config_lib
from jax3d.data import documents, shards, tokenizer as tok_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STDLIB = sysconfig.get_paths()['stdlib']
VOCAB = 200


@pytest.fixture(scope='module')
def sp_model(tmp_path_factory):
  """(path of a 200-piece BPE SentencePiece model, the processor, the text it was trained on).
  Identity normalisation and no whitespace folding, so that every line of code round trips
  (newlines are not in its alphabet: SentencePiece trains on lines)."""
  import sentencepiece

  tmp = tmp_path_factory.mktemp('sp')
  text = ''.join(open(os.path.join(STDLIB, 'json', n)).read() for n in ('decoder.py', 'encoder.py'))
  (tmp / 'corpus.txt').write_text(text)
  sentencepiece.SentencePieceTrainer.train(
    input=str(tmp / 'corpus.txt'),
    model_prefix=str(tmp / 'sp'),
    vocab_size=VOCAB,
    model_type='bpe',
    character_coverage=1.0,
    normalization_rule_name='identity',
    remove_extra_whitespaces=False,
    minloglevel=2,
  )
  path = str(tmp / 'sp.model')
  return path, sentencepiece.SentencePieceProcessor(model_file=path), text


def test_sentencepiece_model_loads_with_its_vocabulary_and_ids(sp_model, tmp_path):
  path, sp, _ = sp_model
  tok = tok_lib.load(path)
  assert isinstance(tok, tok_lib.SentencePieceTokenizer) and tok.name == 'sentencepiece'
  assert tok.path == os.path.abspath(path)
  assert tok.vocab_size == sp.get_piece_size() == VOCAB
  assert (tok.bos_id, tok.eos_id) == (sp.bos_id(), sp.eos_id()) == (1, 2)
  assert tok.describe() == f'sentencepiece ({tok.path}): vocab {VOCAB}, bos 1, eos 2'
  # A folder holding tokenizer.model (as a Hugging Face Llama folder does) finds it.
  shutil.copy(path, tmp_path / 'tokenizer.model')
  assert tok_lib.find(str(tmp_path)) == str(tmp_path / 'tokenizer.model')
  assert tok_lib.load(str(tmp_path)).vocab_size == VOCAB
  # A damaged .model file is bad input naming the file.
  (tmp_path / 'bad.model').write_bytes(b'not a model')
  with pytest.raises(config_lib.ConfigError, match='bad.model is not a valid SentencePiece model'):
    tok_lib.load(str(tmp_path / 'bad.model'))


def test_sentencepiece_encode_is_the_library_s_and_decode_inverts_it(sp_model):
  path, sp, text = sp_model
  tok = tok_lib.load(path)
  lines = [line for line in text.split('\n') if line]
  assert tok.encode(text) == sp.encode(text)
  assert tok.encode_batch(lines) == sp.encode(lines)
  ids = tok.encode_batch(lines)
  assert sum(map(len, ids)) < 0.8 * sum(map(len, lines))  # real subwords, not characters
  bad = [line for line, i in zip(lines, ids, strict=True) if tok.decode(i) != line]
  assert not bad, bad[:3]
  # Ids past the vocabulary (the padded rows of a model's head) are dropped, as for the others.
  assert tok.decode(ids[0] + [VOCAB, VOCAB + 55]) == lines[0]


def test_prepare_and_the_trainer_take_a_sentencepiece_model(sp_model, tmp_path):
  """`jax3d.prepare --tokenizer=X.model`: shards are BOS + sp.encode(document) + EOS of each
  training document; a run on them, or with data.tokenizer=X.model, has the model's vocabulary."""
  path, sp, _ = sp_model
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  for n in ('__init__.py', 'scanner.py', 'tool.py'):
    shutil.copy(os.path.join(STDLIB, 'json', n), corpus / n)
  out = tmp_path / 'shards'
  r = subprocess.run(
    [sys.executable, '-m', 'jax3d.prepare', '--noprogress', f'--input={corpus}', f'--out={out}']
    + [f'--tokenizer={path}', '--workers=1', '--eval_fraction=0'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert r.returncode == 0, r.stderr
  index = shards.read_index(str(out))
  assert (index['vocab_size'], index['bos_id'], index['eos_id'], index['dtype']) == (VOCAB, 1, 2, 'uint16')
  assert index['tokenizer']['path'] == os.path.abspath(path)
  want = []
  for f in documents.iter_files(str(corpus), documents.TEXT_SUFFIXES):
    want += [1] + sp.encode(open(f, encoding='utf-8').read()) + [2]
  train, _ = shards.streams(index)
  np.testing.assert_array_equal(train[0 : train.size], want)
  # The trainer's vocabulary rule: the shards' tokenizer, or data.tokenizer given directly.
  for over in ({'data.path': str(out)}, {'data.tokenizer': path}):
    cfg = assemble.resolve(config_lib.load_config('tiny', over))
    assert cfg.data.tokenizer == os.path.abspath(path) and cfg.model.vocab_size == VOCAB, over
