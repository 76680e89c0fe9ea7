"""data.packing on hand-built documents (jax3d/data/packing.py): every array of concat and pack
rows written out by hand, weights from the target tokens, documents longer than a row cut and
counted, first-fit against a direct implementation, and the document boundaries of token shards
(recorded, or recovered at EOS for shards written before they were)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jax3d.config import ConfigError
from jax3d.data import packing, shards

# Documents A = tokens 0..4, B = 5 (one token: no target), C = 6..12, D = 13..19; token i is id i.
STARTS = np.array([0, 5, 6, 13, 20], np.int64)
W = np.array([0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1], np.uint8)  # chat-like


def _rows(how, seq_len, weights=W):
  lay = packing.layout(packing.Documents(np.arange(20, dtype=np.uint16), STARTS, weights), seq_len, how)
  return lay, lay.rows(np.arange(lay.n_rows))


def _check(rows, want):
  for k, v in want.items():
    np.testing.assert_array_equal(rows[k], np.array(v), err_msg=k)
    assert rows[k].dtype == (np.float32 if k == 'weights' else np.int32), k


def test_concat_rows_by_hand():
  lay, rows = _rows('concat', 8)
  assert (lay.n_rows, lay.n_slots, lay.n_docs) == (2, 16, 4)
  _check(
    rows,
    {
      'inputs': [[0, 1, 2, 3, 6, 7, 8, 9], [10, 11, 13, 14, 15, 16, 17, 18]],
      'targets': [[1, 2, 3, 4, 7, 8, 9, 10], [11, 12, 14, 15, 16, 17, 18, 19]],
      'segment_ids': [[1, 1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 2, 2, 2, 2]],
      'positions': [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5]],
      'weights': [[0, 1, 1, 1, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]],
    },
  )
  _, plain = _rows('concat', 8, weights=None)
  assert (plain['weights'] == 1).all()  # plain text: weight 1 everywhere


def test_concat_pads_the_last_row():
  lay, rows = _rows('concat', 6)  # 16 slots: rows of 6, 6 and 4 + 2 padding
  assert lay.n_rows == 3
  _check(
    {k: v[2] for k, v in rows.items()},
    {
      'inputs': [15, 16, 17, 18, 0, 0],
      'targets': [16, 17, 18, 19, 0, 0],
      'segment_ids': [1, 1, 1, 1, 0, 0],
      'positions': [0, 1, 2, 3, 0, 0],
      'weights': [1, 1, 1, 1, 0, 0],
    },
  )


def test_pack_rows_by_hand():
  lay, rows = _rows('pack', 8)  # A (4 slots) in row 0; C (6) does not fit its room 4: row 1; D: row 2
  assert (lay.n_rows, lay.cut) == (3, 0)
  _check(
    rows,
    {
      'inputs': [[0, 1, 2, 3, 0, 0, 0, 0], [6, 7, 8, 9, 10, 11, 0, 0], [13, 14, 15, 16, 17, 18, 0, 0]],
      'targets': [[1, 2, 3, 4, 0, 0, 0, 0], [7, 8, 9, 10, 11, 12, 0, 0], [14, 15, 16, 17, 18, 19, 0, 0]],
      'segment_ids': [[1, 1, 1, 1, 0, 0, 0, 0], [1] * 6 + [0, 0], [1] * 6 + [0, 0]],
      'positions': [[0, 1, 2, 3, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5, 0, 0], [0, 1, 2, 3, 4, 5, 0, 0]],
      'weights': [[0, 1, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0], [1] * 6 + [0, 0]],
    },
  )
  assert lay.describe() == 'pack: 3 rows of 8 from 4 documents, 0 longer than a row cut; 33.3% padding'


def test_pack_cuts_documents_longer_than_a_row_and_fills_earlier_rows_first():
  """Rows of 4: A fills row 0; C is cut into 4 + 2 (rows 1 and 2), D into 4 + 2 (row 3, and its
  tail first-fit into the room left in row 2)."""
  lay, rows = _rows('pack', 4)
  assert (lay.n_rows, lay.cut) == (4, 2) and '2 longer than a row cut' in lay.describe()
  _check(
    {k: v[2] for k, v in rows.items()},
    {
      'inputs': [10, 11, 17, 18],
      'targets': [11, 12, 18, 19],
      'segment_ids': [1, 1, 2, 2],
      'positions': [0, 1, 0, 1],
      'weights': [0, 0, 1, 1],
    },
  )
  np.testing.assert_array_equal(rows['inputs'][3], [13, 14, 15, 16])


def test_first_fit_is_first_fit():
  sizes = np.random.default_rng(0).integers(1, 17, 500)
  want, room = [], []
  for s in sizes:  # the plain O(n^2) definition
    row = next((i for i, r in enumerate(room) if r >= s), len(room))
    if row == len(room):
      room.append(16)
    room[row] -= s
    want.append(row)
  np.testing.assert_array_equal(packing.first_fit(sizes, 16), want)


def _write_shards(folder, tokens, entry):
  arr = np.asarray(tokens, np.uint16)
  arr.tofile(folder / 'train-00000.bin')
  index = {
    'format': shards.FORMAT,
    'dtype': 'uint16',
    'vocab_size': 100,
    'eos_id': 0,
    'train': [{'file': 'train-00000.bin', 'tokens': int(arr.size), **entry}],
    'val': [],
  }
  (folder / 'index.json').write_text(json.dumps(index))
  return index


def test_shards_without_boundaries_split_at_eos_or_are_one_document(tmp_path):
  """Shards from before boundaries were recorded: documents end at each EOS (0 here); without an
  EOS id, the shard is one document."""
  _write_shards(tmp_path, [5, 6, 0, 7, 0, 8, 9, 0], {})
  index = shards.read_index(str(tmp_path))
  starts, weights = shards.documents(index, 'train')
  np.testing.assert_array_equal(starts, [0, 3, 5, 8])
  assert weights is None
  index['eos_id'] = None
  np.testing.assert_array_equal(shards.documents(index, 'train')[0], [0, 8])


def test_recorded_boundaries_and_weights_that_disagree_are_refused(tmp_path):
  np.array([0, 3], '<i8').tofile(tmp_path / 'train-00000.starts.bin')
  np.ones(8, np.uint8).tofile(tmp_path / 'train-00000.weights.bin')
  entry = {'documents': 2, 'starts': 'train-00000.starts.bin', 'weights': 'train-00000.weights.bin'}
  _write_shards(tmp_path, [5, 6, 1, 7, 1, 8, 9, 1], entry)
  index = shards.read_index(str(tmp_path))
  starts, weights = shards.documents(index, 'train')
  np.testing.assert_array_equal(starts, [0, 3, 8])  # recorded: not split at EOS
  assert shards.weighted(index) and weights[0:8].tolist() == [1] * 8
  np.ones(7, np.uint8).tofile(tmp_path / 'train-00000.weights.bin')
  with pytest.raises(ConfigError, match=r'train-00000.weights.bin has 7 bytes .* disagree'):
    shards.read_index(str(tmp_path))
