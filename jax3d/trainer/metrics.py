"""What a run reports: `WORKDIR/metrics.jsonl` records and the console (process 0 only).

metrics.jsonl contract: one JSON object per line, appended (a resumed run appends again; readers
take the last record of a step). Kinds of record:
  {"event": "start", "layout": {...}, "config": {...}}                 once per (re)start
  {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s", "tokens", "epoch", "mfu", "memory"}
  {"step", "eval_loss"}                                                  held-out evaluations
  with data.mixture: "tokens/NAME", "epoch/NAME" in the step records, "eval_loss/NAME" in the
  evaluations (per source), and {"step", "event": "mixture_changed", "message"} on a resume
  {"step", "event": "nonfinite", "loss", "grad_norm", "consecutive"}   a skipped update
  {"step", "event": "memory_leak", "message", ...}                      the leak detector's warning
  {"step", "event": "preempted", "checkpoint"}                          a SIGTERM that saved
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax3d.analysis.memory import fmt_bytes
from jax3d.model import formulas, lora
from jax3d.parallel import pipeline
from jax3d.parallel.pipeline import timetable


def is_main_process() -> bool:
  """Whether this is process 0, the one that writes files and prints."""
  return jax.process_index() == 0


def _jsonable(x: Any) -> Any:
  """`x` with arrays and numpy scalars as Python lists and numbers, NaN as null, infinities as
  +-1e308 (strict JSON has neither)."""
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.generic, np.ndarray)) or hasattr(x, 'dtype'):
    x = np.asarray(x).tolist()
  if isinstance(x, float) and not math.isfinite(x):
    return None if math.isnan(x) else (1e308 if x > 0 else -1e308)
  return x


class MetricsWriter:
  """Appends records to WORKDIR/metrics.jsonl and keeps them in memory (for the Python API)."""

  def __init__(self, workdir: str | None):
    self.records: list[dict] = []
    self.path = os.path.join(workdir, 'metrics.jsonl') if workdir else None
    self.file = None
    if self.path and is_main_process():
      os.makedirs(workdir, exist_ok=True)
      self.file = open(self.path, 'a')

  def write(self, record: dict) -> None:
    """Keeps `record` and appends it as one JSON line (process 0 only writes the file)."""
    record = _jsonable(record)
    self.records.append(record)
    if self.file:
      self.file.write(json.dumps(record) + '\n')
      self.file.flush()

  def close(self) -> None:
    """Closes the file; records written later are only kept in memory."""
    if self.file:
      self.file.close()
      self.file = None


class Console:
  """Console output of process 0: `log` lines, and a live rich progress bar on a terminal."""

  def __init__(self, total_steps: int, live: bool = True):
    self.main = is_main_process()
    self.total = total_steps
    self.live = live and self.main and sys.stdout.isatty()
    self.bar = self.task = None
    if self.live:
      from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

      self.bar = Progress(
        TextColumn('[bold]train'),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn('{task.fields[stats]}'),
        TimeRemainingColumn(),
        transient=True,
      )

  def log(self, msg: str = '') -> None:
    """Prints a line on process 0 (above the progress bar when it is shown)."""
    if not self.main:
      return
    if self.bar and self.task is not None:
      self.bar.console.print(msg, highlight=False, markup=False)
    else:
      print(msg, flush=True)

  def warn(self, msg: str) -> None:
    """Prints 'warning: msg' on stderr, on every process."""
    print(f'warning: {msg}', file=sys.stderr, flush=True)

  def progress(self, step: int, start_step: int, loss: float, tok_s: float, step_s: float) -> None:
    """Updates the live progress bar (when there is one) to `step` with the latest numbers."""
    if not self.bar:
      return
    stats = f'loss {loss:.4f}  {tok_s:,.0f} tok/s  {step_s * 1e3:.0f} ms/step'
    if self.task is None:
      self.bar.start()
      self.task = self.bar.add_task('train', total=self.total, completed=step, stats=stats)
    self.bar.update(self.task, completed=step, stats=stats)

  def stop(self) -> None:
    """Removes the progress bar; later lines print plainly."""
    if self.bar and self.task is not None:
      self.bar.stop()
      self.task = None


def summary_lines(s: Any, data: str) -> list[str]:
  """The start-up lines of a run (`s` is its run.Setup): mesh, model, parameters per device,
  pipeline schedule and bubble, forward work per stage, tokens per step, and `data`."""
  p, d = s.plan, s.dims
  n_params = formulas.param_count(d)
  per_dev = sum(
    int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
    for a in jax.tree.leaves(s.abstract_state['params'])
  )
  lc = d.n_layers // (p.pp * p.repeats)
  zero = ''
  if s.zero3:
    how = {'layer': 'each layer gathered where it runs', 'step': "the stage's layers gathered once per step"}
    # cast before the gather where the loop gathers (the written-out path gathers as stored)
    compute = jnp.dtype(d.dtype)
    narrowed = any(
      jnp.dtype(t) == compute != jnp.dtype(d.param_dtype) for t in jax.tree.leaves(s.gather.dtypes)
    )
    cast = f', its matmul weights in {compute.name}' if narrowed and not s.explicit_dp else ''
    reduce = s.cfg.train.grad_reduce_dtype if s.explicit_dp else s.gather.reduce
    zero = (
      f', sharded over dp={p.dp} with their gradients and Adam state (ZeRO-3: {how[s.gather.mode]}'
      f'{cast}; gradients reduce-scattered in {reduce})'
    )
  elif s.zero1:
    zero = f', Adam state sharded over dp={p.dp} (ZeRO-1)'
  return [
    f'jax3d: {p.n_devices} {jax.devices()[0].platform} devices, mesh '
    + ' x '.join(f'{a}={s.mesh.shape[a]}' for a in s.mesh.axis_names),
    f'  model: {d.n_layers} layers, d_model {d.d_model}, heads {d.n_heads}/{d.n_kv_heads} kv, '
    f'd_ff {d.d_ff}, vocab {d.vocab_size} (padded {d.vocab_padded}): {n_params / 1e6:.2f}M parameters',
    f'  parameters per device: {fmt_bytes(per_dev)} ({s.cfg.train.param_dtype}){zero}, '
    f'compute {s.cfg.train.compute_dtype}'
    + (' (projection matmuls in fp8: E4M3 forward, E5M2 gradients)' if d.fp8 else '')
    + f', remat {s.cfg.train.remat}, attention {d.attention}'
    + (f' over cp={p.cp} ({d.cp_strategy})' if p.cp > 1 else ''),
    timetable.summary(p.pp, p.repeats, p.microbatches, lc, p.micro_batch, pipeline.skips_bubbles(p, s.mesh))
    if pipeline.in_loop_loss(s.cfg.pipeline.schedule, p)
    else f'  pipeline: {p.pp} stages x {p.repeats} chunk(s) of {lc} layer(s) each, {p.microbatches} '
    f'micro-batches of {p.micro_batch} sequences, {p.iterations} iterations, bubble '
    f'{p.bubble:.1%} ('
    + (
      'skipped: a stage computes only its useful iterations'
      if pipeline.skips_bubbles(p, s.mesh)
      else f'executed/useful stage work {p.iterations / (p.repeats * p.microbatches):.2f}'
    )
    + '); '
    f'embedding and head run on all {p.n_devices} devices',
    f'  per stage: {lc * p.repeats} layers = '
    f'{formulas.stage_forward_flops(d, lc * p.repeats, p.tokens_per_step) / 1e9:.2f} '
    f'GFLOP forward per step (equal for every stage)',
    f'  tokens per step: {p.tokens_per_step:,} ({p.global_batch} x {p.seq_len}), grad_accum {p.grad_accum}',
    f'  data: {data}',
  ] + lora_lines(s)


def lora_lines(s: Any) -> list[str]:
  """The LoRA start-up line (none without LoRA): the adapters, the trainable and frozen counts."""
  d = s.dims
  if not d.lora_rank:
    return []
  trainable = lora.count(lora.trainable(d, s.abstract_state['params'])[0])
  frozen = formulas.param_count(d)
  return [
    f'  LoRA: rank {d.lora_rank}, alpha {d.lora_alpha:g} on {",".join(d.lora_targets)}: '
    f'{trainable:,} trainable parameters ({trainable / frozen:.2%}), {frozen:,} frozen '
    f'(the base, {np.dtype(d.param_dtype).name}; no gradients, no optimizer state)'
  ]


class Clock:
  """Step timing between log lines; the first step (which also compiles) is not counted."""

  def __init__(self) -> None:
    self.t_last, self.steps, self.started = time.time(), 0, False

  def tick(self) -> bool:
    """Counts one finished step; True for the first one (the clock starts after it)."""
    if not self.started:
      self.started, self.t_last, self.steps = True, time.time(), 0
      return True
    self.steps += 1
    return False


class TensorBoard:
  """Scalars of the metric records in WORKDIR/tensorboard (process 0; a no-op without a workdir)."""

  def __init__(self, workdir: str | None):
    self.writer = None
    if workdir and is_main_process():
      from tensorboardX import SummaryWriter

      self.writer = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def scalars(self, step: int, record: dict) -> None:
    if self.writer is None:
      return
    for k, v in record.items():
      if isinstance(v, (int, float)) and k != 'step' and v is not None:
        self.writer.add_scalar(k, v, step)
    if 'memory' in record:
      self.writer.add_scalar('memory_max_bytes', max(record['memory']['bytes_in_use']), step)
    self.writer.flush()

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()
