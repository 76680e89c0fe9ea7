"""Attention's memory and time per implementation (issue 42): `xla` (dense mask) against `auto`
(blockwise on CPU), side by side.

  python scripts/bench_attention_memory.py [--seqs=1024,2048,4096,8192,16384,32768]
                                           [--time_seqs=256,2048] [--steps=4] [--rounds=3]
                                           [--json=docs/bench/attention_memory.json]
  python scripts/bench_attention_memory.py --target=h100x8 [--seqs=8192] [--json=...]

Memory: the real train step (`assemble.compile_train_step`, rows of documents) compiled for one
CPU device, its temp bytes from XLA's memory_analysis (compile only, nothing allocated). Shape: 2
layers, d_model 256, 4 heads (head size 64), d_ff 1024, vocab 256, batch 1, float32, remat none.
Time: the same step run on rows of documents of 16 to 1024 tokens (data.packing=concat), both
programs in alternation, `--rounds` rounds of `--steps` steps (the first of a round dropped);
the figure is the median of the kept steps. Prints the tables and writes the JSON.

With `--target` (needs the CUDA plugin, no GPU): the train step of a 1B-shaped model (16 layers,
d_model 2048, 32/8 heads, d_ff 8192, vocab 32000, dp=8, 32K tokens of documents per GPU: 4 rows of
8K, 1 of 32K; bf16, remat dots) compiled for the target's GPUs with each train.attention (xla, cudnn, blockwise, pallas,
auto): bytes per GPU, whether it fits, and the optimised HLO's arrays of [seq, seq] (the dense
mask, cuDNN's bias, XLA's scores; at 8K also the MLP's [t, d_ff] activations of a row, d_ff being
8192); then the Pallas kernel's GQA cost (K/V repeated per group).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax3d.cli import prepare_devices  # noqa: E402

prepare_devices(1)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax3d import (  # noqa: E402
  assemble,
  config as config_lib,
  step as step_lib,  # noqa: E402
)
from jax3d.data import packing  # noqa: E402

SHAPE = {
  'model.n_layers': 2,
  'model.d_model': 256,
  'model.n_heads': 4,
  'model.n_kv_heads': 4,
  'model.d_ff': 1024,
  'model.vocab_size': 256,
  'train.global_batch_size': 1,
  'train.remat': 'none',
  'train.warmup_steps': 1,
  'model.max_seq_len': 32768,
  'mesh.dp': 1,
  'mesh.pp': 1,
  'mesh.tp': 1,
  'pipeline.microbatches': 1,
}
IMPLS = ('xla', 'auto')
MIB = 2**20


def setup(impl: str, seq: int, rows: int = 1) -> assemble.Setup:
  over = SHAPE | {'train.attention': impl, 'train.seq_len': seq, 'train.global_batch_size': rows}
  return assemble.build(config_lib.load_config('tiny', over), jax.devices()[:1])


def documents(rows: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Rows of documents of 16 to 1024 tokens, concatenated (data.packing=concat)."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(16, 1025, 4 * rows * seq // 256 + 4)
  starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
  docs = packing.Documents(rng.integers(0, vocab, starts[-1]), starts)
  return packing.layout(docs, seq, 'concat').rows(np.arange(rows))


def memory(seqs: list[int]) -> list[dict]:
  out = []
  print(f'{"seq":>6} ' + ' '.join(f'{i + " temp MiB":>15}' for i in IMPLS) + f' {"ratio":>7}')
  for seq in seqs:
    row = {'seq': seq}
    for impl in IMPLS:
      s = setup(impl, seq)
      row[f'{impl}_kernel'] = s.dims.attention
      row[f'{impl}_temp_bytes'] = int(assemble.compile_train_step(s).memory['temp'])
    row['ratio'] = row['xla_temp_bytes'] / row['auto_temp_bytes']
    out.append(row)
    print(
      f'{seq:>6} '
      + ' '.join(f'{row[f"{i}_temp_bytes"] / MIB:>15.1f}' for i in IMPLS)
      + f' {row["ratio"]:>7.2f}'
    )
  return out


def timing(seqs: list[int], steps: int, rounds: int) -> list[dict]:
  out = []
  print(f'{"seq":>6} ' + ' '.join(f'{i + " ms":>10}' for i in IMPLS) + f' {"auto/xla":>9}')
  for seq in seqs:
    rows = max(1, 4096 // seq)
    progs = {}
    for impl in IMPLS:
      s = setup(impl, seq, rows)
      host = documents(rows, seq, s.dims.vocab_size)
      batch = {k: jax.device_put(v, s.batch_sharding) for k, v in host.items()}
      progs[impl] = [assemble.compile_train_step(s), step_lib.make_init(s)(0), batch]
    times: dict[str, list[float]] = {k: [] for k in IMPLS}
    for _ in range(rounds):
      for impl, p in progs.items():
        for i in range(steps):
          t0 = time.perf_counter()
          p[1], m = p[0](p[1], p[2])
          jax.block_until_ready(m['loss'])
          if i:
            times[impl].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    row = {
      'seq': seq,
      'rows': rows,
      **{f'{k}_ms': v for k, v in med.items()},
      'steps_timed': len(times['xla']),
    }
    row['auto_over_xla'] = med['auto'] / med['xla']
    out.append(row)
    print(f'{seq:>6} ' + ' '.join(f'{med[i]:>10.1f}' for i in IMPLS) + f' {row["auto_over_xla"]:>9.3f}')
  return out


GPU_1B = {
  'model.n_layers': 16,
  'model.d_model': 2048,
  'model.n_heads': 32,
  'model.n_kv_heads': 8,
  'model.d_ff': 8192,
  'model.vocab_size': 32000,
  'model.max_seq_len': 32768,
  'train.compute_dtype': 'bfloat16',
  'train.remat': 'dots',
  'mesh.dp': 8,
  'mesh.pp': 1,
  'mesh.tp': 1,
  'pipeline.microbatches': 1,
}


GPU_KERNELS = ('xla', 'cudnn', 'blockwise', 'pallas', 'auto')
GPU_TOKENS = 32768  # tokens per GPU: 4 rows of 8K, 1 of 32K


def square_buffers(hlo: str, seq: int) -> list[str]:
  """The distinct array shapes of the optimised HLO whose last two dimensions are [seq, seq]."""
  return sorted(set(re.findall(rf'\b[a-z]+[0-9]*\[[0-9,]*\b{seq},{seq}\]', hlo)))


def gpu_memory(target: str, seqs: list[int]) -> list[dict]:
  from jax3d.analysis import inspection
  from jax3d.devices import gpu_target

  devices = gpu_target.devices(gpu_target.parse(target))
  cap = gpu_target.parse(target).memory_bytes
  out = []
  print(f'{target}, 1B-shaped model, rows of documents (bytes per GPU):')
  print(
    f'{"seq":>6} {"train.attention":>15} {"in program":>10} {"temp GiB":>9} {"total GiB":>10} {"fits":>5}  [t,t] buffers'
  )
  for seq in seqs:
    for impl in GPU_KERNELS:
      rows = 8 * max(1, GPU_TOKENS // seq)  # the same tokens per GPU at every length (dp=8)
      over = GPU_1B | {'train.seq_len': seq, 'train.global_batch_size': rows, 'train.attention': impl}
      s = assemble.build(config_lib.load_config('tiny', over), devices)
      c = assemble.compile_train_step(s, gpu_target.compiler_options())
      hlo = c.executable.as_text()
      m, sq = c.memory, square_buffers(hlo, seq)
      row = {
        'seq': seq,
        'attention': impl,
        'kernel': s.dims.attention,
        'in_program': inspection.attention_kernel(hlo),
      }
      row |= {k: int(m[k]) for k in ('temp', 'total')} | {'fits': m['total'] <= cap, 'square_buffers': sq}
      out.append(row)
      print(
        f'{seq:>6} {impl:>15} {row["in_program"]:>10} {m["temp"] / 2**30:>9.2f} {m["total"] / 2**30:>10.2f} '
        f'{str(row["fits"]):>5}  {" ".join(sq) or "none"}'
      )
  return out


def gqa_repeat_cost(target: str, seqs: list[int]) -> list[dict]:
  """The Pallas kernel has no GQA: K/V are repeated per query group. One GPU's attention of the
  1B shape (4 rows, 32 query heads of 64, bf16), forward and backward, compiled with its 8 K/V heads
  repeated against K/V given at 32 heads (no repeat): the temp bytes the repeat adds."""
  import jax.numpy as jnp

  from jax3d.devices import gpu_target
  from jax3d.model import pallas

  dev = gpu_target.devices(gpu_target.parse(target))[0]
  sh = jax.sharding.SingleDeviceSharding(dev)
  out = []
  print(
    f'GQA repeat (one GPU: 4 rows, 32 heads of 64, bf16): {"seq":>6} {"kv 8 temp MiB":>14} {"kv 32 temp MiB":>15}'
  )
  for seq in seqs:
    row = {'seq': seq}
    for kv in (8, 32):
      spec = lambda heads, seq=seq: jax.ShapeDtypeStruct((4, seq, heads, 64), jnp.bfloat16, sharding=sh)
      seg = jax.ShapeDtypeStruct((4, seq), jnp.int32, sharding=sh)
      step = lambda q, k, v, s: pallas.backward(q, k, v, s, pallas.attention(q, k, v, s))
      c = jax.jit(step).lower(spec(32), spec(kv), spec(kv), seg).compile(gpu_target.compiler_options())
      row[f'kv{kv}_temp'] = int(c.memory_analysis().temp_size_in_bytes)
    row['repeat_bytes'] = row['kv8_temp'] - row['kv32_temp']
    out.append(row)
    print(f'{"":>49}{seq:>6} {row["kv8_temp"] / 2**20:>14.1f} {row["kv32_temp"] / 2**20:>15.1f}')
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--seqs', default='1024,2048,4096,8192,16384,32768')
  ap.add_argument('--time_seqs', default='256,2048')
  ap.add_argument('--steps', type=int, default=4)
  ap.add_argument('--rounds', type=int, default=3)
  ap.add_argument('--json', default='docs/bench/attention_memory.json')
  ap.add_argument('--target', default='', help='e.g. h100x8: the GPU compile of a 1B-shaped model')
  args = ap.parse_args()
  ints = lambda s: [int(x) for x in s.split(',') if x]
  if args.target:
    mem = gpu_memory(args.target, ints(args.seqs))
    gqa = gqa_repeat_cost(args.target, ints(args.seqs))
    with open(args.json, 'w') as f:
      json.dump(
        {'shape': GPU_1B, 'target': args.target, 'jax': jax.__version__, 'memory': mem, 'gqa_repeat': gqa},
        f,
        indent=1,
      )
    print(f'wrote {args.json}')
    return
  mem = memory(ints(args.seqs))
  tim = timing(ints(args.time_seqs), args.steps, args.rounds)
  shape = {**SHAPE, 'devices': '1 CPU', 'jax': jax.__version__}
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, 'w') as f:
    json.dump({'shape': shape, 'memory': mem, 'time': tim}, f, indent=1)
  print(f'wrote {args.json}')


if __name__ == '__main__':
  main()
