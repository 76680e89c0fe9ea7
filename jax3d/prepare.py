"""`python -m jax3d.prepare --out=DIR [--input=PATH] [--train_tokenizer=VOCAB | --tokenizer=PATH]
[--field=text] [--workers=N] [--eval_fraction=0.05] [--shard_mb=64]`

Turns text into the token shards jax3d trains on (`--config.data.path=DIR`):

  --input       a text file, a folder of text files (.py .txt .md ...) and/or .jsonl files, or a
                .jsonl file (one document per line, text in --field); default: the Python
                standard library's own source (no download)
  --train_tokenizer=VOCAB   first train a byte-level BPE tokenizer of VOCAB tokens on the training
                documents (`tokenizers`), saved as DIR/tokenizer.json (reused when it exists)
  --tokenizer   or use this one: a tokenizer.json, a SentencePiece .model, a folder with one, or
                'bytes' (default: DIR/tokenizer.json when it exists)

Writes DIR/train-NNNNN.bin and DIR/val-NNNNN.bin (uint16, or uint32 for vocabularies over 65536;
documents separated by EOS; a document is wholly in one split) and DIR/index.json, on --workers
processes (default: every core) with a progress bar, then prints the throughput. Rerunning skips
the shards already done for the same inputs and tokenizer (jax3d/data/prepare.py).

Exit status: 0 done; 2 bad flags or input (one line on stderr).
"""

from __future__ import annotations

import os
import sys

from jax3d import cli

FLAGS = {
  'out': cli.Flag(str, None, 'the folder of the token shards (and a trained tokenizer)', required=True),
  'input': cli.Flag(str, '', "text file, folder or .jsonl (default: the standard library's source)"),
  'tokenizer': cli.Flag(str, '', "tokenizer.json, SentencePiece .model, folder or 'bytes'"),
  'train_tokenizer': cli.Flag(
    int, 0, 'train a byte-level BPE tokenizer of this many tokens first', cli.NON_NEGATIVE
  ),
  'field': cli.Flag(str, 'text', 'the text field of .jsonl records'),
  'workers': cli.Flag(int, 0, 'worker processes (0 = every core)', cli.NON_NEGATIVE),
  'eval_fraction': cli.Flag(
    float, 0.05, 'held-out share of the documents', cli.Check(lambda v: 0 <= v < 1, 'in [0, 1)')
  ),
  'shard_mb': cli.Flag(float, 64.0, 'text per shard (and per work unit), MB', cli.POSITIVE),
  'progress': cli.Flag(bool, True, 'show a progress bar'),
}


def main(argv: list[str] | None = None) -> int:
  """Runs `python -m jax3d.prepare` with argv (default sys.argv[1:]); returns the exit status."""
  # A ValueError of the tokenizer or the input (a JSONL line without the text field) is bad input.
  args = cli.parse(sys.argv[1:] if argv is None else argv, __doc__, FLAGS, config=False)
  return cli.run_command(_prepare, args, ValueError)


def _prepare(args: cli.Args) -> int:
  from jax3d.data import prepare, tokenizer as tok_lib

  f = args.flags
  if f['input'] and not os.path.exists(f['input']):
    return cli.fail(f'--input={f["input"]}: no such file or folder')
  if f['train_tokenizer'] and f['tokenizer']:
    return cli.fail(f'--tokenizer={f["tokenizer"]} and --train_tokenizer={f["train_tokenizer"]}: give one')
  if 0 < f['train_tokenizer'] < 257:
    return cli.fail(f'--train_tokenizer={f["train_tokenizer"]} is invalid: at least 257 (256 bytes + EOS)')
  shard_bytes = int(f['shard_mb'] * 1e6)
  own = os.path.join(f['out'], 'tokenizer.json')
  try:
    if f['train_tokenizer'] and not os.path.exists(own):
      os.makedirs(f['out'], exist_ok=True)
      texts = prepare.training_texts(f['input'], f['field'], f['eval_fraction'], shard_bytes)
      prepare.train_tokenizer(texts, f['train_tokenizer'], own)
      print(f'trained a BPE tokenizer: {tok_lib.load(own).describe()}')
    spec = f['tokenizer'] or (own if os.path.exists(own) else tok_lib.BYTES)
    tok = tok_lib.load(spec)
  except ValueError as e:  # a ConfigError too: named by this command's flag
    return cli.fail(str(e).replace('data.tokenizer=', '--tokenizer='))
  r = prepare.tokenize(
    f['input'],
    f['out'],
    tok.path or tok_lib.BYTES,
    f['field'],
    f['eval_fraction'],
    shard_bytes,
    f['workers'],
    f['progress'],
  )
  n = lambda split: sum(s['tokens'] for s in r[split])
  print(
    f'{f["out"]}: {n("train"):,} train tokens, {n("val"):,} held out ({r["dtype"]}, vocab {r["vocab_size"]}); '
    f'{r["units_done"]} shard(s) tokenized, {r["units_skipped"]} already done; '
    f'{r["bytes"] / 1e6:.1f} MB in {r["seconds"]:.1f} s = {r["mb_per_s"]:.2f} MB/s on {r["workers"]} worker(s)'
  )
  return 0


if __name__ == '__main__':
  sys.exit(main())
