"""Chat data (`jax3d.prepare --format=chat`, jax3d/data/chat.py) against transformers: for three
chat templates written into tokenizer folders (a Llama-3 style with header tokens, a ChatML/Qwen
style, and one that injects a default system prompt), multi-turn with system messages, the ids
equal `apply_chat_template(messages, tokenize=True)` and the weights equal transformers' own
assistant mask (the templates mark the assistant turns with {% generation %}) and decode to the
assistant turns; the shards hold exactly that; each bad input exits 2 with its one line."""

from __future__ import annotations

import json
import os
import sysconfig

import numpy as np
import pytest

from jax3d import prepare as prepare_cli
from jax3d.data import chat, shards, tokenizer as tok_lib

SPECIALS = [
  '<|begin_of_text|>',
  '<|end_of_text|>',
  '<|start_header_id|>',
  '<|end_header_id|>',
  '<|eot_id|>',
  '<|im_start|>',
  '<|im_end|>',
  '<s>',
  '</s>',
  '[INST]',
  '[/INST]',
  '<think>',
  '</think>',
]
LLAMA3 = (  # Meta's Llama 3 template, with the assistant's answer and end of turn marked
  "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
  "+ message['role'] + '<|end_header_id|>\n\n' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
  "%}{% endif %}{{ content }}{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim "
  "+ '<|eot_id|>' }}{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (  # Qwen 2 / ChatML
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == "
  "'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}{% else %}"
  "{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_SYSTEM = (  # Qwen 2.5 style: a default system prompt when the first message is not one
  "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + "
  "'<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
  "{%- for message in messages %}{%- if message.role not in ['system', 'user', 'assistant'] %}"
  "{{ raise_exception('unexpected role ' + message.role) }}{%- endif %}"
  "{%- if not (message.role == 'system' and loop.first) %}{{- '<|im_start|>' + message.role + '\n' }}"
  "{%- if message.role == 'assistant' %}{%- generation %}{{- message.content + '<|im_end|>\n' }}"
  "{%- endgeneration %}{%- else %}{{- message.content + '<|im_end|>\n' }}{%- endif %}{%- endif %}"
  "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
TEMPLATES = {'llama3': LLAMA3, 'chatml': CHATML, 'default_system': DEFAULT_SYSTEM}
CONVERSATIONS = [
  [
    {'role': 'system', 'content': 'You write Python.'},
    {'role': 'user', 'content': 'Reverse a list?'},
    {'role': 'assistant', 'content': 'Use xs[::-1] or list(reversed(xs)).'},
    {'role': 'user', 'content': 'And in place?'},
    {'role': 'assistant', 'content': 'xs.reverse()  # returns None'},
  ],
  [{'role': 'user', 'content': 'Say hi in French.'}, {'role': 'assistant', 'content': ' Salut ! Ça va ?'}],
  [
    {'role': 'user', 'content': 'def f(x):\n  return x'},
    {'role': 'assistant', 'content': 'That is the identity.'},
    {'role': 'system', 'content': 'Be brief.'},
    {'role': 'user', 'content': '2+2?'},
    {'role': 'assistant', 'content': '4'},
  ],
]


@pytest.fixture(scope='module')
def base_tokenizer(tmp_path_factory):
  """A byte-level BPE tokenizer (400 tokens) trained on a little standard-library source, with the
  chat templates' special tokens added."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  text = open(os.path.join(sysconfig.get_paths()['stdlib'], 'json', 'decoder.py')).read()
  trainer = trainers.BpeTrainer(
    vocab_size=400,
    special_tokens=SPECIALS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator([text], trainer)
  path = tmp_path_factory.mktemp('tok') / 'tokenizer.json'
  tok.save(str(path))
  return str(path)


def make_folder(folder, base: str, name: str | None) -> str:
  """A tokenizer folder with the template `name` (None: none): Llama 3 in chat_template.jinja,
  ChatML as tokenizer_config.json's string, the default-system one as its list of named templates."""
  import shutil

  os.makedirs(folder, exist_ok=True)
  shutil.copy(base, os.path.join(folder, 'tokenizer.json'))
  cfg = {'tokenizer_class': 'PreTrainedTokenizerFast', 'clean_up_tokenization_spaces': False}
  if name == 'llama3':
    cfg |= {'bos_token': '<|begin_of_text|>', 'eos_token': '<|eot_id|>'}
    with open(os.path.join(folder, 'chat_template.jinja'), 'w') as f:
      f.write(LLAMA3)
  elif name == 'chatml':
    cfg |= {'eos_token': '<|im_end|>', 'chat_template': CHATML}
  elif name is not None:
    cfg |= {'eos_token': '<|im_end|>', 'chat_template': [{'name': 'default', 'template': TEMPLATES[name]}]}
  with open(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
    json.dump(cfg, f)
  return str(folder)


def _hf(folder: str, messages: list[dict]) -> tuple[list[int], list[int]]:
  """transformers' ids and assistant mask."""
  from transformers import AutoTokenizer

  tok = AutoTokenizer.from_pretrained(folder)
  ids = tok.apply_chat_template(messages, tokenize=True)
  ids = list(ids['input_ids'] if hasattr(ids, 'keys') else ids)
  out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
  assert list(out['input_ids']) == ids
  return ids, list(out['assistant_masks'])


@pytest.mark.parametrize('name', sorted(TEMPLATES))
def test_ids_and_weights_equal_transformers(tmp_path, base_tokenizer, name):
  folder = make_folder(tmp_path / name, base_tokenizer, name)
  t = chat.load_template(folder)
  tok = tok_lib.load(folder)
  convs = [(f'c{i}', m) for i, m in enumerate(CONVERSATIONS)]
  for (ids, weights), (_, messages) in zip(chat.encode(t, tok, convs), convs, strict=True):
    want_ids, want_mask = _hf(folder, messages)
    assert ids == want_ids
    np.testing.assert_array_equal(weights, want_mask)
    # The supervised runs decode to the assistant turns: answer and end of turn, nothing else.
    runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(weights.astype(int))) + 1)
    supervised = [
      tok.tok.decode([ids[i] for i in r], skip_special_tokens=False) for r in runs if weights[r[0]]
    ]
    end = '<|eot_id|>' if name == 'llama3' else '<|im_end|>\n'
    answers = [m['content'] for m in messages if m['role'] == 'assistant']
    assert supervised == [(a.strip() if name == 'llama3' else a) + end for a in answers]
  if name == 'default_system':  # the injected prompt is rendered, and not supervised
    assert 'You are a helpful assistant.' in chat.render(t, CONVERSATIONS[1])


def _prepare(tmp_path, folder, lines, *extra):
  src = tmp_path / 'chat.jsonl'
  src.write_text(''.join(l if isinstance(l, str) else json.dumps(l) + '\n' for l in lines))
  out = tmp_path / 'out'
  argv = [f'--input={src}', f'--out={out}', f'--tokenizer={folder}', '--format=chat', '--noprogress']
  return prepare_cli.main(argv + ['--workers=1', '--eval_fraction=0', *extra]), str(src), str(out)


def test_prepare_chat_shards_hold_the_ids_weights_and_boundaries(tmp_path, base_tokenizer, capsys):
  folder = make_folder(tmp_path / 'chatml', base_tokenizer, 'chatml')
  status, _, out = _prepare(tmp_path, folder, [{'messages': m, 'id': i} for i, m in enumerate(CONVERSATIONS)])
  printed = capsys.readouterr().out
  assert status == 0, printed
  index = shards.read_index(out)
  train, _ = shards.streams(index)
  starts, weights = shards.documents(index, 'train')
  want = [_hf(folder, m) for m in CONVERSATIONS]
  np.testing.assert_array_equal(train[0 : train.size], [t for ids, _ in want for t in ids])
  np.testing.assert_array_equal(weights[0 : train.size], [w for _, mask in want for w in mask])
  np.testing.assert_array_equal(starts, np.cumsum([0] + [len(ids) for ids, _ in want]))
  fraction = sum(map(sum, (m for _, m in want))) / train.size
  assert '3 conversations; supervised (assistant) tokens: ' in printed and f'= {fraction:.1%}' in printed
  assert index['data_format'] == 'chat' and shards.weighted(index)


BAD_TEMPLATE = "{% for m in messages %}{{ m['content'] | length }}:{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize(
  'case',
  [
    'no_messages',
    'unknown_role',
    'answer_dependent_template',
    'no_supervised_token',
    'no_template',
    'raises',
  ],
)
def test_bad_chat_input_exits_2_with_one_line(tmp_path, base_tokenizer, capsys, case):
  good = {'messages': CONVERSATIONS[1]}
  lines, name = [good, good], 'chatml'
  if case == 'no_messages':
    lines.append({'text': 'hello'})
  elif case == 'unknown_role':
    lines.append({'messages': [{'role': 'narrator', 'content': 'x'}]})
  elif case == 'no_supervised_token':
    lines.append({'messages': [{'role': 'user', 'content': 'only a question'}]})
  elif case == 'raises':  # the template's own raise_exception
    lines.append({'messages': [{'role': 'tool', 'content': '42'}, CONVERSATIONS[1][1]]})
    name = 'default_system'
  folder = make_folder(tmp_path / 'tok', base_tokenizer, None if case == 'no_template' else name)
  if case == 'answer_dependent_template':
    with open(os.path.join(folder, 'chat_template.jinja'), 'w') as f:
      f.write(BAD_TEMPLATE)
  status, src, _ = _prepare(tmp_path, folder, lines)
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert status == 2 and len(err) == 1 and err[0].startswith('error: '), err
  want = {
    'no_messages': f'{src}:3: no "messages" list in \'{{"text": "hello"}}\'',
    'unknown_role': f"{src}:3: unknown role 'narrator' in a message (expected one of system, developer, user,",
    'answer_dependent_template': f'{src}:1: the chat template renders the text around answer 1 differently when the answer changes',
    'no_supervised_token': f'{src}:3: the conversation has no supervised token',
    'no_template': f'--tokenizer={folder}: the folder has no chat template',
    'raises': f'{src}:3: the chat template fails on this conversation: unexpected role tool',
  }[case]
  assert err[0].startswith('error: ' + want), err[0]


def test_weights_that_disagree_with_their_shards_exit_2(tmp_path, base_tokenizer, capsys):
  """A weights file cut short: the trainer refuses the shards with one line, before compiling."""
  from jax3d import train as train_cli

  folder = make_folder(tmp_path / 'chatml', base_tokenizer, 'chatml')
  status, _, out = _prepare(tmp_path, folder, [{'messages': m} for m in CONVERSATIONS])
  assert status == 0
  weights = os.path.join(out, 'train-00000.weights.bin')
  with open(weights, 'r+b') as f:
    f.truncate(os.path.getsize(weights) - 1)
  capsys.readouterr()
  argv = ['--config=tiny', f'--workdir={tmp_path / "run"}', f'--config.data.path={out}']
  assert train_cli.main(argv) == 2
  err = [l for l in capsys.readouterr().err.splitlines() if l.startswith('error:')]
  assert len(err) == 1 and 'train-00000.weights.bin has' in err[0] and 'disagree' in err[0], err


def test_batch_api_and_command_show_what_a_step_trains_on(tmp_path, base_tokenizer, capsys):
  """`jax3d.batch(cfg, step)`: the global batch of packed conversations (data.packing 'auto' is
  pack for chat data), each segment one whole conversation from position 0; `python -m
  jax3d.batch` prints its rows with exactly the assistant turns marked."""
  import re

  import jax3d
  from jax3d import batch as batch_cmd
  from jax3d.data import packing

  folder = make_folder(tmp_path / 'chatml', base_tokenizer, 'chatml')
  lines = [{'messages': CONVERSATIONS[i % 3], 'n': i} for i in range(24)]
  status, _, out = _prepare(tmp_path, folder, lines, '--eval_fraction=0.3')
  assert status == 0
  capsys.readouterr()
  over = {'data.path': out, 'train.seq_len': 256, 'train.global_batch_size': 4}
  b = jax3d.batch(jax3d.load_config('tiny', over), 2)
  assert {k: (v.dtype.name, v.shape) for k, v in b.items()} == {
    k: ('float32' if k == 'weights' else 'int32', (4, 256)) for k in packing.KEYS
  }
  # slots of each conversation -> its assistant turns
  turns = {len(_hf(folder, c)[0]) - 1: sum(m['role'] == 'assistant' for m in c) for c in CONVERSATIONS}
  assert len(turns) == 3
  n_turns = 0
  for row_seg, row_pos in zip(b['segment_ids'], b['positions'], strict=True):
    for s in range(1, row_seg.max() + 1):
      assert (row_pos[row_seg == s] == np.arange((row_seg == s).sum())).all()
      n_turns += turns[(row_seg == s).sum()]  # whole conversations: pack, none cut
  assert (b['weights'][b['segment_ids'] == 0] == 0).all() and 0 < b['weights'].mean() < 1
  argv = ['--config=tiny', '--step=2', '--rows=0'] + [f'--config.{k}={v}' for k, v in over.items()]
  assert batch_cmd.main(argv) == 0
  printed = capsys.readouterr().out
  assert printed.startswith('step 2: epoch ') and 'pack: ' in printed
  marked = re.findall(f'{batch_cmd.OPEN}(.*?){batch_cmd.CLOSE}', printed, re.S)
  answers = {
    m['content'].strip() + '<|im_end|>' for c in CONVERSATIONS for m in c if m['role'] == 'assistant'
  }
  assert marked and {m.strip() for m in marked} <= answers
  assert len(marked) == n_turns
  assert callable(jax3d.batch) and jax3d.batch is batch_cmd
