"""The 1F1B pipeline schedule as data: which unit of work each stage does at each tick.

A unit (i, k) is micro-batch i on virtual stage k = r*p + s (chunk r of stage s; v chunks per
stage, p stages, V = v*p virtual stages). The SPMD loop (jax3d/parallel/loop_1f1b.py) runs T ticks
in lockstep; in each tick every stage does at most one forward F(i, k) and one backward B(i, k'),
then one `ppermute` sends the forward's output to stage s+1 and one sends the backward's input
gradient to stage s-1 (both round the ring, for the chunks' wrap-around). What arrives is written
into a slot of the receiver's stash (activations) or gradient buffer, and read in a later tick.

Orders. Each stage works through its forwards and its backwards in a fixed order, Megatron-LM's
interleaved order: micro-batches in groups of p (v > 1; one group when v = 1), and within a group
the chunks depth-first: forwards chunk 0..v-1, backwards chunk v-1..0. A forward waits for its
input (k = 0: the loop's own input, always there) and for the stage's in-flight count (units
forwarded, not yet backwarded) to be under a cap W; a backward waits for its output gradient
(k = V-1: for its input; the loss is computed inside that backward, so the last virtual stage has no
forward of its own). W is the smallest cap that costs no tick over an uncapped run (`build`).

What a stage keeps: the stash holds the received inputs of its units (k > 0) from arrival until
their backward recomputes the chunk from them; k = 0 re-reads the loop's input. Its size is the
most slots any stage holds at once, measured here: min((v+1)p - 3, v*m) (`stash_slots`; for v = 1,
2p-3: stage 1 receives micro-batch i at tick i, its gradient comes back 2p-3 ticks later), under
the documented (v+1)p - 1 (tests/test_pipeline_1f1b.py checks both over p, v and m). It depends on
p and v only once m >= p, never on m: GPipe keeps the residuals of all v*m+p-1 iterations.

Ticks: T = v*m + 2(p-1) + (v-1)p (`ticks`): a warm-up of forward-only ticks, a steady phase of one
forward and one backward per tick, a cool-down of backward-only ticks, and (v-1)p more for the
chunks' wrap-around. With idle halves skipped a v = 1 step costs (m + p - 1)(F + B), as GPipe's.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

# The columns of a tick's row in `Schedule.table` ([T, p, len(COLUMNS)] int32).
COLUMNS = (
  'f_valid',  # this stage runs a forward
  'f_mb',  # its micro-batch
  'f_chunk',  # its chunk r
  'f_fresh',  # its input is the loop's own (k = 0), else stash slot f_slot
  'f_slot',
  'b_valid',  # this stage runs a backward
  'b_mb',
  'b_chunk',
  'b_first',  # k = 0: its input is the loop's own; its input gradient is an output of the loop
  'b_last',  # k = V-1: the loss of its micro-batch is computed in it
  'b_slot',  # the stash slot of its input
  'b_gslot',  # the gradient-buffer slot of its output gradient (k < V-1)
  'a_valid',  # an activation arrives at the end of the tick, into stash slot a_slot
  'a_slot',
  'g_valid',  # a gradient arrives at the end of the tick, into gradient slot g_slot
  'g_slot',
)
COL = {name: i for i, name in enumerate(COLUMNS)}


@dataclasses.dataclass(frozen=True)
class Schedule:
  p: int
  v: int
  m: int
  cap: int  # W: in-flight units per stage
  ticks: int  # T
  stash: int  # stash slots per stage (at least 1)
  grads: int  # gradient-buffer slots per stage (at least 1)
  table: np.ndarray  # [T, p, len(COLUMNS)] int32
  busy: int  # forward + backward units per stage: 2*v*m (the last stage: v*m + (v-1)*m)

  @property
  def bubble(self) -> float:
    """Idle share of the step on the busiest stage, with idle halves skipped: F and B of equal
    cost, a tick costs F where no stage has a backward, B where none has a forward."""
    return 1 - self.v * self.m / self.cost

  @property
  def cost(self) -> float:
    """The step's length in (F + B) units: each tick costs the most any stage does in it."""
    f = self.table[:, :, COL['f_valid']].any(axis=1)
    b = self.table[:, :, COL['b_valid']].any(axis=1)
    return float(np.sum(0.5 * f + 0.5 * b))


def orders(p: int, v: int, m: int, s: int) -> tuple[list, list]:
  """Stage s's forwards and backwards, in order: lists of (i, k)."""
  group = p if v > 1 else m
  groups = [range(g, min(g + group, m)) for g in range(0, m, group)]
  last = v * p - 1
  fwd = [(i, r * p + s) for g in groups for r in range(v) for i in g if r * p + s != last]
  bwd = [(i, r * p + s) for g in groups for r in reversed(range(v)) for i in g]
  return fwd, bwd


def _simulate(p: int, v: int, m: int, cap: int) -> Schedule | None:
  """The tick-by-tick run of the orders under in-flight cap `cap` (None: it stalls for good)."""
  last = v * p - 1
  f_ord, b_ord = zip(*(orders(p, v, m, s) for s in range(p)), strict=True)
  fi, bi, inflight = [0] * p, [0] * p, [0] * p
  act, grad = {}, {}  # (i, k) -> (tick it arrived, slot)
  free_a = [list(range(4 * v * p * m + 8)) for _ in range(p)]
  free_g = [list(range(4 * v * p * m + 8)) for _ in range(p)]
  rows, high_a, high_g, t = [], 1, 1, 0
  while any(bi[s] < len(b_ord[s]) for s in range(p)):
    if t > 4 * (v * m + 2 * p) + 8:
      return None
    row = np.zeros((p, len(COLUMNS)), np.int32)
    sent_a, sent_g, freed_a, freed_g = [], [], [], []
    for s in range(p):
      if bi[s] < len(b_ord[s]):
        i, k = b_ord[s][bi[s]]
        need = act.get((i, k)) if k == last else grad.get((i, k))
        if need is not None and need[0] < t:
          a_slot = act[(i, k)][1] if k > 0 else 0
          row[s, [COL['b_valid'], COL['b_mb'], COL['b_chunk'], COL['b_first'], COL['b_last']]] = (
            1,
            i,
            k // p,
            k == 0,
            k == last,
          )
          row[s, COL['b_slot']], row[s, COL['b_gslot']] = a_slot, 0 if k == last else need[1]
          if k > 0:
            freed_a.append((s, a_slot))
            sent_g.append(((s - 1) % p, (i, k - 1)))
          if k < last:
            freed_g.append((s, need[1]))
          inflight[s] -= k != last
          bi[s] += 1
      if fi[s] < len(f_ord[s]) and inflight[s] < cap:
        i, k = f_ord[s][fi[s]]
        have = act.get((i, k))
        if k == 0 or (have is not None and have[0] < t):
          row[s, [COL['f_valid'], COL['f_mb'], COL['f_chunk'], COL['f_fresh']]] = (1, i, k // p, k == 0)
          row[s, COL['f_slot']] = 0 if k == 0 else have[1]
          sent_a.append(((s + 1) % p, (i, k + 1)))
          inflight[s] += 1
          fi[s] += 1
    for s, slot in freed_a:
      free_a[s].append(slot)
    for s, slot in freed_g:
      free_g[s].append(slot)
    for s, unit in sent_a:
      free_a[s].sort()
      act[unit] = (t, free_a[s].pop(0))
      row[s, [COL['a_valid'], COL['a_slot']]] = (1, act[unit][1])
      high_a = max(high_a, act[unit][1] + 1)
    for s, unit in sent_g:
      free_g[s].sort()
      grad[unit] = (t, free_g[s].pop(0))
      row[s, [COL['g_valid'], COL['g_slot']]] = (1, grad[unit][1])
      high_g = max(high_g, grad[unit][1] + 1)
    rows.append(row)
    t += 1
  busy = 2 * v * m
  return Schedule(p, v, m, cap, t, high_a, high_g, np.stack(rows), busy)


@functools.cache
def build(p: int, v: int, m: int) -> Schedule:
  """The schedule with the smallest in-flight cap that takes no more ticks than an uncapped run."""
  if p < 2:
    raise ValueError('the 1F1B schedule needs pp >= 2')
  if v > 1 and m % p:
    raise ValueError(f'interleaved 1F1B (repeats={v}) needs microbatches divisible by pp={p}, got {m}')
  best = _simulate(p, v, m, v * m + 1)  # no cap: a stage never has more than v*m units in flight
  assert best is not None
  low, high = 1, v * m + 1  # the ticks only shrink as the cap grows: bisect for the smallest
  while low < high:
    mid = (low + high) // 2
    sched = _simulate(p, v, m, mid)
    if sched is not None and sched.ticks == best.ticks:
      high = mid
    else:
      low = mid + 1
  return _simulate(p, v, m, low)


def ticks(p: int, v: int, m: int) -> int:
  """T of `build(p, v, m)` in closed form (tests check it against the simulation): the forwards'
  v*m ticks, the warm-up and cool-down 2(p-1), and (v-1)p more for the chunks' wrap-around."""
  return v * m + 2 * (p - 1) + (v - 1) * p


def stash_slots(p: int, v: int, m: int) -> int:
  """The stash of `build(p, v, m)` in closed form: min((v+1)p - 3, v*m), at least 1."""
  return max(1, min((v + 1) * p - 3, v * m))


def stash_bound(p: int, v: int) -> int:
  """The documented bound on a stage's stash (chunk inputs kept), whatever m: (v+1)p - 1."""
  return (v + 1) * p - 1


def summary(p: int, v: int, m: int, layers_per_chunk: int, micro_batch: int, skip: bool) -> str:
  """The start-up line of a 1F1B run: schedule, ticks, bubble, stash."""
  s = build(p, v, m)
  idle = 'idle halves skipped' if skip else 'idle halves computed'
  bubble = s.bubble if skip else 1 - v * m / s.ticks
  return (
    f'  pipeline: 1f1b{" interleaved" if v > 1 else ""}, {p} stages x {v} chunk(s) of {layers_per_chunk} '
    f'layer(s), {m} micro-batches of {micro_batch} sequences, {s.ticks} ticks (warm-up, one forward '
    f'and one backward per tick, cool-down), bubble {bubble:.1%} ({idle}); stash {s.stash} chunk '
    f'inputs per stage (bound (v+1)p-1 = {stash_bound(p, v)}, whatever m); head and loss on the last stage'
  )
