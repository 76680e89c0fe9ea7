"""The fused attention kernels (cuDNN, Pallas) against XLA's on a real GPU, and the compile-only
GPU figure against the real one: one table and JSON (issues 41, 42).

  python scripts/bench_attention_gpu.py [--layers=4] [--seq=2048] [--batch=4] [--steps=10] [--kernels=...]
                                        [--target=h200x1] [--json=bench_attention_gpu.json]

For each kernel (`--kernels`: train.attention = xla, cudnn, pallas, blockwise, auto) on the first GPU, mesh 1x1x1, bf16 compute, rows
of several documents (segment ids and positions): the first 3 losses and gradient norms from the
same seed and batches (the kernels must agree to bf16's precision), the median step time after 2
warm-ups, XLA's compiled bytes per device, and the device's peak bytes in use (memory_stats).
Then the same step compiled for `--target` (gpu_target: a GPU description, no GPU used), whose
memory_analysis must equal the real device's compile of the same program.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def document_rows(rng, rows: int, seq: int, vocab: int) -> dict:
  """Rows of 1 to 8 documents of uneven length: the five batch arrays."""
  import numpy as np

  from jax3d.data import packing

  b = packing.one_document_rows(rng.integers(0, vocab, (rows, seq + 1)))
  for r in range(rows):
    cuts = np.sort(rng.choice(np.arange(1, seq), size=int(rng.integers(0, 8)), replace=False))
    seg = np.searchsorted(cuts, np.arange(seq), side='right')
    b['segment_ids'][r] = seg + 1
    b['positions'][r] = np.arange(seq) - np.concatenate([[0], cuts])[seg]
  return b


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument('--layers', type=int, default=4)
  ap.add_argument('--seq', type=int, default=2048)
  ap.add_argument('--batch', type=int, default=4)
  ap.add_argument('--steps', type=int, default=10)
  ap.add_argument('--target', default='h200x1')
  ap.add_argument(
    '--kernels',
    default='xla,cudnn,pallas,blockwise,auto',
    help='train.attention values; xla and auto required',
  )
  ap.add_argument('--json', default='bench_attention_gpu.json')
  args = ap.parse_args(argv)

  from jax3d.devices import gpu_flags

  gpu_flags.apply_gpu_flags()
  import jax
  import numpy as np

  from jax3d import assemble, config as config_lib, step as step_lib
  from jax3d.devices import gpu_target

  over = {
    'model.n_layers': args.layers,
    'model.d_model': 2048,
    'model.n_heads': 16,
    'model.n_kv_heads': 8,
    'model.d_ff': 5632,
    'model.vocab_size': 32000,
    'model.max_seq_len': args.seq,
    'train.seq_len': args.seq,
    'train.global_batch_size': args.batch,
    'train.compute_dtype': 'bfloat16',
    'train.remat': 'none',
    'train.grad_clip': 1.0,
    'mesh.dp': 1,
    'mesh.pp': 1,
    'mesh.tp': 1,
    'pipeline.microbatches': 1,
  }
  dev = jax.devices()[0]
  rng = np.random.default_rng(0)
  batches = [document_rows(rng, args.batch, args.seq, 32000) for _ in range(3)]
  rows, out = [], {'device': dev.device_kind, 'jax': jax.__version__, 'args': vars(args), 'kernels': {}}
  for kernel in args.kernels.split(','):
    cfg = config_lib.load_config('tiny', dict(over, **{'train.attention': kernel}))
    s = assemble.build(cfg, [dev])
    compiled = assemble.compile_train_step(s)
    state = step_lib.make_init(s)(0)
    put = lambda b, sh=s.batch_sharding: {k: jax.device_put(v, sh) for k, v in b.items()}
    losses, norms, times = [], [], []
    for i in range(args.steps + 2):
      b = put(batches[min(i, 2)])
      t0 = time.perf_counter()
      state, m = compiled(state, b)
      jax.block_until_ready(m['loss'])
      times.append(time.perf_counter() - t0)
      if i < 3:
        losses.append(float(m['loss']))
        norms.append(float(m['grad_norm']))
    stats = dev.memory_stats() or {}
    r = {
      'losses': losses,
      'grad_norms': norms,
      'step_s_median': statistics.median(times[2:]),
      'compiled_bytes': compiled.memory,
      'peak_bytes_in_use': stats.get('peak_bytes_in_use'),
      'kernel_in_program': compiled.analysis()['attention_kernel'],
    }
    out['kernels'][kernel] = r
    rows.append((kernel, r))
    del state, compiled
  # The same program compiled for a described GPU (no device used) against the real compile.
  cfg = config_lib.load_config('tiny', dict(over, **{'train.attention': 'auto'}))
  t = gpu_target.parse(args.target)
  s = assemble.build(cfg, gpu_target.devices(t))
  described = assemble.compile_train_step(s, gpu_target.compiler_options())
  out['described'] = {
    'target': t.name,
    'kernel': s.dims.attention,
    'compiled_bytes': described.memory,
    'real_auto_compiled_bytes': out['kernels']['auto']['compiled_bytes'],
  }
  x, c = out['kernels']['xla'], out['kernels']['auto']
  out['loss_rel_diff'] = {
    k: max(abs(a / b - 1) for a, b in zip(r['losses'], x['losses'], strict=True)) for k, r in rows
  }
  print(
    f'{dev.device_kind}, jax {jax.__version__}: {args.layers} layers d 2048, batch {args.batch} x seq {args.seq}, bf16'
  )
  print(
    f'{"kernel":8s}{"losses (3 steps)":>36s}{"step ms":>10s}{"compiled GiB":>14s}{"peak GiB":>10s}  in program'
  )
  for k, r in rows:
    print(
      f'{k:8s}{" ".join(f"{v:.5f}" for v in r["losses"]):>36s}{r["step_s_median"] * 1e3:10.1f}'
      f'{r["compiled_bytes"]["total"] / 2**30:14.3f}{(r["peak_bytes_in_use"] or 0) / 2**30:10.3f}  {r["kernel_in_program"]}'
    )
  print(
    'losses against xla, max relative difference: '
    + ', '.join(f'{k} {v:.2e}' for k, v in out['loss_rel_diff'].items())
  )
  print(
    f'compiled for {t.name} without a device: {described.memory["total"] / 2**30:.3f} GiB '
    f'(temp {described.memory["temp"] / 2**30:.3f}); on the device: {c["compiled_bytes"]["total"] / 2**30:.3f} '
    f'(temp {c["compiled_bytes"]["temp"] / 2**30:.3f})'
  )
  with open(args.json, 'w') as f:
    json.dump(out, f, indent=1, default=float)
  return 0


if __name__ == '__main__':
  sys.exit(main())
