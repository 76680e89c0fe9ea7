"""Chat data with every supported family's stock chat template (tests/chat_templates/: Llama 3.2,
Qwen2.5, Qwen3, SmolLM2, Mistral v0.3), multi-turn, with a system prompt, with reasoning (Qwen3
renders it for the turns after the last question only, so an earlier turn renders differently
once a later question exists): the ids equal transformers' `apply_chat_template` on the whole
conversation, and the weights equal transformers' assistant mask of the same template with the
assistant turns marked by {% generation %} (which renders the same text): the supervised tokens
are exactly the assistant turns as the whole conversation renders them."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from test_chat import base_tokenizer  # noqa: F401 - the fixture

from jax3d.data import chat, tokenizer as tok_lib

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'chat_templates')
# The special tokens of each family, and where its folder keeps the template (both layouts).
FAMILIES = {
  'llama3.2': ({'bos_token': '<|begin_of_text|>', 'eos_token': '<|eot_id|>'}, 'jinja'),
  'qwen2.5': ({'eos_token': '<|im_end|>'}, 'config'),
  'qwen3': ({'eos_token': '<|im_end|>'}, 'jinja'),
  'smollm2': ({'bos_token': '<|im_start|>', 'eos_token': '<|im_end|>'}, 'config'),
  'mistral': ({'bos_token': '<s>', 'eos_token': '</s>'}, 'config'),
}
# The reference: each template with its assistant turns marked by {% generation %} (same text).
GEN, END = '{% generation %}', '{% endgeneration %}'
MARKS = {
  'llama3.2': [
    (
      "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}",
      "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}{%- if message.role == 'assistant' %}"
      f"{GEN}{{{{- message['content'] | trim + '<|eot_id|>' }}}}{END}"
      "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}",
    )
  ],
  'qwen2.5': [
    (
      "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
      "{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.role == 'assistant' %}"
      f"{GEN}{{{{- message.content + '<|im_end|>' + '\\n' }}}}{END}"
      "{%- else %}{{- message.content + '<|im_end|>' + '\\n' }}{%- endif %}",
    )
  ],
  'qwen3': [
    (
      '{%- if loop.index0 > ns.last_query_index %}',
      "{{- '<|im_start|>' + message.role + '\\n' }}" + GEN + '{%- if loop.index0 > ns.last_query_index %}',
    ),
    ("'<|im_start|>' + message.role + '\\n<think>\\n'", "'<think>\\n'"),
    ("{{- '<|im_start|>' + message.role + '\\n' + content }}", '{{- content }}'),
    (
      '{{- \'<|im_end|>\\n\' }}\n    {%- elif message.role == "tool" %}',
      "{{- '<|im_end|>\\n' }}" + END + '\n    {%- elif message.role == "tool" %}',
    ),
  ],
  'smollm2': [
    (
      "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
      "{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}"
      f"{GEN}{{{{message['content'] + '<|im_end|>' + '\n'}}}}{END}"
      "{% else %}{{message['content'] + '<|im_end|>' + '\n'}}{% endif %}",
    )
  ],
  'mistral': [
    (
      '{{- " " + message["content"]|trim + eos_token}}',
      '{{- " " }}' + GEN + '{{- message["content"]|trim + eos_token}}' + END,
    )
  ],
}
CONVERSATIONS = [
  [
    {'role': 'system', 'content': 'You write Python.'},
    {'role': 'user', 'content': 'Reverse a list?'},
    {'role': 'assistant', 'content': ' Use xs[::-1].\n'},
    {'role': 'user', 'content': 'And in place?'},
    {'role': 'assistant', 'content': 'xs.reverse()'},
  ],
  [{'role': 'user', 'content': 'Say hi in French.'}, {'role': 'assistant', 'content': 'Salut !'}],
  [  # reasoning on both turns: Qwen3 drops the first turn's (a later question exists)
    {'role': 'user', 'content': '2+2?'},
    {'role': 'assistant', 'content': '4', 'reasoning_content': 'Add two and two.'},
    {'role': 'user', 'content': 'And 3+3?'},
    {'role': 'assistant', 'content': '6', 'reasoning_content': '\nThree and three.\n'},
    {'role': 'user', 'content': 'Thanks.'},
    {'role': 'assistant', 'content': 'You are welcome.'},
  ],
  [  # reasoning inline in the content, as Qwen3 writes it
    {'role': 'user', 'content': 'Capital of France?'},
    {'role': 'assistant', 'content': '<think>\nEurope.\n</think>\n\nParis.'},
    {'role': 'user', 'content': 'Of Italy?'},
    {'role': 'assistant', 'content': '<think>\nAlso Europe.\n</think>\n\nRome.'},
  ],
]


def _folder(path, base: str, family: str, source: str) -> str:
  specials, layout = FAMILIES[family]
  os.makedirs(path, exist_ok=True)
  shutil.copy(base, os.path.join(path, 'tokenizer.json'))
  cfg = {'tokenizer_class': 'PreTrainedTokenizerFast', 'clean_up_tokenization_spaces': False, **specials}
  if layout == 'jinja':
    with open(os.path.join(path, 'chat_template.jinja'), 'w') as f:
      f.write(source)
  else:
    cfg['chat_template'] = source
  with open(os.path.join(path, 'tokenizer_config.json'), 'w') as f:
    json.dump(cfg, f)
  return str(path)


def _marked(family: str) -> tuple[str, str]:
  """(the stock template, the same with {% generation %} marks)."""
  with open(os.path.join(HERE, f'{family}.jinja')) as f:
    stock = f.read()
  marked = stock
  for old, new in MARKS[family]:
    assert old in marked, (family, old)
    marked = marked.replace(old, new)
  return stock, marked


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_stock_templates_ids_and_masks_equal_transformers(tmp_path, base_tokenizer, family):  # noqa: F811
  from transformers import AutoTokenizer

  stock, marked = _marked(family)
  folder = _folder(tmp_path / 'stock', base_tokenizer, family, stock)
  ref = AutoTokenizer.from_pretrained(_folder(tmp_path / 'marked', base_tokenizer, family, marked))
  hf = AutoTokenizer.from_pretrained(folder)
  t, tok = chat.load_template(folder), tok_lib.load(folder)
  convs = [(f'c{i}', m) for i, m in enumerate(CONVERSATIONS)]
  total = 0
  for (ids, weights), (_, messages) in zip(chat.encode(t, tok, convs), convs, strict=True):
    want = list(hf.apply_chat_template(messages, tokenize=True, return_dict=True)['input_ids'])
    assert ids == want, (family, messages)
    out = ref.apply_chat_template(
      messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert list(out['input_ids']) == want  # the marks change no text
    np.testing.assert_array_equal(weights, out['assistant_masks'], err_msg=f'{family} {messages}')
    total += int(weights.sum())
  assert total > 0
  if family == 'qwen3':  # the first turn's reasoning is gone, the last turn's supervised
    text = chat.render(t, CONVERSATIONS[2])
    assert 'Add two and two.' not in text and 'Three and three.' not in text
    assert '<think>\n\n</think>\n\nYou are welcome.<|im_end|>\n' in text
    ids, w = chat.encode(t, tok, [('c', CONVERSATIONS[3])])[0]
    sup = tok.tok.decode([i for i, x in zip(ids, w, strict=True) if x], skip_special_tokens=False)
    assert sup == 'Paris.<|im_end|>\n<think>\nAlso Europe.\n</think>\n\nRome.<|im_end|>\n'


def _assistant_spans(text: str) -> list[tuple[int, int]]:
  """The assistant turns of a ChatML text, read off the text alone: from the end of each
  '<|im_start|>assistant\\n' header to the end of the '<|im_end|>\\n' that closes it."""
  head, end, spans, at = '<|im_start|>assistant\n', '<|im_end|>\n', [], 0
  while (a := text.find(head, at)) >= 0:
    b = text.index(end, a) + len(end)
    spans.append((a + len(head), b))
    at = b
  return spans


def test_reasoning_turns_are_supervised_as_rendered(tmp_path, base_tokenizer):  # noqa: F811
  """Qwen3's stock template over a conversation whose every answer starts with its <think> block
  (inline, and as reasoning_content): the earlier turns render without their reasoning and the last
  turn with it, and the weights are 1 on exactly the tokens of the assistant turns as the text
  renders them (spans read off the rendered text, not by jax3d.data.chat), the last turn's <think>
  block included. Through prepare, a padded row (pack) holds the whole conversation, fewer tokens
  than one row and no held-out split, and its targets' weights are the same."""
  from jax3d.data import corpus as corpus_lib, shard_writer

  conv = [
    {'role': 'system', 'content': 'You reason first.'},
    {'role': 'user', 'content': 'Capital of France?'},
    {'role': 'assistant', 'content': '<think>\nEurope, west.\n</think>\n\nParis.'},
    {'role': 'user', 'content': 'Of Italy?'},
    {'role': 'assistant', 'content': 'Rome.', 'reasoning_content': 'South of France.'},
    {'role': 'user', 'content': 'Of Spain?'},
    {'role': 'assistant', 'content': '<think>\nIberia; the middle of it.\n</think>\n\nMadrid.'},
  ]
  folder = _folder(tmp_path / 'qwen3', base_tokenizer, 'qwen3', _marked('qwen3')[0])
  t, tok = chat.load_template(folder), tok_lib.load(folder)
  text = chat.render(t, conv)
  assert 'Europe, west.' not in text and 'South of France.' not in text
  last = '<think>\nIberia; the middle of it.\n</think>\n\nMadrid.<|im_end|>\n'
  assert text.endswith(last)
  enc = tok.tok.encode(text, add_special_tokens=False)
  want = chat.token_weights(enc.offsets, _assistant_spans(text))
  ids, w = chat.encode(t, tok, [('c', conv)])[0]
  assert ids == enc.ids
  np.testing.assert_array_equal(w, want)
  sup = tok.tok.decode([i for i, x in zip(ids, w, strict=True) if x], skip_special_tokens=False)
  assert sup == 'Paris.<|im_end|>\nRome.<|im_end|>\n' + last

  (tmp_path / 'c.jsonl').write_text(json.dumps({'messages': conv}) + '\n')
  out = str(tmp_path / 'shards')
  shard_writer.tokenize(
    str(tmp_path / 'c.jsonl'), out, folder, 'messages', 0.0, workers=1, progress=False, fmt='chat'
  )
  seq = 2 * len(ids)  # one row holds the conversation, padded
  corpus = corpus_lib.load_corpus(out, 0.05, seq + 1, tok, 'auto')
  assert corpus.packing == 'pack' and not corpus.evaluable
  row = corpus_lib.batch_at(corpus, 0, 0, 1, seq)
  n = len(ids) - 1  # targets: every token but the first
  np.testing.assert_array_equal(row['targets'][0, :n], ids[1:])
  np.testing.assert_array_equal(row['weights'][0, :n], want[1:])
  assert not row['weights'][0, n:].any()
