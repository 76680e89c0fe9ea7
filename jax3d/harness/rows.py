"""Log-likelihood requests as documents packed into rows (data.packing 'pack'), and the per-request
sums read back from the per-token scores. Imports no jax.

A request (context tokens, continuation tokens) is the document context + continuation, its first
max_length + 1 tokens dropped when longer (lm-eval's left truncation), whose continuation tokens
are the weighted targets: slot j of the document predicts token j + 1 from tokens 0..j only
(its own segment), so a request scores the same alone in a row or packed with others. The
documents go longest first (first-fit decreasing: fuller rows) into rows of `seq_len` slots by
jax3d/data/packing.py's `Pack`; `Packed.sums` maps every slot back to its request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jax3d.data import packing


def request_document(context: Sequence[int], continuation: Sequence[int], max_length: int) -> list[int]:
  """The tokens a request is scored on: context + continuation, at most max_length + 1 of them
  (the last ones; lm-eval's `hf` model keeps the same)."""
  return (list(context) + list(continuation))[-(max_length + 1) :]


@dataclasses.dataclass
class Packed:
  """Requests packed into rows: `layout.rows(ids)` gives the step's arrays of rows `ids`; `order`
  is the request of each document (documents are sorted longest first)."""

  layout: packing.Pack
  order: np.ndarray  # document d is request order[d]
  n_requests: int

  @property
  def n_rows(self) -> int:
    return self.layout.n_rows

  @property
  def slots(self) -> int:
    """Slots holding a token (the rest is padding)."""
    return self.layout.n_slots

  def request_of_slots(self, rows: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """The request of every slot of the rows `rows` ([n, t], -1 on padding)."""
    lay = self.layout
    first = lay.row_start[np.asarray(rows)][:, None]  # each row's first piece
    piece = np.where(segment_ids > 0, first + segment_ids - 1, 0)
    return np.where(segment_ids > 0, self.order[lay.doc[piece]], -1)

  def sums(
    self, rows: np.ndarray, arrays: dict[str, np.ndarray], logp: np.ndarray, greedy: np.ndarray
  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sum of weighted log-probabilities, count of weighted non-greedy slots, count of weighted
    slots) per request, of the rows `rows` whose step arrays are `arrays` and scores logp/greedy."""
    req = self.request_of_slots(rows, arrays['segment_ids'])
    w = (arrays['weights'] > 0) & (req >= 0)
    idx = req[w]
    total = np.zeros(self.n_requests, np.float64)
    missed = np.zeros(self.n_requests, np.int64)
    counted = np.zeros(self.n_requests, np.int64)
    np.add.at(total, idx, np.asarray(logp, np.float64)[w])
    np.add.at(missed, idx, ~np.asarray(greedy)[w])
    np.add.at(counted, idx, 1)
    return total, missed, counted


def pack(requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int) -> Packed:
  """The requests (context, continuation) as documents in rows of max_length slots; the
  continuation's tokens are the weighted targets (at most max_length of them)."""
  docs, weights = [], []
  for context, continuation in requests:
    if not continuation:
      raise ValueError('a log-likelihood request with an empty continuation')
    doc = request_document(context, continuation, max_length)
    n = min(len(continuation), len(doc) - 1)
    docs.append(doc)
    weights.append([0] * (len(doc) - n) + [1] * n)
  order = np.argsort([-len(d) for d in docs], kind='stable')  # longest first
  lengths = np.array([len(docs[i]) for i in order], np.int64)
  stream = np.array([t for i in order for t in docs[i]], np.int32)
  w = np.array([x for i in order for x in weights[i]], np.uint8)
  starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  layout = packing.Pack(packing.Documents(stream, starts, w), max_length)
  return Packed(layout, order.astype(np.int64), len(docs))
