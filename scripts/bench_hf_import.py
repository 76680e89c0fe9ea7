"""Import time and peak host memory of a ~1.2B-parameter Hugging Face Llama 3.2 (issues 15 and 30).

  python scripts/bench_hf_import.py [--dir=/tmp/jax3d_hf_llama32] [--layout=2x2x2]
                                    [--shape=llama3.2-1b] [--param_dtype=float32] [--json=...]

Builds once (cached in --dir; rebuilt when its config.json is another shape) a random
`LlamaForCausalLM` with transformers shaped as Llama-3.2-1B: hidden 2048, 16 layers, 32 heads over
8 KV heads (GQA), intermediate 8192, vocabulary 128256, tied embeddings, llama3 rope scaling
(factor 32, original context 8192, rope_theta 500000): 1.24B parameters, in bfloat16 (as published
checkpoints are, and what jax3d reads through its memory map; 2.5 GB on disk). `--shape=1b` is
issue 15's untied Llama-2-style 1.07B model. Norm scales randomised, saved with `save_pretrained(safe_serialization=True)` in 1 GB shards with
an index. Then, in a fresh process (only the importer's memory in its RSS; the parent imports
neither jax nor torch, since a child's ru_maxrss starts from its parent's at exec), imports it on
8 fake CPU devices onto --layout (DPxPPxTP, microbatches 4 when pipelined) through the trainer's own
path: `assemble.build` (config.json, tensor headers, layout check, shardings), then
`hf.weights.load_params` (what `--config.checkpoint.init_from=hf:PATH` runs in Trainer.init_state),
and waits for the arrays. Reported: seconds (headers and setup, loading, total), the RSS before
the import (after jax is up), the peak RSS (`ru_maxrss`), the RSS after, the bytes the devices hold
(fake CPU devices live in the host's memory, dp copies of the replicated parameters included, so
peak - after is what the import itself held on the way), parameter count and bytes on disk.

Checked after the measurement: every parameter's shape (against shapes derived from config.json),
dtype and sharding, and the canonical first and last layers (in different pipeline stages),
embedding, final norm and head equal the safetensors data read independently (torch through
`safetensors.safe_open(..., 'pt')`) exactly (bf16 -> fp32 is exact). `--shape=small` (2 layers,
hidden 256) exercises the script in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LLAMA3_ROPE = dict(
  rope_type='llama3',
  factor=32.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=8192,
)
SHAPES = {
  'llama3.2-1b': dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    rope_scaling=LLAMA3_ROPE,
    max_position_embeddings=131072,
  ),
  '1b': dict(
    hidden_size=2048,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=5632,
    vocab_size=32000,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    max_position_embeddings=2048,
  ),
  'small': dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=688,
    vocab_size=1000,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    rope_scaling=dict(LLAMA3_ROPE, original_max_position_embeddings=64),
    max_position_embeddings=2048,
  ),
}
COMMON = dict(rms_norm_eps=1e-5)
# config.json keys the cache check compares (transformers 5 folds rope_scaling into rope_parameters)
CACHE_KEYS = ('hidden_size', 'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads')
CACHE_KEYS += ('intermediate_size', 'vocab_size', 'tie_word_embeddings')
MB = 2**20


def parse_layout(s: str) -> tuple[int, int, int]:
  try:
    dp, pp, tp = (int(x) for x in s.split('x'))
  except ValueError:
    raise argparse.ArgumentTypeError(f'--layout={s!r}: give DPxPPxTP, e.g. 2x2x2') from None
  if dp * pp * tp > 8:
    raise argparse.ArgumentTypeError(f'--layout={s!r}: {dp * pp * tp} devices, there are 8')
  return dp, pp, tp


def _cached(folder: str, shape: dict) -> bool:
  try:
    with open(os.path.join(folder, 'config.json')) as f:
      c = json.load(f)
  except (OSError, ValueError):
    return False
  same = all(c.get(k) == shape[k] for k in CACHE_KEYS)
  return same and c.get('dtype', c.get('torch_dtype')) == 'bfloat16'


def build(folder: str, shape_name: str, max_shard_size: str) -> None:
  """The random bf16 LlamaForCausalLM, saved by transformers (run in its own process)."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM

  t0 = time.perf_counter()
  torch.manual_seed(0)
  torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the memory of fp32, then cast
  model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape_name], **COMMON, dtype='bfloat16')).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):  # transformers initialises them to 1: make the check see them
        p.copy_(1 + 0.1 * torch.randn_like(p))
  os.makedirs(folder, exist_ok=True)
  for n in os.listdir(folder):  # an older build's shards (another shape) must not linger
    if n.endswith('.safetensors') or n == 'model.safetensors.index.json':
      os.remove(os.path.join(folder, n))
  model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
  n = sum(p.numel() for p in model.parameters())
  print(
    f'built {n / 1e9:.3f}B-parameter LlamaForCausalLM (bf16) in {folder} in {time.perf_counter() - t0:.1f} s'
  )


def _status() -> dict[str, int]:
  """VmRSS / VmHWM of this process, bytes."""
  with open('/proc/self/status') as f:
    rows = dict(line.split(':', 1) for line in f if ':' in line)
  return {k: int(rows[k].split()[0]) * 1024 for k in ('VmRSS', 'VmHWM')}


def _maxrss() -> int:
  import resource

  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child_import(folder: str, layout: tuple[int, int, int], param_dtype: str, out: str) -> None:
  """Imports the folder in this (fresh) process and writes the figures and checks to `out`."""
  from jax3d.cli import prepare_devices

  prepare_devices(8)
  import jax

  from jax3d import assemble, config as config_lib
  from jax3d.hf import weights as hf_weights

  jax.devices()  # the backend is up
  rss_before, maxrss_before = _status()['VmRSS'], _maxrss()
  dp, pp, tp = layout
  n = dp * pp * tp
  cfg = config_lib.load_config(
    'finetune',
    {
      'checkpoint.init_from': f'hf:{folder}',
      'mesh.dp': dp,
      'mesh.pp': pp,
      'mesh.tp': tp,
      'pipeline.microbatches': 4 if pp > 1 else 1,
      'train.param_dtype': param_dtype,
    },
  )
  t0 = time.perf_counter()
  s = assemble.build(cfg, jax.devices()[:n])  # config.json, every tensor's header, the layout check
  t1 = time.perf_counter()
  params = hf_weights.load_params(s)
  jax.block_until_ready(params)
  t2 = time.perf_counter()
  peak, st = _maxrss(), _status()
  leaves = jax.tree_util.tree_leaves_with_path(params)
  device_bytes = sum(sh.data.nbytes for _, a in leaves for sh in a.addressable_shards)
  largest = max(leaves, key=lambda kv: kv[1].nbytes)
  hf = s.hf
  files = sorted({f for f, _, _ in hf.tensors.values()})
  r = {
    'layout': f'{dp}x{pp}x{tp}',
    'n_devices': n,
    'param_dtype': param_dtype,
    'params': sum(int(_prod(shape)) for _, shape, _ in hf.tensors.values()),
    'jax3d_params': sum(int(a.size) for _, a in leaves),
    'disk_bytes': sum(os.path.getsize(f) for f in files),
    'files': len(files),
    'headers_setup_s': t1 - t0,
    'load_s': t2 - t1,
    'import_s': t2 - t0,
    'rss_before_bytes': rss_before,
    'maxrss_before_bytes': maxrss_before,
    'peak_rss_bytes': peak,
    'vmhwm_bytes': st['VmHWM'],
    'rss_after_bytes': st['VmRSS'],
    'device_bytes': device_bytes,
    'model_bytes': sum(int(a.nbytes) for _, a in leaves),
    'largest_param': {'name': jax.tree_util.keystr(largest[0]), 'bytes': int(largest[1].nbytes)},
  }
  r['checks'] = check(params, s, hf)
  with open(out, 'w') as f:
    json.dump(r, f)


def _prod(shape: tuple[int, ...]) -> int:
  out = 1
  for x in shape:
    out *= x
  return out


def check(params, s, hf) -> dict:
  """Every parameter's shape (from config.json), dtype and sharding; first/last layer, embedding,
  final norm and head equal to the safetensors data (read with torch, not jax3d's reader)."""
  import jax
  import numpy as np
  import torch
  from safetensors import safe_open

  c = hf.config
  d, L, n = c['hidden_size'], c['num_hidden_layers'], c['num_attention_heads']
  k, f, v = c['num_key_value_heads'], c['intermediate_size'], c['vocab_size']
  h, g, vp = d // n, n // k, s.dims.vocab_padded
  assert vp >= v and vp % s.cfg.model.vocab_multiple == 0, (vp, v)
  tied = bool(c.get('tie_word_embeddings'))
  want = {
    "['embed']['embedding']": (vp, d),
    "['head']['norm']['scale']": (d,),
    **({} if tied else {"['head']['out']['kernel']": (d, vp)}),
    "['layers']['attn_norm']['scale']": (L, d),
    "['layers']['mlp_norm']['scale']": (L, d),
    "['layers']['qkv']['kernel']": (L, d, k, g + 2, h),
    "['layers']['o']['kernel']": (L, n, h, d),
    "['layers']['gate_up']['kernel']": (L, d, 2, f),
    "['layers']['down']['kernel']": (L, f, d),
  }
  abstract = dict(jax.tree_util.tree_leaves_with_path(s.abstract_state['params']))
  got = jax.tree_util.tree_leaves_with_path(params)
  bad = []
  for path, a in got:
    name, ab = jax.tree_util.keystr(path), abstract[path]
    if (
      tuple(a.shape) != want.get(name)
      or a.dtype != ab.dtype
      or not a.sharding.is_equivalent_to(ab.sharding, a.ndim)
    ):
      bad.append(f'{name}: {a.shape} {a.dtype} {a.sharding}, want {want.get(name)} {ab.dtype} {ab.sharding}')
  if len(got) != len(want):
    bad.append(f'{len(got)} parameters, want {len(want)}')
  if bad:  # the values are compared only on the right shapes
    return {'ok': False, 'problems': bad, 'parameters_checked': len(got), 'tensors_compared': []}

  handles: dict[str, object] = {}

  def hf_tensor(name: str) -> np.ndarray:
    file = hf.tensors[name][0]
    if file not in handles:
      handles[file] = safe_open(file, 'pt')
    return handles[file].get_tensor(name).to(torch.float32).numpy()

  get = lambda a: np.asarray(jax.device_get(a), np.float32)
  pairs = []  # (HF name, jax3d's tensor in HF layout)
  position = np.argsort(s.layer_order)  # canonical layer i is stored at position[i]
  for i in sorted({0, L - 1}):
    lay = lambda leaf, sub='kernel', i=i: get(params['layers'][leaf][sub][int(position[i])])
    qkv = lay('qkv')  # [d, k, g+2, h]: per KV head its g query heads, then K, then V
    p = f'model.layers.{i}.'
    pairs += [
      (p + 'self_attn.q_proj.weight', qkv[:, :, :g].transpose(1, 2, 3, 0).reshape(n * h, d)),
      (p + 'self_attn.k_proj.weight', qkv[:, :, g].transpose(1, 2, 0).reshape(k * h, d)),
      (p + 'self_attn.v_proj.weight', qkv[:, :, g + 1].transpose(1, 2, 0).reshape(k * h, d)),
      (p + 'self_attn.o_proj.weight', lay('o').reshape(n * h, d).T),
      (p + 'mlp.gate_proj.weight', lay('gate_up')[:, 0].T),
      (p + 'mlp.up_proj.weight', lay('gate_up')[:, 1].T),
      (p + 'mlp.down_proj.weight', lay('down').T),
      (p + 'input_layernorm.weight', lay('attn_norm', 'scale')),
      (p + 'post_attention_layernorm.weight', lay('mlp_norm', 'scale')),
    ]
  embed = get(params['embed']['embedding'])
  out = embed.T if tied else get(params['head']['out']['kernel'])  # a tied head is the embedding
  pairs += [
    ('model.embed_tokens.weight', embed[:v]),
    ('model.norm.weight', get(params['head']['norm']['scale'])),
  ]
  pairs += [] if tied else [('lm_head.weight', out[:, :v].T)]
  if vp > v and (np.any(embed[v:]) or np.any(out[:, v:])):
    bad.append('padded vocabulary rows are not zero')
  for name, mine in pairs:
    ref = hf_tensor(name)
    if mine.shape != ref.shape or not np.array_equal(mine, ref):
      diff = float(np.max(np.abs(mine - ref))) if mine.shape == ref.shape else float('inf')
      bad.append(f'{name}: differs from the safetensors data (max |diff| {diff:.3g})')
  return {
    'ok': not bad,
    'problems': bad,
    'parameters_checked': len(got),
    'tensors_compared': [x for x, _ in pairs],
  }


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--dir', default='/tmp/jax3d_hf_llama32', help='where the model is built once and cached')
  ap.add_argument('--layout', type=parse_layout, default=(2, 2, 2), help='DPxPPxTP on 8 fake CPU devices')
  ap.add_argument('--shape', choices=sorted(SHAPES), default='llama3.2-1b')
  ap.add_argument('--param_dtype', choices=('float32', 'bfloat16'), default='float32')
  ap.add_argument('--max_shard_size', default='1GB', help="save_pretrained's shard size")
  ap.add_argument('--json', default='bench_hf_import.json')
  ap.add_argument('--_import', default='', help=argparse.SUPPRESS)  # the child: write figures here
  ap.add_argument('--_build', action='store_true', help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args._build:
    build(args.dir, args.shape, args.max_shard_size)
    return
  if args._import:
    child_import(args.dir, args.layout, args.param_dtype, args._import)
    return
  if _cached(args.dir, SHAPES[args.shape]):
    print(f'using the model cached in {args.dir}')
  else:
    cmd = [sys.executable, __file__, '--_build', f'--dir={args.dir}', f'--shape={args.shape}']
    if rc := subprocess.run(cmd + [f'--max_shard_size={args.max_shard_size}']).returncode:
      sys.exit(rc)
  dp, pp, tp = args.layout
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'r.json')
    cmd = [sys.executable, __file__, f'--dir={args.dir}', f'--layout={dp}x{pp}x{tp}']
    if rc := subprocess.run(cmd + [f'--param_dtype={args.param_dtype}', f'--_import={out}']).returncode:
      sys.exit(rc)  # the importer's error (e.g. a ConfigError naming the file) is above
    with open(out) as f:
      r = json.load(f)
  gib = lambda b: f'{b / 2**30:.2f} GiB'
  rows = [
    ('layout (dp x pp x tp)', r['layout'] + f', {r["n_devices"]} fake CPU devices'),
    ('parameters', f'{r["params"] / 1e9:.3f}B ({r["params"]:,})'),
    ('on disk (bf16 safetensors)', f'{gib(r["disk_bytes"])} in {r["files"]} files'),
    ('import: headers + setup', f'{r["headers_setup_s"]:.2f} s'),
    ('import: load_params', f'{r["load_s"]:.2f} s'),
    ('import: total', f'{r["import_s"]:.2f} s'),
    ('RSS before the import', gib(r['rss_before_bytes'])),
    ('peak RSS (ru_maxrss)', gib(r['peak_rss_bytes'])),
    ('RSS after the import', gib(r['rss_after_bytes'])),
    (f'model in jax3d ({r["param_dtype"]})', gib(r['model_bytes'])),
    ('held by the devices (all copies)', gib(r['device_bytes'])),
    ('peak - after (import transient)', gib(r['peak_rss_bytes'] - r['rss_after_bytes'])),
    ('largest parameter', f'{r["largest_param"]["name"]} {gib(r["largest_param"]["bytes"])}'),
  ]
  width = max(len(a) for a, _ in rows)
  for a, b in rows:
    print(f'{a:<{width}}  {b}')
  c = r['checks']
  print(
    f'check: {c["parameters_checked"]} parameters (shape, dtype, sharding), '
    f'{len(c["tensors_compared"])} tensors equal to the safetensors data: '
    + ('ok' if c['ok'] else 'FAILED\n  ' + '\n  '.join(c['problems']))
  )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(r | {'shape': args.shape, 'dir': os.path.abspath(args.dir)}, f, indent=1)
    print(f'wrote {args.json}')
  if not c['ok']:
    sys.exit(1)


if __name__ == '__main__':
  main()
