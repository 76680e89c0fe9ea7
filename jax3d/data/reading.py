"""What `jax3d.prepare` reads: its input files (checked to be text, compressed ones decompressed:
jax3d/data/inputs.py), cut into pieces (byte ranges ending at line ends), grouped into work units,
and the documents of each piece: a text file (or a piece of a long one) is one document, a JSONL
line is one (its text field, a string), or one conversation (--format=chat). A document's name is
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

from jax3d.data import chat, documents, inputs
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


JSONL_SUFFIXES = inputs.JSONL_SUFFIXES


def input_files(path: str) -> tuple[str, list[str]]:
  """(root, files): '' = the standard library's .py files; a folder's text and JSONL files, plain
  or compressed (a.jsonl.gz); a file, whatever its name (read for what it is: jax3d/data/inputs.py)."""
  if not path:
    root = sysconfig.get_paths()['stdlib']
    return root, list(documents.iter_files(root, ('.py',)))
  if os.path.isdir(path):
    plain = documents.TEXT_SUFFIXES + JSONL_SUFFIXES
    return path, list(documents.iter_files(path, inputs.with_compressed(plain)))
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


def pieces(root: str, files: list[str], shard_bytes: int, scratch: str) -> list[Piece]:
  """The byte ranges of the input files, each checked to be text (ConfigError naming a binary one);
  a compressed file is decompressed into the folder `scratch` first, and named without its suffix."""
  out = []
  for n, origin in enumerate(files):
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
    if out[-1] and size + p.end - p.start > shard_bytes:
      out.append([])
      size = 0
    out[-1].append(p)
    size += p.end - p.start
  return [u for u in out if u]


def read_documents(
  p: Piece, field: str, fmt: str = 'text', bad: dict[str, int] | None = None
) -> Iterator[tuple[str, Any]]:
  """(name, text) of the documents of a piece; with fmt='chat', (name, messages). Bytes that are
  not UTF-8 are replaced, and counted into `bad[p.origin]`. ValueError naming the document
  (relative path:byte offset, `locate` makes it file:line) for a JSONL line that is not a JSON
  object or whose field is missing or not a string."""
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
    if fmt == 'chat':
      yield where, chat.parse(text, where)
      continue
    try:
      record = json.loads(text)
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
    yield where, record[field]


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
  path: str, field: str, eval_fraction: float, shard_bytes: int, scratch: str
) -> Iterator[str]:
  """The training documents (held-out ones left out) of the corpus, for training a tokenizer
  (compressed inputs decompressed into the folder `scratch`)."""
  root, files = input_files(path)
  for p in pieces(root, files, shard_bytes, scratch):
    for name, text in read_documents(p, field):
      if not documents.held_out(name, eval_fraction):
        yield text
