"""The numeric format chosen from the CPU (agl_trainer.hardware), with faked /proc/cpuinfo flags."""

from __future__ import annotations

import pytest
from agl_trainer.config import TrainConfig
from agl_trainer.hardware import choose_dtype, describe, read_cpuinfo
from pydantic import ValidationError

AMX = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu sse avx2 fma avx512f avx512_bf16 amx_tile amx_bf16\n"
ZEN5 = "model name\t: AMD EPYC 9R45\nflags\t\t: fpu avx2 fma avx512f avx512_bf16 avx512_vnni\n"
AVX2 = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx avx2 fma\n"
OLD = "model name\t: Some CPU\nflags\t\t: fpu sse sse2\n"


@pytest.mark.parametrize("text, capability, native, chosen", [
    (AMX, "AVX512", True, "bfloat16"),
    (ZEN5, "AVX512", True, "bfloat16"),
    (AMX, "AVX2", False, "float32"),     # ATEN_CPU_CAPABILITY=avx2: PyTorch's AVX2 kernels emulate bf16
    (AVX2, "AVX2", False, "float32"),
    (OLD, "DEFAULT", False, "float32"),
    ("", "AVX512", False, "float32"),    # no cpuinfo: no flags known, nothing assumed
])
def test_auto_picks_bf16_only_where_native(text, capability, native, chosen):
    info = read_cpuinfo(text, capability)
    assert info.native_bf16 is native
    assert choose_dtype("auto", info) == chosen
    assert choose_dtype("float32", info) == "float32" and choose_dtype("bfloat16", info) == "bfloat16"


def test_what_summary_records():
    d = describe("auto", read_cpuinfo(AVX2, "AVX2"))
    assert d["model"] == "AMD EPYC 7B13" and d["flags"] == ["avx2", "fma"] and d["capability"] == "AVX2"
    assert (d["dtype_requested"], d["dtype"], d["native_bf16"]) == ("auto", "float32", False)
    assert d["cores"] >= 1
    here = describe("auto")  # this machine, whatever it is: a real reading, consistent with itself
    assert here["dtype"] == ("bfloat16" if here["native_bf16"] else "float32")


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        choose_dtype("fp16", read_cpuinfo(AVX2, "AVX2"))
    with pytest.raises(ValidationError):
        TrainConfig(dtype="half")
    assert TrainConfig().dtype == "auto" and TrainConfig(dtype="float32").dtype == "float32"
