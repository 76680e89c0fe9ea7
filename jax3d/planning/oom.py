"""Out of memory: the tutorial's ladder of remedies, each priced for this config and layout, the
check of a compiled step against the device, and the smallest cluster on which the config fits.

The trainer calls `check_fits` after compiling (a ConfigError with the ladder, before the first
step); `python -m jax3d.plan` prints the ladder when no layout fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import ml_collections

from jax3d.config import Config, ConfigError, RunPlan, typed, validated
from jax3d.planning.costmodel import GB, Estimate, Hardware, estimate
from jax3d.planning.planner import more_loss_chunks, search, with_overrides

if TYPE_CHECKING:
  import jax


def oom_ladder(
  cfg: Config | ml_collections.ConfigDict,
  plan: RunPlan,
  device_memory_bytes: float,
  hw: Hardware | None = None,
) -> list[str]:
  """The out-of-memory ladder, each rung priced for this config and layout: recompute activations,
  drop needless copies, smaller micro-batches, more pp or tp, bf16, ZeRO-1, ZeRO-3, then more
  nodes."""
  cfg = typed(cfg)
  hw = hw or Hardware(
    nodes=max(plan.n_devices // 8, 1),
    gpus_per_node=min(plan.n_devices, 8),
    memory_gb=device_memory_bytes / GB,
  )
  if cfg.train.attention == 'xla':  # the dense reference, priced as what it keeps (s x s scores)
    hw = dataclasses.replace(hw, attention='xla')
  ladder = _Ladder(cfg, plan, device_memory_bytes, hw, estimate(cfg, plan, device_memory_bytes, hw))
  lines = [f"Out of memory: {ladder.base.reason} ({ladder.base.describe()}). In the tutorial's order:"]
  lines.append(_recompute_rung(ladder))
  if ladder.base.breakdown['head'] > ladder.base.breakdown['activations']:
    lines.append(_loss_chunks_rung(ladder))
  lines.append('2. drop needless copies: the step keeps none (state donated, logs read scalars only)')
  if cfg.train.attention == 'xla':
    lines.append(_attention_rung(ladder))
  lines.append(
    ladder.rung('3. smaller micro-batch', {'train.grad_accum': 2 * cfg.train.grad_accum}, ladder.acts)
  )
  lines.append(_more_pp_or_tp_rung(ladder))
  if plan.pp > 1:
    lines.append(_schedule_rung(ladder))
  if plan.dp % 2 == 0:  # half the dp ranks become cp ranks; twice the accumulation keeps the batch
    cp = {'mesh.cp': 2 * plan.cp, 'mesh.dp': plan.dp // 2, 'train.grad_accum': 2 * plan.grad_accum}
    lines.append(ladder.rung('4c. split the sequence: cp (each row over 2x the devices)', cp, ladder.acts))
  e = cfg.moe.num_experts
  if e and plan.dp > 1 and e % (2 * plan.ep) == 0:  # dp ranks become ep ranks: all of them, or half
    to = plan.ep * plan.dp if e % (plan.ep * plan.dp) == 0 else 2 * plan.ep
    ep = {'mesh.ep': to, 'mesh.dp': plan.dp * plan.ep // to}
    lines.append(ladder.rung(f'4e. split the experts: ep={to} ({e // to} per device)', ep))
  if cfg.train.param_dtype != 'bfloat16':
    lines.append(
      ladder.rung(
        '5. bf16 weights and optimizer state',
        {'train.param_dtype': 'bfloat16', 'train.compute_dtype': 'bfloat16'},
      )
    )
  else:
    lines.append('5. bf16: weights, gradients and Adam state are already bf16')
  if plan.zero_ranks > 1 and not cfg.train.shard_optimizer and not cfg.train.shard_params:
    lines.append(ladder.rung('6. shard the optimizer over dp (ZeRO-1)', {'train.shard_optimizer': True}))
  if plan.zero_ranks > 1:
    lines += _zero3_rungs(ladder)
  if not cfg.lora.rank:
    lora = {'lora.rank': 16, 'lora.alpha': 32.0, 'lora.base_dtype': 'bfloat16'}
    lines.append(ladder.rung('7. LoRA: fine-tune the adapters only (rank 16, the base frozen in bf16)', lora))
  lines.append(smallest_cluster(cfg, hw))
  return lines


@dataclasses.dataclass(frozen=True)
class _Ladder:
  """What every rung is priced against: the config, its layout, the device and the base estimate."""

  cfg: Config
  plan: RunPlan
  device_memory_bytes: float
  hw: Hardware
  base: Estimate

  def rung(self, label: str, overrides: dict, what: Callable[[Estimate], str] | None = None) -> str:
    """One rung: the config with `overrides`, its bytes per GPU against the base's (and `what` of
    its estimate), or why it is not possible here."""
    try:
      c, p = validated(with_overrides(self.cfg, overrides), self.plan.n_devices)
      e = estimate(c, p, self.device_memory_bytes, self.hw)
    except ConfigError as err:
      return f'{label}: not possible here ({err})'
    flags_ = ' '.join(f'--config.{k}={v}' for k, v in overrides.items())
    return (
      f'{label} ({flags_}): {_gb(self.base)} -> {_gb(e)} per GPU{what(e) if what else ""}'
      f'{"  FITS" if e.fits else ""}'
    )

  def acts(self, e: Estimate) -> str:
    """The activations of estimate `e` against the base's."""
    before, after = self.base.breakdown['activations'], e.breakdown['activations']
    return f' (activations {before / GB:.1f} -> {after / GB:.1f} GB, saves {1 - after / before:.0%})'


def _attention_rung(ladder: _Ladder) -> str:
  """train.attention=xla keeps s x s scores per head: `auto` (`fused` on a GPU in bf16/fp16: cuDNN
  without documents, Pallas with them; blockwise elsewhere) keeps a logsumexp instead; priced on the
  GPU's kernel."""
  from jax3d.model import attention

  cfg, m = ladder.cfg, ladder.cfg.model
  why = attention.cudnn_supported('gpu', cfg.train.compute_dtype, m.head_dim or m.d_model // m.n_heads, 9.0)
  hw = dataclasses.replace(ladder.hw, attention='blockwise' if why else 'fused')
  c = typed(with_overrides(cfg, {'train.attention': 'auto'}))
  e = estimate(c, ladder.plan, ladder.device_memory_bytes, hw)
  return (
    f'2b. attention implementation (--config.train.attention=auto: {hw.attention}): '
    f'{_gb(ladder.base)} -> {_gb(e)} per GPU{ladder.acts(e)}{"  FITS" if e.fits else ""}'
  )


def _gb(e: Estimate) -> str:
  return f'{e.total_bytes / GB:.1f} GB'


def _recompute_rung(ladder: _Ladder) -> str:
  """Rung 1: recompute activations (whole pipeline iterations when layers already are)."""
  remat = ladder.cfg.train.remat
  if remat not in ('full', 'stage'):
    return ladder.rung('1. recompute activations', {'train.remat': 'full'}, ladder.acts)
  if remat == 'full' and ladder.plan.pp > 1:
    return ladder.rung('1. recomputation of whole pipeline iterations', {'train.remat': 'stage'}, ladder.acts)
  return (
    f'1. recomputation is already on (train.remat={remat}): activations '
    f'{ladder.base.breakdown["activations"] / GB:.1f} GB'
  )


def _loss_chunks_rung(ladder: _Ladder) -> str:
  """Rung 1b, where the head's fp32 logits outweigh the layers' activations (a large vocabulary at
  small tp): the head and loss in pieces of the sequence, 8 times as many as now where seq_len has
  such a divisor (else the most it has)."""
  now = ladder.cfg.train.loss_chunks
  chunks = more_loss_chunks(ladder.plan.seq_len, now)
  if chunks is None:
    return f'1b. the head and loss are already in {now} pieces, one position each'
  head = lambda e: f' (head {ladder.base.breakdown["head"] / GB:.2f} -> {e.breakdown["head"] / GB:.2f} GB)'
  return ladder.rung('1b. the head and loss in pieces (logits dominate)', {'train.loss_chunks': chunks}, head)


def _zero_now(cfg: Config) -> tuple[str, ...]:
  """The planner's ZERO variant of `cfg` (the more-pp-or-tp rung keeps it)."""
  if cfg.train.shard_params:
    return ('zero3',)
  return ('zero1',) if cfg.train.shard_optimizer else ('off',)


def _zero3_rungs(ladder: _Ladder) -> list[str]:
  """Rung 6b, ZeRO-3: the parameters and their gradients over dp too, gathered once per step
  ('step': the stage's layers whole during the step); where that does not fit, gathered per layer
  where it runs ('layer': one layer whole at a time, for more dp traffic)."""
  t = ladder.cfg.train
  on = {'train.shard_params': True, 'train.shard_params_gather': 'step'}
  out = []
  if not t.shard_params:
    out.append(ladder.rung('6b. shard the parameters and gradients over dp too (ZeRO-3)', on, _gathered))
  if not t.shard_params or t.shard_params_gather != 'layer':
    out.append(
      ladder.rung(
        "6c. ZeRO-3 gathering each layer where it runs (when 'step' does not fit)",
        on | {'train.shard_params_gather': 'layer'},
        _gathered,
      )
    )
  return out


def _gathered(e: Estimate) -> str:
  """What ZeRO-3 holds whole during the step, for its rungs."""
  return f' (gathered whole during the step: {e.breakdown.get("gathered", 0) / GB:.2f} GB)'


def _schedule_rung(ladder: _Ladder) -> str:
  """Rung 4b: the 1F1B schedule, whose activations do not grow with the micro-batches; under it,
  twice the micro-batches (smaller ones, and a smaller bubble) at no activation cost."""
  cfg = ladder.cfg
  if cfg.pipeline.schedule != '1f1b':
    return ladder.rung('4b. the 1F1B schedule', {'pipeline.schedule': '1f1b'}, ladder.acts)
  more = {'pipeline.microbatches': 2 * cfg.pipeline.microbatches}
  return ladder.rung(
    '4b. more micro-batches cost no activation memory under 1f1b (smaller ones: less)', more, ladder.acts
  )


def _more_pp_or_tp_rung(ladder: _Ladder) -> str:
  """Rung 4: the best layout with more pp*tp (its activations with sequence parallelism too)."""
  cfg, plan = ladder.cfg, ladder.plan
  deeper = [
    c
    for c in search(cfg, ladder.hw, policies=(cfg.train.remat,), zero=_zero_now(cfg))
    if c.plan.pp * c.plan.tp > plan.pp * plan.tp
  ]
  if not deeper:
    return (
      f'4. more pp or tp: pp*tp = {plan.pp}*{plan.tp} is already the most these '
      f'{plan.n_devices} GPUs and this model allow'
    )
  c = min(deeper, key=lambda c: (not c.est.fits, c.est.step_time_s if c.est.fits else c.est.total_bytes))
  over = {k: v for k, v in c.overrides.items() if k != 'train.remat'}
  return ladder.rung('4. more pp or tp', over, ladder.acts) + _sequence_parallel(
    cfg, over, plan, ladder.device_memory_bytes, ladder.hw
  )


def _sequence_parallel(
  cfg: Config | ml_collections.ConfigDict, over: dict, plan: RunPlan, device_memory_bytes: float, hw: Hardware
) -> str:
  """The more-tp rung's activations without and with sequence parallelism (Megatron-SP splits the
  replicated residual stream over tp too, so raising tp pays in full only with it)."""
  out = []
  for sp in ('false', 'true'):
    try:
      c, p = validated(with_overrides(cfg, over | {'train.sequence_parallel': sp}), plan.n_devices)
    except ConfigError:
      return ''
    if p.tp == 1:
      return ''
    out.append(estimate(c, p, device_memory_bytes, hw).breakdown['activations'] / GB)
  return (
    f'; activations at tp={p.tp}: {out[0]:.3g} GB without sequence parallelism, {out[1]:.3g} GB with it '
    f'(--config.train.sequence_parallel=true)'
  )


def check_fits(cfg: Config, plan: RunPlan, compiled_bytes: int, device: jax.Device) -> str:
  """A line comparing the compiled bytes per device with the estimate's; raises ConfigError with
  the out-of-memory ladder when they exceed the limit: `hardware.memory_gb` when set (on any
  backend, CPU included), else what the device's allocator reports (none on CPU). On a GPU the
  estimate counts too (XLA:GPU may need more than it reports before it runs)."""
  from jax3d.analysis import memory as memory_lib
  from jax3d.analysis.memory import fmt_bytes

  est = estimate(cfg, plan)
  line = (
    f'memory per device: compiled {fmt_bytes(compiled_bytes)}, planner estimate '
    f'{fmt_bytes(est.total_bytes)} ({est.total_bytes / max(compiled_bytes, 1) - 1:+.0%})'
  )
  budget = cfg.hardware.memory_gb
  limit = budget * GB if budget else memory_lib.device_memory_limit(device)
  if limit and max(compiled_bytes, est.total_bytes if device.platform == 'gpu' else 0) > limit:
    ladder = oom_ladder(cfg, plan, limit)
    source = f'hardware.memory_gb={budget:g} allows' if budget else 'the device has'
    raise ConfigError(
      f'this layout needs {compiled_bytes / 1e9:.3g} GB per device, {source} '
      f'{limit / 1e9:.3g} GB; what would fit, in the order to try: '
      + ' | '.join(rung.strip() for rung in ladder)
    )
  return line


def smallest_cluster(cfg: Config | ml_collections.ConfigDict, hw: Hardware) -> str:
  """The fewest nodes (doubling) of this kind on which some layout fits."""
  nodes = 1
  while nodes <= 4096:
    h = dataclasses.replace(hw, nodes=nodes)
    try:
      fits = [c for c in search(cfg, h, policies=('full', 'stage')) if c.est.fits]
    except ConfigError:
      fits = []
    if fits:
      p = fits[0].plan
      return (
        f'Smallest cluster that fits: {nodes} node(s) x {hw.gpus_per_node} GPUs of '
        f'{hw.memory_gb:g} GB (dp={p.dp}, pp={p.pp}, tp={p.tp}, remat={fits[0].est.remat}: '
        f'{fits[0].est.total_bytes / GB:.1f} GB per GPU)'
      )
    nodes *= 2
  return f'No cluster of up to 4096 nodes of {hw.gpus_per_node} x {hw.memory_gb:g} GB fits this config'
