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
SHAPES = {  # name -> Python expression of the bytes, all at most MAX_BYTES
    "escaped quotes, unterminated": "b'\"' + b'\\\\\"' * N",
    "backslash runs, unterminated": "b'\"' + b'\\\\' * (2 * N - 1)",
    "quote then escapes and brackets": "b'[\"' + b'\\\\\"[{' * (N // 2)",
    "many short unterminated strings": "b'\"a\\\\' * (N // 2)",
    "many terminated strings in brackets": "b'[' + b'\"\\\\\"\",' * (N // 3) + b'1]'",
}
CHILD = """
import sys, time
from gpuwatchd.sources.flight_recorder_files import loads_answer
N = {n}
raw = {expr}
assert len(raw) <= {cap}, len(raw)
t = time.perf_counter()
try:
    loads_answer(raw)
except ValueError:
    pass
print(len(raw), time.perf_counter() - t)
"""


@pytest.mark.parametrize("name", list(SHAPES))
def test_an_adversarial_answer_is_bounded_in_linear_time(name: str) -> None:
    code = CHILD.format(n=N, expr=SHAPES[name], cap=MAX_BYTES)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=20, check=True).stdout.split()
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: the check ran past 20 s (quadratic)")
    size, seconds = int(out[0]), float(out[1])
    assert size > 170_000
    assert seconds < 0.1, f"{name}: {size} bytes took {seconds:.3f} s"


def test_larger_than_the_cap_is_refused_before_any_pattern() -> None:
    with pytest.raises(ValueError, match="larger than"):
        frf.loads_answer(b'"' + b'\\"' * (MAX_BYTES // 2 + 1))


@pytest.mark.parametrize(("text", "depth"), [
    ('{"a": "[[[{{{", "b": [1, [2, ["\\"]]"]]]}', 4),
    ('["\\\\", [["x\\\\\\"]"]]]', 3),
    ('"[[["', 0),
    ("[" * 17 + "]" * 17, 17),
])
def test_the_nesting_check_skips_brackets_inside_strings(text: str, depth: int) -> None:
    json.loads(text)  # each text is valid JSON
    assert frf._nesting_within(text.encode(), depth)
    assert not frf._nesting_within(text.encode(), depth - 1) or depth == 0
