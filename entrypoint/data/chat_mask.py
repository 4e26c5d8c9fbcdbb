"""Which characters of a rendered chat are assistant replies (trained on), anchored by construction.

The conversation is rendered twice: once as is, and once with each message's content replaced
by a unique sentinel. In the sentinel render, everything outside the sentinels is exactly the
template's own text (role headers, end-of-turn markers, empty <think> blocks), and each
message's position is where its sentinel is: nothing is searched for, so a reply such as "a"
or "start" can never be found inside the markup (`<|im_st[a]rt|>`). The real render must then
equal the sentinel render with each sentinel replaced by the message's content (as the
template left it: as is, or stripped); if it does not, the template rewrote or dropped
content, and the row is counted under its own reason rather than trained on with guessed
labels.

Where the template marks replies with `{% generation %}`, transformers computes the mask
itself (apply_chat_template(..., return_assistant_tokens_mask=True)) and that is used instead.

Token rule (both paths use it in the tests): a token is trained on when its first character
lies inside an assistant span. The span of a reply is its content plus the end-of-turn
token that closes it, since the model must learn to stop.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
SENTINEL = "\ue000FTIMAGE{}\ue001"   # private-use code points: never produced by a real chat row
REASONING = "\ue000FTIMAGER{}\ue001"  # the same, for a message's reasoning_content
_MARK = re.compile("\ue000FTIMAGE(R?)(\\d+)\ue001")
# How templates commonly transform content before printing it; tried in this order.
TRANSFORMS = (lambda c: c, str.strip, lambda c: c.lstrip("\n"), str.rstrip, str.lstrip)


class Unmaskable(Exception):
    """The assistant spans of a row cannot be located unambiguously; `reason` is its bad-row reason."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


@dataclass(frozen=True)
class Rendered:
    text: str
    spans: tuple[tuple[int, int], ...]   # character spans trained on, in order
    reasoning_dropped: int = 0           # reasoning_content the template did not render (not an error)


def has_generation_tags(template: str | None) -> bool:
    return bool(template and GENERATION_TAG.search(template))


def special_texts(tokenizer) -> tuple[str, ...]:
    """Texts that would render as real special tokens if they appeared in content."""
    texts = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return tuple(sorted((t for t in texts if t), key=len, reverse=True))


def _refuse_special_tokens(tokenizer, messages: list[dict]) -> None:
    for m in messages:
        for text in special_texts(tokenizer):
            for field in ("content", "reasoning_content"):
                if text in m.get(field, ""):
                    raise Unmaskable("content_has_special_token", f"{text!r} in a {m['role']} message")


def render_with_spans(tokenizer, messages: list[dict], eot: str) -> Rendered:
    """The rendered chat and the character spans of each assistant reply (+ its end of turn). A
    reply's reasoning_content, where the template renders it (Qwen-style templates do only after
    the last user message), is part of the reply's span: the model generates it."""
    _refuse_special_tokens(tokenizer, messages)
    real = tokenizer.apply_chat_template(messages, tokenize=False)
    marked = []
    for i, m in enumerate(messages):
        item = {**m, "content": SENTINEL.format(i)}
        if "reasoning_content" in m:
            item["reasoning_content"] = REASONING.format(i)
        marked.append(item)
    skeleton = tokenizer.apply_chat_template(marked, tokenize=False)
    texts = _MARK.split(skeleton)
    # texts: template text, (kind, index), template text, (kind, index), ..., template text
    marks = [(texts[k] == "R", int(texts[k + 1])) for k in range(1, len(texts) - 1, 3)]
    between = texts[0::3]
    if [i for is_reasoning, i in marks if not is_reasoning] != list(range(len(messages))):
        raise Unmaskable("template_dropped_message", f"rendered {marks}, expected {len(messages)} messages")
    rendered_reasoning = {i for is_reasoning, i in marks if is_reasoning}
    for n, (is_reasoning, i) in enumerate(marks):
        if is_reasoning and (n + 1 >= len(marks) or marks[n + 1] != (False, i)):
            raise Unmaskable("template_rewrote_content", f"message {i}'s reasoning is not right before its content")
    pos, spans, reply_start = 0, [], None
    for n, (is_reasoning, i) in enumerate(marks):
        before = between[n]
        if not real.startswith(before, pos):
            raise Unmaskable("template_rewrote_content", f"the template text before message {i} differs")
        pos += len(before)
        message = messages[i]
        text = message["reasoning_content"] if is_reasoning else message["content"]
        content = _match_content(real, pos, text, between[n + 1], last=n == len(marks) - 1)
        start, pos = pos, pos + len(content)
        if is_reasoning:
            reply_start = _generation_start(tokenizer, messages[:i], real, start)
            continue
        if message["role"] == "assistant":
            end = pos
            rest = real[pos:]
            gap = len(rest) - len(rest.lstrip())
            if eot and real.startswith(eot, pos + gap):
                end = pos + gap + len(eot)
            spans.append((reply_start if reply_start is not None else start, end))
        reply_start = None
    if real[pos:] != between[-1]:
        raise Unmaskable("template_rewrote_content", "the template text after the last message differs")
    dropped = sum(1 for i, m in enumerate(messages) if "reasoning_content" in m and i not in rendered_reasoning)
    return Rendered(text=real, spans=tuple(spans), reasoning_dropped=dropped)


def _generation_start(tokenizer, history: list[dict], real: str, reasoning_start: int) -> int:
    """Where the model's own text begins in a turn with reasoning: right after what the template's
    generation prompt supplies (`<|im_start|>assistant\n`), so the `<think>` markup the model
    writes before its reasoning is trained too. Falls back to the reasoning itself."""
    try:
        prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template may refuse a history (e.g. one that ends on an assistant)
        return reasoning_start
    if real.startswith(prompt) and len(prompt) <= reasoning_start:
        return len(prompt)
    return reasoning_start


def _match_content(real: str, pos: int, content: str, after: str, last: bool) -> str:
    for transform in TRANSFORMS:
        candidate = transform(content)
        if real.startswith(candidate, pos) and (real.startswith(after, pos + len(candidate))
                                                 or (last and real[pos + len(candidate):] == after)):
            return candidate
    raise Unmaskable("template_rewrote_content", "a message's content does not appear where the template put it")


def render_tagged(tokenizer, messages: list[dict]) -> Rendered:
    """Generation-tagged templates: the rendered chat and transformers' own generation spans
    (the character spans apply_chat_template(..., return_assistant_tokens_mask=True) masks)."""
    # transformers only when rendering: the workers import this module (micro_batches -> tokenize)
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = render_jinja_template(conversations=[messages], chat_template=tokenizer.chat_template,
                                              return_assistant_tokens_mask=True,
                                              **getattr(tokenizer, "special_tokens_map", {}))
    return Rendered(text=rendered[0], spans=tuple((int(a), int(b)) for a, b in indices[0]))


def render(tokenizer, messages: list[dict], eot: str) -> Rendered:
    """The one entry point: transformers' generation spans when the template has them, else the
    anchored sentinel render. Special-token text in content is refused on both paths."""
    if has_generation_tags(tokenizer.chat_template):
        _refuse_special_tokens(tokenizer, messages)
        return render_tagged(tokenizer, messages)
    return render_with_spans(tokenizer, messages, eot)
