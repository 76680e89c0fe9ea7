"""The training loop behind `Trainer.train` (jax3d/trainer/trainer.py, the `Host` below).

  train   the SIGTERM handler set, then a `_Loop` run; the console, the prefetch thread and the
          handler put back whatever happens
  _Loop   start (state, compile, the 'start' record, the prefetch thread, the step-0 evaluation),
          the steps, the final evaluation and checkpoint

One step: its batch from the prefetch thread, the compiled step dispatched, then the previous
step's metrics read back (`_after_step`): the host runs one step behind, so logging, the
non-finite count and the console never hold the device up. Evaluations, saves and stops read the
current step first (`_flush`): the state is donated to the next step.

SIGTERM: with one process a Python handler (`StopFlag`) is set before the state is initialised
(its log line is the first sign of life a supervisor sees) and compiled, so that a SIGTERM at any
point from there saves and stops cleanly. With several processes JAX's preemption service owns
SIGTERM (a Python handler would replace its notifier) and `distributed.preemption_sync` makes
every process stop at the same step. Either way the step is saved, a 'preempted' record written
and `train` returns (`Trainer.preempted` is then True).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Protocol

import jax

from jax3d import assemble
from jax3d.config import Config, RunPlan
from jax3d.data import corpus as corpus_lib, mixture as mixture_lib, prefetch as prefetch_lib
from jax3d.errors import TrainingError
from jax3d.setup import Setup
from jax3d.trainer import checkpoint as ckpt_lib, distributed, metrics as metrics_lib
from jax3d.trainer.steplog import StepLog


class Host(Protocol):
  """What the loop uses of the Trainer, which it does not import (the Trainer imports the loop)."""

  cfg: Config
  setup: Setup
  plan: RunPlan
  corpus: corpus_lib.Corpus | mixture_lib.Mixture
  state: dict | None
  compiled: assemble.CompiledStep | None
  checkpointer: ckpt_lib.Checkpointer | None
  writer: metrics_lib.MetricsWriter
  console: metrics_lib.Console
  steplog: StepLog
  workdir: str | None
  layout: dict
  step: int
  eval_losses: dict[str, float]

  def log(self, msg: str = '') -> None: ...
  def init_state(self) -> str: ...
  def compile(self) -> list[str]: ...
  def evaluate(self) -> float: ...
  def evaluate_tasks(self) -> dict: ...
  def save(self, force: bool = True) -> str | None: ...


class StopFlag:
  """The signal that stops the loop: set by the SIGTERM handler (one process) or by the loop when
  JAX's preemption sync says a process got SIGTERM (several). It stays set once set."""

  def __init__(self) -> None:
    self.signum: int | None = None

  def __call__(self, signum: int, frame: object) -> None:  # the SIGTERM handler
    self.signum = signum

  @property
  def set(self) -> bool:
    return self.signum is not None


def train(host: Host, flag: StopFlag, steps: int | None = None) -> list[dict]:
  """Trains `host` until train.steps (or `steps` more steps); returns the metric records written."""
  multi = jax.process_count() > 1
  prev_handler = (
    signal.signal(signal.SIGTERM, flag)
    if threading.current_thread() is threading.main_thread() and not multi
    else None
  )
  loop = _Loop(host, flag, multi)
  try:
    return loop.run(steps)
  finally:
    host.console.stop()
    if loop.prefetch is not None:
      loop.prefetch.close()
    if prev_handler is not None:
      signal.signal(signal.SIGTERM, prev_handler)


class _Loop:
  """One call of `train`, from the current step to `stop`."""

  def __init__(self, host: Host, flag: StopFlag, multi: bool) -> None:
    self.host, self.cfg, self.flag, self.multi = host, host.cfg, flag, multi
    self.prefetch: prefetch_lib.Prefetcher | None = None
    self.pending: tuple | None = None  # (step, its metrics on the device, its dispatch time)
    self.start = self.stop = 0
    self.clock = metrics_lib.Clock()

  def run(self, steps: int | None) -> list[dict]:
    host, cfg = self.host, self.cfg
    if host.state is None:
      host.log(host.init_state())
    for line in host.compile():
      host.log('  ' + line)
    self.start = host.step
    self.stop = cfg.train.steps if steps is None else self.start + steps
    n_first = len(host.writer.records)
    host.writer.write({'event': 'start', 'step': self.start, 'layout': host.layout, 'config': cfg.to_dict()})
    # The batches of the epoch order; the step gets only the keys it takes (corpus_lib.STEP_KEYS).
    self.prefetch = prefetch_lib.Prefetcher(
      host.corpus,
      cfg.train.seed,
      self.start,
      self.stop,
      host.plan.global_batch,
      host.plan.seq_len,
      host.setup.batch_sharding,
      cfg.data.prefetch,
    )
    host.log(f'  data rows: {host.corpus.layout(host.plan.seq_len).describe()}')
    host.steplog.bad, self.clock = 0, metrics_lib.Clock()
    if self.start == 0 and cfg.eval.every and self.stop > 0:
      self._evaluate(0)  # where held-out loss starts (ln(vocab) for an untrained model)
    if self.flag.set:  # SIGTERM while compiling or in that first evaluation
      self._preempted(self.start)
    else:
      self._steps()
    return host.writer.records[n_first:]

  def _steps(self) -> None:
    """Steps start+1 .. stop with their evaluations and checkpoints, then the last evaluation and
    checkpoint; returns early, with the step saved, on a stop."""
    host, cfg, stop = self.host, self.cfg, self.stop
    for i in range(self.start, stop):
      step = i + 1
      self._dispatch(i)
      evaluate, save = _every(cfg.eval.every, step), _every(cfg.checkpoint.every, step)
      if evaluate or save or step == stop or self.flag.set:
        self._flush()
      tasks = bool(cfg.eval.tasks) and _every(cfg.eval.tasks_every, step) and step != stop
      if tasks and not evaluate:
        self._flush()
      if evaluate and step != stop:
        self._evaluate(step)
      if tasks:
        self._evaluate_tasks(step)
      if (evaluate or tasks) and step != stop:
        self.clock.t_last = time.time()
      if host.checkpointer and save and step != stop and not host.steplog.none_finite(step, False):
        host.save(force=True)
      if self.multi and not self.flag.set and distributed.preemption_sync(step):
        self.flag.signum = signal.SIGTERM
      if self.flag.set:
        self._flush()  # a SIGTERM (or a peer's) after the boundary check above
        self._preempted(step)
        return
    host.steplog.none_finite(stop, True)
    self._evaluate(host.step)
    if cfg.eval.tasks:
      self._evaluate_tasks(host.step)
    if host.checkpointer and stop > self.start:
      host.save(force=True)
      host.checkpointer.wait()

  def _dispatch(self, i: int) -> None:
    """Step i + 1 dispatched on its batch, then the host's part of the step before it."""
    host = self.host
    self._profile(i, start=True)
    try:
      batch = self.prefetch.next(i)
    except corpus_lib.DataError as e:  # the CLI's exit 3, with the cause on its one line
      self._flush()  # the last step's record first
      raise TrainingError(str(e)) from e
    t0 = time.time()
    host.state, m = host.compiled(host.state, batch)
    self._flush()
    self.pending = (i + 1, m, t0)

  def _flush(self) -> None:
    """The host's part of the step still pending, if one is."""
    if self.pending is not None:
      pending, self.pending = self.pending, None
      self._after_step(*pending)

  def _after_step(self, step: int, m: dict, t0: float) -> None:
    """The host's part of step `step` (dispatched at `t0`): its metrics read back, the profile
    stopped, the non-finite count, the metric record and the console."""
    host = self.host
    m = jax.device_get(m)
    if self.clock.tick():
      host.log(f'  first step (compile + run): {time.time() - t0:.1f} s')
    self._profile(step, start=False)
    host.steplog.check_finite(step, m)
    if step % self.cfg.log.every == 0 or step == self.stop:
      host.steplog.record(
        step, self.stop, m, self.clock, self.prefetch.epoch(step - 1), self.prefetch.per_source(step)
      )
    dt = max(time.time() - t0, 1e-9)
    host.console.progress(step, self.start, float(m['loss']), host.plan.tokens_per_step / dt, dt)

  def _profile(self, at: int, start: bool) -> None:
    """profile.start/steps: a jax.profiler trace of those steps in WORKDIR/profile (started before
    step index `at`, stopped after step number `at`)."""
    prof, workdir = self.cfg.profile, self.host.workdir
    if prof.start < 0 or not workdir:
      return
    if start and at == prof.start:
      jax.profiler.start_trace(os.path.join(workdir, 'profile'))
    elif not start and at == prof.start + prof.steps:
      jax.profiler.stop_trace()
      self.host.log(
        f'  profile of steps {prof.start}..{at - 1} written to {workdir}/profile '
        '(open with TensorBoard or https://ui.perfetto.dev)'
      )

  def _evaluate(self, step: int) -> None:
    if not self.host.corpus.evaluable:  # no held-out data: said at start-up, nothing to evaluate
      return
    loss = self.host.evaluate()
    self.host.steplog.evaluation(step, loss, {k: v for k, v in self.host.eval_losses.items() if '/' in k})

  def _evaluate_tasks(self, step: int) -> None:
    """eval.tasks at `step`: lm-eval's table on the console, the scores as one record (and
    TensorBoard scalars), the results' JSON in WORKDIR/eval/<step>.json."""
    self.host.steplog.tasks(step, self.host.evaluate_tasks(), self.host.workdir)

  def _preempted(self, step: int) -> None:
    """SIGTERM (or a peer's, through JAX's preemption sync): save this step and stop cleanly."""
    host = self.host
    host.steplog.none_finite(step, True)
    path = host.save(force=True)
    if host.checkpointer:
      host.checkpointer.wait()
    host.writer.write({'step': step, 'event': 'preempted', 'checkpoint': path})
    host.log(f'SIGTERM: saved step {step} to {path}; run the same command again to resume')
    if self.multi and jax.process_index() != 0:  # one line per process: all stopped at the same step
      print(f'process {jax.process_index()}: preempted, saved step {step}', file=sys.stderr, flush=True)


def _every(n: int, step: int) -> bool:
  """Whether `step` is a multiple of the interval `n` (0: never)."""
  return bool(n) and step % n == 0
