"""Why the planner's winner (jax3d/planning/planner.py `search`): tp first (fill a node), cp where
the sequence is split, ep for a mixture of experts, then pp, then dp, with the numbers `python -m
jax3d.plan` prints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jax3d.planning import costmodel
from jax3d.planning.costmodel import GB, Hardware
from jax3d.planning.planner import Candidate

if TYPE_CHECKING:
  from jax3d.config import Config


def explain(cfg: Config, best: Candidate, ranked: list[Candidate], hw: Hardware) -> list[str]:
  """Why the winner: tp first (fill a node), then pp (a divisor of the rest), then dp = N/(tp*pp),
  its memory, and what the best layout with less tp would cost."""
  p, e, m, n = best.plan, best.est, cfg.model, hw.n_devices
  inner = p.tp * p.cp * p.ep  # what pp and dp divide
  split = 'cp' if p.cp > 1 else 'ep' if p.ep > 1 else ''
  tc = f'{p.tp}*{p.cp * p.ep}' if split else f'{p.tp}'
  tcn = f'tp*{split}' if split else 'tp'
  where = 'on NVLink inside one node' if p.tp <= hw.gpus_per_node else 'ACROSS nodes'
  weights = costmodel.param_count(cfg) * costmodel.BYTES[cfg.train.param_dtype] * 4
  what = 'weights, gradients and Adam state'
  if cfg.lora.rank:  # LoRA: the base alone in its dtype (the adapters and their state are small)
    weights = costmodel.param_count(cfg) * costmodel.BYTES[cfg.lora.base_dtype or cfg.train.param_dtype]
    what = "the frozen base (LoRA: the adapters' gradients and Adam state are small)"
  lines = [
    f'Why dp={p.dp}, pp={p.pp}, tp={p.tp}{f", cp={p.cp}" if p.cp > 1 else ""} (the tutorial: fill a node with tp, give the rest to pp, fill with dp):',
    f'  tp = {p.tp}: at most the {hw.gpus_per_node} GPUs per node, so its 4 all-reduces per layer '
    f"stay {where}; each GPU holds 1/{p.tp} of every layer's width "
    f'({m.n_heads // p.tp} of {m.n_heads} heads, {m.d_ff // p.tp} of {m.d_ff} ffw units).',
    f'  pp = {p.pp}: a divisor of the {n}/{f"({tc})" if split else tc} = {n // inner} GPUs that remain'
    f'{" (across nodes)" if inner * p.pp > hw.gpus_per_node else ""}; {m.n_layers} layers -> '
    f'{m.n_layers // p.pp} per stage; bubble (p-1)/(v*m+p-1) = {p.pp - 1}/({p.repeats}*'
    f'{p.microbatches}+{p.pp - 1}) = {p.bubble:.1%}.',
    f'  dp = {n}/({tcn}*pp) = {n}/({tc}*{p.pp}) = {p.dp} fills the rest: each replica takes '
    f'{p.global_batch // p.dp} of the {p.global_batch} sequences per step.',
    f'  Memory: {what} ({weights / GB:.0f} GB in all) over tp*pp = '
    f'{p.tp * p.pp} shards{f" (the experts over tp*pp*ep = {p.tp * p.pp * p.ep})" if p.ep > 1 else ""}'
    f'{_over_dp(e)}, activations with remat={e.remat}'
    f'{f", the head and loss in {e.loss_chunks} pieces" if e.loss_chunks > 1 else ""}: '
    f'{e.total_bytes / GB:.1f} of {hw.memory_gb:g} GB.',
  ]
  if p.cp > 1:
    lines.insert(2, _cp_line(cfg, best, ranked, hw))
  if cfg.moe.num_experts:
    lines.insert(2, _ep_line(cfg, best, ranked))
  # "Few layers -> more tp": the best layout with less tp (hence more pp or dp) for comparison.
  alt = next((c for c in ranked if c.est.fits and c.plan.tp < p.tp), None)
  if alt is not None:
    a = alt.plan
    lines.append(
      f'  Less tp costs more: the best with tp={a.tp} (dp={a.dp}, pp={a.pp}, bubble '
      f'{a.bubble:.1%}) runs {alt.est.step_time_s / e.step_time_s - 1:.0%} slower; with '
      f'{m.n_layers} layers, depth bought with pp pays a bubble, width bought with tp does not.'
    )
  return lines


def _cp_line(cfg: Config, best: Candidate, ranked: list[Candidate], hw: Hardware) -> str:
  """Why cp > 1, for `explain`: each GPU's share of the sequence, and what the best fitting layout
  without cp would need (nothing fits without it, or it is slower)."""
  p, e = best.plan, best.est
  alt = next((c for c in ranked if c.plan.cp == 1), None)
  if alt is None:
    why = 'no layout without it is valid'
  elif not alt.est.fits:
    why = f'the best without it needs {alt.est.total_bytes / GB:.1f} GB per GPU: it does not fit'
  else:
    why = f'the best without it runs {alt.est.step_time_s / e.step_time_s - 1:.0%} slower'

  return (
    f'  cp = {p.cp}: each sequence of {p.seq_len} tokens split over {p.cp} GPUs of a node '
    f'({p.seq_len // p.cp} each: activations 1/{p.cp}), K and V all-gathered per layer '
    f'({e.times["cp"]:.3g} s of traffic per step); {why}.'
  )


def _ep_line(cfg: Config, best: Candidate, ranked: list[Candidate]) -> str:
  """For a mixture of experts, for `explain`: why ep (each GPU's experts, the all-to-alls' time, what
  the best fitting layout without it would need), or why not (what the best with it costs)."""
  p, e, experts = best.plan, best.est, cfg.moe.num_experts
  other = next((c for c in ranked if (c.plan.ep > 1) != (p.ep > 1)), None)
  if other is None:
    why = 'no layout with ep > 1 is valid' if p.ep == 1 else 'no layout without it is valid'
  elif not other.est.fits:
    why = (
      f'the best {"with" if p.ep == 1 else "without"} it needs {other.est.total_bytes / GB:.1f} GB per GPU'
    )
  else:
    slower = other.est.step_time_s / e.step_time_s - 1
    why = (
      f'the best {"with ep=" + str(other.plan.ep) if p.ep == 1 else "without it"} runs {slower:.0%} slower'
    )
  if p.ep == 1:
    return f'  ep = 1: each GPU holds all {experts} experts of its layers (no all-to-all); {why}.'
  return (
    f'  ep = {p.ep}: the {experts} experts of each layer split over {p.ep} GPUs of a node beside tp '
    f'({experts // p.ep} each), data parallel outside the experts (each takes 1/{p.ep} of its dp '
    f"replica's rows); 5 all-to-alls of the slots per layer and micro-batch ({e.times['ep']:.3g} s of "
    f'traffic per step); {why}.'
  )


def _over_dp(e: costmodel.Estimate) -> str:
  """How the winner holds its state over dp, for `explain` (the rule ZeRO-3's gather follows)."""
  if e.zero3 == 'step':
    return (
      " and over dp too (ZeRO-3; gathered once per step: the stage's layers whole, "
      f'{e.breakdown["gathered"] / GB:.1f} GB, fit, for the fewest collectives)'
    )
  if e.zero3 == 'layer':
    return (
      " and over dp too (ZeRO-3; gathered per layer where it runs: the stage's layers whole do not "
      'fit, so one layer at a time, for a gather and a reduce-scatter per use)'
    )
  return ' and the optimizer over dp (ZeRO-1)' if e.shard_optimizer else ''
