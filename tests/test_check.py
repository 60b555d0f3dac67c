"""``gpuwatchd check`` end to end through the CLI: real processes, real rank files, real signals;
NVML replayed from the H200 recording with its PIDs mapped onto those processes.

The --kill verification reads a two-cycle recording derived from the H200 one: before the kill the
stale holder is listed, after it is not (what NVML showed on the GPU node once the process died).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.cli import check, main
from gpuwatchd.rank.rankfile import write_rank_file
from gpuwatchd.sources.nvml import NvmlSource
from gpuwatchd.sources.nvml_fixture import RecordedNvml

H200 = Path(__file__).parent / "fixtures" / "nvml" / "h200_orphan_dataloader.json"


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[dict]:
    """A registered rank (recorded PID 447 and the DataLoader ranks 449/450) and a stale holder
    (recorded PID 453) whose wrapper was killed."""
    rank = _sleeper()
    wrapper = subprocess.Popen(
        ["sh", "-c", f"nohup {sys.executable} -c 'import time; time.sleep(120)' >/dev/null 2>&1 & echo $!; wait"],
        stdout=subprocess.PIPE,
    )
    assert wrapper.stdout is not None
    stale = int(wrapper.stdout.readline())
    wrapper.kill()
    wrapper.wait()
    rank_dir = tmp_path / "ranks"
    write_rank_file(
        str(rank_dir),
        {"version": 1, "job_id": "dflash", "world_size": 1, "ranks": [{"rank": 0, "local_rank": 0, "pid": rank.pid}]},
        "dflash.json",
    )
    doc = json.loads(H200.read_text())
    after = copy.deepcopy(doc["cycles"][-1])
    after["devices"][0]["compute"] = [p for p in after["devices"][0]["compute"] if p["pid"] != 453]
    doc["cycles"] = [doc["cycles"][0], after]
    fixture = tmp_path / "nvml.json"
    fixture.write_text(json.dumps(doc))
    pid_map = {447: rank.pid, 449: rank.pid, 450: rank.pid, 453: stale}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"rank_dir: {rank_dir}\nnvml:\n  fixture: {fixture}\n")
    yield {
        "rank": rank,
        "stale": stale,
        "rank_dir": rank_dir,
        "fixture": fixture,
        "pid_map": pid_map,
        "cfg": cfg,
        "tmp": tmp_path,
    }
    with contextlib.suppress(ProcessLookupError):
        os.kill(stale, signal.SIGKILL)
    rank.kill()
    rank.wait()


def _inputs(scene: dict, loop: bool = False) -> check.Inputs:
    from gpuwatchd.config.schema import load_config

    lib = RecordedNvml(json.loads(scene["fixture"].read_text()), pid_map=scene["pid_map"], loop=loop)
    cfg = load_config(str(scene["cfg"]))
    inputs = check.default_inputs(cfg, None, 5.0)
    source = NvmlSource(pynvml=lib)
    inputs.read_nvml = lambda: check.read_with_timeout(source, 5.0)
    return inputs


def test_exit_1_with_a_table_naming_the_stale_pid(scene: dict) -> None:
    out = io.StringIO()
    rc = check.run_check(_inputs(scene), [], out=out)
    text = out.getvalue()
    assert rc == 1
    assert "1 process(es) outside any live job hold GPU memory" in text
    (row,) = [line for line in text.splitlines() if f" {scene['stale']} " in line]
    assert "5.60 GiB" in row and "reparented_to_init" in row and "root" in row
    assert str(scene["rank"].pid) not in text  # the registered rank is not an offender


def test_json_output(scene: dict) -> None:
    out = io.StringIO()
    assert check.run_check(_inputs(scene), ["0"], as_json=True, out=out) == 1
    doc = json.loads(out.getvalue())
    assert doc["status"] == "offenders"
    (o,) = doc["offenders"]
    assert (o["pid"], o["reason"], o["used_memory_bytes"], o["gpu"]) == (
        scene["stale"],
        "reparented_to_init",
        6008340480,
        0,
    )
    assert o["age_seconds"] >= 0


def test_kill_frees_and_verifies_then_second_check_is_clean(scene: dict) -> None:
    inputs = _inputs(scene)
    out = io.StringIO()
    rc = check.run_check(inputs, [], kill=True, grace=5, verify_seconds=5, out=out)
    assert rc == 0, out.getvalue()
    assert f"pid {scene['stale']} terminated" in out.getvalue()
    assert "NVML confirms" in out.getvalue()
    stat = Path(f"/proc/{scene['stale']}/stat")
    # really dead: gone, or a zombie until init reaps it (this host's PID 1 reaps lazily)
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    out = io.StringIO()
    assert check.run_check(inputs, [], out=out) == 0
    assert out.getvalue().startswith("clean:")


def test_kill_reports_failure_when_memory_stays(scene: dict) -> None:
    # NVML keeps listing the PID after it died (driver still holds the memory): not freed
    inputs = _inputs(scene, loop=True)
    lib_doc = json.loads(scene["fixture"].read_text())
    lib_doc["cycles"] = [lib_doc["cycles"][0]]
    source = NvmlSource(pynvml=RecordedNvml(lib_doc, pid_map=scene["pid_map"]))
    inputs.read_nvml = lambda: check.read_with_timeout(source, 5.0)
    out = io.StringIO()
    rc = check.run_check(inputs, [], kill=True, grace=2, verify_seconds=1, as_json=True, out=out)
    doc = json.loads(out.getvalue())
    assert rc == 1 and doc["status"] == "not_freed"
    assert doc["still_holding"][0]["reason"] == "defunct"


def test_sigterm_ignored_gets_sigkill(tmp_path: Path) -> None:
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal,time,sys; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert p.stdout is not None
    p.stdout.readline()
    threading.Thread(target=p.wait, daemon=True).start()  # reap it like init would
    ticks = int(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    t0 = time.monotonic()
    outcome = check.terminate({p.pid: ticks}, check.HostPaths(), grace=0.5)
    assert outcome == {p.pid: "killed"}
    assert 0.5 <= time.monotonic() - t0 < 3
    p.wait(5)
    assert p.returncode == -signal.SIGKILL


def test_cli_exit_codes(scene: dict, capsys: pytest.CaptureFixture[str]) -> None:
    # The recorded PIDs are not mapped through the config path, so use a clean recording there:
    # the idle H200 (no process) -> exit 0; a GPU that does not exist -> exit 2 (usage), on stderr;
    # the not-present document -> exit 3 (NVML cannot be read).
    idle = Path(__file__).parent / "fixtures" / "nvml" / "h200_idle.json"
    cfg = scene["tmp"] / "idle.yaml"
    cfg.write_text(f"rank_dir: {scene['rank_dir']}\nnvml:\n  fixture: {idle}\n")
    assert main(["check", "--config.file", str(cfg)]) == 0
    assert "clean: no process outside a live job holds memory on 1 GPU(s) (0)" in capsys.readouterr().out
    assert main(["check", "--config.file", str(cfg), "--gpus", "7"]) == 2
    err = capsys.readouterr()
    assert err.out == "" and "no single GPU matches '7'" in err.err
    absent = Path(__file__).parent / "fixtures" / "nvml" / "not_present.json"
    cfg.write_text(f"nvml:\n  fixture: {absent}\n")
    assert main(["check", "--config.file", str(cfg), "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "error" and "not present" in doc["error"]


def test_hung_nvml_is_exit_3_within_the_timeout() -> None:
    release = threading.Event()

    class Hung:
        def read(self):  # type: ignore[no-untyped-def]
            release.wait(10)
            return (), ()

    t0 = time.monotonic()
    with pytest.raises(check.CheckError, match=r"did not answer within 0\.3 s") as e:
        check.read_with_timeout(Hung(), 0.3)
    assert time.monotonic() - t0 < 2 and e.value.code == 3
    release.set()
