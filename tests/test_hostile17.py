"""Round 17 of hostile input (docs/operations.md, "A seventeenth round"): each test failed before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from agl_common.schemas import CallRecord, Policy

from test_roles import FakeRoleBackend

ROLES = Policy(model="base", version=0, roles={"solver": "base", "checker": "base"},
               role_models={"solver": "solver", "checker": "checker"})
ROLES_CFG = {"policy_serving": "adapter", "lora_rank": 8, "lora_alpha": 16,
             "roles": {"solver": {"models": ["solver"], "lora_rank": 8}, "checker": {"models": ["checker"]}}}


def _trained_run(tmp_path, cfg: dict):
    from agl_trainer.config import TrainConfig

    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(TrainConfig.model_validate(cfg).shown()))
    return run


def test_a_resume_with_other_weight_settings_is_refused_before_anything_starts(tmp_path):
    """The prober: ``check_resumable`` compared only the role names. Another LoRA rank was a size-mismatch traceback
    after vLLM, the gateway and the controller had started; another alpha (or base model) loaded in silence and
    trained a policy other than the one the engine served (off-policy from the first resumed step). Settings that
    shape no weights (lr, a role's model names) may still change."""
    from agl_trainer.config import TrainConfig
    from agl_trainer.run import NotResumable, check_resumable

    run = _trained_run(tmp_path, ROLES_CFG)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    solver = ROLES_CFG["roles"]["solver"]
    for change, says in (({"lora_rank": 32}, "checker lora_rank/lora_alpha (8, 16) → (32, 16)"),
                         ({"lora_alpha": 64}, "solver lora_rank/lora_alpha (8, 16) → (8, 64)"),
                         ({"roles": {**ROLES_CFG["roles"], "solver": {**solver, "lora_rank": 64}}}, "solver"),
                         ({"base_model": str(model)}, "base_model None →")):
        with pytest.raises(NotResumable, match="other weight settings") as info:
            check_resumable(TrainConfig.model_validate({**ROLES_CFG, **change}), run)
        assert says in str(info.value), (change, str(info.value))
    check_resumable(TrainConfig.model_validate({**ROLES_CFG, "lr": 1e-4, "roles": {
        **ROLES_CFG["roles"], "checker": {"models": ["judge"]}}}), run)  # no weight changes shape: resumable
    plain = _trained_run(tmp_path / "plain", {"lora_rank": 8})
    with pytest.raises(NotResumable, match=r"lora_rank/lora_alpha \(8, 32\) → \(16, 32\)"):
        check_resumable(TrainConfig(), plain)
    (plain / "config.json").write_text("[1, 2]")
    with pytest.raises(NotResumable, match="not a run's config"):
        check_resumable(TrainConfig(), plain)


def test_resume_files_that_are_not_regular_files_are_one_line_not_a_hang(tmp_path, redis_url, prefix):
    """The prober: ``train --resume`` read a FIFO ``checkpoint/state.json`` or ``config.json`` for ever (and
    ``/dev/zero`` until memory ran out); a config file whose read fails (``/proc/self/clear_refs``; for a user, a
    file they may not read) was a traceback in ``train``, ``eval`` and ``rollouts``. Each is one line, exit 2."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"out_dir: {tmp_path / 'runs'}\n")
    env = {**os.environ, "AGL_REDIS_URL": redis_url, "AGL_PREFIX": prefix}
    good_state = json.dumps({"step": 1, "version": 1, "metrics": {"groups": []}, "active": []})
    for what in ("state.json", "config.json"):
        run = tmp_path / what
        (run / "checkpoint").mkdir(parents=True)
        (run / "checkpoint" / "state.json").write_text(good_state)
        fifo = run / "checkpoint" / "state.json" if what == "state.json" else run / "config.json"
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo)
        out = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(cfg), "--resume", str(run)],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 2 and "cannot resume" in out.stderr and "not a regular file" in out.stderr, \
            (what, out.returncode, out.stderr[-1500:])
        assert "Traceback" not in out.stderr and "engine" not in out.stdout.lower(), what
    unreadable = tmp_path / "unreadable.yaml"
    unreadable.symlink_to("/proc/self/clear_refs")  # opens, then every read fails (EINVAL)
    for argv in (["train", str(unreadable)], ["eval", str(unreadable)],
                 ["rollouts", "export", "--shape", "rows", "--config", str(unreadable)]):
        out = subprocess.run([sys.executable, "-m", "agl_trainer", *argv], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 2 and "cannot be read" in out.stderr and "Traceback" not in out.stderr, \
            (argv, out.returncode, out.stderr[-1500:])


async def test_a_resumed_role_serves_the_adapter_it_served_at_its_checkpoint(tmp_path):
    """The prober: a resumed roles run served each role its newest adapter directory at or below the version. With
    the adapter a role served at the checkpoint gone, it served an older one in silence (the trainer restored
    newer weights: off-policy). Now the checkpoint says what each role served; a missing adapter is refused before
    anything starts, and a role that was skipped still serves its older one."""
    from agl_trainer.algorithm.aggregate import Row
    from agl_trainer.backends.roles import RolesBackend
    from agl_trainer.config import TrainConfig
    from agl_trainer.run import NotResumable, check_resumable

    run = _trained_run(tmp_path, ROLES_CFG)
    adapters = run / "adapters"

    def make():
        return RolesBackend({r: FakeRoleBackend(adapters, r) for r in ("solver", "checker")}, ROLES)

    b = make()
    for version, roles in ((1, ("solver", "checker")), (2, ("solver", "checker")), (3, ("solver",))):
        b.update([Row(f"r{version}", [1], role=r) for r in roles], [1.0] * len(roles))
        await b.publish(version)
    (run / "checkpoint").rmdir()
    b.checkpoint(run / "checkpoint")
    cfg = TrainConfig.model_validate(ROLES_CFG)
    check_resumable(cfg, run)
    again = make()
    again.restore(run / "checkpoint")
    assert (await again.serve(3)).roles == {"solver": "policy-v3-solver", "checker": "policy-v2-checker"}
    for f in (adapters / "policy-v2-checker").iterdir():  # the adapter the checker served at the checkpoint
        f.unlink()
    (adapters / "policy-v2-checker").rmdir()
    with pytest.raises(NotResumable, match="role checker served policy-v2-checker at the checkpoint"):
        check_resumable(cfg, run)
    again = make()
    again.restore(run / "checkpoint")
    with pytest.raises(FileNotFoundError, match="policy-v2-checker"):
        await again.serve(3)  # never policy-v1-checker in silence
    (run / "checkpoint" / "served.json").write_text('{"solver": 3}')
    with pytest.raises(NotResumable, match="does not give each of the roles"):
        check_resumable(cfg, run)


def test_eval_of_a_roles_run_trained_with_other_roles_is_refused(tmp_path):
    """The prober: ``eval --policy v2`` with roles solver and checker, against a run trained with solver and
    planner, served the checker the base model in silence and reported the result as v2."""
    from agl_trainer.config import TrainConfig
    from agl_trainer.evaluation import PolicyNotFound, resolve_policy

    cfg = TrainConfig.model_validate({**ROLES_CFG, "out_dir": str(tmp_path / "runs")})
    run = tmp_path / "runs" / "1207-000000-abcd"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(TrainConfig.model_validate(
        {**ROLES_CFG, "roles": {"solver": {"models": ["solver"]}, "planner": {"models": ["planner"]}}}).shown()))
    for role in ("solver", "planner"):
        (run / "adapters" / f"policy-v2-{role}").mkdir(parents=True)
        (run / "adapters" / f"policy-v2-{role}" / "adapter_config.json").write_text("{}")
    with pytest.raises(PolicyNotFound, match="trained with other roles: 1207-000000-abcd: planner, solver"):
        resolve_policy("v2", cfg)
    with pytest.raises(PolicyNotFound, match="trained with other roles"):
        resolve_policy("v2", cfg, run)
    (run / "config.json").write_text(json.dumps(cfg.shown()))  # the same roles: found, each role its adapter
    (run / "adapters" / "policy-v1-checker").mkdir()
    (run / "adapters" / "policy-v1-checker" / "adapter_config.json").write_text("{}")
    assert {r: n for r, (n, _) in resolve_policy("v2", cfg, run).roles.items()} == {
        "solver": "policy-v2-solver", "checker": "policy-v1-checker"}


def test_an_exported_conversation_is_one_roles(tmp_path):
    """The prober: ``rollouts export --shape messages`` merged a checker's call whose messages extended the solver's
    conversation into that conversation, and dropped the role: a per-role fine-tuning set mixed both agents'
    outputs, where training never merges two roles into one row."""
    from agl_trainer.export import ExportStats, conversations

    user = {"role": "user", "content": "3+4?"}
    solver_says = {"role": "assistant", "content": "7"}
    checker_asks = {"role": "user", "content": "check it"}

    def call(seq, role, sent, answer):
        return CallRecord(rollout_id="r", attempt_id="0", seq=seq, route="chat", role=role,
                          request={"messages": sent}, response={"choices": [{"message": answer}]})

    calls = [call(0, "solver", [user], solver_says),
             call(1, "checker", [user, solver_says, checker_asks], {"role": "assistant", "content": "7"}),
             call(2, "solver", [user, solver_says, {"role": "user", "content": "sure?"}], solver_says)]
    convs = conversations(calls, ExportStats())
    assert [(n, role, len(m)) for m, _, n, role in convs] == [(1, "solver", 2), (1, "checker", 4), (1, "solver", 4)]
    plain = [c.model_copy(update={"role": None}) for c in calls[:2]]
    assert [(n, role) for _, _, n, role in conversations(plain, ExportStats())] == [(2, None)]


def test_rows_export_with_a_base_model_without_a_tokenizer_is_one_line(tmp_path, redis_url, prefix):
    """The prober: ``rollouts export --shape rows --config X`` whose ``base_model`` holds no tokenizer was a
    traceback; and ``rollouts show --config X`` classified merge breaks with the shipped model's tokenizer, not
    the run's own."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {model}\n")
    env = {**os.environ, "AGL_REDIS_URL": redis_url, "AGL_PREFIX": prefix, "HF_HUB_OFFLINE": "1"}
    for argv in (["rollouts", "export", "--shape", "rows", "--config", str(cfg)],
                 ["rollouts", "show", "r1", "--config", str(cfg)]):
        out = subprocess.run([sys.executable, "-m", "agl_trainer", *argv], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 2 and f"no tokenizer in {model}" in out.stderr and "Traceback" not in out.stderr, \
            (argv, out.returncode, out.stderr[-1500:])


def test_a_role_names_a_bounded_number_of_models():
    """The prober: a role's ``models`` had no bound; ~100k names were accepted, and every ``unknown_role`` 400 and
    ``GET /v1/models`` then listed all of them."""
    from agl_trainer.config import TrainConfig

    with pytest.raises(ValueError, match="at most 64"):
        TrainConfig.model_validate({**ROLES_CFG, "roles": {"solver": {"models": [f"m{i}" for i in range(65)]}}})
