"""`python -m jax3d.report WORKDIR` on a synthetic (but realistic) metrics.jsonl, resumed once."""

import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def _train(step, loss, run_speed=1.0):
  tokens_per_step = 16 * 128
  return {
    'step': step,
    'loss': loss,
    'lr': 3e-3 * min(1, step / 30),
    'grad_norm': 1.0 / (1 + step / 50),
    'tokens_per_sec': 9000.0 * run_speed + (step % 7) * 50,
    'step_time_s': 0.22 + (step % 5) * 0.01,
    'tokens': step * tokens_per_step,
    'mfu': None,
    'memory': {'bytes_in_use': [40_000_000 + 1000 * d for d in range(8)], 'peak_bytes': [None] * 8},
  }


def _write_run(workdir):
  layout = {'dp': 2, 'pp': 2, 'tp': 2, 'microbatches': 4, 'repeats': 1, 'grad_accum': 1}
  lines = [{'event': 'start', 'step': 0, 'layout': layout, 'config': {'train': {'steps': 300}}}]
  for step in range(10, 260, 10):  # the first run dies after step 250 (its last checkpoint: 200)
    lines.append(_train(step, 5.5 * math.exp(-step / 120) + 1.2))
    if step % 100 == 0:
      lines.append({'step': step, 'eval_loss': 5.5 * math.exp(-step / 120) + 1.3})
  lines.append({'event': 'nonfinite', 'step': 230, 'message': 'loss is nan; update skipped'})
  # Resumed from step 200: steps 210..250 are logged again (different numbers) and replace the old.
  lines.append({'event': 'start', 'step': 200, 'layout': layout, 'config': {'train': {'steps': 300}}})
  for step in range(210, 310, 10):
    lines.append(_train(step, 5.5 * math.exp(-step / 120) + 1.1, run_speed=1.1))
    if step % 100 == 0:
      lines.append({'step': step, 'eval_loss': 5.5 * math.exp(-step / 120) + 1.25})
  with open(workdir / 'metrics.jsonl', 'w') as f:
    f.write('\n'.join(json.dumps(r) for r in lines) + '\n{"step": 310, "lo')  # a torn last line
  return lines


def test_report_command(tmp_path):
  _write_run(tmp_path)
  proc = subprocess.run(
    [sys.executable, '-m', 'jax3d.report', str(tmp_path)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, 'PYTHONPATH': REPO, 'MPLBACKEND': 'Agg'},
  )
  assert proc.returncode == 0, proc.stderr
  out = tmp_path / 'report'
  pngs = ['loss.png', 'throughput.png', 'memory.png', 'step_time.png']
  for name in pngs:
    data = (out / name).read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, name
  md = (out / 'report.md').read_text()
  for name in pngs:
    assert f']({name})' in md
  final = 5.5 * math.exp(-300 / 120) + 1.1  # the resumed run's step 300
  assert f'final train loss: {final:.4f} (step 300)' in md
  assert f'final held-out loss: {5.5 * math.exp(-300 / 120) + 1.25:.4f} (step 300)' in md
  assert '| dp | pp | tp | microbatches | repeats | grad_accum |' in md and '| 2 | 2 | 2 | 4 | 1 | 1 |' in md
  assert 'MFU: unknown' in md and '`nonfinite`' in md and '1 unreadable line' in md


def test_resume_keeps_the_latest_record_of_each_step(tmp_path):
  from jax3d.analysis import run_report

  _write_run(tmp_path)
  run = run_report.load(str(tmp_path / 'metrics.jsonl'))
  steps = [r['step'] for r in run['train']]
  assert steps == list(range(10, 310, 10))  # one record per step, in order
  by_step = {r['step']: r for r in run['train']}
  assert by_step[250]['loss'] == pytest.approx(5.5 * math.exp(-250 / 120) + 1.1)  # the resumed run's
  assert by_step[200]['loss'] == pytest.approx(5.5 * math.exp(-200 / 120) + 1.2)  # before the resume point
  assert [r['step'] for r in run['eval']] == [100, 200, 300]
  assert run['bad_lines'] == 1


def test_missing_workdir_exits_2(tmp_path):
  proc = subprocess.run(
    [sys.executable, '-m', 'jax3d.report', str(tmp_path / 'nope')],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=60,
    env={**os.environ, 'PYTHONPATH': REPO},
  )
  assert proc.returncode == 2 and proc.stderr.startswith('error:')
