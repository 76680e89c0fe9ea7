"""Rows of documents (`data.packing`): how a split's documents become the rows of `train.seq_len`
slots that batches are made of. Imports no jax.

A document of n tokens gives n - 1 slots: slot j holds input token j, target token j + 1 and the
target's loss weight. A document's first token is never a target, and nothing after its last
token (its EOS) is predicted, so no target ever belongs to another document. A row is seq_len slots:

  concat  the slots of all documents in order, cut into rows (the last row padded): no padding, no
          token dropped. A document cut by a row edge goes on in the next row as a new segment.
  pack    whole documents placed first-fit, in document order, into the first row with room (rows
          open as needed); the rest of a row is padding. A document longer than a row is first cut
          into row-long pieces (`Layout.cut` counts such documents), each placed like a document.

Each slot of a row has inputs and targets (int32), weights (float32: the target's loss weight; 0
on padding), segment_ids (int32: 1, 2, ... for the documents, or pieces, of the row in order; 0
on padding) and positions (int32: 0 at each segment's first slot). A segment that continues a
document cut by a row edge starts at position 0 too: rotary attention depends only on position
differences inside a segment, and positions stay below seq_len.

Every target token of a split is in exactly one slot of exactly one row, in both packings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

KEYS = ('inputs', 'targets', 'weights', 'segment_ids', 'positions')
DTYPES = {'weights': np.float32}  # the others are int32


@dataclasses.dataclass
class Documents:
  """A split's token stream cut into documents: document d is tokens[starts[d]:starts[d+1]]."""

  tokens: Any  # 1-D token stream: np.ndarray, np.memmap or shards.TokenStream (read as stream[a:b])
  starts: np.ndarray  # int64 [documents + 1], the last entry the stream's size
  weights: Any = None  # per-token loss weights (a uint8 stream like `tokens`); None = 1 everywhere

  @classmethod
  def whole(cls, tokens: Any, weights: Any = None) -> Documents:
    """The stream as one document (a corpus with no boundaries)."""
    return cls(tokens, np.array([0, tokens.size], np.int64), weights)

  def slots(self) -> np.ndarray:
    """Slots of each document: its token count less one (none for an empty document)."""
    return np.maximum(np.diff(self.starts) - 1, 0)

  def read(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(tokens, weights) of stream positions a:b."""
    w = None if self.weights is None else np.asarray(self.weights[a:b])
    return np.asarray(self.tokens[a:b]), w


def one_document_rows(tokens: np.ndarray) -> dict[str, np.ndarray]:
  """The five arrays of rows that are each one whole document: `tokens` [n, seq_len + 1] (slot j:
  input j, target j + 1, weight 1, segment 1, position j). For batches built by hand (benchmarks,
  tests)."""
  n, t = tokens.shape[0], tokens.shape[1] - 1
  return {
    'inputs': tokens[:, :-1].astype(np.int32),
    'targets': tokens[:, 1:].astype(np.int32),
    'weights': np.ones((n, t), np.float32),
    'segment_ids': np.ones((n, t), np.int32),
    'positions': np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy(),
  }


def empty_rows(n: int, seq_len: int) -> dict[str, np.ndarray]:
  """`n` rows of padding (every key zero)."""
  return {k: np.zeros((n, seq_len), DTYPES.get(k, np.int32)) for k in KEYS}


class Layout:
  """The rows of one split under one packing; `rows(ids)` builds rows by their index."""

  packing = ''

  def __init__(self, docs: Documents, seq_len: int):
    self.docs, self.seq_len = docs, seq_len
    self.n_docs = len(docs.starts) - 1
    self.n_slots = int(docs.slots().sum())
    self.n_rows = 0
    self.cut = 0  # documents longer than a row

  def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The rows `ids` (row indices, any order, repeats allowed) as [len(ids), seq_len] arrays."""
    out = empty_rows(len(ids), self.seq_len)
    for i, r in enumerate(np.asarray(ids, np.int64)):
      if not 0 <= r < self.n_rows:
        raise IndexError(f'row {r} of {self.n_rows}')
      self._fill(int(r), {k: v[i] for k, v in out.items()})
    return out

  def _fill(self, r: int, row: dict[str, np.ndarray]) -> None:
    raise NotImplementedError

  def describe(self) -> str:
    """One line: the packing, rows, documents, cuts and padding."""
    pad = 1 - self.n_slots / max(self.n_rows * self.seq_len, 1)
    cut = f', {self.cut:,} longer than a row cut' if self.packing == 'pack' else ''
    return (
      f'{self.packing}: {self.n_rows:,} rows of {self.seq_len} from {self.n_docs:,} documents{cut}; '
      f'{pad:.1%} padding'
    )


class Concat(Layout):
  """concat: the documents' slots in order, cut every seq_len slots."""

  packing = 'concat'

  def __init__(self, docs: Documents, seq_len: int):
    super().__init__(docs, seq_len)
    slots = docs.slots()
    self.first = np.concatenate([[0], np.cumsum(slots)[:-1]]).astype(np.int64)  # each doc's first slot
    self.n_rows = -(-self.n_slots // seq_len)
    self.cut = int((slots > seq_len).sum())

  def _fill(self, r: int, row: dict[str, np.ndarray]) -> None:
    a = r * self.seq_len
    k = np.arange(a, min(a + self.seq_len, self.n_slots))
    d = np.searchsorted(self.first, k, side='right') - 1  # empty documents share the next one's first
    tok = self.docs.starts[d] + (k - self.first[d])  # the input's place in the stream
    lo = int(tok[0])
    tokens, weights = self.docs.read(lo, int(tok[-1]) + 2)
    n = k.size
    row['inputs'][:n] = tokens[tok - lo]
    row['targets'][:n] = tokens[tok + 1 - lo]
    row['weights'][:n] = 1.0 if weights is None else weights[tok + 1 - lo]
    row['segment_ids'][:n] = 1 + np.concatenate([[0], np.cumsum(d[1:] != d[:-1])])
    row['positions'][:n] = k - np.maximum(self.first[d], a)


class Pack(Layout):
  """pack: whole documents (row-long pieces of longer ones) first-fit into rows."""

  packing = 'pack'

  def __init__(self, docs: Documents, seq_len: int):
    super().__init__(docs, seq_len)
    slots = docs.slots()
    self.cut = int((slots > seq_len).sum())
    pieces = -(-slots // seq_len)  # per document (0 for an empty one)
    doc = np.repeat(np.arange(self.n_docs), pieces)
    first_piece = np.concatenate([[0], np.cumsum(pieces)[:-1]])
    offset = (np.arange(doc.size) - first_piece[doc]) * seq_len  # the piece's first slot in its doc
    length = np.minimum(slots[doc] - offset, seq_len)
    row = first_fit(length, seq_len)
    order = np.argsort(row, kind='stable')  # by row, each row's pieces in placement order
    self.doc, self.offset, self.length = doc[order], offset[order], length[order]
    self.n_rows = int(row.max()) + 1 if row.size else 0
    self.row_start = np.searchsorted(row[order], np.arange(self.n_rows + 1))

  def _fill(self, r: int, row: dict[str, np.ndarray]) -> None:
    t = 0
    for seg, j in enumerate(range(self.row_start[r], self.row_start[r + 1]), start=1):
      a, m = int(self.docs.starts[self.doc[j]] + self.offset[j]), int(self.length[j])
      tokens, weights = self.docs.read(a, a + m + 1)
      row['inputs'][t : t + m] = tokens[:-1]
      row['targets'][t : t + m] = tokens[1:]
      row['weights'][t : t + m] = 1.0 if weights is None else weights[1:]
      row['segment_ids'][t : t + m] = seg
      row['positions'][t : t + m] = np.arange(m)
      t += m


def first_fit(sizes: np.ndarray, capacity: int) -> np.ndarray:
  """The row of each item, in order: the first row with room for it (first-fit bin packing), in
  O(log n) per item with a max-tree over the rows' room. Every row starts with `capacity`, so the
  first row with room is an open one or, when none has, the next new one."""
  n = max(len(sizes), 1)
  size = 1 << (n - 1).bit_length()
  room = [capacity] * (2 * size)  # room[i]: the most room of any row under tree node i
  out = np.empty(len(sizes), np.int64)
  for i, s in enumerate(np.asarray(sizes).tolist()):
    node = 1
    while node < size:  # down to the leftmost row with room for s
      node = 2 * node if room[2 * node] >= s else 2 * node + 1
    out[i] = node - size
    room[node] -= s
    node //= 2
    while node:
      room[node] = max(room[2 * node], room[2 * node + 1])
      node //= 2
  return out


def layout(docs: Documents, seq_len: int, packing: str) -> Layout:
  """The rows of `docs` under `packing` ('concat' or 'pack')."""
  return {'concat': Concat, 'pack': Pack}[packing](docs, seq_len)


def resolve(packing: str, weighted: bool) -> str:
  """data.packing as used: 'auto' is 'pack' for data with loss weights (chat: one conversation per
  segment, no conversation cut unless longer than a row), else 'concat' (pre-training: no padding)."""
  if packing == 'auto':
    return 'pack' if weighted else 'concat'
  return packing
