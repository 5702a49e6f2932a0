"""What verl 0.9.1 lacks to run on CPU, and AGL's loss: loaded by verl's extension hook in every process.

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` (comma-separated) at ``import verl``,
in the driver and in each Ray worker. Naming this module there
(``VERL_USE_EXTERNAL_MODULES=agl_trainer.backends.verl.hook``) registers:

- **AGL's per-rollout loss** in verl's policy-loss registry as ``agl_per_rollout`` (always; on GPU too).
- **The ``agl_cpu`` rollout** (:mod:`agl_trainer.backends.verl.rollout`): a rollout engine for CPU that
  serves the actor's policy over an OpenAI-compatible HTTP server and receives weights through verl's
  checkpoint engine (always registered; chosen with ``actor_rollout_ref.rollout.name=agl_cpu``).
- **With ``AGL_VERL_CPU=1`` only**: a CPU device platform (verl 0.9.1 knows nvidia, npu and rocm and
  falls back to nvidia) selected through ``VERL_PLATFORM=agl_cpu``, and verl's FSDP engines registered
  for the ``cpu`` device (verl registers them for cuda and npu only).

Measured facts behind the platform (``docs/machine-notes.md``, "verl on CPU"): torch's ``cpu`` module lacks
``memory_reserved`` and friends that verl calls (stand-ins below); verl's backend string ``cpu:gloo`` per
device type gives "Duplicate device type cpu" (plain ``gloo`` here); FSDP2 works on CPU with gloo.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

#: Ray resource standing for one CPU "device" (one training rank). Ray's GPU resource is logical, so the
#: driver declares as many as it wants ranks (``ray.init(num_gpus=n)``) on a machine without a GPU; verl's
#: resource-pool check counts only ``GPU``/``NPU``, so a custom resource name would be refused.
CPU_SLOT = "GPU"


def _cpu_device_module() -> ModuleType:
    """``torch.cpu`` plus the memory functions verl calls on its device module (all report 0 bytes)."""
    mod = torch.cpu
    zero = lambda *a, **k: 0  # noqa: E731
    for name in ("memory_reserved", "memory_allocated", "max_memory_allocated", "max_memory_reserved",
                 "reset_peak_memory_stats"):
        if not hasattr(mod, name):
            setattr(mod, name, zero)
    if not hasattr(mod, "mem_get_info"):
        def mem_get_info(*a, **k):
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            return free, pages
        mod.mem_get_info = mem_get_info
    for name in ("empty_cache", "ipc_collect"):
        if not hasattr(mod, name):
            setattr(mod, name, lambda *a, **k: None)
    if not hasattr(mod, "manual_seed"):
        mod.manual_seed = torch.manual_seed
    if not hasattr(mod, "manual_seed_all"):
        mod.manual_seed_all = torch.manual_seed
    return mod


def _register_platform() -> None:
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    @PlatformRegistry.register(platform="agl_cpu")
    class PlatformAglCPU(PlatformBase):
        """verl's device abstraction for plain CPU: gloo, no IPC, one custom Ray resource per rank."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return _cpu_device_module()

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check=False) -> bool:
            return os.environ.get("AGL_VERL_CPU") == "1"

        def current_device(self):
            # verl moves tensors with ``.to(get_device_id())``: an int would mean an accelerator
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "AGL_CPU_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return CPU_SLOT

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_gpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None


def _register_cpu_engines() -> None:
    """verl's FSDP engines (registered for cuda/npu) also under the ``cpu`` device."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl as fsdp

    for model_type, cls in (("language_model", fsdp.FSDPEngineWithLMHead),
                            ("value_model", fsdp.FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            EngineRegistry._engines.setdefault(model_type, {}).setdefault(backend, {})["cpu"] = cls


def _patch_cpu_backend_string() -> None:
    """verl builds ``cpu:gloo,cpu:gloo`` for the cpu device ("Duplicate device type cpu"): use ``gloo``."""
    import torch.distributed as dist

    if getattr(dist.init_process_group, "_agl_cpu", False):
        return
    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend")
        if isinstance(backend, str) and "cpu:" in backend:
            kwargs["backend"] = "gloo"
        return original(*args, **kwargs)

    init_process_group._agl_cpu = True
    dist.init_process_group = init_process_group


def register() -> None:
    """Register everything (idempotent). Called at import."""
    from . import adapter
    from . import rollout as verl_rollout

    adapter.register_verl_loss()
    verl_rollout.register()
    if os.environ.get("AGL_VERL_CPU") == "1":
        os.environ.setdefault("VERL_PLATFORM", "agl_cpu")
        _register_platform()
        _register_cpu_engines()
        _patch_cpu_backend_string()
        # one thread per process, as the agl_cpu server: a different thread count changes BLAS reduction
        # order, and recomputed logprobs then differ from the recorded ones by ~2e-5 instead of ~1e-6
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


register()
