"""The android export's memory: the allocator setting (freed weight-sized buffers leave the process instead of
staying resident in the heap, what kept ExecuTorch's lowering growing by layer), XNNPACK packing each weight
without a second copy of the model, and cache buffers that stay unwritten (docs/android.md)."""

import os
import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.system() != "Linux" or not os.confstr("CS_GNU_LIBC_VERSION"),
                           reason="the setting is glibc's mallopt; this host has no glibc")

# After a 16 MiB buffer is freed, glibc serves 1 MiB buffers from the heap; the last one, kept, holds the heap's
# top above the others, so freeing them returns nothing unless each had its own mapping.
PROBE = """
import ctypes, sys
from oscar_export.targets.android.lower import return_freed_buffers_to_the_os
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "set":
    assert return_freed_buffers_to_the_os()
libc.free(libc.malloc(16 << 20))
buffers = [libc.malloc(1 << 20) for _ in range(129)]
for b in buffers:
    ctypes.memset(b, 1, 1 << 20)
before = resident()
for b in buffers[:-1]:
    libc.free(b)
print((before - resident()) >> 20)
"""


def returned_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@glibc
def test_freed_buffers_are_returned_with_the_setting_and_kept_without():
    assert returned_mib("set") >= 120  # of 128 MiB freed
    assert returned_mib("default") <= 8  # the control: glibc's moving threshold keeps them resident


def quantized_program(spend_weights: bool):
    """The bundled model with the android export's 4-bit weights, lowered; and its quantized linears."""
    import torch

    from oscar_export.config import OscarConfig
    from oscar_export.export.graph import OscarCausalLM
    from oscar_export.models import load_model
    from oscar_export.targets.android.lower import ExecuTorchLM, quantize_artifact_weights, lower

    torch.manual_seed(0)
    module = OscarCausalLM(load_model("bundled")[0], OscarConfig(sink=16, recent=32), "hadamard").eval()
    module.layers = module.layers[:1]  # one layer's partitions show it; the rest only cost lowering time
    quantize_artifact_weights(module, 32)
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    program = lower(ExecuTorchLM(module, 128).eval(), 128, 32, {}, spend_weights=spend_weights)
    return program.buffer, linears


def test_spent_weights_are_freed_as_packed_and_the_program_is_unchanged():
    pytest.importorskip("executorch.backends.xnnpack")
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    hooks = {name: XnnpackBackend.__dict__.get(name) for name in ("preprocess", "copy_exported_program_for_preprocess")}
    kept, kept_linears = quantized_program(spend_weights=False)
    spent, spent_linears = quantized_program(spend_weights=True)
    # Sharing the weights with XNNPACK's partition copies, and freeing them once packed, changes no byte.
    assert len(spent) == len(kept) and spent == kept
    assert len(spent_linears) == 8  # q, k, v, o, gate, up, down, lm_head
    for m in kept_linears:  # the control: without spending, every weight survives the lowering
        assert m.weight.qdata.untyped_storage().nbytes() == m.weight.qdata.numel()
    for m in spent_linears:  # every quantized linear was packed into a partition, which freed its codes and scales
        assert m.weight.qdata.untyped_storage().nbytes() == 0 and m.weight.scale.untyped_storage().nbytes() == 0
    # ExecuTorch's XNNPACK backend is itself again after the lowering.
    assert {name: XnnpackBackend.__dict__.get(name) for name in hooks} == hooks


UNTOUCHED_CACHE = """
from oscar_export.config import OscarConfig
from oscar_export.export.graph import OscarCausalLM
from oscar_export.models import load_model
from oscar_export.targets.android.lower import ExecuTorchLM
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
lm = OscarCausalLM(load_model("bundled")[0], OscarConfig(sink=16, recent=1 << 19), "hadamard").eval()
before = resident()
cache = ExecuTorchLM(lm, 16 + (1 << 19)).cache_buffers()
grown = resident() - before
allocated = sum(b.numel() * b.element_size() for b in cache)
print(allocated >> 20, grown >> 20, all(int(b[:, -4:].abs().max()) == 0 for b in cache if b.numel()))
"""


@glibc
def test_the_programs_cache_buffers_take_no_memory_until_written():
    # 8 fp16 windows of 2 heads x 2^19 tokens x 64 channels (128 MiB each), as the export holds them.
    out = subprocess.run([sys.executable, "-c", UNTOUCHED_CACHE], capture_output=True, text=True, check=True)
    allocated_mib, grown_mib, zero = out.stdout.split()
    assert int(allocated_mib) >= 1024 and int(grown_mib) <= 64 and zero == "True", out.stdout
