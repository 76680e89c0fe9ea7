"""`python -m jax3d.prepare --out=DIR [--input=PATH] [--train_tokenizer=VOCAB | --tokenizer=PATH]
[--format=text|chat] [--field=text] [--split=train] [--on_bad=fail|skip] [--workers=N]
[--eval_fraction=0.05] [--shard_mb=64]`

Turns text into the token shards jax3d trains on (`--config.data.path=DIR`):

  --input       a text file, a folder of text files (.py .txt .md ...) and/or .jsonl files, or a
                .jsonl file (one document per line, text in --field: a string); any of them
                compressed with gzip, zstd, bzip2 or xz (read by content, jax3d/data/inputs.py);
                Parquet and Arrow/Feather files (and folders of them), a folder written by
                `datasets`' save_to_disk (a DatasetDict's --split), or hf:NAME[:CONFIG], a dataset
                in the Hugging Face cache (offline: never downloaded), its column --field read
                row group by row group (jax3d/data/arrow_tables.py, sources.py);
                default: the Python standard library's own source (no download)
  --field       the column or JSON field of the documents (default text; messages for chat)
  --on_bad      a bad row or JSONL line (field missing, null, not text, not UTF-8, not a
                conversation): fail (exit 2 naming file and row, nothing written over) or skip
                (left out, counted, the first ones named)
  --train_tokenizer=VOCAB   first train a byte-level BPE tokenizer of VOCAB tokens on the training
                documents (`tokenizers`), saved as DIR/tokenizer.json (reused when it exists)
  --tokenizer   or use this one: a tokenizer.json, a SentencePiece .model, a folder with one, or
                'bytes' (default: DIR/tokenizer.json when it exists)
  --format=chat each .jsonl line is a conversation {"messages": [{"role", "content"}, ...]},
                rendered with the --tokenizer folder's own chat template (tokenizer.json with
                chat_template.jinja or tokenizer_config.json's chat_template): the ids of
                transformers' apply_chat_template, and a loss weight per token, 1 on the
                assistant turns (answer and end of turn), 0 elsewhere (jax3d/data/chat.py)

Writes DIR/train-NNNNN.bin and DIR/val-NNNNN.bin (uint16, or uint32 for vocabularies over 65536;
documents separated by EOS; a document is wholly in one split), each with its document starts
(.starts.bin) and, for chat, its weights (.weights.bin), and DIR/index.json, on --workers
processes (default: every core) with a progress bar, then prints the throughput (and, for chat,
the supervised fraction). Rerunning skips the shards already done for the same inputs, tokenizer
and template (jax3d/data/shard_writer.py); over a complete dataset the new one is written beside it and
swapped in only when complete, so a failed rerun leaves it as it was (jax3d/data/staging.py).

Exit status: 0 done; 2 bad flags or input (one line on stderr naming the file, and the line of a
JSONL one or the row of a table: a binary file, text that is not UTF-8, a field that is missing or
not a string, no text at all, --out inside --input; for chat data also a line without "messages",
an unknown role, a template that fails or renders the text around an answer differently as the
answer changes, a conversation with no supervised token, a tokenizer folder without a chat
template).
"""

from __future__ import annotations

import os
import sys
import tempfile

from jax3d import cli

FORMATS = ('text', 'chat')
ON_BAD = ('fail', 'skip')
FLAGS = {
  'out': cli.Flag(
    str, None, 'the folder of the token shards (and a trained tokenizer)', cli.ranges.NEW_OR_FOLDER, True
  ),
  'input': cli.Flag(
    str,
    '',
    "text, .jsonl, Parquet or Arrow file, folder, or hf:NAME (default: the standard library's source)",
    cli.ranges.Range(
      lambda v: v == '' or str(v).startswith('hf:') or os.path.exists(v),
      'an existing file or folder, or hf:NAME (a dataset in the Hugging Face cache)',
    ),
  ),
  'tokenizer': cli.Flag(str, '', "tokenizer.json, SentencePiece .model, folder or 'bytes'"),
  'train_tokenizer': cli.Flag(
    int,
    0,
    'train a byte-level BPE tokenizer of this many tokens first',
    cli.ranges.either(0, cli.ranges.at_least(257), '256 bytes + EOS at least; 0 = none'),
  ),
  'format': cli.Flag(
    str,
    'text',
    'text, or chat: .jsonl conversations ({"messages": [...]})',
    cli.one_of(*FORMATS),
  ),
  'field': cli.Flag(
    str,
    None,
    'the column or JSON field of the documents (default: text; chat: messages)',
    cli.ranges.text('a column or JSON key'),
  ),
  'split': cli.Flag(str, '', 'the split of a DatasetDict or hf: input (default: train, or the only one)'),
  'on_bad': cli.Flag(
    str, 'fail', 'a bad row: fail (exit 2 naming it) or skip (counted)', cli.one_of(*ON_BAD)
  ),
  'workers': cli.Flag(int, 0, 'worker processes (0 = every core)', cli.NON_NEGATIVE),
  'eval_fraction': cli.Flag(
    float, 0.05, 'held-out share of the documents', cli.ranges.between(0, 1, high_open=True)
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
  from jax3d.data import staging

  made, refused = not os.path.exists(args.flags['out']), False
  try:
    status = _write(args)
    refused = status == 2
    return status
  except ValueError:  # bad input (a ConfigError too): cli.run_command makes it one line, exit 2
    refused = True
    raise
  finally:  # an interrupted run keeps its finished units for the rerun
    staging.discard(args.flags['out'], made, refused)


def _write(args: cli.Args) -> int:
  from jax3d.data import bpe, reading, shard_writer, staging, tokenizer as tok_lib

  f = args.flags
  f['field'] = f['field'] or ('messages' if f['format'] == 'chat' else 'text')
  staging.check(f['input'], f['out'])  # --out inside --input, or over what prepare did not write
  if f['train_tokenizer'] and f['tokenizer']:
    return cli.fail(f'--tokenizer={f["tokenizer"]} and --train_tokenizer={f["train_tokenizer"]}: give one')
  shard_bytes = int(f['shard_mb'] * 1e6)
  own = os.path.join(f['out'], 'tokenizer.json')
  try:
    if f['train_tokenizer'] and not os.path.exists(own):
      os.makedirs(f['out'], exist_ok=True)
      with tempfile.TemporaryDirectory(dir=f['out']) as scratch:  # decompressed inputs
        texts = reading.training_texts(
          f['input'], f['field'], f['eval_fraction'], shard_bytes, scratch, f['split']
        )
        bpe.train_tokenizer(texts, f['train_tokenizer'], own)
      print(f'trained a BPE tokenizer: {tok_lib.load(own).describe()}')
    spec = f['tokenizer'] or (own if os.path.exists(own) else tok_lib.BYTES)
    tok = tok_lib.load(spec)
    if f['format'] == 'chat':
      _check_chat(f, tok)
    elif note := tok_lib.bos_note(tok):  # documents get the tokenizer's own special tokens only
      print(f'note: {note}', file=sys.stderr)
  except ValueError as e:  # a ConfigError too: named by this command's flag
    return cli.fail(str(e).replace('data.tokenizer=', '--tokenizer='))
  r = shard_writer.tokenize(
    f['input'],
    f['out'],
    tok.path or tok_lib.BYTES,
    f['field'],
    f['eval_fraction'],
    shard_bytes,
    f['workers'],
    f['progress'],
    f['format'],
    f['split'],
    f['on_bad'],
  )
  n = lambda split, key='tokens': sum(s.get(key, 0) for s in r[split])
  print(
    f'{f["out"]}: {n("train"):,} train tokens, {n("val"):,} held out ({r["dtype"]}, vocab {r["vocab_size"]}); '
    f'{r["units_done"]} shard(s) tokenized, {r["units_skipped"]} already done; '
    f'{r["bytes"] / 1e6:.1f} MB in {r["seconds"]:.1f} s = {r["mb_per_s"]:.2f} MB/s on {r["workers"]} worker(s)'
  )
  if r['undecodable']:
    where = ', '.join(f'{file} ({n})' for file, n in sorted(r['undecodable'].items())[:3])
    print(
      f'note: {sum(r["undecodable"].values()):,} byte(s) that are not UTF-8 replaced by U+FFFD: {where}',
      file=sys.stderr,
    )
  if r['bad_rows']['count']:
    where = '; '.join(r['bad_rows']['rows'])
    print(f'note: {r["bad_rows"]["count"]:,} bad row(s) skipped (--on_bad=skip): {where}', file=sys.stderr)
  if f['format'] == 'chat':
    docs, sup = (
      n('train', 'documents') + n('val', 'documents'),
      n('train', 'supervised') + n('val', 'supervised'),
    )
    total = max(n('train') + n('val'), 1)
    print(f'{docs:,} conversations; supervised (assistant) tokens: {sup:,} of {total:,} = {sup / total:.1%}')
  return 0


def _check_chat(f: dict, tok: object) -> None:
  """ValueError unless chat data can be made: a Hugging Face tokenizer.json whose folder has a
  chat template, and JSONL input."""
  from jax3d.data import arrow_tables, chat, inputs, tokenizer as tok_lib
  from jax3d.data.reading import JSONL_SUFFIXES

  if not isinstance(tok, tok_lib.HFTokenizer):
    raise ValueError(
      f'--tokenizer={f["tokenizer"] or tok.name}: --format=chat needs a Hugging Face tokenizer folder '
      '(tokenizer.json and its chat template)'
    )
  chat.load_template(os.path.dirname(tok.path))
  name = f['input']
  if name and not (os.path.isdir(name) or name.startswith('hf:') or arrow_tables.is_table(name)):
    if not inputs.plain_name(name).endswith(JSONL_SUFFIXES):
      raise ValueError(
        f'--input={name}: --format=chat reads .jsonl files (one conversation a line) or tables'
      )


if __name__ == '__main__':
  sys.exit(main())
