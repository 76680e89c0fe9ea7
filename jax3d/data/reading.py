"""What `jax3d.prepare` reads: its input files (checked to be text, compressed ones decompressed:
jax3d/data/inputs.py), cut into pieces (byte ranges ending at line ends), grouped into work units,
and the documents of each piece: a text file (or a piece of a long one) is one document, a JSONL
line is one (its text field, a string), or one conversation (--format=chat); a table (Parquet,
Arrow: jax3d/data/arrow_tables.py) is cut into row ranges, a row one document. A document's name is
its relative path (without a compression suffix), plus the byte offset for JSONL lines and cut
files: the held-out split hashes it (jax3d/data/documents.py). Imports no jax.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sysconfig
from collections.abc import Iterator
from typing import Any

from jax3d.data import arrow_tables, chat, documents, hf_datasets, inputs
from jax3d.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Piece:
  """A byte range of one input file: a text document, or a run of JSONL lines."""

  file: str  # the file read (a decompressed copy of a compressed input)
  rel: str  # its name in the corpus (relative path, without a compression suffix)
  start: int
  end: int
  jsonl: bool
  origin: str = ''  # the input file, as the user gave it (named in errors; its size and mtime fingerprinted)
  table: str = ''  # a table's kind (jax3d/data/arrow_tables.py): start and end are then rows
  nbytes: int = 0  # a table piece's bytes (of its column)

  @property
  def size(self) -> int:
    """The piece's bytes of text (a table's: of its column, uncompressed)."""
    return self.nbytes if self.table else self.end - self.start


JSONL_SUFFIXES = inputs.JSONL_SUFFIXES


def input_files(path: str, split: str = '') -> tuple[str, list[str]]:
  """(root, files): '' = the standard library's .py files; hf:NAME or a `save_to_disk` folder =
  its Arrow files (its `split`: jax3d/data/hf_datasets.py); a folder's text, JSONL (plain or
  compressed: a.jsonl.gz) and table files (.parquet, .arrow, ...); a file, whatever its name (read
  for what it is: jax3d/data/inputs.py, jax3d/data/arrow_tables.py)."""
  if not path:
    root = sysconfig.get_paths()['stdlib']
    return root, list(documents.iter_files(root, ('.py',)))
  if path.startswith(hf_datasets.HF) or (os.path.isdir(path) and (files := hf_datasets.saved(path, split))):
    files = hf_datasets.cached(path, split) if path.startswith(hf_datasets.HF) else files
    return os.path.commonpath([os.path.dirname(f) for f in files]) if files else path, files
  if split:  # a file or a folder of files is read whole: it has no splits to choose from
    raise ConfigError(
      f'--split={split}: {path} has no splits (it is read whole); --split chooses a split of a '
      'DatasetDict folder (save_to_disk) or an hf:NAME input: leave it out'
    )
  if os.path.isdir(path):
    plain = documents.TEXT_SUFFIXES + JSONL_SUFFIXES
    return path, list(documents.iter_files(path, inputs.with_compressed(plain) + arrow_tables.SUFFIXES))
  return os.path.dirname(os.path.abspath(path)), [os.path.abspath(path)]


def _cut(file: str, size: int, every: int) -> Iterator[tuple[int, int]]:
  """Byte ranges of about `every` bytes, ending at line ends."""
  start = 0
  with open(file, 'rb') as f:
    while start < size:
      f.seek(min(start + every, size))
      f.readline()
      end = min(f.tell(), size) if start + every < size else size
      yield start, end
      start = end


def pieces(
  root: str, files: list[str], shard_bytes: int, scratch: str, field: str = 'text', fmt: str = 'text'
) -> list[Piece]:
  """The byte ranges of the input files, each checked to be text (ConfigError naming a binary one);
  a compressed file is decompressed into the folder `scratch` first, and named without its suffix.
  A table's pieces are row ranges (jax3d/data/arrow_tables.py: its column `field` checked)."""
  out = []
  for n, origin in enumerate(files):
    if what := arrow_tables.is_table(origin):
      rel = os.path.relpath(origin, root)
      for a, b, size in arrow_tables.plan(origin, what, field, fmt, shard_bytes):
        out.append(Piece(origin, rel, a, b, False, origin, what, size))
      continue
    try:
      stream, kind = inputs.open_input(origin)
    except OSError as e:  # a dangling link, a file that cannot be read
      raise ConfigError(f'{origin}: cannot be read ({e.strerror})') from None
    stream.close()
    file = origin
    if kind:
      os.makedirs(scratch, exist_ok=True)
      file = os.path.join(scratch, f'{n:06d}-{os.path.basename(origin)}')
      inputs.decompress_to(origin, file)
    size = os.path.getsize(file)
    rel = inputs.plain_name(os.path.relpath(origin, root))
    for a, b in _cut(file, size, shard_bytes) if size else ():
      out.append(Piece(file, rel, a, b, rel.endswith(JSONL_SUFFIXES), origin))
  return out


def units(ps: list[Piece], shard_bytes: int) -> list[list[Piece]]:
  """Consecutive pieces grouped into work units of about shard_bytes."""
  out, size = [[]], 0
  for p in ps:
    if out[-1] and size + p.size > shard_bytes:
      out.append([])
      size = 0
    out[-1].append(p)
    size += p.size
  return [u for u in out if u]


def read_documents(
  p: Piece,
  field: str,
  fmt: str = 'text',
  bad: dict[str, int] | None = None,
  on_bad: str = 'fail',
  bad_rows: dict | None = None,
) -> Iterator[tuple[str, Any]]:
  """(name, text) of the documents of a piece; with fmt='chat', (name, messages). Bytes that are
  not UTF-8 are replaced, and counted into `bad[p.origin]`. A bad JSONL line (not a JSON object,
  its field missing or not a string, not a conversation) or table row: with on_bad='fail' a
  ValueError naming it (relative path:byte offset, `locate` makes it file:line; a table's file
  and row), with 'skip' counted into `bad_rows` (arrow_tables.note) and left out."""
  if p.table:
    yield from arrow_tables.rows(
      p.file, p.table, p.rel, p.start, p.end, field, fmt, on_bad, {} if bad_rows is None else bad_rows
    )
    return
  with open(p.file, 'rb') as f:
    f.seek(p.start)
    raw = f.read(p.end - p.start)
  count = lambda n: bad.__setitem__(p.origin, bad.get(p.origin, 0) + n) if bad is not None and n else None
  if not p.jsonl:
    name = p.rel if p.start == 0 else f'{p.rel}:{p.start}'
    text, n = inputs.decode(raw)
    count(n)
    yield name, text
    return
  offset = p.start
  for line in raw.splitlines(keepends=True):
    where = f'{p.rel}:{offset}'
    offset += len(line)
    if not line.strip():
      continue
    text, n = inputs.decode(line)
    count(n)
    text = text.removeprefix('\ufeff') if where.endswith(':0') else text  # a UTF-8 BOM (Windows editors)
    try:
      yield where, chat.parse(text, where, field) if fmt == 'chat' else _text(text, where, field)
    except ValueError as e:
      if on_bad == 'fail':
        raise
      message = locate(str(e), [p])
      file, _, why = message.partition(': ')
      arrow_tables.note(bad_rows if bad_rows is not None else {}, file, why)


def _text(line: str, where: str, field: str) -> str:
  """The text field of a JSONL line; ValueError naming `where` when it has none."""
  try:
    record = json.loads(line)
  except ValueError as e:
    raise ValueError(f'{where}: not a JSON object ({e})') from None
  if not isinstance(record, dict) or field not in record:
    has = f'its fields: {", ".join(record)[:80]}' if isinstance(record, dict) else type(record).__name__
    raise ValueError(f'{where}: no field {field!r} ({has}; --field names the text field)')
  if not isinstance(record[field], str):
    value = json.dumps(record[field])
    raise ValueError(
      f'{where}: field {field!r} is {value[:40]}{"..." * (len(value) > 40)}, not a string (the text of the document)'
    )
  return record[field]


def locate(message: str, unit: list[Piece]) -> str:
  """An error message that starts with a document's name (relative path:byte offset) with the name
  replaced by its input file and line (1-based)."""
  name, _, rest = message.partition(': ')
  rel, _, offset = name.rpartition(':')
  p = next((p for p in unit if p.rel == rel), None)
  if p is None or not offset.isdigit():
    return message
  with open(p.file, 'rb') as f:
    line = f.read(int(offset)).count(b'\n') + 1
  return f'{p.origin}:{line}: {rest}'


def training_texts(
  path: str, field: str, eval_fraction: float, shard_bytes: int, scratch: str, split: str = ''
) -> Iterator[str]:
  """The training documents (held-out ones left out) of the corpus, for training a tokenizer
  (compressed inputs decompressed into the folder `scratch`)."""
  root, files = input_files(path, split)
  for p in pieces(root, files, shard_bytes, scratch, field):
    for name, text in read_documents(p, field):
      if not documents.held_out(name, eval_fraction):
        yield text
