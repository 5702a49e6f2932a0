"""Hostile input, round 5 (docs/operations.md "Hostile input"): what a fresh probing round found."""

from __future__ import annotations

from agl_common.schemas import CallRecord, answer_text


def _call(route: str, response: dict, status: str = "ok") -> CallRecord:
    return CallRecord(rollout_id="r", attempt_id="1", seq=0, route=route, request={}, response=response,
                      status=status)


def test_the_reward_function_gets_the_answer_whatever_the_route():
    """final_output read only chat/completions shapes: Messages and Responses answers reached --reward-fn as ""."""
    from agl_controller.base import final_output
    from agl_trainer.ui.traces import message_text

    said = {
        "chat": {"choices": [{"message": {"role": "assistant", "content": "the answer is 7"}}]},
        "completions": {"choices": [{"text": "the answer is 7"}]},
        "messages": {"content": [{"type": "text", "text": "the answer is 7"}]},
        "responses": {"output": [{"type": "message", "role": "assistant",
                                  "content": [{"type": "output_text", "text": "the answer is 7"}]}]},
    }
    for route, response in said.items():
        assert final_output([_call(route, response)]) == "the answer is 7", route
        assert message_text(_call(route, response)) == "the answer is 7", route
    assert final_output([_call("responses", {"output_text": "7", "output": []})]) == "7"
    # chat content as a list of text parts
    assert answer_text(_call("chat", {"choices": [{"message": {"content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]}}]})) == "ab"


def test_an_answer_that_is_not_text_is_never_passed_on_as_something_else():
    """A chat `content: 7` reached the reward function as the int 7, and the dashboard's rollout page was a 500."""
    from agl_controller.base import final_output
    from agl_trainer.ui.traces import message_text

    odd = [{"choices": [{"message": {"content": 7}}]}, {"choices": [{"message": {"content": {"x": 1}}}]},
           {"choices": "x"}, {"choices": [None]}, {"choices": [{"text": 5}]}, {}]
    for response in odd:
        out = final_output([_call("chat", response)])
        assert out == "" and isinstance(out, str), response
        assert isinstance(message_text(_call("chat", response)), str)
    for response in ({"content": "x"}, {"content": [{"type": "text", "text": 3}]}, {"content": None}):
        assert answer_text(_call("messages", response)) in ("x", "")
    assert answer_text(_call("responses", {"output": "x"})) == ""
    assert answer_text(_call("responses", {"output": [{"type": "message", "content": 5}]})) == ""
