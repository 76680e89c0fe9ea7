"""ZeRO-3 (train.shard_params) and the chunked head (train.loss_chunks): bytes per device against dp,
compiled temp memory against loss_chunks, and step time of each option against its baseline.

  python scripts/bench_zero3.py [--only=bytes,chunks,time] [--rounds=3] [--steps=3]
                                [--out=bench_zero3.json] [--plot=PNG]

bytes   dp = 1, 2, 4, 8 (pp = tp = 1), shard_params off and on. Parameter and optimizer bytes per
        device of the compiled step: the state's shapes under the shardings XLA compiled it for
        (`input_shardings`, shard shape x itemsize), checked against memory_analysis's argument
        size (state + batch); the gradients live in XLA's temp figure (with the activations and
        the head). Beside them the planner's estimate (jax3d/planning/memory_model.py
        `breakdown`). Shape BYTES_SHAPE: 4 layers, d_model 512, d_ff 2048, vocab 8192, seq 128,
        8 rows, float32, remat none.
chunks  compiled temp memory against loss_chunks = 1, 2, 4, 8, 16 for a 32K vocabulary at seq 512
        (CHUNKS_SHAPE: 2 layers, d_model 256, 2 rows), on 1 device and on 1x1x2 (tp), with the
        planner's head and activation estimates.
time    step time, side by side: shard_params 'layer' and 'step' against off at 8x1x1, 2x2x2 m2
        and 4x1x2 (TIME_SHAPE: 4 layers, d_model 256, vocab 1024, seq 64, 8 rows); loss_chunks 8
        against 1 at CHUNKS_SHAPE on 1 device, 1 row. The programs of a case run in alternation,
        `--rounds` rounds of `--steps` steps each (the first step of a round dropped); each
        figure is the median of all kept steps, and the ratio is of medians from the same run.

Memory is XLA's own figure for the compiled step (nothing is allocated); fake CPU devices. Prints
the tables and writes the JSON (and, with --plot, a figure).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax3d.cli import prepare_devices  # noqa: E402

prepare_devices(8)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax3d import (  # noqa: E402
  assemble,
  config as config_lib,
  step as step_lib,  # noqa: E402
)
from jax3d.data import packing  # noqa: E402
from jax3d.planning import memory_model  # noqa: E402

MiB = 2**20
PARTS = ('bytes', 'chunks', 'time')
DPS = (1, 2, 4, 8)
CHUNKS = (1, 2, 4, 8, 16)
COMMON = {'train.remat': 'none', 'mesh.dp': 1, 'mesh.pp': 1, 'mesh.tp': 1, 'pipeline.microbatches': 1}
BYTES_SHAPE = COMMON | {
  'model.n_layers': 4,
  'model.d_model': 512,
  'model.n_heads': 8,
  'model.n_kv_heads': 8,
  'model.d_ff': 2048,
  'model.vocab_size': 8192,
  'train.seq_len': 128,
  'train.global_batch_size': 8,
}
CHUNKS_SHAPE = COMMON | {
  'model.n_layers': 2,
  'model.d_model': 256,
  'model.n_heads': 4,
  'model.n_kv_heads': 4,
  'model.d_ff': 1024,
  'model.vocab_size': 32768,
  'train.seq_len': 512,
  'train.global_batch_size': 2,
}
TIME_SHAPE = COMMON | {
  'model.n_layers': 4,
  'model.d_model': 256,
  'model.n_heads': 4,
  'model.n_kv_heads': 4,
  'model.d_ff': 1024,
  'model.vocab_size': 1024,
  'train.seq_len': 64,
  'train.global_batch_size': 8,
}
LAYOUTS = {  # dp x pp x tp [m micro-batches]
  '1x1x1': {},
  '1x1x2': {'mesh.tp': 2},
  '8x1x1': {'mesh.dp': 8},
  '2x2x2 m2': {'mesh.dp': 2, 'mesh.pp': 2, 'mesh.tp': 2, 'pipeline.microbatches': 2},
  '4x1x2': {'mesh.dp': 4, 'mesh.tp': 2},
}
CHUNK_LAYOUTS = ('1x1x1', '1x1x2')
ZERO3_LAYOUTS = ('8x1x1', '2x2x2 m2', '4x1x2')
ZERO3 = {
  'off': {'train.shard_params': False},
  'layer': {'train.shard_params': True, 'train.shard_params_gather': 'layer'},
  'step': {'train.shard_params': True, 'train.shard_params_gather': 'step'},
}


class _Parser(argparse.ArgumentParser):
  def error(self, message: str) -> NoReturn:  # one line, exit 2
    self.exit(2, f'{self.prog}: error: {message}\n')


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The flags; `only` becomes a list of PARTS. A bad flag exits 2 with one line."""
  ap = _Parser(prog='bench_zero3.py', description=__doc__.split('\n')[0])
  ap.add_argument('--only', default=','.join(PARTS), help='comma-separated parts: ' + ', '.join(PARTS))
  ap.add_argument('--rounds', type=int, default=3)
  ap.add_argument('--steps', type=int, default=3, help='steps per round and program (the first dropped)')
  ap.add_argument('--out', default='bench_zero3.json', help='JSON path')
  ap.add_argument('--plot', default='', help='PNG path (optional)')
  a = ap.parse_args(argv)
  a.only = [p for p in a.only.split(',') if p]
  bad = [p for p in a.only if p not in PARTS]
  if bad or not a.only:
    ap.error(f'--only: {",".join(bad) or "nothing"} is not one of {",".join(PARTS)}')
  if a.rounds < 1:
    ap.error(f'--rounds={a.rounds}: at least 1')
  if a.steps < 2:
    ap.error(f'--steps={a.steps}: at least 2 (the first step of a round is dropped)')
  return a


def make_setup(shape: dict, layout: str, **over: Any) -> assemble.Setup:
  """The built run of `shape` at `layout` (LAYOUTS) with config overrides, on the first devices."""
  cfg = config_lib.load_config('tiny', shape | LAYOUTS[layout] | over)
  n = cfg.mesh.dp * cfg.mesh.pp * cfg.mesh.tp
  return assemble.build(cfg, jax.devices()[:n])


def shard_bytes(abstract: Any, shardings: Any) -> int:
  """Bytes on one device of a tree of abstract arrays laid out by a matching tree of shardings
  (the largest shard: the same on every device for these even layouts)."""
  leaves = jax.tree.leaves(abstract)
  shs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  assert len(leaves) == len(shs), (len(leaves), len(shs))
  return sum(
    math.prod(sh.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize for a, sh in zip(leaves, shs, strict=True)
  )


def estimate(s: assemble.Setup) -> dict:
  """The planner's per-component bytes per device for this run."""
  return memory_model.breakdown(s.cfg, s.plan, flash=False)


# ---------------------------------------------------------------------------------------------
# bytes per device against dp
# ---------------------------------------------------------------------------------------------
def bytes_rows() -> list[dict]:
  rows = []
  for dp in DPS:
    for on in (False, True) if dp > 1 else (False,):  # at dp = 1 shard_params is off
      s = make_setup(BYTES_SHAPE, '1x1x1', **{'mesh.dp': dp, 'train.shard_params': on})
      c = assemble.compile_train_step(s)
      (state_sh, batch_sh), _ = c.executable.input_shardings
      got = {k: shard_bytes(s.abstract_state[k], state_sh[k]) for k in ('params', 'opt_state', 'step')}
      batch = shard_bytes(s.abstract_batch, batch_sh)
      est = estimate(s)
      r = {
        'dp': dp,
        'shard_params': on,
        'gather': s.gather.mode if s.gather else None,
        'params_mib': got['params'] / MiB,
        'optimizer_mib': got['opt_state'] / MiB,
        'argument_mib': c.memory['argument'] / MiB,
        'argument_check': c.memory['argument'] == sum(got.values()) + batch,
        'temp_mib': c.memory['temp'] / MiB,
        'est_params_mib': est['params'] / MiB,
        'est_grads_mib': est['grads'] / MiB,
        'est_optimizer_mib': est['optimizer'] / MiB,
        'est_activations_head_mib': (est['activations'] + est['head']) / MiB,
      }
      rows.append(r)
  base = next(r['params_mib'] + r['optimizer_mib'] for r in rows if r['dp'] == 1)
  for r in rows:
    r['state_vs_dp1'] = (r['params_mib'] + r['optimizer_mib']) / base
  return rows


def format_bytes(rows: list[dict]) -> list[str]:
  out = [
    '| dp | shard_params | params MiB (est) | optimizer MiB (est) | params+opt vs dp=1 | argument MiB '
    '| temp MiB | est grads MiB | est act+head MiB |',
    '|---:|---|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for r in rows:
    on = (
      r['gather']
      if r['shard_params'] and r['gather']
      else ('on (dp=1: no-op)' if r['shard_params'] else 'off')
    )
    check = '' if r['argument_check'] else ' (!)'
    out.append(
      f'| {r["dp"]} | {on} | {r["params_mib"]:.1f} ({r["est_params_mib"]:.1f}) '
      f'| {r["optimizer_mib"]:.1f} ({r["est_optimizer_mib"]:.1f}) | {r["state_vs_dp1"]:.3f} '
      f'| {r["argument_mib"]:.1f}{check} | {r["temp_mib"]:.1f} | {r["est_grads_mib"]:.1f} '
      f'| {r["est_activations_head_mib"]:.1f} |'
    )
  return out


# ---------------------------------------------------------------------------------------------
# temp memory against loss_chunks
# ---------------------------------------------------------------------------------------------
def chunks_rows() -> list[dict]:
  rows = []
  for layout in CHUNK_LAYOUTS:
    for n in CHUNKS:
      s = make_setup(CHUNKS_SHAPE, layout, **{'train.loss_chunks': n})
      mem = assemble.compile_train_step(s).memory
      est = estimate(s)
      rows.append(
        {
          'layout': layout,
          'loss_chunks': n,
          'temp_mib': mem['temp'] / MiB,
          'est_head_mib': est['head'] / MiB,
          'est_activations_mib': est['activations'] / MiB,
          'est_grads_mib': est['grads'] / MiB,
        }
      )
  base = {r['layout']: r['temp_mib'] for r in rows if r['loss_chunks'] == 1}
  for r in rows:
    r['temp_vs_1'] = r['temp_mib'] / base[r['layout']] if r['layout'] in base else float('nan')
  return rows


def format_chunks(rows: list[dict]) -> list[str]:
  out = [
    '| layout | loss_chunks | temp MiB | vs 1 chunk | est head MiB | est act+grads+head MiB |',
    '|---|---:|---:|---:|---:|---:|',
  ]
  for r in rows:
    est = r['est_head_mib'] + r['est_activations_mib'] + r['est_grads_mib']
    out.append(
      f'| {r["layout"]} | {r["loss_chunks"]} | {r["temp_mib"]:.1f} | {r["temp_vs_1"]:.3f} '
      f'| {r["est_head_mib"]:.1f} | {est:.1f} |'
    )
  return out


# ---------------------------------------------------------------------------------------------
# step time, side by side
# ---------------------------------------------------------------------------------------------
def side_by_side(setups: dict[str, assemble.Setup], rounds: int, steps: int) -> dict[str, list[list[float]]]:
  """Seconds of each kept step of each program, by round: the programs run in alternation, `steps`
  steps a round each (the first dropped: it waits for the other programs' leftovers)."""
  compiled, state, batch = {}, {}, {}
  for k, s in setups.items():
    compiled[k] = assemble.compile_train_step(s)
    state[k] = step_lib.make_init(s)(0)
    toks = np.random.default_rng(0).integers(0, s.dims.vocab_size, (s.plan.global_batch, s.plan.seq_len + 1))
    rows = packing.one_document_rows(toks.astype(np.int32))
    batch[k] = {n: jax.device_put(v, s.batch_sharding) for n, v in rows.items()}
  times: dict[str, list[list[float]]] = {k: [] for k in setups}
  for _ in range(rounds):
    for k in setups:
      kept = []
      for i in range(steps):
        t0 = time.perf_counter()
        state[k], m = compiled[k](state[k], batch[k])
        jax.block_until_ready(m['loss'])
        if i:
          kept.append(time.perf_counter() - t0)
      times[k].append(kept)
  return times


def time_rows(rounds: int, steps: int) -> list[dict]:
  """The side-by-side cases: ZeRO-3's gathers against off at ZERO3_LAYOUTS (TIME_SHAPE), and
  loss_chunks 8 against 1 at CHUNKS_SHAPE on one device (one row: the head's FLOPs dominate)."""
  chunks = {'chunks 1': {'train.loss_chunks': 1}, 'chunks 8': {'train.loss_chunks': 8}}
  chunks = {k: v | {'train.global_batch_size': 1} for k, v in chunks.items()}
  cases = [(layout, TIME_SHAPE, ZERO3, 'off') for layout in ZERO3_LAYOUTS]
  cases.append(('1x1x1', CHUNKS_SHAPE, chunks, 'chunks 1'))
  rows: list[dict] = []
  print('\n'.join(format_time([])), flush=True)
  for layout, shape, variants, base in cases:
    times = side_by_side({k: make_setup(shape, layout, **v) for k, v in variants.items()}, rounds, steps)
    new = summarize_times(layout, times, base)
    print('\n'.join(format_time(new)[2:]), flush=True)
    rows.extend(new)
  return rows


def summarize_times(layout: str, times: dict[str, list[list[float]]], base: str) -> list[dict]:
  """One row per variant other than `base`: the medians of all kept steps (ms), their ratio, and
  the ratios of each round's medians (the spread)."""
  med = {k: statistics.median([t for r in v for t in r]) for k, v in times.items()}
  rows = []
  for k, v in times.items():
    if k == base:
      continue
    per_round = [statistics.median(a) / statistics.median(b) for a, b in zip(v, times[base], strict=True)]
    rows.append(
      {
        'layout': layout,
        'baseline': base,
        'variant': k,
        'baseline_ms': med[base] * 1e3,
        'variant_ms': med[k] * 1e3,
        'ratio': med[k] / med[base],
        'round_ratios': per_round,
        'steps_timed': sum(len(r) for r in v),
      }
    )
  return rows


def format_time(rows: list[dict]) -> list[str]:
  out = [
    '| layout | variant / baseline | baseline ms | variant ms | ratio | rounds (min-max) |',
    '|---|---|---:|---:|---:|---:|',
  ]
  for r in rows:
    rr = r['round_ratios']
    out.append(
      f'| {r["layout"]} | {r["variant"]} / {r["baseline"]} | {r["baseline_ms"]:.1f} | {r["variant_ms"]:.1f} '
      f'| {r["ratio"]:.2f} | {min(rr):.2f}-{max(rr):.2f} |'
    )
  return out


# ---------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> None:
  a = parse_args(argv)
  report: dict[str, Any] = {
    'shapes': {'bytes': BYTES_SHAPE, 'chunks': CHUNKS_SHAPE, 'time': TIME_SHAPE},
    'devices': 'fake CPU',
    'jax': jax.__version__,
    'rounds': a.rounds,
    'steps': a.steps,
  }
  if 'bytes' in a.only:
    report['bytes'] = bytes_rows()
    print('\n'.join(['', 'bytes per device against dp (compiled; planner estimate in brackets)']))
    print('\n'.join(format_bytes(report['bytes'])), flush=True)
  if 'chunks' in a.only:
    report['chunks'] = chunks_rows()
    print('\n'.join(['', 'compiled temp memory against loss_chunks (vocab 32768, seq 512)']))
    print('\n'.join(format_chunks(report['chunks'])), flush=True)
  if 'time' in a.only:
    print(f'\nstep time, side by side ({a.rounds} rounds x {a.steps - 1} kept steps, medians)', flush=True)
    report['time'] = time_rows(a.rounds, a.steps)
  with open(a.out, 'w') as f:
    json.dump(report, f, indent=1)
  print(f'wrote {a.out}')
  if a.plot:
    plot(report, a.plot)
    print(f'wrote {a.plot}')


def plot(report: dict, path: str) -> None:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  panels = [p for p in ('bytes', 'chunks') if p in report]
  if not panels:
    return
  fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
  for ax, p in zip(axes[0], panels, strict=False):
    rows = report[p]
    if p == 'bytes':
      for on, style in ((False, 'o-'), (True, 's-')):
        rs = [r for r in rows if r['shard_params'] == on or r['dp'] == 1]  # dp = 1: the same
        lab = 'shard_params' if on else 'off'
        ax.plot(
          [r['dp'] for r in rs],
          [r['params_mib'] + r['optimizer_mib'] for r in rs],
          style,
          label=f'{lab}: compiled',
        )
        est = [r['est_params_mib'] + r['est_optimizer_mib'] for r in rs]
        ax.plot([r['dp'] for r in rs], est, style[0] + ':', alpha=0.6, label=f'{lab}: planner')
      ax.set_xlabel('dp')
      ax.set_ylabel('params + optimizer per device (MiB)')
      ax.set_title('ZeRO-3: state bytes per device')
    else:
      for layout in sorted({r['layout'] for r in rows}):
        rs = [r for r in rows if r['layout'] == layout]
        ax.plot(
          [r['loss_chunks'] for r in rs], [r['temp_mib'] for r in rs], 'o-', label=f'{layout}: compiled temp'
        )
        est = [r['est_head_mib'] + r['est_activations_mib'] + r['est_grads_mib'] for r in rs]
        ax.plot(
          [r['loss_chunks'] for r in rs], est, 'o:', alpha=0.6, label=f'{layout}: planner act+grads+head'
        )
      ax.set_xlabel('train.loss_chunks')
      ax.set_ylabel('temp memory per device (MiB)')
      ax.set_title('Chunked head: vocab 32768, seq 512')
    ax.set_xscale('log', base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == '__main__':
  main()
