"""Aggregation edge cases of issue 4, on the real SmolLM2 tokenizer and its chat template.

The SmolLM2-Instruct template renders every message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``
(``<|im_end|>`` is id 2, the newline id 198) and the generation prompt as ``<|im_start|>assistant\\n``.
A recorded call is built the way the gateway records it: prompt ids = the template applied to the
messages so far, response ids = what the engine sampled (ending with ``<|im_end|>`` when it stopped).
"""

from __future__ import annotations

import json

import pytest
import torch
from agl_common.schemas import CallRecord, Rollout, RolloutStatus
from agl_trainer.algorithm.advantage import grpo_advantages
from agl_trainer.algorithm.aggregate import AggregateStats, Vocabulary, build_rows, classify_break, first_difference
from agl_trainer.model import end_of_turn_ids
from agl_trainer.config import TrainConfig
from agl_trainer.algorithm.batch import build_batch
from agl_trainer.algorithm.loss import per_rollout_token_weights, ppo_loss

IM_END, NEWLINE = 2, 198
SYSTEM = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def tok():
    from agl_trainer.model import ensure_base_model
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_base_model())


def render(tok, messages, generation_prompt=True) -> list[int]:
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode(tok, text) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def rec(seq, prompt, response, finish_reason="stop", rid="r", logprob=-0.5) -> CallRecord:
    return CallRecord(rollout_id=rid, attempt_id="0", seq=seq, route="chat", request={}, response={},
                      prompt_token_ids=prompt, response_token_ids=response, finish_reason=finish_reason,
                      response_logprobs=[logprob] * len(response))


def non_canonical(tok, ids: list[int]) -> list[int]:
    """``ids`` with one token replaced by two vocabulary tokens spelling the same bytes (same text)."""
    vocab = tok.get_vocab()
    for i, piece in enumerate(tok.convert_ids_to_tokens(ids)):
        for k in range(1, len(piece)):
            if piece[:k] in vocab and piece[k:] in vocab:
                return ids[:i] + [vocab[piece[:k]], vocab[piece[k:]]] + ids[i + 1:]
    raise AssertionError("no splittable token")


def two_turns(tok, answer_text, response_ids, follow_up="Check it."):
    """(call 1, call 2): turn 2's prompt is the template re-rendering turn 1's answer *text*."""
    p1 = render(tok, SYSTEM)
    p2 = render(tok, SYSTEM + [{"role": "assistant", "content": answer_text}, {"role": "user", "content": follow_up}])
    return rec(0, p1, response_ids), rec(1, p2, encode(tok, "Yes, 5.") + [IM_END])


def test_template_facts(tok):
    """The facts the cases below rely on (so a template change fails loudly here, not obscurely there)."""
    assert tok.convert_ids_to_tokens([IM_END]) == ["<|im_end|>"] and tok.eos_token_id == IM_END
    p = render(tok, SYSTEM + [{"role": "assistant", "content": "x"}], generation_prompt=False)
    assert p[-2:] == [IM_END, NEWLINE]
    assert end_of_turn_ids(tok) == {IM_END}


# (1) non-canonical response ids, re-tokenized canonically by the template → a counted `retokenized` break
def test_non_canonical_response_is_a_retokenized_break(tok):
    text = "The answer is 5."
    canonical = encode(tok, text)
    odd = non_canonical(tok, canonical)
    assert odd != canonical and tok.decode(odd) == tok.decode(canonical) == text
    # control: the canonical ids merge into one row
    stats = AggregateStats()
    assert len(build_rows(list(two_turns(tok, text, canonical + [IM_END])), stats=stats,
                          vocab=Vocabulary(tok.decode))) == 1
    assert stats.merge_breaks == 0
    # the non-canonical ids: same text, different ids → never silently merged
    c1, c2 = two_turns(tok, text, odd + [IM_END])
    stats = AggregateStats()
    rows = build_rows([c1, c2], stats=stats, vocab=Vocabulary(tok.decode, frozenset({IM_END})))
    assert [r.prompt_ids for r in rows] == [c1.prompt_token_ids, c2.prompt_token_ids]
    assert [r.n_calls for r in rows] == [1, 1]
    assert stats.merge_breaks == 1 and stats.merge_break_classes == {"retokenized": 1}
    (ex,) = stats.merge_break_examples["retokenized"]
    assert ex["position"] == first_difference(c1.prompt_token_ids + odd, c2.prompt_token_ids)
    assert ex["position"] >= ex["response_start"] == len(c1.prompt_token_ids)
    assert ex["row_ids"] != ex["prompt_ids"] and "answer" in ex["row_text"] and "answer" in ex["prompt_text"]
    # without a decoder the break is still counted, as `other`
    stats = AggregateStats()
    assert len(build_rows([c1, c2], stats=stats)) == 2 and stats.merge_break_classes == {"other": 1}


# (2) the response ends at <|im_end|> without the template's newline → merged, newline is context
def test_stop_token_without_newline_merges_with_newline_as_context(tok):
    text = "The answer is 5."
    response = encode(tok, text) + [IM_END]
    c1, c2 = two_turns(tok, text, response)
    n1 = len(c1.prompt_token_ids) + len(response)
    assert c2.prompt_token_ids[:n1] == c1.prompt_token_ids + response and c2.prompt_token_ids[n1] == NEWLINE
    stats = AggregateStats()
    (row,) = build_rows([c1, c2], stats=stats, vocab=Vocabulary(tok.decode, frozenset({IM_END})))
    assert stats.merge_breaks == 0 and row.n_calls == 2
    assert row.full_ids() == c2.prompt_token_ids + c2.response_token_ids
    k = len(response)  # index in response_ids of the template's "\n" after <|im_end|>
    assert row.response_ids[k - 1:k + 1] == [IM_END, NEWLINE]
    assert row.response_mask[:k] == [1] * k and row.response_mask[k] == 0 and row.old_logprobs[k] == 0.0
    assert sum(row.response_mask) == len(response) + len(c2.response_token_ids)


def test_missing_stop_token(tok):
    """The recorded response stops before <|im_end|> although the engine reported ``finish_reason="stop"``.

    With this template turn 2's prompt is ``... text <|im_end|> \\n <|im_start|>user ...``, so the
    response ids *are* still an exact prefix of it: by ids alone the calls merge and the ``<|im_end|>``
    the policy produced lands in the row as context (mask 0), silently. So: given end-of-turn ids,
    build_rows refuses that merge and counts a ``missing_stop_token`` break; without them it merges (the
    id-only rule). A ``finish_reason="length"`` response legitimately lacks the stop token (the template
    closes the cut turn), so it merges either way.
    """
    text = "The answer is 5."
    c1, c2 = two_turns(tok, text, encode(tok, text))  # no <|im_end|> at the end
    # id-only rule: merged, and <|im_end|> is context
    stats = AggregateStats()
    (row,) = build_rows([c1, c2], stats=stats)
    k = len(c1.response_token_ids)
    assert stats.merge_breaks == 0 and row.response_ids[k] == IM_END and row.response_mask[k] == 0
    # with the end-of-turn ids: a new row and a counted `missing_stop_token` break
    stats = AggregateStats()
    rows = build_rows([c1, c2], stats=stats, vocab=Vocabulary(tok.decode, frozenset({IM_END})))
    assert len(rows) == 2 and [r.n_calls for r in rows] == [1, 1]
    assert stats.merge_breaks == 1 and stats.merge_break_classes == {"missing_stop_token": 1}
    (ex,) = stats.merge_break_examples["missing_stop_token"]
    assert ex["position"] == ex["row_tokens"] == len(c1.prompt_token_ids) + k
    assert "<|im_end|>" in ex["prompt_text"] and "<|im_end|>" not in ex["row_text"]
    # cut at max_tokens: merges
    c1_len = rec(0, c1.prompt_token_ids, c1.response_token_ids, finish_reason="length")
    stats = AggregateStats()
    rows = build_rows([c1_len, c2], stats=stats, vocab=Vocabulary(eos_ids=frozenset({IM_END})))
    assert len(rows) == 1 and stats.merge_breaks == 0


# (3) compact tool-call JSON re-rendered by the harness with other spacing → a `template_rerender` break
def test_tool_call_rerendered_with_other_spacing_is_a_break(tok):
    messages = [{"role": "user", "content": "Add 1 and 2 with the add tool."}]
    emitted = '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
    parsed = {"name": "add", "arguments": {"a": 1, "b": 2}}
    rerendered = "<tool_call>\n" + json.dumps(parsed) + "\n</tool_call>"  # Hermes-style: json.dumps spacing
    assert emitted != rerendered
    p1 = render(tok, messages)
    c1 = rec(0, p1, encode(tok, emitted) + [IM_END], finish_reason="tool_calls")
    p2 = render(tok, messages + [{"role": "assistant", "content": rerendered}, {"role": "tool", "content": "3"}])
    c2 = rec(1, p2, encode(tok, "1 + 2 = 3.") + [IM_END])
    p3 = render(tok, messages + [{"role": "assistant", "content": rerendered}, {"role": "tool", "content": "3"},
                                 {"role": "assistant", "content": "1 + 2 = 3."}, {"role": "user", "content": "Thanks"}])
    c3 = rec(2, p3, encode(tok, "You're welcome.") + [IM_END])
    stats = AggregateStats()
    rows = build_rows([c1, c2, c3], stats=stats, vocab=Vocabulary(tok.decode, frozenset({IM_END})))
    assert [r.n_calls for r in rows] == [1, 2]  # the break, then call 3 extends call 2 exactly
    assert stats.merge_breaks == 1 and stats.merge_break_classes == {"template_rerender": 1}
    (ex,) = stats.merge_break_examples["template_rerender"]
    assert ex["position"] > ex["response_start"] == len(p1)  # the mismatch is inside the tool call
    assert '{"' in ex["row_text"] and ex["row_text"] != ex["prompt_text"]
    assert json.loads(json.dumps(stats.metrics()))["merge_break_classes"] == {"template_rerender": 1}
    # and classify_break on its own says the same
    assert classify_break(p1 + c1.response_token_ids, p2, len(p1), tok.decode)[0] == "template_rerender"


# (4) a rollout split into several rows counts once in its group and weighs as much as a one-row rollout

def test_multi_row_rollout_counts_once(tok):
    text = "The answer is 5."
    split_calls = list(two_turns(tok, text, non_canonical(tok, encode(tok, text)) + [IM_END]))  # → 2 rows
    merged_calls = list(two_turns(tok, text, encode(tok, text) + [IM_END]))  # → 1 row
    calls = {"a": [c.model_copy(update={"rollout_id": "a"}) for c in split_calls],
             "b": [c.model_copy(update={"rollout_id": "b"}) for c in merged_calls],
             "c": [c.model_copy(update={"rollout_id": "c"}) for c in merged_calls]}
    rewards = {"a": 1.0, "b": 0.0, "c": 0.0}
    rollouts = [Rollout(rollout_id=r, status=RolloutStatus.succeeded, reward=v, group_id="g")
                for r, v in rewards.items()]
    rows, row_adv, stats, _ = build_batch(rollouts, calls, TrainConfig(), Vocabulary(tok.decode, frozenset({IM_END})))
    assert [r.rollout_id for r in rows] == ["a", "a", "b", "c"] and stats.merge_breaks == 1
    # the group statistics see 3 rollouts (not 4 rows): A = (r - 1/3) / std([1, 0, 0])
    expected = grpo_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0, 0, 0])).tolist()
    assert row_adv == pytest.approx([expected[0], expected[0], expected[1], expected[2]])
    assert expected[0] == pytest.approx((2 / 3) / (1 / 3) ** 0.5, rel=1e-4)
    # equal total loss weight per rollout, whatever its number of rows
    T = max(len(r.response_mask) for r in rows)
    mask = torch.tensor([r.response_mask + [0] * (T - len(r.response_mask)) for r in rows])
    w = per_rollout_token_weights(mask, torch.tensor([0, 0, 1, 2]))
    assert [w[:2].sum().item(), w[2].sum().item(), w[3].sum().item()] == pytest.approx([1 / 3] * 3)
    # so with ratio 1 the loss is -mean over rollouts of A (the two rows of "a" add up to one rollout)
    zeros = torch.zeros_like(w)
    loss, _ = ppo_loss(zeros, zeros, torch.tensor(row_adv), w)
    assert loss.item() == pytest.approx(-sum(expected) / 3, abs=1e-6)


# limits
def test_max_prompt_tokens_drops_rows_and_counts():
    calls = [rec(0, [1, 2, 3], [4]), rec(1, [1, 2, 3, 4, 5], [6]),  # row 1 (2 calls, first prompt 3 tokens)
             rec(2, [9] * 10, [7]), rec(3, [9] * 10 + [7, 5], [8]),  # row 2: first prompt 10 > 5 → dropped
             rec(4, [1, 1], [2])]  # row 3: short prompt, kept
    stats = AggregateStats()
    rows = build_rows(calls, stats=stats, max_prompt_tokens=5)
    assert [r.prompt_ids for r in rows] == [[1, 2, 3], [1, 1]] and stats.rows == 2
    assert stats.dropped_rows == {"prompt_too_long": 1} and stats.dropped_calls == 2
    assert stats.merge_breaks == 2  # the calls merged into the dropped row are not breaks
    # the limit is on the row's *first* prompt: later, longer prompts of a kept row are fine
    assert rows[0].n_calls == 2 and len(rows[0].full_ids()) > 5
    stats = AggregateStats()
    assert len(build_rows(calls, "transition", stats, max_prompt_tokens=5)) == 3
    assert stats.dropped_rows == {"prompt_too_long": 2}


def test_max_response_tokens_truncates_and_counts():
    calls = [rec(0, [1, 2], [3, 4, 5]), rec(1, [1, 2, 3, 4, 5, 9, 9], [6, 7, 8])]  # merged response: 8 tokens
    stats = AggregateStats()
    (row,) = build_rows(calls, stats=stats, max_response_tokens=5)
    assert row.response_ids == [3, 4, 5, 9, 9] and row.response_mask == [1, 1, 1, 0, 0]
    assert len(row.old_logprobs) == 5 and row.n_calls == 2
    assert stats.truncated_rows == 1 and stats.truncated_tokens == 3
    stats = AggregateStats()
    rows = build_rows(calls, stats=stats, max_response_tokens=8)  # exactly at the limit: untouched
    assert len(rows[0].response_ids) == 8 and stats.truncated_rows == 0
    stats = AggregateStats()
    rows = build_rows(calls, "transition", stats, max_response_tokens=2)
    assert [r.response_ids for r in rows] == [[3, 4], [6, 7]] and stats.truncated_tokens == 2
    with pytest.raises(ValueError):
        build_rows(calls, max_response_tokens=0)
    with pytest.raises(ValueError):
        build_rows(calls, max_prompt_tokens=-1)


def test_examples_are_capped_and_json_ready():
    stats = AggregateStats(max_examples=2)
    for i in range(5):
        build_rows([rec(0, [1, 2], [3], rid=f"r{i}"), rec(1, [1, 2, 7], [4], rid=f"r{i}")], stats=stats,
                   vocab=Vocabulary(lambda ids: " ".join(map(str, ids))))
    assert stats.merge_breaks == 5 and stats.merge_break_classes == {"template_rerender": 5}
    assert len(stats.merge_break_examples["template_rerender"]) == 2
    m = json.loads(json.dumps(stats.metrics()))
    assert m["merge_break_examples"]["template_rerender"][0]["row_text"] == "1 2 3"
    # a decoder that raises never breaks aggregation: the break is `other`
    stats = AggregateStats()

    def bad(ids):
        raise KeyError("unknown id")

    assert len(build_rows([rec(0, [1], [3]), rec(1, [1, 4], [5])], stats=stats, vocab=Vocabulary(bad))) == 2
    assert stats.merge_break_classes == {"other": 1}


def test_first_difference():
    a = list(range(1000))
    assert first_difference(a, a) == 1000 and first_difference(a, a[:10]) == 10
    assert first_difference(a, a[:700] + [-1] + a[701:]) == 700 and first_difference([], a) == 0
