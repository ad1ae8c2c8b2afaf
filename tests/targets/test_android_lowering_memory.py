"""The android export's allocator setting: freed weight-sized buffers leave the process instead of staying
resident in the heap (what kept ExecuTorch's lowering growing by layer, docs/android.md)."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or not os.confstr("CS_GNU_LIBC_VERSION"),
                                reason="the setting is glibc's mallopt; this host has no glibc")

# After a 16 MiB buffer is freed, glibc serves 1 MiB buffers from the heap; the last one, kept, holds the heap's
# top above the others, so freeing them returns nothing unless each had its own mapping.
PROBE = """
import ctypes, sys
from oscar_export.targets.android import return_freed_buffers_to_the_os
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


def test_freed_buffers_are_returned_with_the_setting_and_kept_without():
    assert returned_mib("set") >= 120  # of 128 MiB freed
    assert returned_mib("default") <= 8  # the control: glibc's moving threshold keeps them resident
