"""The training loop behind `python -m jax3d.train` and the Python API.

  t = Trainer(load_config('configs/tiny.py', {'train.steps': 50}), workdir='runs/x')
  t.train()            # resumes from workdir if it holds a checkpoint
  t.evaluate()         # held-out loss
  t.sample('def ')     # text

Order of work: assemble.setup (validate the config and the data: errors here, before anything
compiles; the mesh; the shardings) -> restore or jitted sharded init -> assemble.compile_train_step
-> the loop (`train`: one `_step` per iteration, then logging, evaluation, checkpoints).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np

from jax3d import assemble
from jax3d.analysis import inspection, memory as memory_lib
from jax3d.data import corpus as data_lib, tokenizer as tokenizer_lib
from jax3d.errors import TrainingError
from jax3d.hf import weights as hf_weights
from jax3d.model import formulas as flops_lib
from jax3d.planning import oom
from jax3d.trainer import (
  checkpoint as ckpt_lib,
  distributed,
  lock as lock_lib,
  metrics as metrics_lib,
  workdir as workdir_lib,
)
from jax3d.training import step as step_lib


class Trainer:
  def __init__(
    self,
    cfg: ml_collections.ConfigDict,
    workdir: str | None = None,
    devices: Sequence[jax.Device] | None = None,
    console: bool = True,
  ):
    # The one build path: the model of a Hugging Face import, the tokenizer's vocabulary, the
    # layout, all checked (exit 2 on bad input) before the data is read and anything compiles.
    self.setup = assemble.build(cfg, devices)
    cfg = self.cfg = self.setup.cfg
    self.workdir = workdir
    # One run per workdir (process 0 holds the lock for all); CheckpointError if another holds it.
    self._lock = (
      lock_lib.WorkdirLock(workdir, warn=lambda m: print(f'warning: {m}', file=sys.stderr, flush=True))
      if workdir and jax.process_index() == 0
      else None
    )
    self.tokenizer = tokenizer_lib.load(cfg.data.tokenizer)
    self.corpus = data_lib.load_corpus(
      cfg.data.path, cfg.data.eval_fraction, cfg.train.seq_len + 1, self.tokenizer
    )
    data_lib.check_vocab(self.corpus, cfg.model.vocab_size)
    self.plan, self.mesh = self.setup.plan, self.setup.mesh
    self.console = metrics_lib.Console(cfg.train.steps, live=console and cfg.log.progress)
    self.quiet = not console
    self.writer = metrics_lib.MetricsWriter(workdir)
    self.checkpointer = (
      ckpt_lib.Checkpointer(
        os.path.join(workdir, 'checkpoints'), cfg.checkpoint.keep, cfg.checkpoint.async_save
      )
      if workdir
      else None
    )
    self.state = None
    self.compiled: assemble.CompiledStep | None = None
    self._eval_step = None
    self._stop_signal = None
    self.devices = list(self.mesh.devices.flat)
    self.mfu_meter = flops_lib.MFUMeter(
      self.setup.dims, cfg.train.seq_len, self.devices[0], self.plan.n_devices, cfg.hardware.peak_tflops
    )
    self.leak = memory_lib.LeakDetector(
      window=cfg.log.leak_window, threshold_mb_per_step=cfg.log.leak_mb_per_step
    )
    self.tb = metrics_lib.TensorBoard(workdir if cfg.log.tensorboard else None)

  # ------------------------------------------------------------------ set-up
  @property
  def layout(self) -> dict:
    return self.setup.layout

  @property
  def compiled_info(self) -> dict | None:
    """Memory, FLOPs and collectives of the compiled step (jax3d/analysis/inspection.py), once compiled."""
    return self.compiled.analysis() if self.compiled is not None else None

  def log(self, msg: str = '') -> None:
    if not self.quiet:
      self.console.log(msg)

  def summary(self) -> list[str]:
    """The start-up lines: mesh, model, memory, pipeline schedule, work per stage, data."""
    return metrics_lib.summary_lines(self.setup, self.corpus.describe())

  def init_state(self) -> str:
    """Restores the newest good checkpoint, or warm-starts, or initialises. Returns what it did."""
    abstract = self.setup.abstract_state
    if self.checkpointer and self.checkpointer.steps():
      state, meta = self.checkpointer.restore_latest(abstract, self.layout, warn=self.console.warn)
      if state is not None:
        self.state = state
        saved = meta['layout']
        return (
          f'resumed from {self.checkpointer.directory}/{meta["step"]} (saved under dp={saved["dp"]} '
          f'pp={saved["pp"]} tp={saved["tp"]} repeats={saved["repeats"]}), next step {meta["step"]}'
        )
    if self.setup.hf is not None:  # the parameters straight from the folder, no random init first
      self.state = step_lib.make_init_from_params(self.setup)(hf_weights.load_params(self.setup))
      hf = self.setup.hf
      return f'initialised, parameters imported from {hf.path} (Hugging Face {hf.config["architectures"][0]})'
    if self.cfg.checkpoint.init_from:
      params, step = ckpt_lib.load_params(
        self.cfg.checkpoint.init_from, abstract['params'], self.layout, warn=self.console.warn
      )
      self.state = step_lib.make_init_from_params(self.setup)(params)
      return f'initialised, parameters warm-started from {self.cfg.checkpoint.init_from} (step {step})'
    self.state = step_lib.make_init(self.setup)(self.cfg.train.seed)
    return f'initialised from seed {self.cfg.train.seed}'

  def compile(self) -> list[str]:
    """Compiles the train step ahead of time; returns the start-up lines about what it costs
    (compiled memory per device beside the planner's estimate, FLOPs, bytes per mesh axis)."""
    if self.compiled is not None:
      return []
    self.compiled = assemble.compile_train_step(self.setup)
    self._eval_step = step_lib.make_eval_step(self.setup)
    lines = [f'compiled the train step in {self.compiled.compile_s:.1f} s']
    lines += inspection.summary_lines(self.compiled.analysis())
    # The compiled bytes beside the planner's estimate; ConfigError with the OOM ladder if too many.
    return lines + [oom.check_fits(self.cfg, self.plan, self.compiled.memory['total'], self.devices[0])]

  def _compile(self):
    for line in self.compile():
      self.log('  ' + line)

  @property
  def step(self) -> int:
    return int(jax.device_get(self.state['step']))

  # ------------------------------------------------------------------ checkpoints
  def meta(self) -> dict:
    step = self.step
    return {
      'step': step,
      'data_step': step,
      'seed': self.cfg.train.seed,
      'layout': self.layout,
      'config': self.cfg.to_dict(),
    }

  def save(self, force: bool = True) -> str | None:
    if not self.checkpointer:
      return None
    step = self.step
    if step in self.checkpointer.steps():
      return os.path.join(self.checkpointer.directory, str(step))
    self.checkpointer.save(step, self.state, self.meta(), force=force)
    return os.path.join(self.checkpointer.directory, str(step))

  # ------------------------------------------------------------------ evaluation and text
  def evaluate(self) -> float:
    self._compile()
    batches = data_lib.eval_batches(
      self.corpus, self.cfg.train.seed, self.cfg.eval.batches, self.plan.chunk_batch, self.plan.seq_len
    )
    sh = self.setup.batch_sharding
    losses = [
      self._eval_step(
        self.state['params'],
        data_lib.to_global(
          {k: v[data_lib.local_rows(sh, self.plan.chunk_batch)] for k, v in b.items()},
          sh,
          self.plan.chunk_batch,
        ),
      )
      for b in batches
    ]
    return float(np.mean(jax.device_get(losses)))

  def sample(
    self,
    prompt: str | None = None,
    n_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    seed: int = 0,
  ) -> str:
    s = self.cfg.sample
    return workdir_lib.generate_text(
      self.setup,
      self.state['params'],
      s.prompt if prompt is None else prompt,
      s.tokens if n_tokens is None else n_tokens,
      s.temperature if temperature is None else temperature,
      s.top_k if top_k is None else top_k,
      seed,
    )

  # ------------------------------------------------------------------ the loop
  def _on_sigterm(self, signum, frame):
    self._stop_signal = signum

  def train(self, steps: int | None = None) -> list[dict]:
    """Trains until `train.steps` (or `steps` more steps). Returns the metric records written."""
    cfg, plan = self.cfg, self.plan
    # Several processes: JAX's preemption service owns SIGTERM (a Python handler would replace its
    # notifier) and makes every process stop at the same step; one process: a Python flag, set
    # before the state is initialised (its log line is the first sign of life a supervisor sees)
    # and compiled, so that a SIGTERM at any point from here saves and exits cleanly.
    multi = jax.process_count() > 1
    prev_handler = (
      signal.signal(signal.SIGTERM, self._on_sigterm)
      if threading.current_thread() is threading.main_thread() and not multi
      else None
    )
    prefetch = None
    try:
      if self.state is None:
        self.log(self.init_state())
      self._compile()
      start = self.step
      stop = cfg.train.steps if steps is None else start + steps
      n_first = len(self.writer.records)
      self.writer.write({'event': 'start', 'step': start, 'layout': self.layout, 'config': cfg.to_dict()})
      prefetch = data_lib.Prefetcher(
        self.corpus,
        cfg.train.seed,
        start,
        stop,
        plan.global_batch,
        plan.seq_len,
        self.setup.batch_sharding,
        cfg.data.prefetch,
      )
      self._bad, clock = 0, metrics_lib.Clock()
      if start == 0 and cfg.eval.every and stop > 0:
        self._eval_and_log(0)  # where held-out loss starts (ln(vocab) for an untrained model)
      if self._stop_signal is not None:  # SIGTERM while compiling or in that first evaluation
        self._preempted(start, multi)
        return self.writer.records[n_first:]
      # The host reads a step's metrics after dispatching the next step (one step behind), so
      # logging, the finite-check count and the console never hold the device up. Evaluations,
      # saves and stops read the current step first: the state is donated to the next step.
      pending = None
      for i in range(start, stop):
        step = i + 1
        self._profile(i, start=True)
        try:
          batch = prefetch.next(i)
        except data_lib.DataError as e:  # the CLI's exit 3, with the cause on its one line
          if pending is not None:  # the last step's record first
            self._after_step(*pending, start, stop, clock)
          raise TrainingError(str(e)) from e
        t0 = time.time()
        self.state, m = self.compiled(self.state, batch)
        if pending is not None:
          self._after_step(*pending, start, stop, clock)
        pending = (step, m, t0)
        boundary = (cfg.eval.every and step % cfg.eval.every == 0) or (
          cfg.checkpoint.every and step % cfg.checkpoint.every == 0
        )
        if boundary or step == stop or self._stop_signal is not None:
          self._after_step(*pending, start, stop, clock)
          pending = None
        if cfg.eval.every and step % cfg.eval.every == 0 and step != stop:
          self._eval_and_log(step)
          clock.t_last = time.time()
        if self.checkpointer and cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != stop:
          self.save(force=True)
        if multi and self._stop_signal is None and distributed.preemption_sync(step):
          self._stop_signal = signal.SIGTERM
        if self._stop_signal is not None:
          if pending is not None:  # a SIGTERM (or a peer's) after the boundary check above
            self._after_step(*pending, start, stop, clock)
          self._preempted(step, multi)
          return self.writer.records[n_first:]
      self._eval_and_log(self.step)
      if self.checkpointer and stop > start:
        self.save(force=True)
        self.checkpointer.wait()
    finally:
      self.console.stop()
      if prefetch is not None:
        prefetch.close()
      if prev_handler is not None:
        signal.signal(signal.SIGTERM, prev_handler)
    return self.writer.records[n_first:]

  def _after_step(
    self, step: int, m: dict, t0: float, start: int, stop: int, clock: metrics_lib.Clock
  ) -> None:
    """The host's part of step `step` (dispatched at `t0`): its metrics read back, the profile
    stopped, the non-finite count, the metric record and the console."""
    m = jax.device_get(m)
    if clock.tick():
      self.log(f'  first step (compile + run): {time.time() - t0:.1f} s')
    self._profile(step, start=False)
    self._check_finite(step, m)
    if step % self.cfg.log.every == 0 or step == stop:
      self._log_step(step, stop, m, clock)
    dt = max(time.time() - t0, 1e-9)
    self.console.progress(step, start, float(m['loss']), self.plan.tokens_per_step / dt, dt)

  def _profile(self, at: int, start: bool) -> None:
    """profile.start/steps: a jax.profiler trace of those steps in WORKDIR/profile (started before
    step index `at`, stopped after step number `at`)."""
    prof = self.cfg.profile
    if prof.start < 0 or not self.workdir:
      return
    if start and at == prof.start:
      jax.profiler.start_trace(os.path.join(self.workdir, 'profile'))
    elif not start and at == prof.start + prof.steps:
      jax.profiler.stop_trace()
      self.log(
        f'  profile of steps {prof.start}..{at - 1} written to {self.workdir}/profile '
        '(open with TensorBoard or https://ui.perfetto.dev)'
      )

  def _check_finite(self, step: int, m: dict) -> None:
    """A non-finite step was skipped inside the step; train.max_bad_steps in a row stop the run."""
    if m['finite']:
      self._bad = 0
      return
    self._bad += 1
    limit = self.cfg.train.max_bad_steps
    self.console.warn(
      f'step {step}: non-finite loss {float(m["loss"])} / grad norm {float(m["grad_norm"])}; '
      f'update skipped ({self._bad} in a row, limit train.max_bad_steps={limit})'
    )
    self.writer.write(
      {
        'step': step,
        'event': 'nonfinite',
        'loss': float(m['loss']),
        'grad_norm': float(m['grad_norm']),
        'consecutive': self._bad,
      }
    )
    if self._bad >= limit:
      raise TrainingError(
        f'stopping at step {step}: {self._bad} consecutive non-finite steps '
        f'(loss {float(m["loss"])}, grad norm {float(m["grad_norm"])}); the last '
        f'checkpoint holds finite values only'
      )

  def _log_step(self, step: int, stop: int, m: dict, clock: metrics_lib.Clock) -> None:
    """A metrics record, TensorBoard scalars, the leak check and a console line."""
    now = time.time()
    dt = (now - clock.t_last) / max(clock.steps, 1)
    tok_s = self.plan.tokens_per_step / dt if clock.steps else 0.0
    # memory_stats() exists only for this process's devices; metrics come from process 0.
    mem = memory_lib.sample(self.devices)
    mfu = self.mfu_meter(tok_s) if clock.steps else None
    record = {
      'step': step,
      'loss': float(m['loss']),
      'lr': float(m['lr']),
      'grad_norm': float(m['grad_norm']),
      'tokens_per_sec': tok_s,
      'step_time_s': dt,
      'tokens': step * self.plan.tokens_per_step,
      'mfu': mfu,
      'memory': mem,
    }
    self.writer.write(record)
    self.tb.scalars(step, record)
    leak = self.leak.update(step, mem['bytes_in_use'])
    if leak:
      self.writer.write(leak)
      self.console.warn(leak['message'])
    mfu_txt = f'  MFU {mfu:.1%}' if mfu is not None else ''
    self.log(
      f'step {step:>6}/{stop}  loss {float(m["loss"]):.4f}  lr {float(m["lr"]):.2e}  '
      f'|g| {float(m["grad_norm"]):.3f}  {tok_s:,.0f} tok/s  {dt * 1e3:.0f} ms/step{mfu_txt}  '
      f'mem {memory_lib.fmt_bytes(max(mem["bytes_in_use"]))}/dev  '
      f'ETA {memory_lib.fmt_duration((stop - step) * dt)}'
    )
    clock.t_last, clock.steps = now, 0

  def _preempted(self, step: int, multi: bool) -> None:
    """SIGTERM (or a peer's, through JAX's preemption sync): save this step and stop cleanly."""
    path = self.save(force=True)
    if self.checkpointer:
      self.checkpointer.wait()
    self.writer.write({'step': step, 'event': 'preempted', 'checkpoint': path})
    self.log(f'SIGTERM: saved step {step} to {path}; run the same command again to resume')
    if multi and jax.process_index() != 0:  # one line per process: all stopped at the same step
      print(f'process {jax.process_index()}: preempted, saved step {step}', file=sys.stderr, flush=True)

  def _eval_and_log(self, step: int) -> float:
    loss = self.evaluate()
    self.writer.write({'step': step, 'eval_loss': loss})
    self.tb.scalars(step, {'eval_loss': loss})
    self.log(f'step {step:>6}  held-out loss {loss:.4f} nats/token ({loss / math.log(2):.3f} bits)')
    return loss

  def close(self) -> None:
    try:
      if self.checkpointer:
        self.checkpointer.close()
      self.writer.close()
      self.tb.close()
    finally:
      if self._lock is not None:
        self._lock.release()
