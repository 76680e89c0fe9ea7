"""What a run reports: `WORKDIR/metrics.jsonl` records and the console (process 0 only).

metrics.jsonl contract: one JSON object per line, appended (a resumed run appends again; readers
take the last record of a step). Kinds of record:
  {"event": "start", "layout": {...}, "config": {...}}                 once per (re)start
  {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s", "tokens", "mfu", "memory"}
  {"step", "eval_loss"}                                                  held-out evaluations
  {"step", "event": "nonfinite" | "memory_leak" | "checkpoint" | ..., ...}
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import jax
import numpy as np


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


def fmt_bytes(n: float) -> str:
  """'512 B', '1.5 KiB', ... '2.0 TiB' (binary units)."""
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.1f} {unit}' if unit != 'B' else f'{int(n)} B'
    n /= 1024


def fmt_duration(s: float) -> str:
  """'m:ss', or 'h:mm:ss' from an hour on (negative durations show as 0:00)."""
  s = int(max(s, 0))
  return f'{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}' if s >= 3600 else f'{s // 60}:{s % 60:02d}'


class Console:
  """Console output of process 0: `log` lines, and a live rich progress bar on a terminal."""

  def __init__(self, total_steps: int, live: bool = True):
    self.main = is_main_process()
    self.total = total_steps
    self.live = live and self.main and sys.stdout.isatty()
    self.bar = self.task = None
    if self.live:
      from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
      self.bar = Progress(TextColumn('[bold]train'), BarColumn(), MofNCompleteColumn(),
                          TextColumn('{task.fields[stats]}'), TimeRemainingColumn(), transient=True)

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
