"""The planner: every valid (dp, pp, tp, micro-batches, remat, ZeRO) layout of a config on a GPU
cluster, priced by the cost model (jax3d/planning/costmodel.py), ranked, explained (tp, then pp, then
dp, with the numbers); jax3d/planning/memory_check.py compiles the winner ahead of time.

The search follows three placement rules: tp at most the GPUs of one node (tensor parallelism
stays on NVLink), pp a divisor of what remains, dp fills the rest; every candidate is priced with
`costmodel.estimate`, so "few layers -> more tp" falls out of the bubble. `python -m jax3d.plan`
(jax3d/plan.py) prints what this module computes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import ml_collections

from jax3d.config import REMAT_POLICIES, Config, ConfigError, RunPlan, editable, set_key, validated
from jax3d.planning import costmodel
from jax3d.planning.costmodel import GB, Hardware, estimate

LAYOUT_KEYS = (
  'mesh.dp',
  'mesh.pp',
  'mesh.tp',
  'pipeline.microbatches',
  'pipeline.repeats',
  'pipeline.schedule',
  'train.remat',
  'train.shard_optimizer',
  'train.grad_accum',
  'train.shard_params',
  'train.shard_params_gather',
  'train.loss_chunks',
  'mesh.cp',
  'mesh.ep',
)
# How dp > 1 holds the training state: replicated, ZeRO-1 (Adam's moments over dp) or ZeRO-3 (the
# parameters, gradients and moments over dp; gathered once per step: 'layer' is the fallback).
ZERO = {
  'off': {'train.shard_optimizer': False, 'train.shard_params': False, 'train.shard_params_gather': 'auto'},
  'zero1': {'train.shard_optimizer': True, 'train.shard_params': False, 'train.shard_params_gather': 'auto'},
  'zero3': {'train.shard_optimizer': False, 'train.shard_params': True, 'train.shard_params_gather': 'step'},
}


@dataclasses.dataclass
class Candidate:
  overrides: dict  # the LAYOUT_KEYS values of this layout
  est: costmodel.Estimate

  @property
  def plan(self) -> RunPlan:
    return self.est.plan

  def row(self) -> dict:
    e, p = self.est, self.est.plan
    return {
      'dp': p.dp,
      'pp': p.pp,
      'tp': p.tp,
      'cp': p.cp,
      'ep': p.ep,
      'microbatches': p.microbatches,
      'repeats': p.repeats,
      'schedule': e.schedule,
      'grad_accum': p.grad_accum,
      'remat': e.remat,
      'shard_optimizer': e.shard_optimizer,
      'shard_params_gather': e.zero3,  # ZeRO-3's gather ('step', 'layer'), None without it
      'loss_chunks': e.loss_chunks,
      'memory_gb': round(e.total_bytes / GB, 3),
      'memory_breakdown_gb': {k: round(v / GB, 3) for k, v in e.breakdown.items()},
      'step_time_s': float(f'{e.step_time_s:.4g}'),
      'bubble': round(e.bubble, 4),
      'tokens_per_s': round(e.tokens_per_s),
      'mfu': round(e.mfu, 4),
      'fits': e.fits,
      'reason': e.reason,
    }


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _batch_splits(batch: int, dp: int, pp: int) -> list[tuple[int, int]]:
  """(grad_accum, micro-batches) pairs that split `batch` sequences over dp: up to 64 of each, and
  one micro-batch without a pipeline."""
  return [
    (ga, mb)
    for ga in (1, 2, 4, 8, 16, 32, 64)
    if batch % (ga * dp) == 0
    for mb in ([1] if pp == 1 else _divisors(batch // (ga * dp)))
    if mb <= 64
  ]


def layouts(
  cfg: Config | ml_collections.ConfigDict,
  hw: Hardware,
  policies: Sequence[str] = REMAT_POLICIES,
  cps: Sequence[int] | None = None,
) -> Iterator[tuple[dict, RunPlan, Config]]:
  """Every layout the rules allow that config.validate accepts: (overrides, plan, config) triples,
  with the state replicated over dp (ZERO['off']; `search` tries the others), mesh.cp among `cps`
  (None: all the rules allow), and for a mixture of experts mesh.ep (`_inner`). The configs are
  typed, made from one working copy of `cfg` set to each layout's values in turn."""
  n, m = hw.n_devices, cfg.model
  work = editable(cfg)
  for tp, cp, ep in [(t, c, e) for t, c, e in _inner(hw, cfg) if cps is None or c in cps]:
    inner = tp * cp * ep
    for pp in [p for p in _divisors(n // inner) if m.n_layers % p == 0]:  # rule: pp divides the rest
      dp = n // (inner * pp)  # rule: dp fills the rest
      for ga, mb in _batch_splits(cfg.train.global_batch_size, dp * ep, pp):  # rows over dp, then ep
        reps = [1] + ([r for r in _divisors(m.n_layers // pp) if 1 < r <= 8] if mb >= pp > 1 else [])
        for v in reps:
          for remat in policies:
            schedule = 'circular' if v > 1 else 'gpipe'
            o = dict(zip(LAYOUT_KEYS, (dp, pp, tp, mb, v, schedule, remat), strict=False))
            o |= {'train.grad_accum': ga, 'train.loss_chunks': cfg.train.loss_chunks, 'mesh.cp': cp}
            o |= ZERO['off'] | {'mesh.ep': ep}
            for k, val in o.items():
              set_key(work, k, val)
            try:
              c, plan = validated(work, n)
              yield o, plan, c
            except ConfigError:
              continue


def _inner(hw: Hardware, cfg: Config | ml_collections.ConfigDict) -> list[tuple[int, int, int]]:
  """(tp, cp, ep) triples inside a node (jax3d/parallel/mesh.py): `_tp_cp`'s with ep = 1, and for
  a mixture of experts (moe.num_experts > 0) each divisor ep > 1 of the experts with tp*ep dividing
  the GPUs of a node (the experts' all-to-all on NVLink; ep ranks are dp ranks outside the experts)
  and no cp (ep with cp is not built)."""
  out = [(tp, cp, 1) for tp, cp in _tp_cp(hw, cfg.train.seq_len)]
  experts, per = cfg.moe.num_experts, hw.gpus_per_node
  if experts:
    tps = [tp for tp, cp, _ in out if cp == 1]
    out += [
      (tp, 1, ep)
      for tp in tps
      for ep in _divisors(per // tp)[1:]
      if experts % ep == 0 and per % (tp * ep) == 0
    ]
  return out


def _tp_cp(hw: Hardware, seq_len: int) -> list[tuple[int, int]]:
  """(tp, cp) pairs by the rules: tp <= GPUs per node; cp next inside the node (tp*cp <= GPUs per
  node: its K/V gathers are the heaviest traffic after tp's), each row splitting into 2*cp chunks
  (seq_len divisible by 2*cp, train.seq_len's rule)."""
  per, n = hw.gpus_per_node, hw.n_devices
  return [
    (tp, cp)
    for tp in _divisors(per)
    for cp in _divisors(per // tp)
    if n % (tp * cp) == 0 and seq_len % (2 * cp if cp > 1 else 1) == 0
  ]


def more_loss_chunks(seq: int, now: int) -> int | None:
  """The head and loss in 8 times as many pieces as `now` where seq_len has such a divisor, else
  the most it has (None: already one position each)."""
  more = [d for d in range(now + 1, seq + 1) if seq % d == 0]
  return next((d for d in more if d >= 8 * now), more[-1]) if more else None


def _savings(
  o: dict, cfg: Config, hw: Hardware, est: costmodel.Estimate, zero: Sequence[str]
) -> list[Candidate]:
  """The variants of a layout that does not fit, each on top of the one before, priced until one
  fits (each saves memory and is no faster, so the first that fits is the one to take): with
  dp > 1 the `zero` ones in order (ZeRO-1, then ZeRO-3 gathering once per step); the head and loss
  in pieces where the head's fp32 logits outweigh the layers' activations (`more_loss_chunks`);
  then, under ZeRO-3, the 'layer' gather (one layer's weights and gradient whole at a time instead
  of the stage's, for a gather and a reduce-scatter per use of each layer)."""
  steps = [ZERO[z] for z in zero if z != 'off' and est.plan.zero_ranks > 1]
  if est.breakdown['head'] > est.breakdown['activations']:
    chunks = more_loss_chunks(est.plan.seq_len, cfg.train.loss_chunks)
    steps += [{'train.loss_chunks': chunks}] if chunks else []
  if 'zero3' in zero and est.plan.zero_ranks > 1:
    steps.append({'train.shard_params_gather': 'layer'})
  out, over = [], dict(o)
  for step in steps:
    try:
      c, plan = validated(with_overrides(cfg, over | step), hw.n_devices)
    except ConfigError:  # (the 'layer' gather with bf16 reductions): the variants so far
      break
    over |= step
    out.append(Candidate(dict(over), estimate(c, plan, hw.memory_gb * GB, hw)))
    if out[-1].est.fits:
      break
  return out


def _one_f_one_b(o: dict, cfg: Config, hw: Hardware) -> Candidate | None:
  """The 1F1B variant of a pipelined layout GPipe does not fit (`search`), priced; None where it is
  not valid. Its activations do not grow with the micro-batches, so it fits where GPipe does not,
  or with more micro-batches (a smaller bubble); where GPipe fits it is no faster (each backward
  recomputes its chunk, and accelerators compute the idle halves of its ticks), so it is not priced."""
  o = o | {'pipeline.schedule': '1f1b'}
  try:
    c, plan = validated(with_overrides(cfg, o), hw.n_devices)
  except ConfigError:
    return None
  return Candidate(o, estimate(c, plan, hw.memory_gb * GB, hw))


# From this many tokens per row the sequence split over cp is searched even where layouts without it
# fit (below, only where none does and it may make one fit, `_cp_may_fit`): it multiplies the
# layouts to price by up to 2.5 on a node of 8.
LONG_SEQ = 16384


def search(
  cfg: Config | ml_collections.ConfigDict,
  hw: Hardware,
  policies: Sequence[str] = REMAT_POLICIES,
  zero: Sequence[str] = tuple(ZERO),
  cps: Sequence[int] | None = None,
) -> list[Candidate]:
  """All valid layouts (`layouts`, narrowed to the remat `policies`), priced; fitting ones first,
  fastest first (ties: more tp, less pp, less cp, less ep). For a layout that does not fit, its
  memory-saving variants until one fits (`_savings`: the `zero` ways to hold the state over dp,
  loss chunks, ZeRO-3's 'layer' gather), and for a pipelined one the 1F1B variant. mesh.cp among
  `cps`; None: 1, and the rest where a row has LONG_SEQ tokens or more, or no layout with cp=1
  fits and splitting the sequence may make one fit."""
  out = _priced(cfg, hw, policies, zero, (1,) if cps is None else cps)
  if cps is None and (cfg.train.seq_len >= LONG_SEQ or _cp_may_fit(out, hw)):
    out += _priced(cfg, hw, policies, zero, range(2, hw.gpus_per_node + 1))
  if not out:
    m = cfg.model
    raise ConfigError(
      f'{hw.nodes} x {hw.gpus_per_node} GPUs: no layout is valid for n_layers='
      f'{m.n_layers}, n_heads={m.n_heads}, n_kv_heads={m.n_kv_heads}, global_batch_size='
      f'{cfg.train.global_batch_size} (tp must divide the heads and pp the layers, '
      f'dp the batch); use fewer GPUs or divisible sizes'
    )
  out.sort(
    key=lambda c: (
      not c.est.fits,
      c.est.step_time_s if c.est.fits else c.est.total_bytes,
      -c.plan.tp,
      c.plan.pp,
      c.plan.cp,
      c.plan.ep,
      c.est.total_bytes,
    )
  )
  return out


def _cp_may_fit(ranked: list[Candidate], hw: Hardware) -> bool:
  """Whether none of `ranked` (layouts without cp) fits, and splitting the sequence over a node's
  GPUs may make one: none is valid, or the least memory of them, less all but 1/c of its
  activations and head (what cp divides), is within a GPU's memory."""
  if not ranked:
    return True
  if any(c.est.fits for c in ranked):
    return False
  least = min(ranked, key=lambda c: c.est.total_bytes).est
  split = (least.breakdown['activations'] + least.breakdown['head']) * (1 - 1 / hw.gpus_per_node)
  return least.total_bytes - split <= hw.memory_gb * GB


def _priced(
  cfg: Config | ml_collections.ConfigDict,
  hw: Hardware,
  policies: Sequence[str],
  zero: Sequence[str],
  cps: Sequence[int],
) -> list[Candidate]:
  """The layouts with mesh.cp among `cps`, priced, with their variants (`search`)."""
  out = []
  for o, plan, c in layouts(cfg, hw, policies, cps):
    out.append(Candidate(o, estimate(c, plan, hw.memory_gb * GB, hw)))
    if not out[-1].est.fits:
      out += _savings(o, c, hw, out[-1].est, zero)
    if plan.pp > 1 and not out[-1].est.fits and (alt := _one_f_one_b(out[-1].overrides, c, hw)) is not None:
      out.append(alt)
  return out


def with_overrides(cfg: Config | ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
  """A copy of cfg with `overrides` ({dotted key: value}) set, as a ConfigDict (cfg itself is left as
  it is); `config.validated` makes it typed."""
  cfg = editable(cfg)
  for k, v in overrides.items():
    set_key(cfg, k, v)
  return cfg


SAVINGS = ('train.shard_optimizer', 'train.shard_params', 'train.shard_params_gather', 'train.loss_chunks')


def shortlist(ranked: list[Candidate], top: int) -> list[Candidate]:
  """The first `top` fitting layouts, one row per layout: of its variants that only save memory
  (ZeRO-1, ZeRO-3, loss chunks) the first in the ranking (the faster, or the smaller)."""
  fit, shown = [], set()
  for c in ranked:
    key = tuple(v for k, v in c.overrides.items() if k not in SAVINGS)
    if c.est.fits and key not in shown and len(fit) < top:
      shown.add(key)
      fit.append(c)
  return fit


def table(cands: list[Candidate]) -> list[str]:
  """The candidates as a text table, one numbered line each under a header line."""
  head = (
    f'{"#":>3} {"dp":>4} {"pp":>3} {"tp":>3} {"cp":>3} {"ep":>3} {"m":>4} {"v":>2} {"sched":>5} {"ga":>3} {"remat":>5} {"zero":>7} {"lc":>3} '
    f'{"GB/GPU":>7} {"step s":>8} {"bubble":>6} {"tokens/s":>10} {"MFU":>5}'
  )
  lines = [head]
  for i, c in enumerate(cands, 1):
    r = c.row()
    lines.append(
      f'{i:>3} {r["dp"]:>4} {r["pp"]:>3} {r["tp"]:>3} {r["cp"]:>3} {r["ep"]:>3} '
      f'{r["microbatches"]:>4} '
      f'{r["repeats"]:>2} {r["schedule"]:>5} {r["grad_accum"]:>3} {r["remat"]:>5} '
      f'{_zero(r):>7} {r["loss_chunks"]:>3} '
      f'{r["memory_gb"]:>7.1f} {r["step_time_s"]:>8.3g} {r["bubble"]:>6.1%} '
      f'{r["tokens_per_s"]:>10,} {r["mfu"]:>5.1%}'
    )
  return lines


def _zero(row: dict) -> str:
  """The table's ZeRO column: '-', '1' (ZeRO-1), '3/step' or '3/layer' (ZeRO-3 and its gather)."""
  if row['shard_params_gather']:
    return f'3/{row["shard_params_gather"]}'
  return '1' if row['shard_optimizer'] else '-'
