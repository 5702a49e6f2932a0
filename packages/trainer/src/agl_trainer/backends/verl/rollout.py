"""``agl_cpu``: a rollout engine for verl on CPU that serves the actor's policy over OpenAI chat HTTP.

verl 0.9.1 registers rollouts for vLLM, SGLang and TRT-LLM only, all GPU engines. This module gives verl's
own machinery (``LLMServerManager`` → replicas → ``CheckpointEngineManager.sleep_replicas`` /
``update_weights``) an engine that runs on CPU, so that path runs unchanged in CI:

- :class:`AglCpuServer` (a Ray actor, one per replica, named ``agl_cpu_server_{replica_rank}``) loads the
  base model in **fp32** with transformers and answers ``POST /v1/chat/completions`` the way vLLM does with
  ``return_token_ids``/``logprobs`` (top-level ``prompt_token_ids``, ``choices[].token_ids``,
  ``choices[].logprobs.content[].logprob``), so AGL's gateway records token ids and logprobs from it. The
  recorded logprobs are ``log_softmax(logits / temperature)`` of one full fp32 forward pass over prompt +
  response, computed the way verl's actor recomputes them. ``sleep`` / ``wake_up`` mark the engine asleep (a call
  while asleep is answered 503: the gateway must have paused first); ``GET /agl/events`` lists what
  happened, in order, with wall-clock times; ``POST /agl/score`` returns the served policy's logprobs of
  given prompt and response ids (tests use it to see the weights move).
- :class:`AglCpuRolloutReplica` (verl's ``RolloutReplica``) starts that actor in ``launch_servers``; its
  address is what ``LLMServerManager.get_addresses()`` returns.
- :class:`AglCpuRollout` (verl's ``BaseRollout``, living in each hybrid actor worker) receives the weights
  verl's checkpoint engine hands it in ``update_weights`` (with LoRA: the adapter tensors in PEFT's
  format plus the ``LoraConfig``) and loads them into its replica's server, so the **next calls run the
  updated policy**. With ``AGL_VERL_LORA_DIR`` set, each adapter is also saved with PEFT's layout under
  ``{dir}/policy-v{step}`` (what ``/v1/load_lora_adapter`` of a vLLM server takes).

This is a stand-in for vLLM on CPU, not vLLM: it decodes one request at a time without a KV cache pool.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

ROLLOUT_NAME = "agl_cpu"


def server_name(replica_rank: int) -> str:
    """Ray actor name of replica ``replica_rank``'s server."""
    return f"agl_cpu_server_{replica_rank}"


class PolicyServer:
    """An fp32 transformers policy behind an OpenAI-compatible chat endpoint (plain Python, no Ray).

    Args:
        model_path: a Hugging Face model directory (weights, tokenizer, chat template).
        host: interface to bind; the port is chosen free.
        threads: torch CPU threads for generation.
    """

    def __init__(self, model_path: str, host: str = "127.0.0.1", threads: int = 1):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.model_path = model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        self.lock = threading.Lock()
        self.asleep = False
        self.version_step: int | None = None
        self.events: list[tuple[str, float]] = []
        eos = self.tokenizer.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        if gen_eos is not None:
            self.eos_ids |= {gen_eos} if isinstance(gen_eos, int) else set(gen_eos)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                return

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.rstrip("/") in ("/health", "/v1/health"):
                    return self._send(200, {"ok": True, "asleep": server.asleep})
                if self.path.startswith("/v1/models"):
                    return self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})
                if self.path.startswith("/agl/events"):
                    return self._send(200, {"events": server.events})
                return self._send(404, {"error": "not found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(n) or b"{}")
                except ValueError:
                    return self._send(400, {"error": {"message": "body is not JSON"}})
                if self.path.rstrip("/") == "/agl/score":  # the served policy's logprobs of given tokens
                    with server.lock:
                        lps = server.score(body["prompt_ids"], body["response_ids"],
                                           float(body.get("temperature", 1.0)))
                    return self._send(200, {"logprobs": lps})
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                if body.get("stream"):
                    return self._send(400, {"error": {"message": "stream is not supported by agl_cpu"}})
                if server.asleep:
                    return self._send(503, {"error": {"message": "engine asleep (the gateway must pause first)"}})
                try:
                    return self._send(200, server.chat(body))
                except (ValueError, TypeError, KeyError) as e:
                    return self._send(400, {"error": {"message": str(e)}})

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.address = f"{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    # --------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def score(self, prompt_ids: list[int], response_ids: list[int], temperature: float) -> list[float]:
        """``log_softmax(logits / temperature)`` of each response token under one fp32 forward pass (nats),
        computed as verl's actor does (``logit[token] - logsumexp(logits)``, verl's
        ``logprobs_from_logits_v2``): ``torch.log_softmax`` rounds differently, ~5e-6 nats off on average."""
        ids = torch.tensor([prompt_ids + response_ids])
        logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float() / temperature
        picked = logits.gather(-1, torch.tensor(response_ids).unsqueeze(-1)).squeeze(-1)
        return (picked - torch.logsumexp(logits, dim=-1)).tolist()

    @torch.no_grad()
    def chat(self, body: dict) -> dict:
        """One non-streamed chat completion, vLLM-shaped (token ids and logprobs always included)."""
        messages = body["messages"]
        temperature = float(body.get("temperature") if body.get("temperature") is not None else 1.0)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 64)
        seed = body.get("seed")
        gen = torch.Generator().manual_seed(int(seed)) if seed is not None else None
        with self.lock:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
            if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
                prompt = list(prompt["input_ids"])
            prompt = [int(t) for t in prompt]
            ids = torch.tensor([prompt])
            out = self.model(input_ids=ids, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
            response: list[int] = []
            finish = "length"
            for _ in range(max_tokens):
                if temperature <= 0:
                    tok = int(torch.argmax(logits))
                else:
                    probs = torch.softmax(logits.float() / temperature, dim=-1)
                    tok = int(torch.multinomial(probs, 1, generator=gen))
                response.append(tok)
                if tok in self.eos_ids:
                    finish = "stop"
                    break
                out = self.model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[0, -1]
            logprobs = self.score(prompt, response, temperature if temperature > 0 else 1.0)
        text = self.tokenizer.decode(response, skip_special_tokens=True)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "policy"), "prompt_token_ids": prompt,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish, "token_ids": response,
                         "logprobs": {"content": [{"token": self.tokenizer.decode([t]), "logprob": lp}
                                                  for t, lp in zip(response, logprobs)]}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(response),
                      "total_tokens": len(prompt) + len(response)},
        }

    # ------------------------------------------------------------------------------------ control
    def mark(self, event: str) -> None:
        self.events.append((event, time.time()))

    def sleep(self) -> None:
        self.asleep = True
        self.mark("sleep")

    def wake_up(self) -> None:
        self.asleep = False
        self.mark("wake")

    def load_weights(self, tensors: dict[str, torch.Tensor], peft_config: Any = None,
                     global_steps: int | None = None) -> int:
        """Load what verl's checkpoint engine sent: LoRA tensors (PEFT state-dict names) with their
        ``LoraConfig``, or full base weights. Returns the number of tensors loaded.

        Raises:
            ValueError: names that match nothing in the model.
        """
        with self.lock:
            if peft_config is not None:
                from peft import PeftModel, get_peft_model, set_peft_model_state_dict

                if not isinstance(self.model, PeftModel):
                    import copy

                    if isinstance(peft_config, dict):  # verl sends LoraConfig as a dict
                        from peft import get_peft_config

                        cfg = get_peft_config({**peft_config, "peft_type": peft_config.get("peft_type") or "LORA"})
                    else:
                        cfg = copy.deepcopy(peft_config)
                    cfg.inference_mode = True
                    self.model = get_peft_model(self.model, cfg).eval()
                result = set_peft_model_state_dict(self.model, tensors)
                unexpected = getattr(result, "unexpected_keys", None) or []
                if unexpected:
                    raise ValueError(f"LoRA tensors match nothing in the model: {unexpected[:5]}")
                out_dir = os.environ.get("AGL_VERL_LORA_DIR")
                if out_dir and global_steps is not None:
                    from agl_common.schemas import policy_name  # (the one served-name function)

                    self.model.save_pretrained(Path(out_dir) / policy_name(global_steps))
            else:
                target = getattr(self.model, "base_model", None)
                target = target.model if target is not None and hasattr(target, "model") else self.model
                # a LoRA actor's base weights arrive with PEFT's ``.base_layer`` in their names
                base = {k.replace(".base_layer", ""): v for k, v in tensors.items() if "lora_" not in k}
                missing, unexpected = target.load_state_dict(base, strict=False)
                if unexpected:
                    raise ValueError(f"weights match nothing in the model: {unexpected[:5]}")
            self.version_step = global_steps
        self.mark(f"weights:{global_steps}")
        return len(tensors)

    def close(self) -> None:
        self.httpd.shutdown()


class _ServerActor:
    """Ray actor wrapping :class:`PolicyServer` (all control calls are plain methods)."""

    def __init__(self, model_path: str):
        self.server = PolicyServer(model_path)

    def address(self) -> str:
        return self.server.address

    def sleep(self):
        self.server.sleep()

    def wake_up(self):
        self.server.wake_up()

    def load_weights(self, tensors, peft_config=None, global_steps=None):
        return self.server.load_weights(tensors, peft_config, global_steps)

    def events(self):
        return list(self.server.events)

    # verl's replica calls these around weight syncs and aborts; a one-request-at-a-time engine has
    # no queue or KV cache pool to manage
    def abort_all_requests(self, reject_request: bool = False):
        return None

    def resume_generation(self):
        return None

    def clear_kv_cache(self):
        return None

    def release_kv_cache(self):
        return None

    def resume_kv_cache(self):
        return None

    def start_profile(self, **kwargs):
        return None

    def stop_profile(self):
        return None


def _model_path(model_config: Any) -> str:
    get = model_config.get if hasattr(model_config, "get") else lambda k, d=None: getattr(model_config, k, d)
    return get("local_path", None) or get("path")


def register() -> None:
    """Register ``agl_cpu`` in verl's rollout and replica registries (idempotent)."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.AglCpuRollout"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: AglCpuRolloutReplica)


def _verl_classes():
    from verl.workers.rollout.base import BaseRollout
    from verl.workers.rollout.replica import RolloutReplica

    return BaseRollout, RolloutReplica


try:  # the classes subclass verl's; without verl this module still imports (PolicyServer only)
    _BaseRollout, _RolloutReplica = _verl_classes()
except ImportError:  # pragma: no cover - main environment
    _BaseRollout = _RolloutReplica = object


class AglCpuRolloutReplica(_RolloutReplica):
    """verl replica whose server is an :class:`AglCpuServer` Ray actor (CPU only, no GPU resources)."""

    async def launch_servers(self):
        import ray

        actor_cls = ray.remote(num_cpus=0, max_concurrency=16)(_ServerActor)
        path = _model_path(self.model_config)
        server = actor_cls.options(name=server_name(self.replica_rank), lifetime=None).remote(path)
        address = await server.address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = address

    def rollout_worker_use_gpu(self) -> bool:
        return False


class AglCpuRollout(_BaseRollout):
    """verl's in-worker rollout: forwards sleep/wake and the synced weights to its replica's server."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        import torch.distributed as dist

        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.replica_rank = rank // world
        self.is_leader = rank % world == 0
        self.sleep_level = 2
        self._server = None

    def _handle(self):
        import ray

        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        if self.is_leader and "kv_cache" in tags:
            await self._handle().wake_up.remote()

    async def release(self):
        if self.is_leader:
            await self._handle().sleep.remote()

    async def update_weights(self, weights, wire_format: str = "named_tensors", peft_config=None,
                             base_sync_done: bool = True, global_steps: int | None = None, **kwargs):
        if wire_format != "named_tensors":
            raise ValueError(f"agl_cpu takes named tensors, not {wire_format}")
        tensors = {name: t.detach().to("cpu", torch.float32).clone()
                   if t.is_floating_point() else t.detach().cpu().clone() for name, t in weights}
        if not self.is_leader:
            return
        if peft_config is not None and not base_sync_done:
            await self._handle().load_weights.remote(tensors, None, global_steps)
        else:
            await self._handle().load_weights.remote(tensors, peft_config, global_steps)
