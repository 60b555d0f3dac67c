"""The flight-recorder answer's bounds cost linear time on adversarial input: an unterminated run
of escaped quotes (``"`` + ``\\"`` x 131,000, 262,001 bytes, under the 256 KiB cap) froze the
daemon's cycle for about 6.5 minutes, because the nesting check's string pattern failed at every
quote and rescanned to the end (offline: 8 KB 0.18 s, 16 KB 0.72 s, 32 KB 2.86 s). Each shape runs
in a child process with a hard time-out so that the old code fails the bound instead of hanging
the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpuwatchd.rank.flight_recorder import MAX_BYTES
from gpuwatchd.sources import flight_recorder_files as frf

N = 131_000
# name -> (Python expression of the bytes, all at most MAX_BYTES; the bound in seconds): the
# unterminated shapes are scanned once (1-3 ms here), the last is valid JSON of 43,000 strings whose
# parse is real work (about 35 ms here)
SHAPES = {
    "escaped quotes, unterminated": ("b'\"' + b'\\\\\"' * N", 0.1),
    "backslash runs, unterminated": ("b'\"' + b'\\\\' * (2 * N - 1)", 0.1),
    "quote then escapes and brackets": ("b'[\"' + b'\\\\\"[{' * (N // 2)", 0.1),
    "many short unterminated strings": ("b'\"a\\\\' * (N // 2)", 0.1),
    "many terminated strings in brackets": ("b'[' + b'\"\\\\\"\",' * (N // 3) + b'1]'", 0.5),
}
CHILD = """
import sys, time
from gpuwatchd.sources.flight_recorder_files import loads_answer
N = {n}
raw = {expr}
assert len(raw) <= {cap}, len(raw)
best = 1e9
for _ in range(5):  # the least of five: a busy machine preempts one run, never the five
    t = time.perf_counter()
    try:
        loads_answer(raw)
    except ValueError:
        pass
    best = min(best, time.perf_counter() - t)
print(len(raw), best)
"""


@pytest.mark.parametrize("name", list(SHAPES))
def test_an_adversarial_answer_is_bounded_in_linear_time(name: str) -> None:
    expr, bound = SHAPES[name]
    code = CHILD.format(n=N, expr=expr, cap=MAX_BYTES)
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: the check ran past 60 s (quadratic)")
    size, seconds = int(out[0]), float(out[1])
    assert size > 170_000
    assert seconds < bound, f"{name}: {size} bytes took {seconds:.3f} s"


def test_larger_than_the_cap_is_refused_before_any_pattern() -> None:
    with pytest.raises(ValueError, match="larger than"):
        frf.loads_answer(b'"' + b'\\"' * (MAX_BYTES // 2 + 1))


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ('{"a": "[[[{{{", "b": [1, [2, ["\\"]]"]]]}', 4),
        ('["\\\\", [["x\\\\\\"]"]]]', 3),
        ('"[[["', 0),
        ("[" * 17 + "]" * 17, 17),
    ],
)
def test_the_nesting_check_skips_brackets_inside_strings(text: str, depth: int) -> None:
    json.loads(text)  # each text is valid JSON
    assert frf._nesting_within(text.encode(), depth)
    assert not frf._nesting_within(text.encode(), depth - 1) or depth == 0
