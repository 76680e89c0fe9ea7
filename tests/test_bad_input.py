"""Bad input, as a careless or unlucky user gives it, through the real commands: exit status 2 and
one `error:` line naming the setting (or file), its value and what is valid, no traceback, nothing
compiled, and nothing on disk changed where something could be lost; where accepting an input is
right (a compressed file), the result equals the plain input's.

TABLE holds the cases (command, arguments, the words the one line must hold); `results` runs them
all once, a few at a time, each as its own `python -m jax3d.COMMAND` process, on the files that
`made` writes (FILES in the arguments and words is that folder). The other tests are the cases
whose check is on disk: a failed re-run of prepare, the accepted compressed inputs, chat parts.
"""

import bz2
import concurrent.futures
import gzip
import hashlib
import importlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from jax3d import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F = 'FILES'  # the folder `made` writes, in a case's arguments and words
DOCS = [
  {'text': f'document {i}: ' + 'the quick brown fox jumps over the lazy dog. ' * (3 + i % 5)}
  for i in range(300)
]
PNG = b'\x89PNG\r\n\x1a\n' + bytes(range(256)) * 4


def _jsonl(records) -> bytes:
  return ''.join(json.dumps(r) + '\n' for r in records).encode()


def _zstd(raw: bytes) -> bytes:
  import zstandard

  return zstandard.ZstdCompressor().compress(raw)


def _write_files(d: str) -> None:
  """Every input file the cases name."""
  text = _jsonl(DOCS)
  notes = b'Plain notes, one document of text.\n' * 200
  files = {
    'text.jsonl': text,
    'text.jsonl.gz': gzip.compress(text),
    'text.jsonl.zst': _zstd(text),
    'text.jsonl.bz2': bz2.compress(text),
    'text.jsonl.xz': lzma.compress(text),
    'gz/part.jsonl.gz': gzip.compress(text),
    'gz/sub/notes.txt.gz': gzip.compress(notes),
    'plain/part.jsonl': text,
    'plain/sub/notes.txt': notes,
    'notes.txt': notes,
    'notes.txt.gz': gzip.compress(notes),
    'image.png': PNG,
    'image.png.gz': gzip.compress(PNG),
    'named.jsonl': PNG,  # a PNG under a text name
    'table.parquet': b'PAR1' + bytes(200) + b'PAR1',
    'truncated.jsonl.gz': gzip.compress(text)[:500],
    'null.jsonl': _jsonl(DOCS[:2] + [{'text': None}]),
    'number.jsonl': _jsonl(DOCS[:1] + [{'text': 12345}]),
    'list.jsonl': _jsonl(DOCS[:3] + [{'text': ['a', 'b']}]),
    'object.jsonl': _jsonl([{'text': {'body': 'x'}}]),
    'nofield.jsonl': _jsonl(DOCS[:1] + [{'body': 'x', 'id': 2}]),
    'notjson.jsonl': _jsonl(DOCS[:1]) + b'{"text": "unterminated\n',
    'array.jsonl': _jsonl(DOCS[:1]) + b'["a", "b"]\n',
    'latin1.txt': 'Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, d\u00e9j\u00e0 vu. '.encode('latin-1') * 50,
    'utf16.txt': 'plain text, but UTF-16\n'.encode('utf-16') * 20,
    'empty.txt': b'',
    'blank.jsonl': b'\n\n  \n',
    'emptydir/a.txt': b'',
    'pngdir/image.png': PNG,
    'bintxt/a.txt': PNG,
    'bintxt/b.txt': b'text beside it\n' * 100,
    'afile': b'a file, not a folder\n',
    'binrun/metrics.jsonl': PNG,
    'textrun/metrics.jsonl': b'hello\nworld\n',
    'foreign/index.json': b'{"pages": ["home"]}\n',
    'foreign/home.html': b'<html></html>\n',
    'syntax.py': b'def get_config(:\n  pass\n',
    'noget.py': b'from jax3d.config import base_config\nc = base_config()\n',
    'raises.py': b'from jax3d.config import base_config\n\ndef get_config():\n  c = base_config()\n  return c.trian\n',
    'returns_dict.py': b'def get_config():\n  return {"train": {"lr": 1}}\n',
    'unknown_key.py': b'from jax3d.config import base_config\n\ndef get_config():\n  c = base_config()\n  c.train.lrr = 0.1\n  return c\n',
    'top_level_key.py': b'from jax3d.config import base_config\n\ndef get_config():\n  c = base_config()\n  c.lr = 1\n  return c\n',
    'wrong_type.py': b'from jax3d.config import base_config\n\ndef get_config():\n  c = base_config()\n  c.train.lr = "fast"\n  return c\n',
  }
  for name, raw in files.items():
    os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
    with open(os.path.join(d, name), 'wb') as f:
      f.write(raw)
  with zipfile.ZipFile(os.path.join(d, 'archive.zip'), 'w') as z:
    z.writestr('a.txt', 'hello')
  _write_tables(d)
  os.makedirs(os.path.join(d, 'chat'))
  os.makedirs(os.path.join(d, 'dangling'))
  os.symlink(os.path.join(d, 'gone.txt'), os.path.join(d, 'dangling', 'a.txt'))


def _write_tables(d: str) -> None:
  """Tables: a Parquet file with a null row, and a DatasetDict folder with two splits."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  texts = [r['text'] for r in DOCS[:3]]
  pq.write_table(pa.table({'id': [0, 1, 2, 3], 'text': texts[:2] + [None] + texts[2:]}), f'{d}/rows.parquet')
  for split in ('train', 'test'):
    os.makedirs(f'{d}/dsdict/{split}')
  with open(f'{d}/dsdict/dataset_dict.json', 'w') as f:
    json.dump({'splits': ['train', 'test']}, f)


def _shards(d: str) -> None:
  """Token shards with an id past the model's vocabulary (300 > 256 bytes): 'ids_recorded' as
  prepare records it, 'ids_scanned' as older shards are (no max_id: the shard is read)."""
  from jax3d.data import shard_writer

  shard_writer.tokenize(
    os.path.join(d, 'text.jsonl'), os.path.join(d, 'ids_recorded'), 'bytes', workers=1, progress=False
  )
  shutil.copytree(os.path.join(d, 'ids_recorded'), os.path.join(d, 'shards_ok'))
  index_file = os.path.join(d, 'ids_recorded', 'index.json')
  index = json.load(open(index_file))
  shard = os.path.join(d, 'ids_recorded', index['train'][0]['file'])
  raw = bytearray(open(shard, 'rb').read())
  raw[20:22] = (300).to_bytes(2, 'little')
  open(shard, 'wb').write(raw)
  shutil.copytree(os.path.join(d, 'ids_recorded'), os.path.join(d, 'ids_scanned'))
  index['train'][0]['max_id'] = 300
  json.dump(index, open(index_file, 'w'))
  for s in index['train'] + index['val']:
    s.pop('max_id')
  json.dump(index, open(os.path.join(d, 'ids_scanned', 'index.json'), 'w'))


def _adapters_and_tasks(d: str) -> None:
  """PEFT adapter folders damaged two ways (weights cut short, config not JSON) and a folder of
  task YAMLs one of which does not parse."""
  from safetensors.numpy import save_file

  config = {'peft_type': 'LORA', 'r': 4, 'lora_alpha': 8, 'target_modules': ['q_proj', 'v_proj']}
  for name in ('peft_truncated', 'peft_badjson'):
    os.makedirs(os.path.join(d, name))
    weights = os.path.join(d, name, 'adapter_model.safetensors')
    save_file(
      {'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight': np.ones((4, 64), np.float32)},
      weights,
    )
    with open(os.path.join(d, name, 'adapter_config.json'), 'w') as f:
      f.write(json.dumps(config) if name == 'peft_truncated' else json.dumps(config)[:-5])
  with open(weights := os.path.join(d, 'peft_truncated', 'adapter_model.safetensors'), 'r+b') as f:
    f.truncate(os.path.getsize(weights) - 100)
  os.makedirs(os.path.join(d, 'badyaml'))
  with open(os.path.join(d, 'badyaml', 'my_task.yaml'), 'w') as f:
    f.write('task: my_task\ndataset_path: json\n  output_type: [\n')


@pytest.fixture(scope='module')
def made(tmp_path_factory):
  d = str(tmp_path_factory.mktemp('inputs'))
  _write_files(d)
  _shards(d)
  _adapters_and_tasks(d)
  return d


T = 'train'
PREP = ['prepare', '--noprogress', '--workers=1']
TABLE = [
  # --- one range per setting: config keys (each checked when the command line is read) --------
  (T, ['--config.train.lr=-1'], ['train.lr=-1.0 is invalid', 'a number >= 0']),
  (T, ['--config.train.lr=nan'], ['train.lr=nan is invalid', 'a number >= 0']),
  (T, ['--config.train.lr=inf'], ['train.lr=inf is invalid']),
  (T, ['--config.train.warmup_steps=-10'], ['train.warmup_steps=-10', 'an integer >= 0']),
  (T, ['--config.train.grad_clip=-1'], ['train.grad_clip=-1.0', 'a number >= 0 (0 disables)']),
  (T, ['--config.train.b1=1'], ['train.b1=1.0', 'a number in [0, 1)']),
  (T, ['--config.train.b2=1.5'], ['train.b2=1.5', 'a number in [0, 1)']),
  (T, ['--config.train.weight_decay=-0.1'], ['train.weight_decay=-0.1', '>= 0']),
  (T, ['--config.train.min_lr_ratio=2'], ['train.min_lr_ratio=2.0', 'in [0, 1]']),
  (T, ['--config.train.steps=-1'], ['train.steps=-1', 'an integer >= 0']),
  (T, ['--config.train.seed=-1'], ['train.seed=-1', 'in [0, 2**63)']),
  (T, ['--config.train.max_bad_steps=0'], ['train.max_bad_steps=0', '>= 1']),
  (T, ['--config.train.inject_nan_at=3,x'], ["train.inject_nan_at='3,x'", 'comma-separated step numbers']),
  (T, ['--config.eval.batches=0'], ['eval.batches=0', 'an integer >= 1']),
  (T, ['--config.eval.batches=-2'], ['eval.batches=-2', 'an integer >= 1']),
  (T, ['--config.eval.every=-1'], ['eval.every=-1', 'an integer >= 0 (0 = only at the end)']),
  (T, ['--config.checkpoint.keep=0'], ['checkpoint.keep=0', 'an integer >= 1']),
  (T, ['--config.checkpoint.keep=-1'], ['checkpoint.keep=-1', 'an integer >= 1']),
  (T, ['--config.checkpoint.every=-5'], ['checkpoint.every=-5', '>= 0']),
  (T, ['--config.data.eval_fraction=1.5'], ['data.eval_fraction=1.5 is invalid', 'a number in (0, 1)']),
  (T, ['--config.data.eval_fraction=0'], ['data.eval_fraction=0.0 is invalid', 'in (0, 1)']),
  (T, ['--config.data.prefetch=-1'], ['data.prefetch=-1', '>= 0']),
  (T, ['--config.data.tokenizer='], ["data.tokenizer=''", 'a non-empty string']),
  (T, ['--config.log.every=0'], ['log.every=0', '>= 1']),
  (T, ['--config.log.leak_window=2'], ['log.leak_window=2', '>= 3']),
  (T, ['--config.model.norm_eps=0'], ['model.norm_eps=0.0', 'in (0, 1]']),
  (T, ['--config.model.rope_theta=-1'], ['model.rope_theta=-1.0', '> 0']),
  (T, ['--config.profile.start=-2'], ['profile.start=-2', '-1 or an integer >= 0']),
  (T, ['--config.hardware.peak_tflops=-1'], ['hardware.peak_tflops=-1.0', '>= 0']),
  (T, ['--config.sample.temperature=nan'], ['sample.temperature=nan', 'a number >= 0 (0 = greedy)']),
  (T, ['--config.sample.top_k=-5'], ['sample.top_k=-5', 'an integer >= 0 (0 = all)']),
  (T, ['--config.model.hf_model_type=gpt2'], ["model.hf_model_type='gpt2'", 'llama, mistral, qwen2, qwen3']),
  (T, ['--config.train.compute_dtype=float16'], ["train.compute_dtype='float16'", 'float32, bfloat16']),
  (T, ['--config.lora.dropout=1'], ['lora.dropout=1.0 is invalid', 'a number in [0, 1)']),
  (T, ['--config.lora.dropout=-0.1'], ['lora.dropout=-0.1 is invalid', 'a number in [0, 1)']),
  (T, ['--config.lora.base_dtype=int4'], ["lora.base_dtype='int4'", 'float32, bfloat16, int8']),
  (
    [T, '--config.lora.rank=4', '--config.lora.base_dtype=int8', '--config.pipeline.schedule=1f1b'],
    ["lora.base_dtype='int8'", "float32 or bfloat16 with pipeline.schedule='1f1b'"],
  ),
  (T, ['--config.train.param_dtype=int8'], ["train.param_dtype='int8'", 'float32, bfloat16']),
  # FP8 matmuls (jax3d/model/fp8.py); an A100 target's refusal needs the CUDA plugin: tests/test_fp8.py
  (T, ['--config.train.matmul_dtype=fp16'], ["train.matmul_dtype='fp16'", "one of '', fp8"]),
  (
    [T, '--config.train.matmul_dtype=fp8', '--config.lora.rank=4', '--config.lora.base_dtype=int8'],
    ["train.matmul_dtype='fp8'", "'' (the compute dtype) with lora.base_dtype='int8'"],
  ),
  (
    [T, '--config.train.matmul_dtype=fp8', '--config.train.sequence_parallel=true'],
    ["train.sequence_parallel='true'", "false or auto with train.matmul_dtype='fp8'"],
  ),
  (
    [T, '--config.train.matmul_dtype=fp8', '--config.moe.num_experts=4'],
    ["train.matmul_dtype='fp8'", "'' (the compute dtype) with moe.num_experts > 0"],
  ),
  (T, ['--config.train.remat=some'], ["train.remat='some'", 'none, dots, attn, full, stage']),
  (T, ['--config.pipeline.schedule=1f2b'], ["pipeline.schedule='1f2b'", 'gpipe, circular, 1f1b']),
  (T, ['--config.pipeline.microbatches=0'], ['pipeline.microbatches=0', '>= 1']),
  (T, ['--config.train.sequence_parallel=maybe'], ["train.sequence_parallel='maybe'", 'true, false, auto']),
  # context parallelism (mesh.cp): what it is not built with yet is refused by name
  (T, ['--config.train.cp_strategy=spiral'], ["train.cp_strategy='spiral'", 'one of allgather, ring']),
  (
    T,
    [
      '--config.mesh.cp=2',
      '--config.mesh.pp=1',
      '--config.train.cp_strategy=ring',
      '--config.train.attention=xla',
    ],
    ["train.attention='xla'", 'not supported yet with mesh.cp=2', 'valid: auto, blockwise'],
  ),
  (
    T,
    ['--config.mesh.cp=4', '--config.mesh.pp=1', '--config.mesh.tp=1', '--config.train.seq_len=100'],
    ['train.seq_len=100', 'divisible by 2*mesh.cp = 8'],
  ),
  (
    T,
    ['--config.pipeline.skip_bubbles=sometimes'],
    ["pipeline.skip_bubbles='sometimes'", 'true, false, auto'],
  ),
  (T, ['--config.train.steps=many'], ["train.steps='many' is invalid", 'int']),
  (T, ['--config.model.nlayers=4'], ["unknown config key 'model.nlayers'", 'n_layers']),
  (T, ['--config.trian.steps=4'], ["unknown config key 'trian'", 'train']),
  (['plan', '--config.train.lr=-1'], ['train.lr=-1.0 is invalid']),
  (['inspect', '--config.eval.batches=0'], ['eval.batches=0 is invalid']),
  (['batch', '--step=0', '--config.data.eval_fraction=1.5'], ['data.eval_fraction=1.5 is invalid']),
  (['sample', '--workdir=.', '--config.sample.top_k=-1'], ['sample.top_k=-1 is invalid']),
  # --- settings against each other and against the devices (before anything compiles) --------
  (T, ['--config.mesh.dp=3'], ['mesh dp*pp*tp', '3*2*2 = 12', '8 devices']),
  (T, ['--config.mesh.dp=0'], ['mesh.dp=0 is invalid', '-1 or an integer >= 1']),
  (T, ['--config.mesh.dp=-1', '--config.mesh.tp=-1'], ['mesh.dp=-1 and mesh.tp=-1', 'at most one']),
  (
    T,
    ['--config.mesh.dp=-1', '--config.mesh.pp=3', '--config.mesh.tp=1'],
    ['mesh.dp=-1 cannot be filled', '3'],
  ),
  (
    T,
    ['--config.mesh.dp=1', '--config.mesh.pp=1', '--config.mesh.tp=8', '--config.model.n_heads=8'],
    ['model.n_kv_heads=2', 'mesh.tp=8'],
  ),
  (
    T,
    [
      '--config.model.n_heads=6',
      '--config.model.n_kv_heads=6',
      '--config.model.d_model=384',
      '--config.mesh.dp=2',
      '--config.mesh.pp=1',
      '--config.mesh.tp=4',
    ],
    ['model.n_heads=6', 'mesh.tp=4'],
  ),
  (T, ['--config.model.d_ff=771'], ['model.d_ff=771', 'mesh.tp=2']),
  (
    T,
    ['--config.model.vocab_multiple=1', '--config.model.vocab_size=257'],
    ['model.vocab_size=257', 'padded to 257'],
  ),
  (T, ['--config.model.n_layers=3'], ['model.n_layers=3', 'mesh.pp*pipeline.repeats = 2*1 = 2']),
  (T, ['--config.train.global_batch_size=20'], ['train.global_batch_size=20', '2*4*1 = 8']),
  (T, ['--config.train.grad_accum=3'], ['train.global_batch_size=16', '2*4*3 = 24']),
  (T, ['--config.train.seq_len=4096'], ['train.seq_len=4096', 'model.max_seq_len=2048']),
  (
    T,
    ['--config.pipeline.microbatches=3', '--config.train.global_batch_size=15'],
    ['train.global_batch_size=15', '2*3*1 = 6', 'split over dp'],
  ),
  (
    T,
    [
      '--config.pipeline.schedule=circular',
      '--config.pipeline.repeats=2',
      '--config.pipeline.microbatches=1',
      '--config.train.global_batch_size=16',
    ],
    ['pipeline.microbatches=1', 'circular', 'mesh.pp=2'],
  ),
  (
    T,
    ['--config.pipeline.schedule=circular', '--config.pipeline.repeats=3'],
    ['model.n_layers=4', '2*3 = 6'],
  ),
  (
    T,
    [
      '--config.train.sequence_parallel=true',
      '--config.train.seq_len=127',
      '--config.train.global_batch_size=8',
    ],
    ["train.sequence_parallel='true'", 'train.seq_len = 127', 'divisible by mesh.tp=2'],
  ),
  # --- command-line flags: each in its declared range --------------------------------------
  (['plan', '--efficiency=5'], ['--efficiency=5 is invalid', 'a number in (0, 1]']),
  (['plan', '--efficiency=0'], ['--efficiency=0 is invalid', 'in (0, 1]']),
  (['plan', '--overlap=1.5'], ['--overlap=1.5 is invalid', 'a number in [0, 1]']),
  (['plan', '--top=0'], ['--top=0 is invalid', '> 0']),
  (['plan', '--gpu_memory_gb=inf'], ['--gpu_memory_gb=inf is invalid', 'a number > 0']),
  (['plan', '--peak_tflops=nan'], ['--peak_tflops=nan is invalid', 'a number > 0']),
  (['plan', '--gpus-per-node=0'], ['--gpus_per_node=0 is invalid', 'an integer > 0']),
  (['plan', '--nodes'], ['--nodes needs a value']),
  (
    ['sample', '--workdir=.', '--temperature=nan'],
    ['--temperature=nan is invalid', 'a number >= 0 (0 = greedy)'],
  ),
  (['sample', '--workdir=.', '--temperature=-1'], ['--temperature=-1 is invalid', 'a number >= 0']),
  (['sample', '--workdir=.', '--top_k=-5'], ['--top_k=-5 is invalid', 'an integer >= 0 (0 = all)']),
  (['sample', '--workdir=.', '--tokens=-1'], ['--tokens=-1 is invalid', 'an integer >= 0']),
  (['sample', '--workdir=.', '--seed=-1'], ['--seed=-1 is invalid', 'in [0, 2**63)']),
  (['sample', '--prompt=x'], ['give --workdir=DIR', 'or --config.checkpoint.init_from=hf:PATH']),
  ([*PREP, '--out=FILES/o', '--shard_mb=0'], ['--shard_mb=0 is invalid', 'a number > 0']),
  ([*PREP, '--out=FILES/o', '--eval_fraction=1'], ['--eval_fraction=1 is invalid', 'a number in [0, 1)']),
  ([*PREP, '--out=FILES/o', '--workers=-1'], ['--workers=-1 is invalid', '>= 0']),
  ([*PREP, '--out=FILES/o', '--train_tokenizer=100'], ['--train_tokenizer=100 is invalid', '>= 257']),
  ([*PREP, '--out=FILES/o', '--field='], ['--field= is invalid', 'a non-empty string']),
  ([*PREP, '--out=FILES/o', '--format=csv'], ['--format=csv is invalid', 'one of text, chat']),
  (
    [*PREP, '--out=FILES/o', '--input=/nonexistent'],
    ['--input=/nonexistent is invalid', 'an existing file or folder'],
  ),
  (['batch', '--step=-1'], ['--step=-1 is invalid', '>= 0']),
  (['batch', '--step=0', '--rows=-1'], ['--rows=-1 is invalid', '>= 0']),
  (T, ['--devices_per_process=0'], ['--devices_per_process=0 is invalid', '> 0']),
  (T, ['--num_processes=two'], ["--num_processes='two' is invalid", 'integer']),
  (T, ['--distributed=maybe'], ['--distributed=maybe is invalid', 'auto, on, off']),
  (T, ['--wrkdir=x'], ['unknown flag --wrkdir']),
  (['inspect', '--json=maybe'], ["--json='maybe' is invalid", 'true or false']),
  (['inspect', 'configs/tiny.py'], ["unexpected argument 'configs/tiny.py'"]),
  (['inspect', '--hlo=configs'], ['--hlo=configs is invalid', 'a file path in an existing folder']),
  (['inspect', '--hlo=no/such/folder/step.hlo'], ['--hlo=', 'a file path in an existing folder']),
  (['inspect', '--target=h100x12'], ['--target=h100x12 is invalid', 'KINDxN']),
  (['plan', '--verify_top=0'], ['--verify_top=0 is invalid']),
  (['report'], ['expected WORKDIR', '0 argument']),
  (['report', 'a', 'b'], ['expected WORKDIR', "['a', 'b']"]),
  (['report', '--config=tiny', 'a'], ['unknown flag --config=tiny']),
  # --- config files --------------------------------------------------------------------
  (T, ['--config=configs/none.py'], ['--config=configs/none.py', 'no such file']),
  (T, ['--config=FILES/syntax.py'], ['--config=FILES/syntax.py: line 1:', 'a config file is Python']),
  (T, ['--config=FILES/noget.py'], ['--config=FILES/noget.py: defines no get_config()']),
  (T, ['--config=FILES/raises.py'], ['--config=FILES/raises.py: line 5: AttributeError', 'trian']),
  (T, ['--config=FILES/returns_dict.py'], ['get_config() returned dict, not an ml_collections.ConfigDict']),
  (T, ['--config=FILES/unknown_key.py'], ["unknown config key 'train.lrr'", 'train.lr,']),
  (T, ['--config=FILES/top_level_key.py'], ["unknown config key 'lr'", 'checkpoint']),
  (T, ['--config=FILES/wrong_type.py'], ['--config=FILES/wrong_type.py: line 5: TypeError']),
  (
    T,
    ['--config=FILES/image.png'],
    ['--config=FILES/image.png: source code string cannot contain null bytes'],
  ),
  (T, ['--config=FILES'], ['--config=FILES: a folder, not a config file']),
  # --- paths: a file where a folder goes, a folder that is not what it should be ------------
  (T, ['--workdir=FILES/afile'], ['--workdir=FILES/afile is invalid', 'not a file']),
  (T, ['--workdir=FILES/afile/run'], ['--workdir=FILES/afile/run is invalid', 'not a file']),
  (['sample', '--workdir=FILES/afile'], ['--workdir=FILES/afile is invalid', 'an existing folder']),
  ([*PREP, '--input=FILES/text.jsonl', '--out=FILES/afile'], ['--out=FILES/afile is invalid', 'not a file']),
  (
    [*PREP, '--input=FILES/plain', '--out=FILES/plain/shards'],
    ['--out=FILES/plain/shards is inside --input=FILES/plain'],
  ),
  ([*PREP, '--input=FILES', '--out=FILES/shards'], ['--out=FILES/shards is inside --input=FILES']),
  (
    [*PREP, '--input=FILES/foreign/home.html', '--out=FILES/foreign'],
    ['--input=FILES/foreign/home.html is inside --out'],
  ),
  (
    [*PREP, '--input=FILES/notes.txt', '--out=FILES/foreign'],
    ['--out=FILES/foreign holds an index.json', 'did not write'],
  ),
  (['report', 'FILES/afile'], ['WORKDIR=FILES/afile', 'no such file']),
  (['report', 'FILES/binrun'], ['FILES/binrun/metrics.jsonl holds no metrics record', 'not JSON objects']),
  (['report', 'FILES/textrun'], ['FILES/textrun/metrics.jsonl holds no metrics record', '2 line(s)']),
  # --- what is inside input files ------------------------------------------------------
  ([*PREP, '--input=FILES/image.png', '--out=FILES/o'], ['FILES/image.png: not text but a PNG image']),
  ([*PREP, '--input=FILES/named.jsonl', '--out=FILES/o'], ['FILES/named.jsonl: not text but a PNG image']),
  ([*PREP, '--input=FILES/image.png.gz', '--out=FILES/o'], ['a PNG image (inside its gzip compression)']),
  (
    [*PREP, '--input=FILES/table.parquet', '--out=FILES/o'],
    ['FILES/table.parquet: not a readable Parquet file'],
  ),
  (
    [*PREP, '--input=FILES/rows.parquet', '--field=body', '--out=FILES/o'],
    ["--field=body: FILES/rows.parquet has no column 'body' (its columns: id, text)"],
  ),
  (
    [*PREP, '--input=FILES/rows.parquet', '--field=id', '--out=FILES/o'],
    ["--field=id: column 'id' of FILES/rows.parquet is int64, not text"],
  ),
  (
    [*PREP, '--input=FILES/rows.parquet', '--out=FILES/out_rows'],
    ["FILES/rows.parquet: row 2: field 'text' is null"],
  ),
  (
    [*PREP, '--input=FILES/dsdict', '--split=valid', '--out=FILES/o'],
    ['--split=valid: FILES/dsdict has no such split (its splits: train, test)'],
  ),
  (
    [*PREP, '--input=hf:nobody/nothing', '--out=FILES/o'],
    ['--input=hf:nobody/nothing: not in the Hugging Face cache', 'never downloads'],
  ),
  ([*PREP, '--input=FILES/notes.txt', '--on_bad=maybe', '--out=FILES/o'], ['--on_bad=maybe', 'fail, skip']),
  ([*PREP, '--input=FILES/archive.zip', '--out=FILES/o'], ['FILES/archive.zip: not text but a ZIP archive']),
  ([*PREP, '--input=FILES/utf16.txt', '--out=FILES/o'], ['FILES/utf16.txt: not text but UTF-16 text']),
  (
    [*PREP, '--input=FILES/truncated.jsonl.gz', '--out=FILES/o'],
    ['FILES/truncated.jsonl.gz: gzip data that cannot be decompressed'],
  ),
  (
    [*PREP, '--input=FILES/null.jsonl', '--out=FILES/o'],
    ["FILES/null.jsonl:3: field 'text' is null, not a string"],
  ),
  (
    [*PREP, '--input=FILES/number.jsonl', '--out=FILES/o'],
    ["FILES/number.jsonl:2: field 'text' is 12345, not a string"],
  ),
  (
    [*PREP, '--input=FILES/list.jsonl', '--out=FILES/o'],
    ['FILES/list.jsonl:4: field \'text\' is ["a", "b"], not a string'],
  ),
  (
    [*PREP, '--input=FILES/object.jsonl', '--out=FILES/o'],
    ['FILES/object.jsonl:1: field \'text\' is {"body": "x"}'],
  ),
  (
    [*PREP, '--input=FILES/nofield.jsonl', '--out=FILES/o'],
    ["FILES/nofield.jsonl:2: no field 'text' (its fields: body, id"],
  ),
  (
    [*PREP, '--input=FILES/nofield.jsonl', '--out=FILES/o', '--field=body'],
    ["FILES/nofield.jsonl:1: no field 'body'"],
  ),
  ([*PREP, '--input=FILES/notjson.jsonl', '--out=FILES/o'], ['FILES/notjson.jsonl:2: not a JSON object']),
  ([*PREP, '--input=FILES/array.jsonl', '--out=FILES/o'], ["FILES/array.jsonl:2: no field 'text' (list"]),
  (
    [*PREP, '--input=FILES/latin1.txt', '--out=FILES/o'],
    ['FILES/latin1.txt: 300 of its 1,400 bytes are not UTF-8', 'iconv'],
  ),
  (
    [*PREP, '--input=FILES/empty.txt', '--out=FILES/o'],
    ['--input=FILES/empty.txt: no text to prepare (1 file(s), all empty)'],
  ),
  (
    [*PREP, '--input=FILES/emptydir', '--out=FILES/o'],
    ['--input=FILES/emptydir: no text to prepare (1 file(s)'],
  ),
  ([*PREP, '--input=FILES/pngdir', '--out=FILES/o'], ['--input=FILES/pngdir: no text to prepare (0 file(s)']),
  (
    [*PREP, '--input=FILES/blank.jsonl', '--out=FILES/o'],
    ['--input=FILES/blank.jsonl: no document in 1 file(s)'],
  ),
  (
    [*PREP, '--input=FILES/dangling', '--out=FILES/o'],
    ['FILES/dangling/a.txt: cannot be read (No such file or directory)'],
  ),
  (T, ['--config.data.path=FILES/image.png'], ["data.path='FILES/image.png'", 'not text but a PNG image']),
  (
    T,
    ['--config.data.path=FILES/bintxt'],
    ["data.path='FILES/bintxt': FILES/bintxt/a.txt: not text but a PNG"],
  ),
  (T, ['--config.data.path=FILES/emptydir'], ["data.path='FILES/emptydir' holds no usable training data"]),
  (T, ['--config.data.path=/nonexistent/corpus'], ["data.path='/nonexistent/corpus'", 'does not exist']),
  # the other path keys: '' or a path that exists (hf: a folder after the prefix)
  (
    T,
    ['--config.checkpoint.init_from=/nonexistent/run'],
    ["checkpoint.init_from='/nonexistent/run'", 'does not exist'],
  ),
  (
    T,
    ['--config.checkpoint.init_from=hf:/nonexistent/model'],
    ["checkpoint.init_from='hf:/nonexistent/model'", "an existing run's WORKDIR, or hf:FOLDER"],
  ),
  (
    T,
    ['--config.lora.rank=4', '--config.lora.init_from=/nonexistent/adapter'],
    ["lora.init_from='/nonexistent/adapter'", 'an existing PEFT adapter folder'],
  ),
  (
    T,
    ['--config.eval.tasks_include_path=/nonexistent/tasks'],
    ["eval.tasks_include_path='/nonexistent/tasks'", 'an existing folder of task YAML files'],
  ),
  (
    T,
    ['--config.data.mixture=web=1:FILES/nowhere'],
    ["data.mixture source 'web' (FILES/nowhere)", 'does not exist'],
  ),
  (
    T,
    ['--config.data.mixture=web=0:FILES/emptydir'],
    ["data.mixture='web=0:FILES/emptydir'", "the weight of 'web' is '0'; a weight is a number > 0"],
  ),
  (
    ['batch', '--step=0', '--config.data.mixture=web=1:FILES/a,web=2:FILES/b'],
    ["the name 'web' is given twice"],
  ),
  (T, ['--config.data.mixture_stages=5:web=1'], ["data.mixture_stages='5:web=1' needs data.mixture"]),
  (
    T,
    ['--config.data.path=FILES/text.jsonl.gz'],
    ["data.path='FILES/text.jsonl.gz' is JSONL", 'jax3d.prepare'],
  ),
  (
    T,
    ['--config.data.path=FILES/ids_recorded'],
    ['holds token id 300 (the largest)', 'model.vocab_size=256'],
  ),
  (T, ['--config.data.path=FILES/ids_scanned'], ['holds token id 300 (the largest)', 'model.vocab_size=256']),
  (['batch', '--step=0', '--config.data.path=FILES/table.parquet'], ['not text but a Parquet file']),
  (
    ['batch', '--step=0', '--config.data.path=FILES/utf16.txt'],
    ['FILES/utf16.txt: not text but UTF-16 text'],
  ),
  (
    T,
    ['--config.data.tokenizer=FILES/image.png'],
    ["data.tokenizer='FILES/image.png'", 'not a valid SentencePiece'],
  ),
  (
    [*PREP, '--input=FILES/text.jsonl', '--out=FILES/o', '--tokenizer=FILES/image.png'],
    ["--tokenizer='FILES/image.png'", 'not a valid SentencePiece'],
  ),
  (['sample', '--workdir=FILES/plain'], ['--workdir=FILES/plain: no checkpoint in FILES/plain/checkpoints']),
  # --- issue 56: settings that act on nothing, damaged adapters and task files, paths and flags ----
  (
    T,
    ['--config.lora.init_from=FILES/peft_truncated', '--config.checkpoint.init_from=hf:FILES'],
    ["lora.init_from='FILES/peft_truncated'", 'adapter_model.safetensors is not a readable safetensors file'],
  ),
  (
    T,
    ['--config.lora.init_from=FILES/peft_badjson', '--config.checkpoint.init_from=hf:FILES'],
    ["lora.init_from='FILES/peft_badjson'", 'adapter_config.json is not valid JSON'],
  ),
  (T, ['--config.lora.alpha=32'], ['lora.alpha=32.0 is invalid', 'acts only with lora.rank > 0']),
  (T, ['--config.lora.targets=q,v'], ["lora.targets='q,v' is invalid", 'acts only with lora.rank > 0']),
  (T, ['--config.lora.dropout=0.1'], ['lora.dropout=0.1 is invalid', 'acts only with lora.rank > 0']),
  (
    T,
    ['--config.lora.rank=200'],
    ['lora.rank=200 is invalid', 'at most 128', 'the k projection (256 x 128)'],
  ),
  (T, ['--config.eval.tasks_limit=5'], ['eval.tasks_limit=5 is invalid', 'acts only with eval.tasks']),
  (T, ['--config.eval.tasks_include_path=FILES'], ["eval.tasks_include_path='FILES'", 'eval.tasks']),
  (T, ['--config.train.cp_strategy=ring'], ["train.cp_strategy='ring' is invalid", 'mesh.cp > 1']),
  # --- issue 55: mixture of experts -------------------------------------------------------------
  (
    T,
    ['--config.moe.num_experts=4', '--config.moe.top_k=5'],
    ['moe.top_k=5 is invalid', 'at most moe.num_experts=4'],
  ),
  (T, ['--config.moe.num_experts=4', '--config.moe.capacity_factor=0'], ['moe.capacity_factor=0', '> 0']),
  (T, ['--config.moe.num_experts=-2'], ['moe.num_experts=-2 is invalid', '>= 0 (0 = dense)']),
  (T, ['--config.moe.top_k=4'], ['moe.top_k=4 is invalid', 'acts only with moe.num_experts > 0']),
  (
    T,
    ['--config.moe.num_experts=4', '--config.train.sequence_parallel=true'],
    [
      "train.sequence_parallel='true' is invalid",
      'false or auto',
      'not supported yet with moe.num_experts=4',
    ],
  ),
  (
    T,
    ['--config.mesh.ep=2', '--config.mesh.dp=-1'],
    ['mesh.ep=2 is invalid', '1 without a mixture of experts'],
  ),
  (
    T,
    ['--config.moe.num_experts=6', '--config.mesh.ep=4', '--config.mesh.dp=1', '--config.mesh.pp=1'],
    ['mesh.ep=4 is invalid', 'a divisor of moe.num_experts=6'],
  ),
  (
    T,
    ['--config.moe.num_experts=4', '--config.lora.rank=4', '--config.lora.targets=q,up'],
    ["lora.targets='q,up' is invalid", 'attention projections only'],
  ),
  (
    T,
    [
      '--config.data.mixture=a=1:FILES/shards_ok,b=1:FILES/shards_ok',
      '--config.data.mixture_stages=1000:a=1,b=3',
    ],
    ["data.mixture_stages='1000:a=1,b=3'", 'the stage at step 1000', 'train.steps=300'],
  ),
  (
    T,
    ['--config.data.mixture=a=1:FILES/shards_ok,b=1:FILES/ids_recorded'],
    ['holds token id 300 (the largest)', 'model.vocab_size=256'],
  ),
  (
    [
      'eval',
      '--config.checkpoint.init_from=hf:FILES',
      '--tasks=my_task',
      '--include_path=FILES/badyaml',
    ],
    ["task 'my_task'", 'FILES/badyaml/my_task.yaml', 'does not load'],
  ),
  (['inspect', '--hlo=/proc/step.hlo'], ['--hlo=/proc/step.hlo is invalid', 'that can be written']),
  (
    ['plan', '--target=h100x16', '--nodes=4'],
    ['--nodes=4 is invalid', '--target=h100x16 is 2 node(s)', 'give 2'],
  ),
  (
    [*PREP, '--input=FILES/rows.parquet', '--split=validation', '--out=FILES/o'],
    ['--split=validation: FILES/rows.parquet has no splits'],
  ),
]
COMMON = ('--noprogress', '--workers=1')
IDS = [
  ' '.join(a for a in ([T, *c[1]] if c[0] == T else c[0]) if a not in COMMON).replace('FILES/', '')
  for c in TABLE
]


def _argv(i, d):
  """The command and arguments of case i, FILES made `d`; its own --out and --workdir folders
  (out{i}, runs/{i}): the cases run at the same time."""
  case = TABLE[i]
  cmd, *args = [T, *case[1]] if case[0] == T else case[0]
  args = [a.replace('--out=FILES/o', f'--out={d}/out{i}').replace(F, d) for a in args]
  if cmd == T and not any(a.startswith('--workdir') for a in args):
    args.append(f'--workdir={d}/runs/{i}')
  return cmd, args


def _env():
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8', JAX_LOG_COMPILES='1')
  env['PYTHONPATH'] = os.pathsep.join([ROOT] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p])
  return env


def run(command, args, cwd=ROOT, timeout=300):
  """`python -m jax3d.COMMAND ARGS`; a run past `timeout` seconds is killed, exit status -9 (a case
  that was accepted and trains, where it should have been refused)."""
  try:
    return subprocess.run(
      [sys.executable, '-m', f'jax3d.{command}', *args],
      cwd=cwd,
      env=_env(),
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
    )
  except subprocess.TimeoutExpired as e:
    return subprocess.CompletedProcess(e.cmd, -9, '', f'timed out after {timeout} s')


def run_cli(args, tmp_path, env_extra=None):
  """`python -m jax3d.train --workdir=TMP/w ARGS` with the compile log on (for other modules' cases)."""
  env = _env() | (env_extra or {})
  argv = [sys.executable, '-m', 'jax3d.train', f'--workdir={tmp_path}/w', *args]
  return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def _digest(d):
  """{relative path: sha256} of every file under d."""
  out = {}
  for root, _, names in os.walk(d):
    for n in names:
      p = os.path.join(root, n)
      out[os.path.relpath(p, d)] = (
        os.readlink(p) if os.path.islink(p) else hashlib.sha256(open(p, 'rb').read()).hexdigest()
      )
  return out


@pytest.fixture(scope='module')
def results(made, request):
  """The cases of TABLE this session runs (all, or those -k selects), three at a time; and the
  files of `made` before and after."""
  items = request.session.items
  chosen = {it.callspec.params['i'] for it in items if it.originalname == 'test_bad_input_is_one_clear_line'}
  before = _digest(made)
  t0 = time.time()
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    done = dict(zip(chosen, pool.map(lambda i: run(*_argv(i, made), timeout=90), chosen), strict=True))
  return {'runs': done, 'before': before, 'after': _digest(made), 'seconds': time.time() - t0}


@pytest.mark.parametrize('i', range(len(TABLE)), ids=IDS)
def test_bad_input_is_one_clear_line(results, made, i):
  r, words = results['runs'][i], [w.replace(F, made) for w in TABLE[i][-1]]
  assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
  assert 'Traceback' not in r.stderr and 'Compiling' not in r.stderr, r.stderr[-3000:]
  lines = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1, r.stderr[-3000:]
  for w in words:
    assert w in lines[0], (w, lines[0])


def test_the_table_changed_no_input_file(results):
  """No case wrote over an input (a foreign --out, an --out inside --input, ...): every file is
  byte-identical, and new files are only in the cases' own --out and --workdir folders."""
  before, after = results['before'], results['after']
  assert {k: after[k] for k in before} == before
  new = sorted(set(after) - set(before))
  assert all(n.startswith(('out', 'runs' + os.sep)) for n in new), new


def test_the_table_left_no_folder_behind(results, made):
  """A refused train makes no workdir (nor its .lock and empty files), a refused prepare no output
  folder: the cases' own --workdir (runs/i) and --out (out...) folders do not exist afterwards."""
  left = [n for n in os.listdir(made) if n.startswith('out')]
  left += [f'runs/{n}' for n in (os.listdir(f'{made}/runs') if os.path.isdir(f'{made}/runs') else [])]
  assert not left, left


def test_compile_log_shows_a_compile(tmp_path):
  """The sentinel the bad-input cases rely on: with JAX_LOG_COMPILES=1 a compile does print
  'Compiling' on stderr (without it jax prints nothing, and 'no Compiling' proved nothing)."""
  code = 'import jax.numpy as jnp; (jnp.ones(3) + 1).block_until_ready()'
  r = subprocess.run([sys.executable, '-c', code], env=_env(), capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and 'Compiling' in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# Nothing lost: a re-run of prepare over a complete dataset
# ---------------------------------------------------------------------------------------------
def _shard_bytes(d):
  return {n: open(os.path.join(d, n), 'rb').read() for n in sorted(os.listdir(d)) if n.endswith('.bin')}


def test_a_failed_prepare_rerun_leaves_the_dataset_as_it_was(made, tmp_path):
  """A re-run that fails on its last file leaves every file of the complete dataset byte-identical
  (the new one is written beside it) and the dataset still loads; a re-run that succeeds swaps the
  new dataset in (equal to a fresh prepare of the same input) and keeps a file the user put there."""
  src, out = tmp_path / 'src', tmp_path / 'out'
  shutil.copytree(os.path.join(made, 'plain'), src)
  args = [f'--input={src}', f'--out={out}', '--noprogress', '--workers=1', '--shard_mb=0.02']
  assert run('prepare', args).returncode == 0
  (out / 'NOTES.md').write_text('mine')
  before = _digest(out)
  with open(src / 'part.jsonl', 'a') as f:  # its units are redone before the failing one
    f.write(json.dumps({'text': 'one more'}) + '\n')
  with open(src / 'sub' / 'zz.jsonl', 'w') as f:  # the last unit fails
    f.write(json.dumps({'text': 'fine'}) + '\n' + json.dumps({'text': None}) + '\n')
  r = run('prepare', args)
  assert r.returncode == 2 and r.stderr.count('error:') == 1 and 'zz.jsonl:2: field' in r.stderr, r.stderr
  assert _digest(out) == before
  assert run('batch', ['--step=0', f'--config.data.path={out}', '--rows=1']).returncode == 0
  (src / 'sub' / 'zz.jsonl').write_text(json.dumps({'text': 'fine now'}) + '\n')
  r = run('prepare', args)
  assert r.returncode == 0, r.stderr
  fresh = tmp_path / 'fresh'
  assert run('prepare', [f'--input={src}', f'--out={fresh}', *args[2:]]).returncode == 0
  assert _shard_bytes(out) == _shard_bytes(fresh) and _shard_bytes(out) != {}
  assert (out / 'NOTES.md').read_text() == 'mine' and not os.path.exists(f'{out}.partial')


# ---------------------------------------------------------------------------------------------
# Accepted: compressed input reads as the plain input does
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def plain_shards(made, tmp_path_factory):
  out = str(tmp_path_factory.mktemp('plain') / 'out')
  r = run('prepare', [f'--input={made}/text.jsonl', f'--out={out}', '--noprogress', '--workers=1'])
  assert r.returncode == 0, r.stderr
  return _shard_bytes(out)


@pytest.mark.parametrize('suffix', ['gz', 'zst', 'bz2', 'xz', 'bom'])
def test_a_compressed_jsonl_prepares_to_the_plain_one_shards(made, plain_shards, tmp_path, suffix):
  """(and 'bom': the JSONL file with a UTF-8 byte-order mark first, as Windows editors write it)"""
  src = f'{made}/text.jsonl.{suffix}'
  if suffix == 'bom':
    src = f'{tmp_path}/bom/text.jsonl'
    os.makedirs(os.path.dirname(src))
    with open(src, 'wb') as f:
      f.write(b'\xef\xbb\xbf' + open(f'{made}/text.jsonl', 'rb').read())
  common = ['--noprogress', '--workers=1'] + ['--eval_fraction=0'] * (suffix == 'bom')  # its offsets are 3 on
  r = run('prepare', [f'--input={src}', f'--out={tmp_path}/o', *common])
  assert r.returncode == 0 and 'Traceback' not in r.stderr, r.stderr
  if suffix == 'bom':
    assert run('prepare', [f'--input={made}/text.jsonl', f'--out={tmp_path}/plain', *common]).returncode == 0
    plain_shards = _shard_bytes(f'{tmp_path}/plain')
  assert _shard_bytes(f'{tmp_path}/o') == plain_shards and len(plain_shards) == 4
  assert not os.path.exists(f'{tmp_path}/o/.inputs')  # the decompressed copy is gone


def test_a_folder_of_compressed_files_prepares_as_the_plain_folder(made, tmp_path):
  common = ['--noprogress', '--workers=1', '--eval_fraction=0.3']
  for name in ('plain', 'gz'):
    assert run('prepare', [f'--input={made}/{name}', f'--out={tmp_path}/{name}', *common]).returncode == 0
  assert _shard_bytes(f'{tmp_path}/gz') == _shard_bytes(f'{tmp_path}/plain')
  index = json.load(open(f'{tmp_path}/gz/index.json'))
  assert sum(s['documents'] for s in index['train'] + index['val']) == len(DOCS) + 1


def test_train_reads_a_compressed_text_file_as_the_plain_one(made):
  """`jax3d.batch` prints what step 0 trains on: the same rows from notes.txt.gz as from notes.txt."""
  rows = []
  for name in ('notes.txt', 'notes.txt.gz'):
    r = run(
      'batch', ['--step=0', '--rows=2', f'--config.data.path={made}/{name}', '--config.train.seq_len=32']
    )
    assert r.returncode == 0, r.stderr
    rows.append(r.stdout.split('\n', 1)[1])
  assert rows[0] == rows[1] and 'Plain notes' in rows[0]


def test_undecodable_bytes_are_counted_below_the_threshold(made, tmp_path):
  text = (b'good text ' * 400 + b'\xff\n') * 2  # 2 bad bytes in 8,002: under 0.1%
  (tmp_path / 'a.txt').write_bytes(text)
  r = run('prepare', [f'--input={tmp_path}/a.txt', f'--out={tmp_path}/o', '--noprogress', '--workers=1'])
  assert r.returncode == 0, r.stderr
  assert f'note: 2 byte(s) that are not UTF-8 replaced by U+FFFD: {tmp_path}/a.txt (2)' in r.stderr


def test_chat_content_parts_are_joined_as_a_string(made, tmp_path):
  """OpenAI-style content parts give the shards of the same text as a string (parts joined by a
  newline); a part that is not text is one error line naming the file, line and message."""
  from test_chat import CONVERSATIONS, SPECIALS, make_folder
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=SPECIALS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator([json.dumps(CONVERSATIONS)], trainer)
  tok.save(str(tmp_path / 'base.json'))
  folder = make_folder(tmp_path / 'tok', str(tmp_path / 'base.json'), 'chatml')
  split = lambda m: m | {'content': [{'type': 'text', 'text': t} for t in m['content'].split('\n')]}
  parts = [{'messages': [split(m) for m in c]} for c in CONVERSATIONS]
  strings = [{'messages': c} for c in CONVERSATIONS]
  outs = []
  for name, lines in (('parts', parts), ('strings', strings)):
    (tmp_path / f'{name}.jsonl').write_bytes(_jsonl(lines))
    argv = [
      f'--input={tmp_path}/{name}.jsonl',
      f'--out={tmp_path}/{name}',
      f'--tokenizer={folder}',
      '--format=chat',
    ]
    r = run(
      'prepare', [*argv, '--noprogress', '--workers=1', '--eval_fraction=0']
    )  # one split: the names differ
    assert r.returncode == 0, r.stderr
    outs.append(_shard_bytes(f'{tmp_path}/{name}'))
  assert outs[0] == outs[1] and any(n.endswith('.weights.bin') for n in outs[0])
  bad = [{'messages': [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'x'}}]}]}]
  (tmp_path / 'bad.jsonl').write_bytes(_jsonl(strings[:1] + bad))
  r = run(
    'prepare',
    [f'--input={tmp_path}/bad.jsonl', f'--out={tmp_path}/bad', f'--tokenizer={folder}', '--format=chat'],
  )
  lines = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert r.returncode == 2 and len(lines) == 1 and 'Traceback' not in r.stderr, r.stderr
  assert f'{tmp_path}/bad.jsonl:2: message 1 (user): content {{"type": "image_url"' in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------
# The command-line convention of every command (jax3d/cli.py), and validation itself
# ---------------------------------------------------------------------------------------------
def test_validation_raises_real_exceptions_not_asserts():
  """Validation survives `python -O` (which strips assert statements)."""
  r = subprocess.run(
    [
      sys.executable,
      '-O',
      '-c',
      (
        'from jax3d import config as c\n'
        'cfg = c.load_config("tiny", {"mesh.dp": 3})\n'
        'try:\n  c.validate(cfg, 8)\nexcept c.ConfigError as e:\n  print("raised", e)\n'
      ),
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
    check=False,
  )
  assert 'raised mesh dp*pp*tp' in r.stdout, r.stderr


# ---------------------------------------------------------------------------------------------
# One command-line convention for the five commands (jax3d/cli.py)
# ---------------------------------------------------------------------------------------------
COMMANDS = ['train', 'plan', 'inspect', 'report', 'sample', 'prepare', 'export', 'eval']
WITH_CONFIG = ['train', 'plan', 'inspect', 'sample', 'export', 'eval']
REQUIRED = {  # so that the error is about the flag tested
  'sample': ['--workdir=/nonexistent/run'],
  'eval': ['--workdir=/nonexistent/run', '--tasks=some_task'],
  'prepare': ['--out=/nonexistent/out'],
  'export': ['--workdir=/nonexistent/run', '--out=/nonexistent/out'],
}

# `python -m jax3d.COMMAND ARGS...`, then one more line on stdout: was jax imported?
RUN_AS_MAIN = (
  'import runpy, sys\n'
  'sys.argv = sys.argv[1:]\n'
  'try:\n'
  '  runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)\n'
  'finally:\n'
  '  print("jax imported" if "jax" in sys.modules else "jax not imported")\n'
)


def run_command(command, *args):
  r = subprocess.run(
    [sys.executable, '-c', RUN_AS_MAIN, f'jax3d.{command}', *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
    check=False,
  )
  return r, r.stdout.rstrip().splitlines()[-1]


def one_error_line(r):
  """The single stderr line of a usage error (exit status 2, nothing else on stderr)."""
  assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), r.stderr
  return lines[0]


@pytest.mark.parametrize('command', COMMANDS)
def test_every_command_rejects_an_unknown_flag(command):
  r, jax_line = run_command(command, *REQUIRED.get(command, []), '--bogus-flag=1')
  line = one_error_line(r)
  assert 'unknown flag --bogus-flag=1' in line and 'valid: ' in line and '--help' in line, line
  assert jax_line == 'jax not imported'


@pytest.mark.parametrize('command', WITH_CONFIG)
@pytest.mark.parametrize(
  'override,words',
  [
    ('--config.model.nlayers=4', ["unknown config key 'model.nlayers'", 'n_layers']),
    ('--config.train.steps=many', ["train.steps='many' is invalid", 'int']),
  ],
)
def test_every_command_with_a_config_rejects_a_bad_key(command, override, words):
  r, jax_line = run_command(command, *REQUIRED.get(command, []), override)
  line = one_error_line(r)
  assert all(w in line for w in words), line
  assert jax_line == 'jax not imported'


@pytest.mark.parametrize('command', COMMANDS)
def test_every_command_prints_its_docstring_for_help(command):
  first = importlib.import_module(f'jax3d.{command}').__doc__.strip().splitlines()[0]
  for flag in ('--help', '-h'):
    r, jax_line = run_command(command, '--bogus', flag)  # --help wins wherever it is
    assert r.returncode == 0 and r.stderr == '', r.stderr
    assert r.stdout.startswith(first) and '\nArguments and flags:\n' in r.stdout, r.stdout
    assert jax_line == 'jax not imported'


def test_flag_spellings_and_types():
  """--a-b and --a_b alike, --name VALUE, bare and explicit bools, --noNAME; converted types."""
  from jax3d import plan

  args = cli.parse(
    [
      '--gpus-per-node=4',
      '--gpu_memory_gb',
      '40',
      '--json',
      '--fixed=false',
      '--noemit',
      '--config=tiny',
      '--config.mesh.tp=4',
      '--config.mesh.pp=1',
    ],
    plan.__doc__,
    plan.FLAGS,
  )
  assert isinstance(args, cli.Args)
  f = args.flags
  assert (f['gpus_per_node'], f['gpu_memory_gb'], f['json'], f['fixed'], f['emit'], f['nodes']) == (
    4,
    40.0,
    True,
    False,
    False,
    1,
  )
  assert type(f['gpu_memory_gb']) is float and args.config_name == 'tiny'
  assert (
    args.overrides == {'mesh.tp': '4', 'mesh.pp': '1'} and args.cfg.mesh.tp == 4 and args.positional == []
  )


def test_train_declares_every_distributed_flag():
  from jax3d import train
  from jax3d.trainer import distributed

  assert set(train.FLAGS) == {'workdir', *distributed.FLAGS}


def test_sequence_parallel_setting_resolves():
  """train.sequence_parallel: a bool is stored as its string; 'auto' is on where tp > 1 divides the
  rows of a layer and off elsewhere (never an error); 'true' needs tp > 1 to mean anything."""
  from jax3d import config as c

  sp = lambda **o: c.validate(c.load_config('tiny', {k.replace('__', '.'): v for k, v in o.items()}), 8)
  assert sp(train__sequence_parallel=True).sequence_parallel  # tiny: 2x2x2, 2 rows * 128
  assert not sp().sequence_parallel  # the default is off
  assert sp(train__sequence_parallel='auto').sequence_parallel
  odd = {'train__seq_len': 127, 'train__global_batch_size': 8}
  assert not sp(train__sequence_parallel='auto', **odd).sequence_parallel
  assert not sp(train__sequence_parallel=True, mesh__dp=4, mesh__tp=1).sequence_parallel
  moe = {'moe__num_experts': 4, 'mesh__cp': 2, 'mesh__dp': 1}  # auto: off beside a mixture of experts
  assert not sp(train__sequence_parallel='auto', **moe).sequence_parallel
