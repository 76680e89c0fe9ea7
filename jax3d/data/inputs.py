"""Input files read for what they are, not for what their names say: `jax3d.prepare` and the
trainer's text corpora (`data.path`) open every file through here.

  * compressed text is read decompressed, whatever its name: gzip, bzip2 and xz (the standard
    library) and zstd (the `zstandard` package), recognised by their first bytes; a document's
    name drops the compression suffix, so `a.jsonl.gz` splits and tokenizes as `a.jsonl` does;
  * any other binary file (an image, a Parquet or ZIP file, anything with a NUL byte in its first
    8 KiB, UTF-16 text) is refused, naming the file and what it looks like;
  * text is UTF-8: bytes that do not decode are replaced and counted (`decode`), and a file with
    more than `MAX_UNDECODABLE` of its bytes undecodable is refused (`check_undecodable`): it is
    not UTF-8 (Latin-1, a binary dump) and would train on replacement characters.

Errors are ConfigError (bad input, exit status 2) naming the file. Imports no jax.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import re
import shutil
import zlib
from typing import IO

from jax3d.errors import ConfigError

HEAD = 8192  # bytes looked at to tell what a file is
MAX_UNDECODABLE = 0.001  # share of a file's bytes that may be undecodable (replaced) before it is refused

# First bytes of the compressions read, and the suffix each drops from a document's name.
COMPRESSIONS = {
  b'\x1f\x8b': ('gzip', '.gz'),
  b'\x28\xb5\x2f\xfd': ('zstd', '.zst'),
  b'BZh': ('bzip2', '.bz2'),
  b'\xfd7zXZ\x00': ('xz', '.xz'),
}
COMPRESSED_SUFFIXES = ('.gz', '.zst', '.zstd', '.bz2', '.xz')
JSONL_SUFFIXES = ('.jsonl', '.ndjson')  # one JSON document a line: jax3d.prepare reads them
# First bytes of binary formats that are not text, and what to call them.
BINARY = (
  (b'\x89PNG\r\n\x1a\n', 'a PNG image'),
  (b'\xff\xd8\xff', 'a JPEG image'),
  (b'GIF8', 'a GIF image'),
  (b'RIFF', 'a RIFF file (WAV, WebP, AVI)'),
  (b'PAR1', 'a Parquet file (jax3d.prepare reads it into token shards)'),
  (b'PK\x03\x04', 'a ZIP archive (.zip, .docx, .xlsx, .whl)'),
  (b'%PDF', 'a PDF document'),
  (b'\x7fELF', 'an executable (ELF)'),
  (b'\x93NUMPY', 'a NumPy array (.npy)'),
  (b'\x89HDF', 'an HDF5 file'),
  (b'ARROW1', 'an Arrow file (jax3d.prepare reads it into token shards)'),
  (b'SQLite format 3\x00', 'an SQLite database'),
  (b"7z\xbc\xaf'\x1c", 'a 7-Zip archive'),
  (b'\xff\xfe', 'UTF-16 text (convert it to UTF-8)'),
  (b'\xfe\xff', 'UTF-16 text (convert it to UTF-8)'),
)
TEXT_FORMATS = 'UTF-8 text or JSONL, plain or compressed with gzip, zstd, bzip2 or xz'


def compression(head: bytes) -> str | None:
  """'gzip', 'zstd', 'bzip2' or 'xz' when `head` starts a file of that compression, else None."""
  return next((name for magic, (name, _) in COMPRESSIONS.items() if head.startswith(magic)), None)


def binary_kind(head: bytes) -> str | None:
  """What a file that starts with `head` is when it is not text (None: it may be text)."""
  for magic, what in BINARY:
    if head.startswith(magic):
      return what
  if head[257:262] == b'ustar':
    return 'a tar archive'
  if (nul := head.find(b'\x00')) >= 0:
    return f'binary data (a NUL byte at byte {nul})'
  return None


def _broken() -> tuple[type[BaseException], ...]:
  """What reading compressed data that is cut short or corrupt raises."""
  out: tuple[type[BaseException], ...] = (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error)
  try:
    import zstandard

    out += (zstandard.ZstdError,)
  except ImportError:
    pass
  return out


def _open_compressed(path: str, kind: str) -> IO[bytes]:
  if kind == 'zstd':
    import zstandard  # only for .zst input

    return zstandard.open(path, 'rb')
  return {'gzip': gzip.open, 'bzip2': bz2.open, 'xz': lzma.open}[kind](path, 'rb')


def open_input(path: str) -> tuple[IO[bytes], str | None]:
  """(the file's bytes as a stream, decompressed; its compression or None), after checking that it
  holds text: ConfigError naming the file when it is binary, or compressed and unreadable."""
  with open(path, 'rb') as f:
    head = f.read(HEAD)
  kind = compression(head)
  stream = _open_compressed(path, kind) if kind else open(path, 'rb')
  if kind:  # what is inside: its head, then the stream opened afresh (zstd's cannot seek back)
    try:
      with stream:
        head = stream.read(HEAD)
    except _broken() as e:
      raise ConfigError(f'{path}: {kind} data that cannot be decompressed ({e})') from None
    stream = _open_compressed(path, kind)
  if what := binary_kind(head):
    stream.close()
    inner = f' (inside its {kind} compression)' if kind else ''
    raise ConfigError(f'{path}: not text but {what}{inner}: jax3d reads {TEXT_FORMATS}')
  return stream, kind


def read_bytes(path: str, setting: str = '') -> bytes:
  """The file's bytes, decompressed (`open_input`); the error starts with `setting` (the setting
  that named the file, e.g. "data.path='corpus': ")."""
  try:
    stream, kind = open_input(path)
  except ConfigError as e:
    raise ConfigError(f'{setting}{e}') from None
  with stream:
    if not kind:
      return stream.read()
    try:
      return stream.read()
    except _broken() as e:
      raise ConfigError(f'{setting}{path}: {kind} data that cannot be decompressed ({e})') from None


def with_compressed(suffixes: tuple[str, ...]) -> tuple[str, ...]:
  """File-name suffixes, each also with a compression suffix after it: '.txt' and '.txt.gz', ..."""
  return suffixes + tuple(s + z for s in suffixes for z in COMPRESSED_SUFFIXES)


def decompress_to(path: str, dest: str) -> None:
  """Writes the decompressed bytes of `path` to the file `dest`."""
  stream, kind = open_input(path)
  try:
    with stream, open(dest, 'wb') as out:
      shutil.copyfileobj(stream, out, 1 << 22)
  except _broken() as e:
    raise ConfigError(f'{path}: {kind} data that cannot be decompressed ({e})') from None


def plain_name(name: str) -> str:
  """A document's name without its compression suffix: 'a.jsonl.gz' -> 'a.jsonl'."""
  root, ext = os.path.splitext(name)
  return root if ext in COMPRESSED_SUFFIXES else name


_SURROGATES = re.compile('[\udc80-\udcff]')


def decode(raw: bytes) -> tuple[str, int]:
  """(the UTF-8 text of `raw`, undecodable bytes replaced by U+FFFD; how many bytes were)."""
  try:
    return raw.decode('utf-8'), 0
  except UnicodeDecodeError:
    bad = len(_SURROGATES.findall(raw.decode('utf-8', 'surrogateescape')))
    return raw.decode('utf-8', 'replace'), bad


def decode_checked(path: str, raw: bytes) -> str:
  """`decode` of the bytes of the file `path`, refused by `check_undecodable`."""
  text, bad = decode(raw)
  check_undecodable(path, bad, len(raw))
  return text


def check_undecodable(path: str, bad: int, size: int) -> None:
  """ConfigError when more than MAX_UNDECODABLE of the `size` bytes of `path` did not decode."""
  if bad > MAX_UNDECODABLE * size:
    raise ConfigError(
      f'{path}: {bad:,} of its {size:,} bytes are not UTF-8 (more than {MAX_UNDECODABLE:.1%}): '
      'it is not UTF-8 text (convert it first, e.g. iconv -f latin1 -t utf-8)'
    )
