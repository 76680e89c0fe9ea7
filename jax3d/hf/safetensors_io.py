"""Reading blocks of safetensors tensors and writing safetensors files one tensor at a time.

Reading goes through `safetensors.safe_open(...).get_slice`, which reads only the requested block
from the file. numpy has no bfloat16, and the library's numpy reader refuses BF16 tensors; those
are read through a memory map of the file at the offsets the header gives (ml_dtypes' bfloat16),
which also reads only the pages of the block.

Writing: the header (names, dtypes, shapes, offsets) is known before any data from the shapes, so
`write` takes the tensors as (name, shape, dtype, fetch) and calls `fetch()` for one tensor at a
time: the host never holds more than one tensor of the model.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

# safetensors dtype names <-> numpy dtypes
DTYPES = {
  'F64': np.dtype(np.float64),
  'F32': np.dtype(np.float32),
  'F16': np.dtype(np.float16),
  'BF16': np.dtype(ml_dtypes.bfloat16),
  'I64': np.dtype(np.int64),
  'I32': np.dtype(np.int32),
}
NAMES = {v: k for k, v in DTYPES.items()}


def _header(file: str) -> tuple[int, dict]:
  with open(file, 'rb') as f:
    (n,) = struct.unpack('<Q', f.read(8))
    return 8 + n, json.loads(f.read(n))


def header(file: str) -> dict[str, tuple[tuple[int, ...], str]]:
  """name -> (shape, safetensors dtype) of every tensor in `file`, from its header (no data read);
  ValueError naming the file when it is not a readable safetensors file (a damaged header, a
  truncated file: the library checks the data's length against the header's offsets)."""
  from safetensors import safe_open

  try:
    with safe_open(file, 'numpy') as f:
      return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
  except Exception as e:  # noqa: BLE001 - the library's SafetensorError and OSError alike
    raise ValueError(f'{file} is not a readable safetensors file ({str(e)[:200]})') from None


class Reader:
  """Blocks of the tensors of some safetensors files; handles are opened once and kept."""

  def __init__(self) -> None:
    self._open: dict[str, object] = {}
    self._headers: dict[str, tuple[int, dict]] = {}

  def read(self, file: str, name: str, *index: slice) -> np.ndarray:
    """tensor[index] of tensor `name` in `file` (index: one slice per leading axis)."""
    from safetensors import safe_open

    if file not in self._open:
      self._open[file] = safe_open(file, 'numpy')
    sl = self._open[file].get_slice(name)
    if sl.get_dtype() != 'BF16':
      return np.asarray(sl[index])
    if file not in self._headers:
      self._headers[file] = _header(file)
    start, header = self._headers[file]
    meta = header[name]
    a, _ = meta['data_offsets']
    mm = np.memmap(file, DTYPES['BF16'], 'r', offset=start + a, shape=tuple(meta['shape']))
    return np.array(mm[index])


Fetch = Callable[[], np.ndarray]


def write(file: str, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype, Fetch]], meta: dict) -> None:
  """Writes a safetensors file, fetching and writing one tensor at a time (see the module doc)."""
  tensors = list(tensors)
  header, offset = {'__metadata__': meta}, 0
  for name, shape, dtype, _ in tensors:
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    header[name] = {
      'dtype': NAMES[np.dtype(dtype)],
      'shape': list(shape),
      'data_offsets': [offset, offset + size],
    }
    offset += size
  raw = json.dumps(header, separators=(',', ':')).encode()
  raw += b' ' * (-len(raw) % 8)  # the data starts 8-byte aligned
  with open(file, 'wb') as f:
    f.write(struct.pack('<Q', len(raw)))
    f.write(raw)
    for name, shape, dtype, fetch in tensors:
      a = np.ascontiguousarray(fetch(), dtype=dtype)
      if a.shape != tuple(shape):
        raise ValueError(f'{name}: fetched shape {a.shape}, header says {tuple(shape)}')
      f.write(a.tobytes())
