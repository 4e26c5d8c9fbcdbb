"""The assistant-only mask, token for token against transformers' own mask on a generation-tagged
version of the same template, over adversarial conversations (Hypothesis).

Rule used on both sides (entrypoint/data/chat_mask.py): a token is trained on when its first
character lies inside an assistant span; a reply's span is its content plus the end-of-turn
token that closes it. The reference spans come from transformers' `{% generation %}` tracking
(the spans apply_chat_template(..., return_assistant_tokens_mask=True) masks).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from entrypoint.data.chat_mask import Unmaskable, render, render_tagged, render_with_spans
from entrypoint.data.tokenize import label_tokens
from tests.fixtures.chat import CHAT_TEMPLATE, IM_END

pytestmark = pytest.mark.unit

CHATML_TAGGED = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}"
)
# Qwen3-style: the last assistant turn gets an empty <think> block, and replies are trimmed.
QWEN3 = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content | trim + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)
QWEN3_TAGGED = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{% generation %}{{- message.content | trim + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.fixtures.chat import synthetic_conversations, write_tokenizer

    directory = tmp_path_factory.mktemp("tok")
    rows = synthetic_conversations(64)
    write_tokenizer(directory, [m["content"] for r in rows for m in r["messages"]])
    return AutoTokenizer.from_pretrained(str(directory))


def mask(tokenizer, text: str, spans) -> np.ndarray:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    return label_tokens(np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2), ids, spans) != -100


def with_template(tokenizer, template: str):
    tokenizer.chat_template = template
    return tokenizer


WORDS = st.sampled_from(["a", "start", "end", "im", "user", "assistant", "system", "<|", "|>", "im_st", "_end",
                         "héllo", "日本語", "🙂", "?", "x", "The answer is", "line one\nline two", "  padded  ",
                         "\n\nleading newlines", "tabs\tand\tspaces", "<think>", "</think>"])
CONTENT = st.lists(WORDS, min_size=1, max_size=4).map(" ".join) | WORDS


@st.composite
def conversations(draw):
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(CONTENT)})
    for _ in range(draw(st.integers(1, 3))):
        user = draw(CONTENT)
        # contents repeated from earlier turns and the system prompt
        reply = draw(st.sampled_from([m["content"] for m in messages]) if messages and draw(st.booleans())
                     else CONTENT)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return messages


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations(), qwen3=st.booleans())
def test_mask_equals_transformers_generation_mask(tokenizer, messages, qwen3):
    assume(all(m["content"].strip() for m in messages))      # empty content is a bad row before masking
    plain, tagged = (QWEN3, QWEN3_TAGGED) if qwen3 else (CHAT_TEMPLATE, CHATML_TAGGED)
    assume("</think>" not in " ".join(m["content"] for m in messages) or not qwen3)
    ours = render_with_spans(with_template(tokenizer, plain), messages, IM_END)
    reference = render_tagged(with_template(tokenizer, tagged), messages)
    assert ours.text == reference.text
    assert ours.spans == reference.spans
    assert (mask(tokenizer, ours.text, ours.spans) == mask(tokenizer, reference.text, reference.spans)).all()
    # every reply has trained tokens, and the first of them starts where its content starts
    for (start, end), reply in zip(ours.spans, [m for m in messages if m["role"] == "assistant"]):
        assert ours.text[start:end].startswith(reply["content"].strip() if qwen3 else reply["content"])


def test_replies_that_also_occur_in_the_markup_keep_their_loss(tokenizer):
    """The reported bug: "a" was found inside <|im_st[a]rt|> and "start" inside another marker, so
    neither reply got a loss token."""
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "a"},
                {"role": "user", "content": "what"}, {"role": "assistant", "content": "start"}]
    rendered = render_with_spans(with_template(tokenizer, CHAT_TEMPLATE), messages, IM_END)
    assert [rendered.text[s:e] for s, e in rendered.spans] == ["a<|im_end|>", "start<|im_end|>"]
    enc = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    trained = [tokenizer.decode([i]) for i, m in zip(enc["input_ids"], mask(tokenizer, rendered.text,
                                                                              rendered.spans)) if m]
    assert "".join(trained) == "a<|im_end|>start<|im_end|>"


def test_special_token_text_in_content_is_its_own_bad_row(tokenizer):
    with_template(tokenizer, CHAT_TEMPLATE)
    for content in ("fake <|im_end|> marker", "<|im_start|>system"):
        with pytest.raises(Unmaskable) as err:
            render(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}], IM_END)
        assert err.value.reason == "content_has_special_token"


def test_a_template_that_drops_or_rewrites_a_message_is_its_own_bad_row(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "r"}]
    drops_system = ("{%- for m in messages %}{%- if m.role != 'system' %}{{- '<|im_start|>' + m.role + '\\n' + "
                    "m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}")
    with pytest.raises(Unmaskable) as err:
        render_with_spans(with_template(tokenizer, drops_system), messages, IM_END)
    assert err.value.reason == "template_dropped_message"
    upper = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content.upper() + '<|im_end|>\\n' }}"
             "{%- endfor %}")
    with pytest.raises(Unmaskable) as err:
        render_with_spans(with_template(tokenizer, upper), messages, IM_END)
    assert err.value.reason == "template_rewrote_content"


def test_tokenize_rows_counts_each_unmaskable_reason(tokenizer):
    from entrypoint.data.tokenize import tokenize_rows

    with_template(tokenizer, CHAT_TEMPLATE)
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x <|im_end|>"}]},
            {"messages": [{"role": "user", "content": "q\ud800"}, {"role": "assistant", "content": "a"}]}]
    corpus = tokenize_rows(enumerate(rows), tokenizer, max_length=512)
    assert len(corpus) == 1
    assert corpus.bad.counts == {"content_has_special_token": 1, "undecodable_text": 1}
