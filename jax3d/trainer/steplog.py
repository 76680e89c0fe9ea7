"""What the host does with a step's metrics once they are read back (jax3d/trainer/loop.py).

  check_finite  a non-finite step (skipped inside the step) is counted, warned about and recorded;
                train.max_bad_steps in a row stop the run with TrainingError
  none_finite   a run whose every step so far was non-finite saves nothing and, at its end, fails
  record        every log.every steps: the metric record (metrics.jsonl, TensorBoard), the leak
                check on the devices' memory and the console line
  evaluation    a held-out loss: its record and its console line

(Named `steplog`, not `logging`, so that it is never mistaken for the standard library's module.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from jax3d.analysis import memory as memory_lib
from jax3d.errors import TrainingError
from jax3d.model import formulas as flops_lib
from jax3d.setup import Setup
from jax3d.trainer import metrics as metrics_lib


class StepLog:
  """The records and console lines of one Trainer's steps. `bad` counts the non-finite steps in
  a row (the loop resets it at the start of each `train`); the leak detector's window and the MFU
  meter live as long as the Trainer."""

  def __init__(
    self,
    setup: Setup,
    writer: metrics_lib.MetricsWriter,
    console: metrics_lib.Console,
    tb: metrics_lib.TensorBoard,
    log: Callable[[str], None],
  ) -> None:
    cfg = self.cfg = setup.cfg
    self.plan, self.devices = setup.plan, setup.devices
    self.writer, self.console, self.tb, self.log = writer, console, tb, log
    self.mfu_meter = flops_lib.MFUMeter(
      setup.dims, cfg.train.seq_len, self.devices[0], self.plan.n_devices, cfg.hardware.peak_tflops
    )
    self.leak = memory_lib.LeakDetector(
      window=cfg.log.leak_window, threshold_mb_per_step=cfg.log.leak_mb_per_step
    )
    self.bad = self.good = 0  # non-finite steps in a row; finite steps since the state was made
    self.first: int | None = None  # the first step this Trainer ran

  def check_finite(self, step: int, m: dict) -> None:
    """A non-finite step was skipped inside the step; train.max_bad_steps in a row stop the run."""
    self.first = step if self.first is None else self.first
    if m['finite']:
      self.bad = 0
      self.good += 1
      return
    self.bad += 1
    limit = self.cfg.train.max_bad_steps
    loss, grad_norm = float(m['loss']), float(m['grad_norm'])
    self.console.warn(
      f'step {step}: non-finite loss {loss} / grad norm {grad_norm}; '
      f'update skipped ({self.bad} in a row, limit train.max_bad_steps={limit})'
    )
    self.writer.write(
      {'step': step, 'event': 'nonfinite', 'loss': loss, 'grad_norm': grad_norm, 'consecutive': self.bad}
    )
    if self.bad >= limit:
      raise TrainingError(
        f'stopping at step {step}: {self.bad} consecutive non-finite steps '
        f'(loss {loss}, grad norm {grad_norm}); the last '
        f'checkpoint holds finite values only'
      )

  def none_finite(self, step: int, saving: bool) -> bool:
    """Whether every step this Trainer ran (up to `step`) was non-finite, its update skipped: a
    state no checkpoint gets. With `saving` (a run's end, a SIGTERM) that is TrainingError (exit
    3): such a run never ends with status 0."""
    if self.first is None or self.good:
      return False
    if saving:
      raise TrainingError(
        f'steps {self.first}..{step}: every step of this run was non-finite (its update skipped), so '
        'nothing was saved and the workdir keeps the checkpoint the run started from, if any; check '
        'the data (token ids past model.vocab_size) and train.lr'
      )
    self.console.warn(f'step {step}: not saved, every step of this run so far was non-finite')
    return True

  def record(
    self,
    step: int,
    stop: int,
    m: dict,
    clock: metrics_lib.Clock,
    epoch: int | None = None,
    data: dict | None = None,
  ) -> None:
    """A metrics record, TensorBoard scalars, the leak check and a console line; restarts `clock`.
    `epoch`: the data epoch (0-based) the step's batch came from; `data`: a mixture's entries per
    source (tokens/NAME, epoch/NAME: jax3d/data/mixture.py)."""
    now = time.time()
    dt = (now - clock.t_last) / max(clock.steps, 1)
    tok_s = self.plan.tokens_per_step / dt if clock.steps else 0.0
    # memory_stats() exists only for this process's devices; metrics come from process 0.
    mem = memory_lib.sample(self.devices)
    mfu = self.mfu_meter(tok_s) if clock.steps else None
    record = (
      {
        'step': step,
        'loss': float(m['loss']),
        'lr': float(m['lr']),
        'grad_norm': float(m['grad_norm']),
        'tokens_per_sec': tok_s,
        'step_time_s': dt,
        'tokens': step * self.plan.tokens_per_step,
        'epoch': epoch,
        'mfu': mfu,
        'memory': mem,
      }
      | (data or {})
      | _router_record(m)
    )
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

  def evaluation(self, step: int, loss: float, per_source: dict[str, float] | None = None) -> None:
    """The held-out loss at `step`: its record, TensorBoard scalar and console line; a mixture's
    loss per source (`per_source`: eval_loss/NAME) in the record and on the line."""
    record = {'step': step, 'eval_loss': loss} | (per_source or {})
    self.writer.write(record)
    self.tb.scalars(step, record)
    each = ''.join(f', {k.split("/", 1)[1]} {v:.4f}' for k, v in (per_source or {}).items())
    self.log(f'step {step:>6}  held-out loss {loss:.4f} nats/token ({loss / math.log(2):.3f} bits){each}')

  def tasks(self, step: int, results: dict, workdir: str | None) -> None:
    """lm-eval task results at `step`: one record of their scores ('task/TASK/METRIC'), their
    TensorBoard scalars, the table on the console and WORKDIR/eval/<step>.json (process 0)."""
    from jax3d.harness import offline_tasks
    from jax3d.trainer.task_eval import json_path

    scores = offline_tasks.scores(results)
    self.writer.write({'step': step, **scores})
    self.tb.scalars(step, scores)
    self.log(f'step {step:>6}  tasks:\n{offline_tasks.table(results)}')
    if workdir and metrics_lib.is_main_process():
      offline_tasks.write_json(results, json_path(workdir, step), {'step': step})


def _router_record(m: dict) -> dict:
  """A mixture of experts' router statistics (jax3d/loss.py `router_metrics`) as plain numbers:
  `moe_load` a list, one share per expert."""
  out = {k: float(m[k]) for k in ('moe_dropped', 'moe_aux_loss', 'moe_z_loss') if k in m}
  if 'moe_load' in m:
    out['moe_load'] = [round(float(x), 6) for x in m['moe_load']]
  return out
