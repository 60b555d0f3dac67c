from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.paths import HostPaths
from gpuwatchd.rank.api import build_document, heartbeat, register_rank, unregister_rank
from gpuwatchd.rank.rankfile import (
    MAX_FILE_BYTES,
    RankFileError,
    claim_from_env,
    loads_strict,
    parse_rank_document,
    write_rank_file,
)
from gpuwatchd.sources.discovery import discover
from gpuwatchd.sources.procfs import ProcfsReader
from gpuwatchd.sources.rankfiles import RankFileReader

REPO = Path(__file__).resolve().parent.parent


def doc(**kw: object) -> dict:
    base: dict = {
        "version": 1,
        "job_id": "llm-7",
        "world_size": 16,
        "ranks": [
            {
                "rank": 3,
                "local_rank": 3,
                "pid": 1234,
                "gpus": ["GPU-0f1e2d3c-aaaa", 3],
                "heartbeat": "/run/gpuwatch/ranks/llm-7.3.hb",
            }
        ],
    }
    base.update(kw)
    return base


def test_valid_document() -> None:
    (e,) = parse_rank_document(doc(), "/x.json", 0)
    assert (e.job_id, e.rank, e.local_rank, e.pid, e.world_size) == ("llm-7", 3, 3, 1234, 16)
    assert e.gpus == ("GPU-0f1e2d3c-aaaa", "3")
    assert e.owner_uid == 0 and e.source == "rankfile"


@pytest.mark.parametrize(
    "bad,msg",
    [
        (doc(version=2), "version"),
        (doc(job_id="has space"), "job_id"),
        (doc(job_id="x" * 129), "job_id"),
        (doc(job_id=""), "job_id"),
        (doc(ranks=[]), "non-empty"),
        (doc(ranks=[{"rank": 16, "pid": 1}]), "rank"),
        (doc(ranks=[{"rank": 0, "pid": 0}]), "pid"),
        (doc(ranks=[{"rank": 0, "pid": True}]), "pid"),
        (doc(ranks=[{"rank": 0, "pid": 1}, {"rank": 0, "pid": 2}]), "twice"),
        (doc(ranks=[{"rank": 0, "pid": 1, "gpus": ["x; rm -rf"]}]), "GPU"),
        (doc(ranks=[{"rank": 0, "pid": 1, "heartbeat": "relative"}]), "heartbeat"),
        (doc(ranks=[{"rank": 0, "pid": 1, "env": {"SECRET": "x"}}]), "unknown key"),
        (doc(extra=1), "unknown key"),
        ([1, 2], "object"),
        (doc(ranks=[[[[[[[[[[1]]]]]]]]]]), "nested"),
    ],
)
def test_invalid_documents(bad: object, msg: str) -> None:
    with pytest.raises(RankFileError, match=msg):
        parse_rank_document(bad)


def test_atomic_write_and_reader_cache(tmp_path: Path) -> None:
    path = write_rank_file(str(tmp_path), doc(), "llm-7.3.json")
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    assert [p.name for p in tmp_path.iterdir()] == ["llm-7.3.json"]  # no temp file left behind
    reader = RankFileReader(str(tmp_path))
    entries, bad = reader.scan()
    assert [e.rank for e in entries] == [3] and bad == []
    assert reader.scan()[0] is not None
    os.unlink(path)
    assert reader.scan() == ([], [])
    with pytest.raises(RankFileError):
        write_rank_file(str(tmp_path), doc(version=3), "x.json")
    with pytest.raises(RankFileError):
        write_rank_file(str(tmp_path), doc(), "../escape.json")


def test_refusals(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(doc()))
    (tmp_path / "big.json").write_bytes(b" " * (MAX_FILE_BYTES + 1))
    (tmp_path / "link.json").symlink_to(good)
    os.link(good, tmp_path / "hard.json")
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "ignored.txt").write_text("not a rank file")
    entries, bad = RankFileReader(str(tmp_path)).scan()
    reasons = {Path(b.path).name: b.reason for b in bad}
    assert "larger than" in reasons["big.json"]
    assert "symbolic link" in reasons["link.json"]
    # good.json and hard.json are the same inode with two links: both refused
    assert "hard links" in reasons["hard.json"] and "hard links" in reasons["good.json"]
    assert "not a regular file" in reasons["dir.json"]
    assert "ignored.txt" not in reasons and entries == []


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2048) | st.text(max_size=512).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_arbitrary_bytes_are_a_bad_file_never_an_exception(tmp_path: Path, data: bytes) -> None:
    d = tmp_path / "fuzz"
    d.mkdir(exist_ok=True)
    (d / "x.json").write_bytes(data)
    entries, bad = RankFileReader(str(d)).scan()
    assert len(entries) + len(bad) >= 1 or data.strip() == b""  # parsed, or refused with a reason
    assert all(b.reason for b in bad)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda c: (
        st.lists(c, max_size=3)
        | st.dictionaries(
            st.sampled_from(["version", "job_id", "ranks", "rank", "pid", "gpus", "world_size", "local_rank", "x"]),
            c,
            max_size=5,
        )
    ),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_any_json_document_parses_or_raises_rankfileerror(value: object) -> None:
    try:
        entries = parse_rank_document(value)
    except RankFileError as e:
        assert str(e)
    else:
        assert entries and all(e.pid > 0 for e in entries)


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "llm-7"}, ("llm-7", 3, 1, 8)),
        (
            {"RANK": "3", "TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0"},
            ("4242", 3, None, None),
        ),
        (
            {
                "SLURM_PROCID": "5",
                "SLURM_LOCALID": "1",
                "SLURM_JOB_ID": "99",
                "SLURM_STEP_ID": "0",
                "SLURM_NTASKS": "8",
            },
            ("99.0", 5, 1, 8),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_MCA_ess_base_jobid": "123",
            },
            ("123", 2, 0, 4),
        ),
        ({"RANK": "1"}, None),  # RANK alone (no launcher) is not enough
        ({"SLURM_PROCID": "x", "SLURM_JOB_ID": "1"}, None),
    ],
)
def test_claim_from_env(env: dict[str, str], expected: tuple | None) -> None:
    assert claim_from_env(env, ("torchrun", "slurm", "openmpi")) == expected


def test_claim_respects_configured_launchers() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_JOB_ID": "99"}
    assert claim_from_env(env, ("torchrun",)) is None


def test_discovery_from_real_processes_skips_inheriting_children() -> None:
    # A "rank" with a DataLoader-like child that inherits its environment.
    code = (
        "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(30)']); print(c.pid, flush=True); time.sleep(30)"
    )
    job = f"disc-test-{os.getpid()}"  # unique: other processes on the host may run this test too
    env = {**os.environ, "RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": job}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        child = int(p.stdout.readline())
        found = [e for e in discover(ProcfsReader(HostPaths()), ("torchrun",)) if e.job_id == job]
        assert [(e.rank, e.pid, e.source) for e in found] == [(4, p.pid, "environ")]
        assert child != p.pid and found[0].start_ticks is not None
    finally:
        p.kill()
        p.wait()


def test_python_api_register_heartbeat_unregister(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {
        "RANK": "2",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "4",
        "TORCHELASTIC_RUN_ID": "api-job",
        "CUDA_VISIBLE_DEVICES": "5,6",
    }.items():
        monkeypatch.setenv(k, v)
    path = register_rank(rank_dir=str(tmp_path), cuda_oom_hook=False)
    assert path is not None
    reader = RankFileReader(str(tmp_path))
    (e,) = reader.scan()[0]
    assert (e.job_id, e.rank, e.local_rank, e.world_size, e.pid, e.gpus) == ("api-job", 2, 0, 4, os.getpid(), ("5",))
    assert e.start_ticks is not None
    # no heartbeat path until the script beats: one that never calls heartbeat() is not "stalled"
    assert e.heartbeat is None
    heartbeat(16)
    (e,) = reader.scan()[0]
    assert e.heartbeat == str(tmp_path / "api-job.2.hb")
    before = os.stat(e.heartbeat).st_mtime_ns
    time.sleep(0.01)
    heartbeat(17)
    assert os.stat(e.heartbeat).st_mtime_ns > before
    assert Path(e.heartbeat).read_text().strip() == "17"
    assert unregister_rank(rank_dir=str(tmp_path))
    assert list(tmp_path.glob("*.json")) == []


def test_register_without_launcher_env_warns_not_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert register_rank(rank_dir=str(tmp_path), cuda_oom_hook=False) is None
    with pytest.raises(RankFileError):
        register_rank(rank_dir=str(tmp_path), strict=True, cuda_oom_hook=False)


def test_register_cli_then_unregister(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "register",
            "--rank-dir",
            str(tmp_path),
            "--job-id",
            "cli-job",
            "--rank",
            "1",
            "--pid",
            str(os.getpid()),
            "--gpus",
            "0,1",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    written = json.loads(Path(r.stdout.strip()).read_text())
    assert written == build_document(
        "cli-job", 1, os.getpid(), gpus=["0", "1"], start_ticks=written["ranks"][0]["start_ticks"]
    )
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "register",
            "--rank-dir",
            str(tmp_path),
            "--job-id",
            "bad job",
            "--rank",
            "1",
            "--pid",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "job_id" in bad.stderr
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "unregister",
            "--rank-dir",
            str(tmp_path),
            "--job-id",
            "cli-job",
            "--rank",
            "1",
        ],
        check=True,
    )
    assert list(tmp_path.glob("*.json")) == []


def test_schema_document_matches_parser() -> None:
    schema = json.loads((REPO / "gpuwatchd" / "rank" / "rankfile.schema.json").read_text())
    assert set(schema["properties"]) == {"version", "job_id", "world_size", "ranks"}
    assert set(schema["properties"]["ranks"]["items"]["properties"]) == {
        "rank",
        "local_rank",
        "pid",
        "gpus",
        "heartbeat",
        "start_ticks",
        "pid_ns",
    }
    from gpuwatchd.rank.rankfile import RANK_KEYS

    assert set(schema["properties"]["ranks"]["items"]["properties"]) == RANK_KEYS
    from gpuwatchd.rank.rankfile import JOB_ID_RE

    # The same pattern, ECMA-262 "$" (no final newline) written "\\Z" in Python.
    assert schema["properties"]["job_id"]["pattern"] == JOB_ID_RE.pattern.replace("\\Z", "$")


# --- the reader against its published schema, compiled by fastjsonschema ----------------------

_SCHEMA = REPO / "gpuwatchd" / "rank" / "rankfile.schema.json"


def _compiled() -> Any:
    import fastjsonschema  # dev extra: the oracle, never imported by the daemon

    return fastjsonschema.compile(json.loads(_SCHEMA.read_text()))


_ODD_TEXT = st.sampled_from(
    [
        "llm-7",
        "llm-7\n",
        "\nllm-7",
        "a" * 128,
        "a" * 129,
        "",
        "job id",
        "j\u00e9",
        "job:1@x.y-z_",
        "\u0663",
        "3\n",
        "0",
        "999",
        "1000",
        "-1",
        "GPU-0a1b",
        "MIG-GPU-1/2",
        "GPU-" + "a" * 81,
        "/abs/hb",
        "rel/hb",
        "/abs/\x07",
        "/abs/\u00a0x",
        "/" + "x" * 4096,
    ]
) | st.text(max_size=8)
_ODD_INT = st.sampled_from(
    [
        0,
        1,
        -1,
        2,
        7,
        999,
        1000,
        65536,
        65537,
        (1 << 20) - 1,
        1 << 20,
        1 << 22,
        (1 << 22) + 1,
        1 << 40,
        (1 << 62),
        (1 << 62) + 1,
        (1 << 32) - 1,
        1 << 32,
    ]
) | st.integers(-5, 5000)
_ODD = _ODD_INT | _ODD_TEXT | st.sampled_from([True, None, 1.0, 2.5, [], {}])


@st.composite
def _rank_docs(draw: st.DrawFn) -> dict:
    ranks = []
    for _ in range(draw(st.integers(1, 3))):
        r: dict[str, Any] = {"rank": draw(_ODD_INT | st.just(0)), "pid": draw(_ODD_INT | st.just(4242))}
        for key in ("local_rank", "start_ticks", "pid_ns"):
            if draw(st.booleans()):
                r[key] = draw(_ODD_INT)
        if draw(st.booleans()):
            r["gpus"] = draw(st.lists(_ODD_INT | _ODD_TEXT, max_size=3))
        if draw(st.booleans()):
            r["heartbeat"] = draw(_ODD_TEXT)
        if draw(st.integers(0, 9)) == 0:
            r[draw(st.sampled_from(["rank", "pid", "gpus", "extra"]))] = draw(_ODD)
        ranks.append(r)
    doc: dict[str, Any] = {"version": 1, "job_id": draw(_ODD_TEXT | st.just("llm-7")), "ranks": ranks}
    if draw(st.booleans()):
        doc["world_size"] = draw(_ODD_INT)
    if draw(st.integers(0, 9)) == 0:
        doc[draw(st.sampled_from(["version", "job_id", "ranks", "extra"]))] = draw(_ODD)
    return doc


@settings(max_examples=600, deadline=None)
@given(_rank_docs())
def test_every_file_the_reader_accepts_passes_the_shipped_schema(doc: dict) -> None:
    """The reader is stricter than its schema where a schema cannot say it (a rank listed twice,
    rank < world_size, duplicate keys, pid 1.0), never laxer: a launcher that validates against
    the published schema writes only files the daemon may refuse for those reasons."""
    import fastjsonschema

    text = json.dumps(doc)
    try:
        parse_rank_document(loads_strict(text))
    except (RankFileError, ValueError):
        return
    try:
        _compiled()(json.loads(text))
    except fastjsonschema.JsonSchemaValueException as e:
        raise AssertionError(f"the reader accepts what the schema refuses ({e.message}): {text}") from e


@pytest.mark.parametrize("field", ["job_id", "gpu"])
def test_a_final_newline_is_refused_by_reader_and_schema_alike(field: str) -> None:
    import fastjsonschema

    doc: dict[str, Any] = {"version": 1, "job_id": "llm-7", "ranks": [{"rank": 0, "pid": 7, "gpus": ["3"]}]}
    if field == "job_id":
        doc["job_id"] = "llm-7\n"
    else:
        doc["ranks"][0]["gpus"] = ["3\n"]
    with pytest.raises(RankFileError):
        parse_rank_document(doc)
    with pytest.raises(fastjsonschema.JsonSchemaValueException):
        _compiled()(doc)


@pytest.mark.parametrize(
    "doc",
    [
        {"version": 1, "job_id": "j", "ranks": [{"rank": 0, "pid": 1 << 40}]},
        {"version": 1, "job_id": "j", "ranks": [{"rank": 0, "pid": 12345678901234567890123456789}]},
        {"version": 1, "job_id": "j", "ranks": [{"rank": 0, "pid": 7, "heartbeat": "relative/hb"}]},
        {"version": 1, "job_id": "j", "ranks": [{"rank": 0, "pid": 7, "gpus": ["\u0663"]}]},
        {"version": 1, "job_id": "j", "world_size": 1 << 21, "ranks": [{"rank": 0, "pid": 7}]},
    ],
)
def test_the_schema_states_the_maxima_the_reader_enforces(doc: dict) -> None:
    import fastjsonschema

    with pytest.raises(RankFileError):
        parse_rank_document(doc)
    with pytest.raises(fastjsonschema.JsonSchemaValueException):
        _compiled()(doc)
