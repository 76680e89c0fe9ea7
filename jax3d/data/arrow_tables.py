"""Tables `jax3d.prepare` reads with pyarrow: Parquet files, Arrow IPC files (Feather v2) and IPC
streams (what `datasets` writes: a `save_to_disk` folder, the Hugging Face cache), recognised by
their first bytes. One column (`--field`) holds the documents: text (a string, or binary that is
UTF-8), or for chat the messages (a list of {role, content}, or their JSON text).

A table is cut into pieces of whole row groups (Parquet) or record batches (Arrow) of about
`shard_bytes` of that column, a piece's start and end being row numbers; a worker reads only its
piece's row groups or batches, one at a time, and only that column (Arrow files memory-mapped), so
memory follows the piece, not the file. A row's document name is 'relative path:row' (the held-out
split hashes it). A bad row (the value null, not text, not UTF-8, not a conversation) is named by
its file and row (0-based, as `datasets` and pandas number them): with on_bad='fail' a ValueError,
with 'skip' counted and left out. Imports no jax; pyarrow is imported only for a table.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from jax3d.errors import ConfigError

SUFFIXES = ('.parquet', '.arrow', '.feather', '.ipc', '.arrows')
STREAM = b'\xff\xff\xff\xff'  # an Arrow IPC stream's first message (its continuation marker)
ON_BAD = ('fail', 'skip')
EXAMPLES = 5  # bad rows named in a unit's record


def kind(head: bytes) -> str | None:
  """'parquet', 'arrow' (IPC file) or 'stream' (IPC stream) when `head` starts one, else None."""
  if head.startswith(b'PAR1'):
    return 'parquet'
  if head.startswith(b'ARROW1'):
    return 'arrow'
  return 'stream' if head.startswith(STREAM) and len(head) > 8 else None


def _batches(
  path: str, what: str, columns: list[str] | None = None, start: int = 0
) -> Iterator[tuple[int, Any]]:
  """(first row, record batch or table) of the file in order, from the one holding row `start`
  (Parquet: a row group each, those before `start` skipped by the footer alone), only `columns`."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  row = 0
  if what == 'parquet':
    pf = pq.ParquetFile(path)
    for g in range(pf.num_row_groups):
      n = pf.metadata.row_group(g).num_rows
      if row + n > start:
        yield row, pf.read_row_group(g, columns=columns)
      row += n
    return
  source = pa.memory_map(path)  # batches are views of the mapped file: skipping one reads nothing
  reader = pa.ipc.open_file(source) if what == 'arrow' else pa.ipc.open_stream(source)
  batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) if what == 'arrow' else reader
  for b in batches:
    if row + b.num_rows > start:
      yield row, b.select(columns) if columns else b
    row += b.num_rows


def _schema(path: str, what: str) -> Any:
  import pyarrow as pa
  import pyarrow.parquet as pq

  if what == 'parquet':
    return pq.ParquetFile(path).schema_arrow
  source = pa.memory_map(path)
  return (pa.ipc.open_file(source) if what == 'arrow' else pa.ipc.open_stream(source)).schema


def _check_column(path: str, schema: Any, field: str, fmt: str) -> None:
  """ConfigError naming the file and its columns when `field` is missing or of the wrong type."""
  import pyarrow as pa

  names = ', '.join(schema.names)
  if field not in schema.names:
    raise ConfigError(f'--field={field}: {path} has no column {field!r} (its columns: {names})')
  t = schema.field(field).type
  text = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
  text = text or pa.types.is_large_binary(t) or str(t) in ('string_view', 'binary_view')
  chat = pa.types.is_list(t) or pa.types.is_large_list(t) or text
  if not (chat if fmt == 'chat' else text):
    want = 'a list of messages (or their JSON text)' if fmt == 'chat' else 'text (string or binary)'
    raise ConfigError(
      f'--field={field}: column {field!r} of {path} is {t}, not {want} (its columns: {names})'
    )


def plan(path: str, what: str, field: str, fmt: str, shard_bytes: int) -> list[tuple[int, int, int]]:
  """(first row, end row, bytes of the column) of the pieces of a table: whole row groups or
  record batches, about `shard_bytes` of the column each. ConfigError naming the file when it
  cannot be read or lacks the column."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  try:
    _check_column(path, _schema(path, what), field, fmt)
    if what == 'parquet':
      meta = pq.ParquetFile(path).metadata
      groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
      sizes = [(g.num_rows, _chunk_bytes(g, field)) for g in groups]
    else:
      sizes = [(b.num_rows, b.column(0).nbytes) for _, b in _batches(path, what, [field])]
  except (pa.ArrowException, OSError) as e:
    name = {'parquet': 'Parquet', 'arrow': 'Arrow IPC', 'stream': 'Arrow IPC stream'}[what]
    raise ConfigError(f'{path}: not a readable {name} file ({str(e)[:160]})') from None
  out, row, first, size = [], 0, 0, 0
  for rows, nbytes in sizes:
    if size and size + nbytes > shard_bytes:
      out.append((first, row, size))
      first, size = row, 0
    row, size = row + rows, size + nbytes
  if row > first:
    out.append((first, row, size))
  return out


def _chunk_bytes(group: Any, field: str) -> int:
  """The uncompressed bytes of the column `field` (all its leaves, when nested) in a row group."""
  leaves = (group.column(i) for i in range(group.num_columns))
  return sum(c.total_uncompressed_size for c in leaves if c.path_in_schema.split('.')[0] == field)


def rows(
  path: str, what: str, rel: str, start: int, end: int, field: str, fmt: str, on_bad: str, bad: dict
) -> Iterator[tuple[str, Any]]:
  """(name, text) of the rows [start, end) of a table (fmt='chat': (name, messages)); a bad row
  raises ValueError (on_bad='fail') or is counted into `bad` ({'count', 'rows'}: the first ones)."""
  import pyarrow as pa

  try:
    yield from _rows(path, what, rel, start, end, field, fmt, on_bad, bad)
  except (pa.ArrowException, OSError) as e:
    raise ValueError(f'{path}: rows {start}-{end} cannot be read ({str(e)[:160]})') from None


def _rows(
  path: str, what: str, rel: str, start: int, end: int, field: str, fmt: str, on_bad: str, bad: dict
) -> Iterator[tuple[str, Any]]:
  from jax3d.data import chat

  for row, batch in _batches(path, what, [field], start):
    if row >= end:
      return
    n = batch.num_rows
    values = batch.column(0).slice(max(start - row, 0), min(end, row + n) - max(start, row)).to_pylist()
    for i, v in enumerate(values, max(start, row)):
      where = f'{path}: row {i}'
      try:
        doc = _text(v, field) if fmt != 'chat' else chat.messages(_json(v), where, field)
      except ValueError as e:
        if on_bad == 'fail':
          raise ValueError(f'{where}: {e}' if fmt != 'chat' else str(e)) from None
        note(bad, where, str(e).removeprefix(f'{where}: '))
        continue
      yield f'{rel}:{i}', doc


def note(bad: dict, where: str, why: str) -> None:
  """Counts a skipped bad row into `bad`, naming the first EXAMPLES of them."""
  bad['count'] = bad.get('count', 0) + 1
  if len(bad.setdefault('rows', [])) < EXAMPLES:
    bad['rows'].append(f'{where} ({why})')


def merged(counts: list[dict]) -> dict:
  """The bad rows of several units (`note`'s dicts, in order) as one: the count, the first named."""
  rows = [r for c in counts for r in c.get('rows', [])][:EXAMPLES]
  return {'count': sum(c.get('count', 0) for c in counts), 'rows': rows}


def _text(v: Any, field: str) -> str:
  if v is None:
    raise ValueError(f'field {field!r} is null')
  if isinstance(v, bytes):
    try:
      return v.decode('utf-8')
    except UnicodeDecodeError as e:
      raise ValueError(f'field {field!r} is not UTF-8 (byte {e.start})') from None
  return v


def _json(v: Any) -> Any:
  """A conversation given as its JSON text, parsed (else the value as it is)."""
  if isinstance(v, bytes | str):
    try:
      return json.loads(v)
    except ValueError:
      return v
  return v


def is_table(path: str) -> str | None:
  """The table kind of the file at `path` (see `kind`), None for anything else."""
  try:
    with open(path, 'rb') as f:
      return kind(f.read(16))
  except OSError:
    return None
