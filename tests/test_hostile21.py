"""Round 21 of hostile input (docs/operations.md, "A twenty-first round"): each test failed before its fix."""
from __future__ import annotations

from agl_common.schemas import CallRecord, Rollout, RolloutStatus



async def test_a_reward_posted_while_a_no_reward_retry_is_written_is_not_lost(store, monkeypatch):
    """(Left open by round 20.) With ``no_reward`` in ``retry_on``, the retry was decided on the rollout as read
    before the write: a reward posted (HTTP 200) in between was dropped with the attempt and the rollout ran again.
    The retry is decided again on the rollout it writes: the posted reward stands and the attempt succeeds."""
    from agl_controller.base import Runner

    await store.create_rollout(Rollout(rollout_id="late-retry", status=RolloutStatus.running), enqueue=False)
    await store.record_call(CallRecord(rollout_id="late-retry", attempt_id="0", seq=-1, route="chat", request={},
                                       response={}))
    runner = Runner(store, max_attempts=3, retry_on=("no_reward",))
    update = store.update_rollout
    posted = []

    async def post_then_update(rid, change, **kw):
        if not posted:  # a process the run left behind posts its reward here (as the gateway's route does)
            posted.append(await update(rid, lambda r: setattr(r, "reward", 0.5)))
        return await update(rid, change, **kw)

    monkeypatch.setattr(store, "update_rollout", post_then_update)
    got = await runner.finish_attempt("late-retry", "0", None)
    assert posted and (got.status, got.failure, got.reward, got.attempt_id) == (
        RolloutStatus.succeeded, None, 0.5, "0"), got


async def test_a_no_reward_retry_still_retries_without_a_reward(store):
    """The check above changes nothing when no reward arrives: the attempt is retried as before."""
    from agl_controller.base import Runner

    await store.create_rollout(Rollout(rollout_id="none", status=RolloutStatus.running), enqueue=False)
    await store.record_call(CallRecord(rollout_id="none", attempt_id="0", seq=-1, route="chat", request={},
                                       response={}))
    got = await Runner(store, max_attempts=3, retry_on=("no_reward",)).finish_attempt("none", "0", None)
    assert (got.status, got.attempt_id, got.reward) == (RolloutStatus.queuing, "1", None), got
