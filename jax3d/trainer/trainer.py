"""The Trainer: one run behind `python -m jax3d.train` and the Python API, as a facade.

  t = Trainer(load_config('configs/tiny.py', {'train.steps': 50}), workdir='runs/x')
  t.train()            # resumes from workdir if it holds a checkpoint
  t.evaluate()         # held-out loss
  t.sample('def ')     # text

Order of work: assemble.build (validate the config and the data: errors here, before anything
compiles; the mesh; the shardings) -> the initial state -> assemble.compile_train_step -> the loop.
The work itself is in the package's modules, each one read:

  state.py       the initial state: restore, Hugging Face import, warm start or seed
  loop.py        the training loop, its SIGTERM handling and its one-step-behind readback
  steplog.py     a step's metric record, console line, leak check and non-finite check
  evaluation.py  the held-out loss
  checkpoint.py, metrics.py, lock.py, workdir.py (sampling), distributed.py
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import jax
import ml_collections

from jax3d import assemble, step as step_lib
from jax3d.analysis import inspection
from jax3d.data import corpus as corpus_lib, mixture as mixture_lib, tokenizer as tokenizer_lib
from jax3d.errors import ConfigError, TrainingError
from jax3d.planning import oom
from jax3d.trainer import (
  checkpoint as ckpt_lib,
  evaluation,
  lock as lock_lib,
  loop as loop_lib,
  metrics as metrics_lib,
  state as state_lib,
  steplog as steplog_lib,
  task_eval,
  workdir as workdir_lib,
)

__all__ = ['Trainer', 'TrainingError']  # TrainingError (jax3d/errors.py) is importable from here too


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
    task_eval.check(cfg)  # eval.tasks: found, their data local (exit 2 before anything compiles)
    self._tasks: task_eval.TaskEvaluator | None = None
    self.tokenizer = tokenizer_lib.load(cfg.data.tokenizer)
    self.corpus = mixture_lib.for_config(cfg, self.tokenizer)
    corpus_lib.check_vocab(self.corpus, cfg.model.vocab_size)
    # One run per workdir (process 0 holds the lock for all); CheckpointError if another holds it.
    # Taken once the input is checked: a refused run makes no workdir.
    self._lock = (
      lock_lib.WorkdirLock(workdir, warn=lambda m: print(f'warning: {m}', file=sys.stderr, flush=True))
      if workdir and jax.process_index() == 0
      else None
    )
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
    self.eval_losses: dict[str, float] = {}
    self.compiled: assemble.CompiledStep | None = None
    self._eval_step = None
    self._stop = loop_lib.StopFlag()
    self.devices = self.setup.devices
    self.tb = metrics_lib.TensorBoard(workdir if cfg.log.tensorboard else None)
    self.steplog = steplog_lib.StepLog(self.setup, self.writer, self.console, self.tb, self.log)

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
    lines = metrics_lib.summary_lines(self.setup, self.corpus.describe())
    if not self.corpus.evaluable:  # jax3d.prepare --eval_fraction=0: stated, then no evaluation
      lines.append(f'  note: no held-out data in {self.corpus.source}: the run trains without evaluating')
    return lines

  def init_state(self) -> str:
    """Restores the newest good checkpoint, or warm-starts, or initialises (jax3d/trainer/state.py).
    Returns what it did."""
    self.state, what = state_lib.initial_state(self.setup, self.checkpointer, self.console.warn)
    step = self.step
    if self.checkpointer and step in self.checkpointer.steps():  # resumed: the mixture goes on
      saved = self.checkpointer.read_meta(step).get('mixture')
      note = mixture_lib.resume(self.corpus, saved, step)
      if note:
        self.writer.write({'step': step, 'event': 'mixture_changed', 'message': note})
        what += f'\n  {note}'
    return what

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

  @property
  def step(self) -> int:
    return int(jax.device_get(self.state['step']))

  # ------------------------------------------------------------------ checkpoints
  def meta(self) -> dict:
    step = self.step
    return (
      {
        'step': step,
        'data_step': step,
        'seed': self.cfg.train.seed,
        'layout': self.layout,
        'config': self.cfg.to_dict(),
      }
      | ({'lora_base': state_lib.base_source(self.cfg)} if self.setup.dims.lora_rank else {})
      | (
        {'mixture': self.corpus.meta(self.cfg.train.seed, step, self.plan.global_batch, self.plan.seq_len)}
        if isinstance(self.corpus, mixture_lib.Mixture)
        else {}
      )
    )

  def save(self, force: bool = True) -> str | None:
    if not self.checkpointer:
      return None
    step = self.step
    if step in self.checkpointer.steps():
      return os.path.join(self.checkpointer.directory, str(step))
    self.checkpointer.save(step, state_lib.saved(self.setup, self.state), self.meta(), force=force)
    return os.path.join(self.checkpointer.directory, str(step))

  # ------------------------------------------------------------------ evaluation and text
  def evaluate(self) -> float:
    """The held-out loss in nats per token (jax3d/trainer/evaluation.py); compiles first if needed.
    `eval_losses` keeps it with a mixture's loss per source (eval_loss/NAME)."""
    for line in self.compile():
      self.log('  ' + line)
    if not self.corpus.evaluable:
      raise ConfigError(f'{self.corpus.source} holds no held-out data: nothing to evaluate on')
    self.eval_losses = evaluation.held_out_losses(
      self.setup, self.corpus, self._eval_step, self.state['params']
    )
    return self.eval_losses['eval_loss']

  def evaluate_tasks(self) -> dict:
    """The eval.tasks lm-evaluation-harness tasks on the current parameters: lm-eval's results
    (jax3d/trainer/task_eval.py); compiles first if needed."""
    for line in self.compile():
      self.log('  ' + line)
    if self._tasks is None:
      self._tasks = task_eval.TaskEvaluator(self.setup)
    return self._tasks(self.state['params'])

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
  def train(self, steps: int | None = None) -> list[dict]:
    """Trains until `train.steps` (or `steps` more steps), evaluating and saving on the way
    (jax3d/trainer/loop.py). Returns the metric records written. A SIGTERM (or, with several
    processes, a peer's) saves the step and returns early: `preempted` is then True."""
    return loop_lib.train(self, self._stop, steps)

  @property
  def preempted(self) -> bool:
    """Whether a SIGTERM stopped `train` early (the step it stopped at was saved)."""
    return self._stop.set

  def close(self) -> None:
    try:
      if self.checkpointer:
        self.checkpointer.close()
      self.writer.close()
      self.tb.close()
    finally:
      if self._lock is not None:
        self._lock.release()
