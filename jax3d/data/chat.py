"""Chat data: a conversation rendered with the tokenizer folder's own chat template, its token ids
and a loss weight per token (1 on the assistant turns, 0 elsewhere). Behind `jax3d.prepare
--format=chat`; imports no jax.

The template is the folder's `chat_template.jinja`, else `chat_template` in tokenizer_config.json
(a name -> template list: its 'default'), rendered with jinja2 as transformers renders it
(`apply_chat_template`): a sandboxed environment with trim_blocks and lstrip_blocks, loop controls,
the `{% generation %}` tag, the globals raise_exception and strftime_now, a `tojson` that does not
escape HTML, the tokenizer's special tokens (bos_token, eos_token, ...) as variables, and
add_generation_prompt=False. The text is tokenized whole with no special tokens added, so the ids
are those of `apply_chat_template(messages, tokenize=True)`.

The supervised tokens are the assistant turns as the WHOLE conversation renders them, so a stock
template works unchanged, also one that renders an earlier turn differently once a later one
exists (Qwen3 drops the reasoning of turns before the last question; Mistral puts the system
prompt in the last question only). The conversation is rendered once more with each answer
replaced by a marker: the text between two markers (end of a turn, the next messages, the next
assistant header) is found in the real text, so each answer's rendering lies between them,
however the template transforms it (trims it, splits off its reasoning). A turn starts where the
assistant header ends (what the generation prompt adds) and ends with the end-of-turn text that
follows the answer (what follows it both in the conversation and when it is the last message). A
token is supervised when its characters overlap a turn's (transformers' rule for assistant
masks). An assistant message without text content (tool calls only) is not supervised.

Errors are ValueError naming the file, the line and the value: a line without a `messages` list,
an unknown role, a template that fails, or whose text around an answer changes with the answer,
a conversation with no supervised token. (jax3d.prepare turns them into exit status 2 and one line.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from datetime import datetime
from typing import Any

import numpy as np

ROLES = ('system', 'developer', 'user', 'assistant', 'tool', 'ipython')
SUPERVISED_ROLE = 'assistant'
SPECIAL_TOKENS = ('bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token', 'mask_token')
_REASONING = ('reasoning_content', 'thinking', 'reasoning')
MARK = '\ue000%d\ue001'  # an answer's place in the skeleton of a conversation (private-use characters)
CHANGES = (
  'the chat template renders the text around answer %d differently when the answer changes '
  "(or drops it): the assistant turns cannot be found in the conversation's text"
)


@dataclasses.dataclass(frozen=True)
class Template:
  """A tokenizer folder's chat template and the special tokens it is rendered with."""

  source: str
  specials: dict  # {'bos_token': '<s>', ...}
  path: str  # the file it was read from


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:
    raise ValueError(f'{path} cannot be read ({e})') from None


def load_template(folder: str) -> Template:
  """The chat template of a tokenizer folder (see the module docstring); ValueError when it has none."""
  cfg_path = os.path.join(folder, 'tokenizer_config.json')
  cfg = _read_json(cfg_path)
  specials = _read_json(os.path.join(folder, 'special_tokens_map.json')) | cfg  # the config's win
  text = lambda v: v.get('content') if isinstance(v, dict) else v
  specials = {k: text(specials[k]) for k in SPECIAL_TOKENS if isinstance(text(specials.get(k)), str)}
  jinja_path = os.path.join(folder, 'chat_template.jinja')
  if os.path.exists(jinja_path):
    with open(jinja_path, encoding='utf-8') as f:
      return Template(f.read(), specials, jinja_path)
  source = cfg.get('chat_template')
  if isinstance(source, list):  # [{'name': ..., 'template': ...}, ...]
    source = {t.get('name'): t.get('template') for t in source if isinstance(t, dict)}.get('default')
  if not isinstance(source, str) or not source:
    raise ValueError(
      f'--tokenizer={folder}: the folder has no chat template (no chat_template.jinja, and no '
      f'"chat_template" in {cfg_path} or no "default" one): --format=chat renders with it'
    )
  return Template(source, specials, cfg_path)


_COMPILED: dict[str, Any] = {}


def _compiled(source: str) -> Any:
  """The template compiled in transformers' jinja environment (cached)."""
  if source in _COMPILED:
    return _COMPILED[source]
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' assistant-mask marker, rendered as is."""

    tags = {'generation'}

    def parse(self, parser: Any) -> Any:
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
      return caller()

  def raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)

  def tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
  ) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
  )
  env.filters['tojson'] = tojson
  env.globals['raise_exception'] = raise_exception
  env.globals['strftime_now'] = lambda fmt: datetime.now().strftime(fmt)
  _COMPILED[source] = env.from_string(source)
  return _COMPILED[source]


def _normalized(messages: list[dict]) -> list[dict]:
  """What transformers renders: None-valued keys dropped, reasoning under all its names."""
  out = []
  for m in messages:
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
    out.append(m if reasoning is None else {'thinking': reasoning, **m, 'reasoning_content': reasoning})
  return out


def render(t: Template, messages: list[dict], add_generation_prompt: bool = False) -> str:
  """The text of `messages` under the template (what apply_chat_template(tokenize=False) gives)."""
  return _compiled(t.source).render(
    messages=_normalized(messages),
    tools=None,
    documents=None,
    add_generation_prompt=add_generation_prompt,
    **t.specials,
  )


def parse(line: str, where: str, field: str = 'messages') -> list[dict]:
  """The messages of one JSONL line (its `field`); ValueError naming `where` (file:line) when it
  has none, or they are not a conversation (`messages`)."""
  try:
    record = json.loads(line)
  except ValueError as e:
    raise ValueError(f'{where}: not a JSON object ({e})') from None
  value = record.get(field) if isinstance(record, dict) else None
  if not isinstance(value, list) or not value:
    raise ValueError(f'{where}: no "{field}" list in {line.strip()[:80]!r}')
  return messages(value, where, field)


def messages(value: Any, where: str, field: str = 'messages') -> list[dict]:
  """A conversation, each message's content a string (`content`); ValueError naming `where` when
  it is not a list of messages, a message has an unknown role or its content is neither text nor
  a list of text parts."""
  if not isinstance(value, list) or not value:
    raise ValueError(f'{where}: {field!r} is {json.dumps(value, default=str)[:40]}, not a list of messages')
  out = list(value)
  for j, m in enumerate(out):
    role = m.get('role') if isinstance(m, dict) else None
    if role not in ROLES:
      raise ValueError(f'{where}: unknown role {role!r} in a message (expected one of {", ".join(ROLES)})')
    if m.get('content') is not None:
      out[j] = m | {'content': content(m['content'], f'{where}: message {j + 1} ({role})')}
  return out


def content(value: Any, where: str) -> str:
  """A message's content as text: a string as it is; a list of text parts (the OpenAI format,
  [{"type": "text", "text": ...}, ...]) joined by newlines, as the templates expect a string
  (vLLM joins them so too). ValueError naming `where` for anything else (an image part, a number)."""
  if isinstance(value, str):
    return value
  parts = value if isinstance(value, list) else None
  texts = [p.get('text') for p in parts if isinstance(p, dict) and p.get('type') == 'text'] if parts else []
  if parts is None or len(texts) != len(parts) or not all(isinstance(t, str) for t in texts):
    odd = (
      next((p for p in parts if not (isinstance(p, dict) and p.get('type') == 'text')), None)
      if parts
      else value
    )
    raise ValueError(
      f'{where}: content {json.dumps(odd)[:60]} is not text: a string, or a list of '
      '{"type": "text", "text": "..."} parts'
    )
  return '\n'.join(texts)


def _marked(messages: list[dict]) -> tuple[list[dict], list[int]]:
  """The messages with each assistant answer (non-empty text content) replaced by a marker
  (MARK % j), and the indices of those answers. An answer with its reasoning inline ('<think>R
  </think>A', no reasoning field) gives R as its reasoning, as the templates that render
  reasoning read it (Qwen3)."""
  out, marked = [], []
  for j, m in enumerate(messages):
    c = m.get('content')
    if m['role'] != SUPERVISED_ROLE or not isinstance(c, str) or not c:
      out.append(m)
      continue
    if '</think>' in c and not any(m.get(k) is not None for k in _REASONING):
      m = m | {'reasoning_content': c.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')}
    out.append(m | {'content': MARK % j})
    marked.append(j)
  return out, marked


def _prompt(t: Template, messages: list[dict]) -> str:
  """What the generation prompt adds after `messages` (an assistant header), '' when the template
  adds none or cannot render them alone (no message yet)."""
  import jinja2

  try:
    with_prompt = render(t, messages, add_generation_prompt=True)
    return with_prompt[len(render(t, messages)) :]
  except jinja2.exceptions.TemplateError:
    return ''


def _common(a: str, b: str) -> int:
  """The length of the longest common prefix of a and b."""
  return len(os.path.commonprefix([a, b]))


def supervised_spans(t: Template, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
  """(the conversation's text, the character spans of its assistant turns), found in the whole
  conversation's rendering (see the module docstring). ValueError naming `where` when the
  template fails, or renders the answers' surroundings differently once they are marked."""
  import jinja2

  try:
    text = render(t, messages)
    mk, marked = _marked(messages)
    skeleton = render(t, mk)
    cut = re.split('(' + re.escape(MARK).replace('%d', '[0-9]+') + ')', skeleton)
    pieces, found = cut[0::2], [int(x[1:-1]) for x in cut[1::2]]
    spans, at = [], len(pieces[0])
    if MARK[0] in text:
      raise ValueError(f'{where}: the conversation holds the character U+E000, which marks answers')
    if found != marked or not text.startswith(pieces[0]):
      raise ValueError(f'{where}: {CHANGES % 1}')
    for k, j in enumerate(marked):  # answer j: its content between pieces[k] and pieces[k + 1]
      after = pieces[k + 1]
      stop = text.find(after, at) if k + 1 < len(marked) else len(text) - len(after)
      if stop < at or (k + 1 == len(marked) and not text.endswith(after)):
        raise ValueError(f'{where}: {CHANGES % (k + 1)}')
      # The turn starts where the generation prompt ends (its header) ...
      prompt = _prompt(t, mk[:j])
      head = pieces[k].rfind(prompt) + len(prompt) if prompt and prompt in pieces[k] else len(pieces[k])
      # ... and ends with the end of turn the answer is followed by, alone as in the conversation.
      alone = render(t, mk[: j + 1])
      tail = _common(after, alone[alone.index(MARK % j) + len(MARK % j) :])
      spans.append((at - len(pieces[k]) + head, stop + tail))
      at = stop + len(after)
  except jinja2.exceptions.TemplateError as e:
    raise ValueError(f'{where}: the chat template fails on this conversation: {str(e)[:200]}') from None
  return text, spans


def token_weights(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
  """1 for each token (character offsets) that overlaps a span, else 0 (uint8)."""
  w = np.zeros(len(offsets), np.uint8)
  k = 0
  for i, (a, b) in enumerate(offsets):
    while k < len(spans) and a >= spans[k][1]:
      k += 1
    if k == len(spans):
      break
    if b > spans[k][0]:
      w[i] = 1
  return w


def encode(
  t: Template, tok: Any, conversations: list[tuple[str, list[dict]]]
) -> list[tuple[list[int], np.ndarray]]:
  """(ids, weights) of each (where, messages) conversation, `tok` a jax3d HFTokenizer (its
  `tokenizers` object encodes with offsets). ValueError for a conversation with no supervised token."""
  rendered = [supervised_spans(t, messages, where) for where, messages in conversations]
  encodings = tok.tok.encode_batch([text for text, _ in rendered], add_special_tokens=False)
  out = []
  for (where, _), (_, spans), e in zip(conversations, rendered, encodings, strict=True):
    w = token_weights(e.offsets, spans)
    if not w.any():
      raise ValueError(f'{where}: the conversation has no supervised token (no assistant turn with text)')
    out.append((e.ids, w))
  return out
