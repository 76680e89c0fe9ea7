"""Tokens/s and MFU of a 1B-class Llama on one GPU (bf16 compute, cuDNN/XLA attention through
jax.nn.dot_product_attention, donated state, jax3d's GPU XLA flags). Writes JSON.

  python scripts/bench_gpu.py [--steps=20] [--attention=auto|xla|cudnn] [--remat=dots]
                              [--batch=8] [--seq=2048] [--json=bench_gpu.json]
  python scripts/bench_gpu.py --smoke      # a tiny model on CPU: checks that the script runs

The 1B shape: 16 layers, d_model 2048, 16 heads (8 KV heads), d_ff 5632, vocab 32000
(~1.1B parameters). MFU = 6P+12Lhs FLOPs per token x tokens/s / the device's peak (jax3d.flops;
--peak_tflops for an unknown device). Step time is the median after 3 warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPE_1B = {
  'model.n_layers': 16,
  'model.d_model': 2048,
  'model.n_heads': 16,
  'model.n_kv_heads': 8,
  'model.d_ff': 5632,
  'model.vocab_size': 32000,
  'model.max_seq_len': 4096,
}
SHAPE_SMOKE = {
  'model.n_layers': 2,
  'model.d_model': 64,
  'model.n_heads': 4,
  'model.n_kv_heads': 2,
  'model.d_ff': 128,
  'model.vocab_size': 256,
}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument('--steps', type=int, default=20)
  ap.add_argument('--batch', type=int, default=8)
  ap.add_argument('--seq', type=int, default=2048)
  ap.add_argument('--attention', default='auto')
  ap.add_argument('--remat', default='dots')
  ap.add_argument('--compute_dtype', default='bfloat16')
  ap.add_argument('--peak_tflops', type=float, default=0.0)
  ap.add_argument('--json', default='bench_gpu.json')
  ap.add_argument('--smoke', action='store_true', help='tiny model, 3 steps, runs on CPU')
  args = ap.parse_args(argv)

  from jax3d.devices import gpu_flags

  if not args.smoke:
    added = gpu_flags.apply_gpu_flags()  # before jax starts its backend
  else:
    added = []
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import jax

  from jax3d import assemble, config as config_lib
  from jax3d.model import formulas as flops

  shape = SHAPE_SMOKE if args.smoke else SHAPE_1B
  steps, batch, seq = (4, 2, 32) if args.smoke else (args.steps, args.batch, args.seq)
  over = {
    **shape,
    'mesh.dp': 1,
    'mesh.pp': 1,
    'mesh.tp': 1,
    'pipeline.microbatches': 1,
    'train.global_batch_size': batch,
    'train.seq_len': seq,
    'train.remat': args.remat,
    'train.compute_dtype': args.compute_dtype,
    'train.param_dtype': 'float32',
    'train.attention': 'xla' if args.smoke else args.attention,
    'train.warmup_steps': 1,
  }
  cfg = config_lib.load_config('tiny', over)
  device = jax.devices()[0]
  s = assemble.build(cfg, [device])
  r = assemble.benchmark(s, steps)
  compile_s, times, m = r['compile_s'], r['step_times'], r['metrics']
  warm = times[3:] if len(times) > 3 else times
  step_s = statistics.median(warm)
  tok_s = batch * seq / step_s
  per_token = flops.flops_per_token(s.dims, seq)
  peak = flops.peak_flops(device, args.peak_tflops)
  mfu = flops.mfu(tok_s, per_token, peak, 1) if peak else None
  mem = r['compiled'].memory
  out = {
    'device': device.device_kind,
    'platform': device.platform,
    'smoke': args.smoke,
    'params': s.dims.param_count(),
    'batch': batch,
    'seq_len': seq,
    'remat': args.remat,
    'compute_dtype': args.compute_dtype,
    'attention': cfg.train.attention,
    'xla_flags': os.environ.get('XLA_FLAGS', ''),
    'gpu_flags_added': added,
    'compile_s': compile_s,
    'step_s': step_s,
    'tokens_per_sec': tok_s,
    'model_flops_per_token': per_token,
    'peak_flops': peak,
    'mfu': mfu,
    'loss': float(m['loss']),
    'argument_bytes': mem['argument'],
    'temp_bytes': mem['temp'],
  }
  with open(args.json, 'w') as f:
    json.dump(out, f, indent=1)
  mfu_txt = f'{mfu:.1%}' if mfu is not None else 'n/a (unknown peak: --peak_tflops)'
  print(
    f'{device.device_kind}: {s.dims.param_count() / 1e9:.2f}B params, {tok_s:,.0f} tokens/s, '
    f'step {step_s * 1e3:.1f} ms, MFU {mfu_txt}; wrote {args.json}'
  )
  return 0


if __name__ == '__main__':
  sys.exit(main())
