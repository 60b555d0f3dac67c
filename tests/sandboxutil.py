"""Run a command under the seccomp restrictions that systemd/gpuwatchd.service asks systemd for,
without systemd: the unit's SystemCallFilter= allow list (calls outside it fail with EPERM, as with
SystemCallErrorNumber=EPERM; calls newer than the table fail with ENOSYS, as systemd does for
system calls it does not know) and MemoryDenyWriteExecute=yes (no writable+executable mapping, no
mprotect to executable). x86_64 only: the numbers come from tests/fixtures/units/.

The allowed names are tests/fixtures/units/gpuwatchd-allowed-syscalls.txt, which
tests/test_systemd_unit.py keeps equal to the unit's filter as `systemd-analyze syscall-filter`
expands it; the numbers are tests/fixtures/units/syscalls-x86_64.json (from linux-libc-dev's
asm/unistd_64.h), so this also runs where systemd and kernel headers are absent (the GPU host).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "units"
ALLOWED = FIXTURES / "gpuwatchd-allowed-syscalls.txt"
NUMBERS = FIXTURES / "syscalls-x86_64.json"

_CODE = r"""
import ctypes, json, os, struct, sys
allowed, maxnr = json.loads(sys.argv[1]), int(sys.argv[2])
ERRNO, ALLOW = 0x00050000, 0x7FFF0000
libc = ctypes.CDLL(None, use_errno=True)
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
def install(ins):
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in ins))
    prog = Prog(len(ins), ctypes.cast(buf, ctypes.c_void_p))
    assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, ctypes.get_errno()
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS, as NoNewPrivileges=yes
# MemoryDenyWriteExecute=yes
install([
    (0x20, 0, 0, 0), (0x15, 0, 3, 9), (0x20, 0, 0, 32), (0x54, 0, 0, 6), (0x15, 5, 6, 6),
    (0x15, 1, 0, 10), (0x15, 0, 4, 329), (0x20, 0, 0, 32), (0x54, 0, 0, 4), (0x15, 0, 1, 4),
    (0x06, 0, 0, ERRNO | 1), (0x06, 0, 0, ALLOW),
])
# SystemCallFilter= (allow list), SystemCallErrorNumber=EPERM
ins = [(0x20, 0, 0, 0), (0x25, 0, 1, maxnr), (0x06, 0, 0, ERRNO | 38)]
for nr in allowed:
    ins += [(0x15, 0, 1, nr), (0x06, 0, 0, ALLOW)]
ins.append((0x06, 0, 0, ERRNO | 1))
install(ins)
os.execv(sys.argv[3], sys.argv[3:])
"""


def allowed_names() -> list[str]:
    return ALLOWED.read_text().split()


def sandboxed(argv: list[str]) -> list[str]:
    """``argv`` wrapped so that it execs under the unit's seccomp restrictions."""
    if platform.machine() != "x86_64":
        raise RuntimeError("sandboxutil knows x86_64 system-call numbers only")
    numbers: dict[str, int] = json.loads(NUMBERS.read_text())
    nrs = sorted(numbers[n] for n in allowed_names() if n in numbers)
    return ["/usr/bin/python3", "-c", _CODE, json.dumps(nrs), str(max(numbers.values())), *argv]
