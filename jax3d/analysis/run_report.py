"""Reading WORKDIR/metrics.jsonl and turning it into figures and a markdown page (the library of
`python -m jax3d.report`).

`load` keeps one record per step, the latest run's: the file is appended to by every (re)start, so
at each 'start' event what an earlier run logged after the resume point is forgotten, and for any
step the last record wins; a half-written last line (a killed run) is counted, not fatal.
`figures` writes the PNGs (loss and held-out loss against steps and tokens, throughput and MFU,
step time, memory per device); `markdown` the page; `write_report` both, into WORKDIR/report/.
Record kinds are described in jax3d/trainer/metrics.py.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax3d.errors import ConfigError


def load(path: str) -> dict:
  """{'train': [...], 'eval': [...], 'events': [...], 'bad_lines': n}, train and eval sorted by
  step with one record per step (the latest run's)."""
  train, evals, tasks, events, bad = {}, {}, {}, [], 0
  cut = None  # after a 'start' event: drop earlier records from this step on
  with open(path, 'rb') as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        rec = json.loads(line)
      except ValueError:  # not JSON, or not UTF-8
        rec = None
      if not isinstance(rec, dict):
        bad += 1  # e.g. the half-written last line of a killed run
        continue
      if 'event' in rec:
        events.append(rec)
        if rec['event'] == 'start':
          cut = ('resume', rec.get('step'))
        continue
      if 'step' not in rec:
        continue
      if cut is not None:
        first = cut[1] + 1 if cut[1] is not None else rec['step']
        for table in (train, evals, tasks):
          for s in [s for s in table if s >= first]:
            del table[s]
        cut = None
      if 'eval_loss' in rec:
        evals[rec['step']] = rec
      if 'loss' in rec:
        train[rec['step']] = rec
      if any(k.startswith('task/') for k in rec):  # lm-eval task scores (eval.tasks)
        tasks[rec['step']] = rec
  return {
    'train': [train[s] for s in sorted(train)],
    'eval': [evals[s] for s in sorted(evals)],
    'tasks': [tasks[s] for s in sorted(tasks)],
    'events': events,
    'bad_lines': bad,
  }


def _col(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of the records that have a finite number under key."""
  pts = [
    (r['step'], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
  ]
  return np.array([p[0] for p in pts]), np.array([p[1] for p in pts], np.float64)


def _tokens_at(train: Sequence[dict], steps: np.ndarray) -> np.ndarray:
  """Cumulative tokens at the given steps (interpolated from the training records)."""
  s, t = _col(train, 'tokens')
  return np.interp(steps, s, t) if len(s) else np.full(len(steps), np.nan)


def _mib_at(values: Sequence[float | None] | None, i: int) -> float:
  """values[i] in MiB, NaN when missing (no list, short list, or None)."""
  v = values[i] if values and i < len(values) else None
  return v / 2**20 if v is not None else float('nan')


def figures(run: dict, out_dir: str) -> dict[str, str]:
  """Writes the PNGs of a run (as `load` returns it) into out_dir; returns {name: filename} of
  those written (a figure without data is left out)."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  written = {}
  for name, draw in FIGURES:
    fig = draw(plt, run)
    if fig is None:
      continue
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f'{name}.png'), dpi=110)
    plt.close(fig)
    written[name] = f'{name}.png'
  return written


def _loss_figure(plt: Any, run: dict) -> Any:
  """Loss and held-out loss, against steps and against tokens seen."""
  train, evals = run['train'], run['eval']
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  s, loss = _col(train, 'loss')
  es, eloss = _col(evals, 'eval_loss')
  by_tokens = (ax2, _tokens_at(train, s), _tokens_at(train, es), 'tokens')
  for ax, x, ex, label in ((ax1, s, es, 'step'), by_tokens):
    ax.plot(x, loss, label='train loss', lw=1)
    if len(es):
      ax.plot(ex, eloss, 'o-', label='held-out loss', ms=3)
    ax.set_xlabel(label), ax.set_ylabel('loss (nats/token)'), ax.grid(alpha=0.3), ax.legend()
  return fig


def _throughput_figure(plt: Any, run: dict) -> Any:
  """Throughput and MFU."""
  fig, ax = plt.subplots(figsize=(11, 3.5))
  s, tps = _col(run['train'], 'tokens_per_sec')
  ax.plot(s, tps, lw=1, color='C0')
  ax.set_xlabel('step'), ax.set_ylabel('tokens/s', color='C0'), ax.grid(alpha=0.3)
  ms, mfu = _col(run['train'], 'mfu')
  if len(ms):
    ax2 = ax.twinx()
    ax2.plot(ms, 100 * mfu, lw=1, color='C1')
    ax2.set_ylabel('MFU (%)', color='C1')
  else:
    ax.set_title('MFU unknown (no peak FLOP/s for this device; set hardware.peak_tflops)', fontsize=9)
  return fig


def _memory_figure(plt: Any, run: dict) -> Any:
  """Memory: one curve per device; peaks dashed where the backend reports them (None: no data)."""
  mem = [r for r in run['train'] if isinstance(r.get('memory'), dict) and r['memory'].get('bytes_in_use')]
  if not mem:
    return None
  fig, ax = plt.subplots(figsize=(11, 4))
  steps = [r['step'] for r in mem]
  n_dev = max(len(r['memory']['bytes_in_use']) for r in mem)
  for i in range(n_dev):
    used = [_mib_at(r['memory'].get('bytes_in_use'), i) for r in mem]
    (line,) = ax.plot(steps, used, lw=1, label=f'device {i}')
    peaks = [_mib_at(r['memory'].get('peak_bytes'), i) for r in mem]
    if not np.all(np.isnan(peaks)):
      ax.plot(steps, peaks, '--', lw=0.8, color=line.get_color())
  for ev in run['events']:
    if ev.get('event') == 'memory_leak' and 'step' in ev:
      ax.axvline(ev['step'], color='red', lw=0.8, alpha=0.6)
  ax.set_xlabel('step'), ax.set_ylabel('MiB in use (dashed: peak)'), ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=min(n_dev, 8))
  return fig


def _step_time_figure(plt: Any, run: dict) -> Any:
  """Step time distribution (the first logged step includes compilation and is left out)."""
  _, st = _col(_after_first(run['train']), 'step_time_s')
  if not len(st):
    return None
  fig, ax = plt.subplots(figsize=(7, 3.5))
  ax.hist(st * 1e3, bins=min(40, max(5, len(st) // 3)), color='C2', alpha=0.8)
  for q, style in ((50, '-'), (90, '--'), (99, ':')):
    ax.axvline(np.percentile(st * 1e3, q), color='k', ls=style, lw=1, label=f'p{q}')
  ax.set_xlabel('step time (ms)'), ax.set_ylabel('log records'), ax.legend()
  return fig


def _tasks_figure(plt: Any, run: dict) -> Any:
  """Every lm-eval task score (eval.tasks: 'task/TASK/METRIC') against steps."""
  records = run.get('tasks', [])
  keys = sorted({k for r in records for k in r if k.startswith('task/')})
  if not keys:
    return None
  fig, ax = plt.subplots(figsize=(7, 4))
  for k in keys:
    ax.plot(*_col(records, k), 'o-', label=k[len('task/') :], ms=3)
  ax.set_xlabel('step'), ax.set_ylabel('score'), ax.grid(alpha=0.3), ax.legend(fontsize=8)
  return fig


FIGURES = (  # (name, draw(plt, run) -> figure or None), in the report's order
  ('loss', _loss_figure),
  ('tasks', _tasks_figure),
  ('throughput', _throughput_figure),
  ('memory', _memory_figure),
  ('step_time', _step_time_figure),
)
CAPTIONS = {
  'loss': 'Loss',
  'tasks': 'Task scores (lm-evaluation-harness)',
  'throughput': 'Throughput and MFU',
  'memory': 'Memory per device',
  'step_time': 'Step time distribution',
}


def _after_first(train: Sequence[dict]) -> Sequence[dict]:
  """The training records less the first (its step time includes compilation), if there are more."""
  return train[1:] if len(train) > 1 else train


def _fmt_bytes(b: float) -> str:
  return f'{b / 2**30:.2f} GiB' if b >= 2**30 else f'{b / 2**20:.1f} MiB'


def markdown(run: dict, written: dict[str, str], workdir: str) -> str:
  """The report page: the layout, the headline numbers and the figures `written` (name: file)."""
  events = run['events']
  start = next((e for e in reversed(events) if e.get('event') == 'start'), {})
  layout = start.get('layout', {})
  lines = [f'# Run report: `{os.path.abspath(workdir)}`', '']
  if layout:
    lines += [
      '| ' + ' | '.join(layout) + ' |',
      '|' + '---|' * len(layout),
      '| ' + ' | '.join(str(v) for v in layout.values()) + ' |',
      '',
    ]
  head = _progress_lines(run['train'], run['eval']) + _median_lines(run['train'])
  head += _memory_lines(run['train']) + _event_lines(events)
  if run['bad_lines']:
    head.append(f'- {run["bad_lines"]} unreadable line(s) in metrics.jsonl skipped')
  lines += ['## Headline numbers', ''] + head + ['']
  for name, fname in written.items():
    lines += [f'## {CAPTIONS.get(name, name)}', '', f'![{name}]({fname})', '']
  return '\n'.join(lines)


def _progress_lines(train: Sequence[dict], evals: Sequence[dict]) -> list[str]:
  """Steps and tokens logged, the final train loss, the final and best held-out loss."""
  head = []
  if train:
    last = train[-1]
    tokens = f', {last["tokens"] / 1e6:.2f} M tokens' if isinstance(last.get('tokens'), (int, float)) else ''
    head.append(f'- steps logged: {len(train)}, last step {last["step"]}{tokens}')
    head.append(f'- final train loss: {last["loss"]:.4f} (step {last["step"]})')
  if evals:
    best = min(evals, key=lambda r: r['eval_loss'] if math.isfinite(r['eval_loss']) else math.inf)
    head.append(
      f'- final held-out loss: {evals[-1]["eval_loss"]:.4f} (step {evals[-1]["step"]}); '
      f'best {best["eval_loss"]:.4f} (step {best["step"]})'
    )
  return head


def _median_lines(train: Sequence[dict]) -> list[str]:
  """Median throughput and MFU, median and p90 step time (the first record left out)."""
  medians = (
    ('tokens_per_sec', 'tokens/s (median)', '{:,.0f}'),
    ('mfu', 'MFU (median)', '{:.1%}'),
    ('step_time_s', 'step time (median / p90)', None),
  )
  head = []
  for key, label, fmt in medians:
    _, v = _col(_after_first(train), key)
    if len(v):
      text = (
        f'{np.median(v) * 1e3:.1f} / {np.percentile(v, 90) * 1e3:.1f} ms'
        if fmt is None
        else fmt.format(np.median(v))
      )
      head.append(f'- {label}: {text}')
    elif key == 'mfu':
      head.append('- MFU: unknown (no peak FLOP/s known for this device; set hardware.peak_tflops)')
  return head


def _memory_lines(train: Sequence[dict]) -> list[str]:
  """The most memory in use on any device, and the allocator's peak where reported."""
  mem = [r['memory'] for r in train if isinstance(r.get('memory'), dict) and r['memory'].get('bytes_in_use')]
  if not mem:
    return []
  peak_used = max(max(m['bytes_in_use']) for m in mem)
  peaks = [p for m in mem for p in (m.get('peak_bytes') or []) if p is not None]
  return [
    f'- memory: max in use on any device {_fmt_bytes(peak_used)}'
    + (f', allocator peak {_fmt_bytes(max(peaks))}' if peaks else '')
  ]


def _event_lines(events: Sequence[dict]) -> list[str]:
  """How many memory-leak and non-finite events, and the first of each."""
  head = []
  for kind in ('memory_leak', 'nonfinite'):
    evs = [e for e in events if e.get('event') == kind]
    if evs:
      first = (
        f'- {len(evs)} `{kind}` event(s), first at step {evs[0].get("step")}: {evs[0].get("message", "")}'
      )
      head.append(first.rstrip(': '))
  return head


def write_report(workdir: str) -> str:
  """Reads WORKDIR/metrics.jsonl, writes WORKDIR/report/; returns the report.md path."""
  metrics = os.path.join(workdir, 'metrics.jsonl')
  run = load(metrics)
  if run['bad_lines'] and not (run['train'] or run['eval'] or run['events']):
    raise ConfigError(
      f'WORKDIR={workdir}: {metrics} holds no metrics record ({run["bad_lines"]} line(s) that are not '
      "JSON objects): not a jax3d run's metrics.jsonl"
    )
  out_dir = os.path.join(workdir, 'report')
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ConfigError(
      f'WORKDIR={workdir}: {out_dir} is a file; the report is written into a folder of that name'
    )
  os.makedirs(out_dir, exist_ok=True)
  written = figures(run, out_dir)
  path = os.path.join(out_dir, 'report.md')
  with open(path, 'w') as f:
    f.write(markdown(run, written, workdir))
  return path
