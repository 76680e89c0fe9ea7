"""`python -m jax3d.batch --step=N [--rows=4] [--config=PATH] [--config.KEY=VALUE ...]`

What step N trains on: the global batch the trainer feeds step N (0-based: the batch logged as
step N + 1 in metrics.jsonl), read from the data alone (nothing compiles, no device is used), its
rows printed decoded with the tokenizer: each segment (a document, or the part of one in the row)
on its own line with its positions, the supervised tokens (weight > 0: the targets the loss
counts) between ⟪ and ⟫, then the row's counts and the epoch the batch belongs to. The config is
the one the run is given (data.path, data.tokenizer, data.packing, train.seed,
train.global_batch_size, train.seq_len).

Exit status: 0 printed; 2 bad flags, config or data (one line on stderr).

In Python, `jax3d.batch(cfg, step)` returns the arrays (inputs, targets, weights, segment_ids,
positions): this module is callable (it forwards to `jax3d.api.batch`).
"""

from __future__ import annotations

import sys
import types

import numpy as np

from jax3d import cli

OPEN, CLOSE = '⟪', '⟫'
FLAGS = {
  'step': cli.Flag(int, None, 'the step (0-based) whose batch to print', cli.NON_NEGATIVE, required=True),
  'rows': cli.Flag(int, 4, 'rows to print (0 = all)', cli.NON_NEGATIVE),
}


def main(argv: list[str] | None = None) -> int:
  """Runs `python -m jax3d.batch` with argv (default sys.argv[1:]); returns the exit status."""
  return cli.run_command(
    _batch, cli.parse(sys.argv[1:] if argv is None else argv, __doc__, FLAGS), ValueError
  )


def _batch(args: cli.Args) -> int:
  from jax3d import assemble, config as config_lib
  from jax3d.data import corpus as corpus_lib, mixture as mixture_lib, tokenizer as tok_lib

  step, cfg = args.flags['step'], config_lib.checked(assemble.resolve(args.cfg))
  t, tok = cfg.train, tok_lib.load(cfg.data.tokenizer)
  corpus = mixture_lib.for_config(cfg, tok)
  b = corpus_lib.batch_at(corpus, t.seed, step, t.global_batch_size, t.seq_len)  # = jax3d.batch(cfg, step)
  epoch = corpus_lib.epoch_at(corpus, t.seed, step, t.global_batch_size, t.seq_len)
  print(f'step {step}: epoch {epoch}; {corpus.layout(t.seq_len).describe()}')
  if 'source' in b:  # a mixture: each source's rows so far (its cursor) and its rows in this batch
    done = corpus.per_source(t.seed, step, t.global_batch_size, t.seq_len)
    counts = np.bincount(b['source'], minlength=len(corpus.names))
    print(
      'sources: '
      + ', '.join(
        f'{n} {c} rows (tokens so far {done[f"tokens/{n}"]:,})'
        for n, c in zip(corpus.names, counts, strict=True)
      )
    )
  for r in range(min(args.flags['rows'] or len(b['inputs']), len(b['inputs']))):
    lines = row_lines({k: v[r] for k, v in b.items()}, _decoder(tok))
    source = f' ({corpus.names[b["source"][r]]})' if 'source' in b else ''
    print(f'row {r}{source}: ' + '\n'.join(lines))
  return 0


def _decoder(tok: object) -> object:
  """The tokenizer's decode, special tokens shown (a `tokenizers` tokenizer's own decode)."""
  inner = getattr(tok, 'tok', None)
  return (lambda ids: inner.decode(ids, skip_special_tokens=False)) if inner is not None else tok.decode


def row_lines(row: dict[str, np.ndarray], decode: object) -> list[str]:
  """A row as text: its counts, then each segment's tokens (its first input, then its targets)
  decoded, the supervised ones between OPEN and CLOSE."""
  seg, w = row['segment_ids'], row['weights']
  lines = [
    f'segments {seg.max()}, supervised {int((w > 0).sum())} of {seg.size} slots, padding {int((seg == 0).sum())}'
  ]
  for s in range(1, int(seg.max()) + 1):
    at = np.flatnonzero(seg == s)
    tokens = [int(row['inputs'][at[0]])] + row['targets'][at].tolist()
    marks = [False] + (w[at] > 0).tolist()
    text, k = '', 0
    while k < len(tokens):  # runs of equal marking, decoded run by run
      j = k
      while j < len(tokens) and marks[j] == marks[k]:
        j += 1
      piece = decode(tokens[k:j])
      text += f'{OPEN}{piece}{CLOSE}' if marks[k] else piece
      k = j
    head = f'  [{s}] positions {row["positions"][at[0]]}..{row["positions"][at[-1]]}: '
    lines.append(head + text.replace('\n', '\n    '))
  return lines


class _CallableModule(types.ModuleType):
  """`jax3d.batch` is both this command's module and the API function `jax3d.batch(cfg, step)`
  (as `jax3d.sample` is: see jax3d/sample.py): calls forward to `jax3d.api.batch`."""

  def __call__(self, *args, **kwargs):
    from jax3d import api

    return api.batch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == '__main__':
  sys.exit(main())
