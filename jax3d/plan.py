"""python -m jax3d.plan: choose dp, pp, tp, micro-batches, remat for a config on a GPU cluster.

  python -m jax3d.plan --config=configs/llama3_70b.py --nodes=8 --gpus-per-node=8 --gpu-memory-gb=80
  ... --json | --emit (the --config.* overrides for jax3d.train) | --verify (XLA's own figure)

The search (jax3d/planning/planner.py) follows three placement rules: tp at most the GPUs of one
node (tensor parallelism stays on NVLink), pp a divisor of what remains, dp fills the rest; every
candidate is priced with `costmodel.estimate`, so "few layers -> more tp" falls out of the bubble.
When nothing fits, the out-of-memory ladder is printed with this config's numbers.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from jax3d import cli
from jax3d.config import Config, ConfigError, typed, validated
from jax3d.devices import gpu_target
from jax3d.errors import UsageError
from jax3d.planning import costmodel
from jax3d.planning.costmodel import GB, Hardware, estimate
from jax3d.planning.explain import explain
from jax3d.planning.memory_check import render, verify_memory
from jax3d.planning.oom import oom_ladder
from jax3d.planning.planner import (
  LAYOUT_KEYS,
  Candidate,
  search,
  shortlist,
  table,
  with_overrides,
)

if TYPE_CHECKING:
  import ml_collections

FLAGS = {
  'nodes': cli.Flag(int, 1, 'nodes in the cluster', cli.POSITIVE),
  'gpus_per_node': cli.Flag(int, 8, 'GPUs per node (one NVLink domain)', cli.POSITIVE),
  'gpu_memory_gb': cli.Flag(float, 80.0, 'memory per GPU, GB', cli.POSITIVE),
  'peak_tflops': cli.Flag(
    float, Hardware.peak_tflops, 'dense bf16 peak per GPU, TFLOP/s (H100/H200 SXM)', cli.POSITIVE
  ),
  'efficiency': cli.Flag(
    float,
    Hardware.efficiency,
    'achievable share of peak for the matmuls',
    cli.ranges.between(0, 1, low_open=True),
  ),
  'intra_node_gbps': cli.Flag(
    float, Hardware.intra_gbps, 'GB/s per GPU per direction inside a node', cli.POSITIVE
  ),
  'inter_node_gbps': cli.Flag(float, Hardware.inter_gbps, 'GB/s per GPU across nodes', cli.POSITIVE),
  'overlap': cli.Flag(
    float, Hardware.overlap, 'share of the backward pass that hides the dp all-reduce', cli.ranges.FRACTION
  ),
  'top': cli.Flag(int, 10, 'fitting layouts to list', cli.POSITIVE),
  'fixed': cli.Flag(bool, False, 'price only the layout the config sets (no search)'),
  'json': cli.Flag(bool, False, 'print the layouts as JSON'),
  'emit': cli.Flag(bool, False, 'print the --config overrides of the best layout for jax3d.train'),
  'verify': cli.Flag(
    bool, False, "compile the best layout (on fake CPU devices, or --target's GPUs); print XLA's memory"
  ),
  'target': cli.TARGET,
  'verify_top': cli.Flag(
    int,
    5,
    'with --verify --target: compile the best layouts in turn until one fits by the GPU compile',
    cli.POSITIVE,
  ),
}


def run(args: cli.Args) -> int:
  """Plans the layouts for parsed arguments, printing them; raises ConfigError when none fits."""
  from jax3d import assemble

  # The model the trainer would train: an hf: import's config.json, a tokenizer's vocabulary.
  f, cfg = args.flags, assemble.resolve(args.cfg)
  target = gpu_target.parse(f['target']) if f['target'] else None
  _target_agrees(args, target)
  hw = _hardware(f, target)
  if f['verify']:  # before jax starts a backend: n fake CPU devices (unless XLA_FLAGS is set)
    cli.prepare_devices(hw.n_devices)
  ranked = _fixed(cfg, hw) if f['fixed'] else search(cfg, hw)
  fit, misfits = shortlist(ranked, f['top']), _misfits(ranked)
  name = args.config_name
  verified = _verified(cfg, fit, target, f['verify_top']) if f['verify'] and fit else []
  if f['json']:  # stdout is exactly one JSON document; --verify adds XLA's figures to the rows compiled
    rows = [dict(c.row(), rank=i) for i, c in enumerate(fit, 1)] + [dict(c.row(), rank=None) for c in misfits]
    for i, v in verified:
      rows[i].update(v)
    print(json.dumps(rows, indent=1))
  elif f['emit'] and fit:
    print(' '.join(f'--config.{k}={v}' for k, v in fit[0].overrides.items()))
  else:
    _print_plan(name, typed(cfg), hw, ranked, fit, misfits)
  if not fit:
    worst = min(ranked, key=lambda c: c.est.total_bytes)
    if not f['json']:
      print(
        '\n' + '\n'.join(oom_ladder(with_overrides(cfg, worst.overrides), worst.plan, hw.memory_gb * GB, hw))
      )
    raise ConfigError(
      f'no layout of {name} fits {hw.nodes} x {hw.gpus_per_node} GPUs of '
      f'{hw.memory_gb:g} GB: the smallest {worst.est.reason}'
    )
  if verified and not f['json']:
    for i, v in verified:
      print(f'\nrank {i + 1}:' if target else '', *render(v, target), sep='\n')
  if target is not None and verified and not verified[-1][1]['fits']:
    raise ConfigError(
      f'--verify --target={target.name}: none of the {len(verified)} best layouts fits by the GPU compile '
      '(the estimate is below XLA:GPU; --verify_top=N compiles more)'
    )
  if target is not None and len(verified) > 1:
    print(f'\nthe best layout that fits by the GPU compile: rank {verified[-1][0] + 1}')
  return 0


def _verified(
  cfg: ml_collections.ConfigDict, fit: list, target: gpu_target.Target | None, top: int
) -> list[tuple[int, dict]]:
  """XLA's figures for the best layout; with a GPU target, for the best layouts in turn (at most
  `top`) until one fits by the GPU compile: (index in `fit`, verify_memory's result)."""
  out = []
  for i, c in enumerate(fit[: top if target else 1]):
    out.append((i, verify_memory(with_overrides(cfg, c.overrides), c.plan, target)))
    if target is None or out[-1][1]['fits']:
      break
  return out


def _target_agrees(args: cli.Args, target: gpu_target.Target | None) -> None:
  """--target sets the cluster: a --nodes, --gpus_per_node or --gpu_memory_gb given beside it must
  say the same (UsageError naming the flag otherwise), never be overruled without a word."""
  if target is None:
    return
  memory = round(target.memory_bytes / GB, 1)
  fixed = {'nodes': target.nodes, 'gpus_per_node': target.per_node, 'gpu_memory_gb': memory}
  for name, want in fixed.items():
    if name in args.given and round(args.flags[name], 1) != want:
      raise UsageError(
        f'--{name}={args.given[name]} is invalid: --target={target.name} is {target.nodes} node(s) x '
        f'{target.per_node} GPUs of {memory} GB; leave --{name} out or give {want}'
      )


def _hardware(f: dict, target: gpu_target.Target | None = None) -> Hardware:
  """The cluster of the flags; `--target` sets its nodes, GPUs per node, memory and fused attention."""
  return Hardware(
    nodes=target.nodes if target else f['nodes'],
    gpus_per_node=target.per_node if target else f['gpus_per_node'],
    memory_gb=target.memory_bytes / GB if target else f['gpu_memory_gb'],
    peak_tflops=f['peak_tflops'],
    efficiency=f['efficiency'],
    intra_gbps=f['intra_node_gbps'],
    inter_gbps=f['inter_node_gbps'],
    overlap=f['overlap'],
  )


def _fixed(cfg: ml_collections.ConfigDict, hw: Hardware) -> list[Candidate]:
  """--fixed: only the layout the config sets, priced."""
  c, plan = validated(cfg, hw.n_devices)
  layout = {k: c.to_dict()[k.split('.')[0]][k.split('.')[1]] for k in LAYOUT_KEYS}
  return [Candidate(layout, estimate(c, plan, hw.memory_gb * GB, hw))]


def _misfits(ranked: list[Candidate]) -> list[Candidate]:
  """For each mesh where nothing fits: the variant that needs least memory (least first)."""
  mesh = lambda p: (p.dp, p.pp, p.tp, p.cp, p.ep)
  seen, misfits = {mesh(c.plan) for c in ranked if c.est.fits}, []
  for c in sorted(ranked, key=lambda c: c.est.total_bytes):
    key = mesh(c.plan)
    if not c.est.fits and key not in seen:
      seen.add(key)
      misfits.append(c)
  return misfits


def _print_plan(
  name: str,
  cfg: Config,
  hw: Hardware,
  ranked: list[Candidate],
  fit: list[Candidate],
  misfits: list[Candidate],
) -> None:
  """The planner's text output: the model and machine, the layouts that fit, why the best, the rest."""
  n_params = costmodel.param_count(cfg)
  print(f'{name}: {n_params / 1e9:.2f}B' if n_params >= 1e9 else f'{name}: {n_params / 1e6:.1f}M', end='')
  print(
    f' parameters, batch '
    f'{cfg.train.global_batch_size} x {cfg.train.seq_len} tokens, on {hw.nodes} x '
    f'{hw.gpus_per_node} GPUs of {hw.memory_gb:g} GB ({hw.peak_tflops:g} TFLOP/s at '
    f'{hw.efficiency:.0%}, {hw.intra_gbps:g} GB/s in a node, {hw.inter_gbps:g} GB/s across)'
  )
  if fit:
    print(f'\nLayouts that fit ({sum(c.est.fits for c in ranked)} of {len(ranked)}), best first:')
    print('\n'.join(table(fit)))
    print('\n' + '\n'.join(explain(cfg, fit[0], ranked, hw)))
    print(f'  Estimate: {fit[0].est.describe()}')
  if misfits:
    print('\nLayouts that do not fit (least memory of each dp/pp/tp/cp/ep):')
    for c in misfits[:12]:
      p = c.plan
      cp = f' cp={p.cp}' if p.cp > 1 else f' ep={p.ep}' if p.ep > 1 else ''
      print(f'  dp={p.dp} pp={p.pp} tp={p.tp}{cp} (m={p.microbatches}, remat={c.est.remat}): {c.est.reason}')


def main(argv: list[str] | None = None) -> int:
  """Runs `python -m jax3d.plan` with argv (default sys.argv[1:]); returns the exit status."""
  return cli.run_command(run, cli.parse(sys.argv[1:] if argv is None else argv, __doc__, FLAGS))


if __name__ == '__main__':
  sys.exit(main())
