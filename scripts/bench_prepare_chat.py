"""Throughput of `python -m jax3d.prepare --format=chat` (issue 31): conversations, tokens and MB of
JSONL per second, on 1 and 2 worker processes, beside transformers' own `apply_chat_template`
(ids and assistant mask, one process) on the same conversations.

  python scripts/bench_prepare_chat.py [--conversations=20000] [--workers=1,2] [--json=PATH]
                                       [--dir=/tmp/jax3d_bench_chat] [--no-hf]

The data is made here, no download: a byte-level BPE tokenizer (4,096 tokens, trained on the
standard library's json and email packages) with a ChatML template (Qwen 2 style, the assistant
turns marked with {% generation %} so that transformers computes its mask), and multi-turn
conversations (a system message in half of them, 1 to 4 user/assistant exchanges of standard
library source lines). Each variant runs once in a fresh process (wall time, start-up included)
and reports the prepare command's own figure (tokenizing only) too. Prints a table, and writes the
figures as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STDLIB = sysconfig.get_paths()['stdlib']
CHATML = (
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == "
  "'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}{% else %}"
  "{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _source_lines() -> list[str]:
  lines = []
  for pkg in ('json', 'email'):
    for name in sorted(os.listdir(os.path.join(STDLIB, pkg))):
      if name.endswith('.py'):
        lines += [
          l for l in open(os.path.join(STDLIB, pkg, name), encoding='utf-8').read().splitlines() if l.strip()
        ]
  return lines


def make_data(folder: str, n: int) -> tuple[str, str]:
  """(tokenizer folder, chat.jsonl) under `folder`."""
  import numpy as np
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  lines = _source_lines()
  tok_dir, src = os.path.join(folder, 'tokenizer'), os.path.join(folder, 'chat.jsonl')
  os.makedirs(tok_dir, exist_ok=True)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
  trainer = trainers.BpeTrainer(
    vocab_size=4096,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(['\n'.join(lines)], trainer)
  tok.save(os.path.join(tok_dir, 'tokenizer.json'))
  cfg = {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': '<|im_end|>', 'chat_template': CHATML}
  with open(os.path.join(tok_dir, 'tokenizer_config.json'), 'w') as f:
    json.dump(cfg, f)
  rng = np.random.default_rng(0)
  text = lambda: '\n'.join(lines[i] for i in rng.integers(0, len(lines), rng.integers(1, 6)))
  with open(src, 'w') as f:
    for i in range(n):
      messages = [{'role': 'system', 'content': 'You explain Python.'}] if i % 2 else []
      for _ in range(rng.integers(1, 5)):
        messages += [{'role': 'user', 'content': text()}, {'role': 'assistant', 'content': text()}]
      f.write(json.dumps({'messages': messages}) + '\n')
  return tok_dir, src


def run_prepare(tok_dir: str, src: str, out: str, workers: int) -> dict:
  shutil.rmtree(out, ignore_errors=True)
  cmd = [sys.executable, '-m', 'jax3d.prepare', '--format=chat', f'--input={src}', f'--out={out}']
  cmd += [f'--tokenizer={tok_dir}', f'--workers={workers}', '--noprogress', '--shard_mb=2']
  t0 = time.perf_counter()
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - t0
  if r.returncode:
    sys.exit(f'prepare failed ({r.returncode}): {r.stderr.strip()}')
  inner = float(re.search(r'MB in ([\d.]+) s', r.stdout).group(1))
  total = re.search(r'supervised \(assistant\) tokens: ([\d,]+) of ([\d,]+) = ([\d.]+)%', r.stdout)
  tokens = int(total.group(2).replace(',', ''))
  return {'wall_s': wall, 'tokenize_s': inner, 'tokens': tokens, 'supervised_pct': float(total.group(3))}


def run_hf(tok_dir: str, src: str) -> dict:
  """transformers, one process: apply_chat_template with the assistant mask, every conversation."""
  from transformers import AutoTokenizer

  tok = AutoTokenizer.from_pretrained(tok_dir)
  convs = [json.loads(l)['messages'] for l in open(src)]
  t0 = time.perf_counter()
  tokens = 0
  for m in convs:
    out = tok.apply_chat_template(m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    tokens += len(out['input_ids'])
  s = time.perf_counter() - t0
  return {'wall_s': s, 'tokenize_s': s, 'tokens': tokens}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--conversations', type=int, default=20000)
  p.add_argument('--workers', default='1,2', help='comma-separated worker counts')
  p.add_argument('--dir', default='/tmp/jax3d_bench_chat')
  p.add_argument('--json', default='', help='write the figures here')
  p.add_argument('--no-hf', action='store_true', help='skip the transformers reference')
  a = p.parse_args(argv)
  tok_dir, src = make_data(a.dir, a.conversations)
  mb = os.path.getsize(src) / 1e6
  rows = {}
  for w in (int(x) for x in a.workers.split(',')):
    rows[f'jax3d.prepare, {w} worker(s)'] = run_prepare(tok_dir, src, os.path.join(a.dir, f'out{w}'), w)
  if not a.no_hf:
    rows['transformers apply_chat_template (+mask), 1 process'] = run_hf(tok_dir, src)
  print(f'{a.conversations:,} conversations, {mb:.1f} MB of JSONL, {os.cpu_count()} CPU core(s)')
  head = f'{"":<52} {"wall s":>7} {"conv/s":>9} {"tok/s (tokenize)":>17} {"MB/s":>6}'
  print(head + '\n' + '-' * len(head))
  for name, r in rows.items():
    r |= {'conv_per_s': a.conversations / r['wall_s'], 'tokens_per_s': r['tokens'] / r['tokenize_s']}
    r['mb_per_s'] = mb / r['wall_s']
    print(
      f'{name:<52} {r["wall_s"]:>7.1f} {r["conv_per_s"]:>9,.0f} {r["tokens_per_s"]:>17,.0f} {r["mb_per_s"]:>6.2f}'
    )
  sup = next((r['supervised_pct'] for r in rows.values() if 'supervised_pct' in r), None)
  if sup is not None:
    print(f'supervised (assistant) tokens: {sup}%')
  if a.json:
    with open(a.json, 'w') as f:
      json.dump(
        {'conversations': a.conversations, 'mb': mb, 'cpus': os.cpu_count(), 'rows': rows}, f, indent=1
      )
  return 0


if __name__ == '__main__':
  sys.exit(main())
