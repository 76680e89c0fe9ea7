"""The 1F1B timetable (pipeline.schedule='1f1b'): which unit of work each stage does at each tick.

A unit (i, k) is micro-batch i on virtual stage k = r*p + s (chunk r of stage s; v chunks per
stage, p stages, V = v*p virtual stages). The SPMD loop (one_f_one_b.py) runs T ticks
in lockstep; in each tick every stage does at most one forward F(i, k) and one backward B(i, k'),
then one `ppermute` sends the forward's output to stage s+1 and one sends the backward's input
gradient to stage s-1 (both round the ring, for the chunks' wrap-around). What arrives is written
into a slot of the receiver's stash (activations) or gradient buffer, and read in a later tick.

Orders. Each stage works through its forwards and its backwards in a fixed order, Megatron-LM's
interleaved order: micro-batches in groups of p (v > 1; one group when v = 1), and within a group
the chunks depth-first: forwards chunk 0..v-1, backwards chunk v-1..0. A forward waits for its
input (k = 0: the loop's own input, always there) and for the stage's in-flight count (units
forwarded, not yet backwarded) to be under a cap W; a backward waits for its output gradient. The
last virtual stage (k = V-1) has a forward of its own, whose output goes to the head and the loss
(split over pp, in the same tick); their gradient is its output gradient, so its backward can run
the next tick. W is the smallest cap that costs no tick over an uncapped run (`build`).

What a stage keeps: the VJP residuals of each unit from its forward to its backward, in residual
slots: min((v+1)p - 1, v*m) (`residual_slots`, the most units in flight; checked against the
simulation over p, v and m in tests/test_pipeline_1f1b.py), which stops growing at m = 2p where
GPipe keeps the residuals of all v*m+p-1 iterations. An arriving activation or gradient is read
the tick after it arrives: one stash slot and one gradient slot.

Ticks: T = v*m + 2p - 1 + (v-1)p (`ticks`): a warm-up of forward-only ticks, a steady phase of one
forward and one backward per tick, a cool-down of backward-only ticks, and (v-1)p more for the
chunks' wrap-around. Some stage forwards in v*m + p - 1 of them and some stage backwards in
v*m + p - 1 (`Timetable.phases`): GPipe's iteration count, what the loop computes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from jax3d.config import RunPlan

# The columns of a tick's row in `Timetable.table` ([T, p, len(COLUMNS)] int32).
COLUMNS = (
  'f_valid',  # this stage runs a forward
  'f_mb',  # its micro-batch
  'f_chunk',  # its chunk r
  'f_fresh',  # k = 0: its input is the loop's own, else stash slot f_slot
  'f_slot',
  'f_last',  # k = V-1: its output goes to the head, whose gradient is written into gradient slot h_gslot
  'f_rslot',  # the residual slot its VJP residuals are written into
  'h_gslot',
  'b_valid',  # this stage runs a backward
  'b_mb',
  'b_chunk',
  'b_first',  # k = 0: its input gradient is an output of the loop
  'b_rslot',  # the residual slot of its forward
  'b_gslot',  # the gradient-buffer slot of its output gradient
  'a_valid',  # an activation arrives at the end of the tick, into stash slot a_slot
  'a_slot',
  'g_valid',  # a gradient arrives at the end of the tick, into gradient slot g_slot
  'g_slot',
)
COL = {name: i for i, name in enumerate(COLUMNS)}


def in_loop_loss(schedule: str, plan: RunPlan) -> bool:
  """Whether the step computes its loss inside the loop under this timetable (pipeline.schedule
  ='1f1b' with stages: run_1f1b.loss) rather than with the head after the layers (run_gpipe.apply)."""
  return schedule == '1f1b' and plan.pp > 1


class _Slots:
  """A stage's slots of one buffer: the lowest free one is taken; the most ever held is `high`."""

  def __init__(self) -> None:
    self.free, self.high = [], 0

  def take(self) -> int:
    if not self.free:
      self.free.append(self.high)
      self.high += 1
    self.free.sort()
    return self.free.pop(0)

  def give(self, slot: int) -> None:
    self.free.append(slot)


@dataclasses.dataclass(frozen=True)
class Timetable:
  p: int
  v: int
  m: int
  cap: int  # W: in-flight units per stage (forwarded, not yet backwarded)
  ticks: int  # T
  stash: int  # stash slots per stage (at least 1)
  grads: int  # gradient-buffer slots per stage (at least 1)
  residuals: int  # residual slots per stage: the most units in flight on any stage
  table: np.ndarray  # [T, p, len(COLUMNS)] int32

  @property
  def phases(self) -> np.ndarray:
    """[T, 3] bool: whether some stage runs a forward, a backward, the head, in each tick (the
    same on every stage: what the loop computes in that tick on the accelerator path)."""
    t = self.table
    head = (t[:, :, COL['f_valid']] & t[:, :, COL['f_last']]).any(axis=1)
    return np.stack([t[:, :, COL['f_valid']].any(axis=1), t[:, :, COL['b_valid']].any(axis=1), head], 1)

  @property
  def cost(self) -> float:
    """The step's length in (F + B) units, with idle halves skipped: each tick costs the most any
    stage does in it (F and B of equal cost)."""
    f, b, _ = self.phases.T
    return float(np.sum(0.5 * f + 0.5 * b))

  @property
  def bubble(self) -> float:
    """Idle share of the step on the busiest stage, with idle halves skipped."""
    return 1 - self.v * self.m / self.cost


def orders(p: int, v: int, m: int, s: int) -> tuple[list, list]:
  """Stage s's forwards and backwards, in order: lists of (i, k)."""
  group = p if v > 1 else m
  groups = [range(g, min(g + group, m)) for g in range(0, m, group)]
  fwd = [(i, r * p + s) for g in groups for r in range(v) for i in g]
  bwd = [(i, r * p + s) for g in groups for r in reversed(range(v)) for i in g]
  return fwd, bwd


def _simulate(p: int, v: int, m: int, cap: int) -> Timetable | None:
  """The tick-by-tick run of the orders under in-flight cap `cap` (None: it stalls for good)."""
  last = v * p - 1
  f_ord, b_ord = zip(*(orders(p, v, m, s) for s in range(p)), strict=True)
  fi, bi = [0] * p, [0] * p
  stash, grads, res = ([_Slots() for _ in range(p)] for _ in range(3))
  act, grad, rslot = {}, {}, {}  # (i, k) -> (tick it arrived, slot); (i, k) -> residual slot
  rows, t = [], 0
  while any(bi[s] < len(b_ord[s]) for s in range(p)):
    if t > 4 * (v * m + 2 * p) + 8:
      return None
    row = np.zeros((p, len(COLUMNS)), np.int32)
    sent_a, sent_g, freed_a, freed_g = [], [], [], []
    for s in range(p):
      if bi[s] < len(b_ord[s]):  # the backward first: its residual slot is free for the forward
        i, k = b_ord[s][bi[s]]
        need = grad.get((i, k))
        if need is not None and need[0] < t:
          slot = rslot.pop((i, k))
          cols = ('b_valid', 'b_mb', 'b_chunk', 'b_first', 'b_rslot', 'b_gslot')
          row[s, [COL[c] for c in cols]] = (1, i, k // p, k == 0, slot, need[1])
          res[s].give(slot)
          freed_g.append((s, need[1]))
          if k > 0:
            sent_g.append(((s - 1) % p, (i, k - 1)))
          bi[s] += 1
      if fi[s] < len(f_ord[s]) and fi[s] - bi[s] < cap:
        i, k = f_ord[s][fi[s]]
        have = act.get((i, k))
        if k == 0 or (have is not None and have[0] < t):
          rslot[(i, k)] = res[s].take()
          cols = ('f_valid', 'f_mb', 'f_chunk', 'f_fresh', 'f_last', 'f_rslot')
          row[s, [COL[c] for c in cols]] = (1, i, k // p, k == 0, k == last, rslot[(i, k)])
          if k > 0:
            row[s, COL['f_slot']] = have[1]
            freed_a.append((s, have[1]))
          if k == last:  # the head's gradient of y: this unit's output gradient
            sent_g.append((s, (i, k)))
          else:
            sent_a.append(((s + 1) % p, (i, k + 1)))
          fi[s] += 1
    for s, slot in freed_a:
      stash[s].give(slot)
    for s, slot in freed_g:
      grads[s].give(slot)
    for s, unit in sent_a:
      act[unit] = (t, stash[s].take())
      row[s, [COL['a_valid'], COL['a_slot']]] = (1, act[unit][1])
    for s, unit in sent_g:
      grad[unit] = (t, grads[s].take())
      name = 'h_gslot' if unit[1] == last else 'g_slot'
      row[s, COL[name]] = grad[unit][1]
      if name == 'g_slot':
        row[s, COL['g_valid']] = 1
    rows.append(row)
    t += 1
  high = lambda slots: max(1, *(x.high for x in slots))
  return Timetable(p, v, m, cap, t, high(stash), high(grads), high(res), np.stack(rows))


@functools.cache
def build(p: int, v: int, m: int) -> Timetable:
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
    tt = _simulate(p, v, m, mid)
    if tt is not None and tt.ticks == best.ticks:
      high = mid
    else:
      low = mid + 1
  return _simulate(p, v, m, low)


def ticks(p: int, v: int, m: int) -> int:
  """T of `build(p, v, m)` in closed form (tests check it against the simulation): the forwards'
  v*m ticks, the warm-up and cool-down 2p - 1 (the last stage's forward and backward of a
  micro-batch are two ticks), and (v-1)p more for the chunks' wrap-around."""
  return v * m + 2 * p - 1 + (v - 1) * p


def residual_slots(p: int, v: int, m: int) -> int:
  """The residual slots of `build(p, v, m)` in closed form: min((v+1)p - 1, v*m), the most units a
  stage has forwarded and not yet backwarded. For v = 1, 2p - 1: stage 0's first micro-batch
  reaches the last stage after p - 1 ticks, its gradient comes back p ticks later, and stage 0
  forwards one micro-batch per tick meanwhile."""
  return min((v + 1) * p - 1, v * m)


def summary(p: int, v: int, m: int, layers_per_chunk: int, micro_batch: int, skip: bool) -> str:
  """The start-up line of a 1F1B run: schedule, ticks, bubble, residual slots."""
  s = build(p, v, m)
  idle = 'idle halves skipped' if skip else 'idle phases not computed'
  return (
    f'  pipeline: 1f1b{" interleaved" if v > 1 else ""}, {p} stages x {v} chunk(s) of {layers_per_chunk} '
    f'layer(s), {m} micro-batches of {micro_batch} sequences, {s.ticks} ticks (warm-up, one forward '
    f'and one backward per tick, cool-down), bubble {s.bubble:.1%} ({idle}); the VJP residuals of '
    f'{s.residuals} chunks per stage (min((v+1)p-1, v*m), whatever m beyond); the head split over pp'
  )
