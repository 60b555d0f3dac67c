"""Heartbeats with no code change (gpuwatchd/rank/autobeat.py, gpuwatchd/rank/run.py, the wheel's .pth file;
issue 22) on real processes, with a torch-free stand-in for ``torch.optim.optimizer`` (torch is not
installed here): a package ``torch`` whose ``optim.optimizer`` has the real API's
``register_optimizer_step_post_hook`` and an SGD that calls the hooks after each ``step()``.

The training script is never changed: it does not import gpuwatchd.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
import zipfile
from pathlib import Path

import distutil
import pytest
from packaging.metadata import Metadata

REPO = Path(__file__).resolve().parents[1]

FAKE_TORCH = {
    "torch/__init__.py": "from torch import optim  # as torch does: optim loads with torch\n",
    "torch/optim/__init__.py": "from torch.optim.optimizer import Optimizer\nfrom torch.optim.sgd import SGD\n",
    "torch/optim/optimizer.py": """
        _global_optimizer_post_hooks = {}

        def register_optimizer_step_post_hook(hook):
            _global_optimizer_post_hooks[len(_global_optimizer_post_hooks)] = hook

        class Optimizer:
            def __init__(self, params, lr):
                self.params, self.lr = params, lr

            def step(self):
                self._step()
                for hook in _global_optimizer_post_hooks.values():
                    hook(self, (), {})
    """,
    "torch/optim/sgd.py": """
        from torch.optim.optimizer import Optimizer

        class SGD(Optimizer):
            def _step(self):  # minimise sum(p^2): a real update rule on Python floats
                self.params[:] = [p - self.lr * 2 * p for p in self.params]
    """,
}

TRAIN = """
    import sys, time
    import torch
    params = [1.0, -2.0, 3.0]
    opt = torch.optim.SGD(params, lr=0.1)
    steps = int(sys.argv[1])
    for _ in range(steps):
        opt.step()
        time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
    print(f"done {steps} loss {sum(p * p for p in params):.6f} gpuwatchd {'gpuwatchd' in sys.modules}",
          flush=True)
    if sys.argv[3:] == ["hang"]:
        time.sleep(3600)  # stops stepping: the heartbeat stops with it
"""


@pytest.fixture
def world(tmp_path: Path) -> dict[str, object]:
    lib = tmp_path / "lib"
    for name, text in FAKE_TORCH.items():
        (lib / name).parent.mkdir(parents=True, exist_ok=True)
        (lib / name).write_text(textwrap.dedent(text))
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    rank_dir = tmp_path / "ranks"
    rank_dir.mkdir()
    job = f"autobeat-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUWATCH", "RANK", "SLURM_", "OMPI_"))}
    env.update(
        PYTHONPATH=str(lib),
        GPUWATCH_RANK_DIR=str(rank_dir),
        TORCHELASTIC_RUN_ID=job,
        RANK="3",
        LOCAL_RANK="1",
        WORLD_SIZE="4",
    )
    return {"tmp": tmp_path, "env": env, "job": job, "rank_dir": rank_dir}


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def _rank_file(world: dict) -> dict:
    (path,) = list(Path(world["rank_dir"]).glob("*.json"))
    return json.loads(path.read_text())


def test_launcher_shim_registers_and_beats(world: dict) -> None:
    out = _run([sys.executable, "-m", "gpuwatchd.rank.run", "train.py", "5"], world["env"], world["tmp"])
    assert "done 5 loss 1.503239" in out  # the script ran as itself, its argv intact
    doc = _rank_file(world)
    assert doc["job_id"] == world["job"] and doc["world_size"] == 4
    (entry,) = doc["ranks"]
    assert entry["rank"] == 3 and entry["local_rank"] == 1
    hb = Path(entry["heartbeat"])
    assert hb.parent == world["rank_dir"]
    assert hb.read_text().strip() == "1"  # the first step beat; the next four within a second did not


def test_shim_runs_a_module_too(world: dict) -> None:
    _run([sys.executable, "-m", "gpuwatchd.rank.run", "-m", "train", "4", "0.4"], world["env"], world["tmp"])
    (entry,) = _rank_file(world)["ranks"]
    # steps 0.4 s apart: beats at step 1 and at the first step a second later (4, or 3 when slow)
    assert int(Path(entry["heartbeat"]).read_text()) in (3, 4)


@pytest.mark.parametrize("missing", ["rank_dir", "launcher"])
def test_never_fails_the_job(world: dict, missing: str) -> None:
    env = dict(world["env"])
    if missing == "rank_dir":
        (world["tmp"] / "a-file").write_text("")  # a rank directory that cannot be made
        env["GPUWATCH_RANK_DIR"] = str(world["tmp"] / "a-file" / "ranks")
    else:
        for k in ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
            env.pop(k)
    out = _run([sys.executable, "-m", "gpuwatchd.rank.run", "train.py", "20"], env, world["tmp"])
    assert "done 20 loss" in out
    assert out.count("could not register rank") == 1  # one warning, not one per step
    assert not list(Path(world["rank_dir"]).glob("*.json"))


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv whose site-packages holds the built wheel's files (``python -m build``, once per
    run: tests/distutil.py), unpacked as pip would place them, the .pth file at its top. The rank
    side needs only the standard library, so no dependency is installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True, timeout=120)
    (site,) = (tmp / "venv/lib").glob("python3*/site-packages")
    wheel, _ = distutil.build_dist()
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site)
    assert (site / "gpuwatchd-heartbeat.pth").is_file()
    return tmp / "venv/bin/python"


def test_wheel_pth_beats_only_when_asked(world: dict, wheel_env: Path) -> None:
    env = dict(world["env"])
    out = _run([str(wheel_env), "train.py", "3"], env, world["tmp"])
    assert "gpuwatchd False" in out  # not asked: the .pth imported nothing
    assert not list(Path(world["rank_dir"]).glob("*.json"))
    env["GPUWATCHD_HEARTBEAT"] = "1"
    out = _run([str(wheel_env), "train.py", "3"], env, world["tmp"])
    assert "done 3" in out
    (entry,) = _rank_file(world)["ranks"]
    assert entry["rank"] == 3 and Path(entry["heartbeat"]).read_text().strip() == "1"


# What a training process imports of gpuwatchd, all of it (tools/build_client.py's CLIENT_FILES).
CLIENT_MODULES = (
    "gpuwatchd",
    "gpuwatchd.rank.autobeat",
    "gpuwatchd.rank.run",
    "gpuwatchd.rank.api",
    "gpuwatchd.rank.rankfile",
    "gpuwatchd.rank.cuda_oom",
    "gpuwatchd.rank.flight_recorder",
)
ONLY_STDLIB = f"""
import sys, importlib
for m in {CLIENT_MODULES!r}:
    importlib.import_module(m)
import gpuwatchd
assert callable(gpuwatchd.register_rank) and callable(gpuwatchd.heartbeat)
print(sorted({{m.split(".")[0] for m in sys.modules}} - set(sys.stdlib_module_names) - {{"__main__"}}))
"""


@pytest.fixture(scope="module")
def client_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bare venv (no pip, no setuptools: nothing) into which pip installs gpuwatchd-client's
    wheel (tools/build_client.py) with its dependencies resolved and no index: it installs only
    because it has none."""
    tmp = tmp_path_factory.mktemp("client")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True, timeout=120)
    python = tmp / "venv/bin/python"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-index",
            "--disable-pip-version-check",
            str(distutil.build_client()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return python


def test_the_client_wheel_alone_runs_the_rank_side(world: dict, client_env: Path) -> None:
    """A training image's venv with gpuwatchd-client and nothing else: one distribution, every
    in-process module imports, and nothing but the standard library comes with them; the rank
    API, the zero-code heartbeat and the launcher shim work there."""
    wheel = distutil.build_client()
    with zipfile.ZipFile(wheel) as whl:
        raw = whl.read(f"gpuwatchd_client-{distutil.version()}.dist-info/METADATA")
    meta = Metadata.from_email(raw, validate=True)  # the parser pip and twine use
    assert (meta.name, meta.requires_dist, meta.license_expression) == ("gpuwatchd-client", None, "Apache-2.0")
    listed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(client_env),
            "list",
            "--format",
            "json",
            "--disable-pip-version-check",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert [d["name"] for d in json.loads(listed.stdout)] == ["gpuwatchd-client"]
    (site,) = (client_env.parent.parent / "lib").glob("python3*/site-packages")
    size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file())
    # measured: 172,663 B with pip's byte code (docs/packaging.md); the daemon's wheel with its
    # six dependencies adds 16.1 MB to the same bare venv
    assert size < 1_000_000, size
    env = {k: v for k, v in world["env"].items() if k != "PYTHONPATH"}  # not even the fake torch
    out = subprocess.run(
        [str(client_env), "-I", "-c", ONLY_STDLIB], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "['gpuwatchd']", out
    # the launcher shim, then the .pth file: each registers the rank and beats
    _run([str(client_env), "-m", "gpuwatchd.rank.run", "train.py", "3"], world["env"], world["tmp"])
    (entry,) = _rank_file(world)["ranks"]
    assert entry["rank"] == 3 and Path(entry["heartbeat"]).read_text().strip() == "1"
    for f in Path(world["rank_dir"]).iterdir():
        f.unlink()
    out = _run([str(client_env), "train.py", "3"], {**world["env"], "GPUWATCHD_HEARTBEAT": "1"}, world["tmp"])
    assert "done 3" in out and _rank_file(world)["job_id"] == world["job"]


def test_the_daemon_wheel_cannot_install_so(tmp_path: Path) -> None:
    """Why the client is its own distribution: the daemon's wheel in the same bare venv, with no
    index, stops at its first dependency (a training image would get all six, ~16 MB)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    wheel, _ = distutil.build_dist()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(tmp_path / "venv/bin/python"),
            "install",
            "--no-index",
            "--disable-pip-version-check",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "No matching distribution found for" in r.stderr, r.stdout + r.stderr


def test_heartbeat_reaches_the_daemon(world: dict) -> None:
    """Through the real daemon: the rank's step is exported while it steps, and when it stops
    stepping it is paged with ``method: heartbeat``."""
    from daemonutil import DaemonProc, write_config

    home = world["tmp"] / "d"
    home.mkdir()
    cfg_path, cfg = write_config(home, rank_dir=str(world["rank_dir"]), stall={"after_seconds": 1.5})
    p = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd.rank.run", "train.py", "25", "0.1", "hang"],
        env=world["env"],
        cwd=world["tmp"],
        stdout=subprocess.PIPE,
        text=True,
    )
    d = DaemonProc(cfg_path, cfg)
    try:
        d.wait_for(
            lambda: (d.value("gpuwatch_rank_step", job_id=world["job"], rank="3") or 0) >= 2,
            timeout=20,
            what="the rank's heartbeat step",
        )

        def paged() -> list[dict]:
            state = json.loads((Path(cfg["state_dir"]) / "state.json").read_text())
            return [f for f in state["findings"] if f["kind"] == "rank_stalled" and f["job_id"] == world["job"]]

        d.wait_for(lambda: bool(paged()), timeout=20, what="rank_stalled once the steps stop")
        (f,) = paged()
        assert f["evidence"]["method"] == "heartbeat" and f["rank"] == "3"
    finally:
        assert d.stop() == 0
        p.kill()
        p.wait()


# What a bare interpreter start-up of the wheel's venv may import more with GPUWATCHD_HEARTBEAT=1:
# the finder's module and its two packages (which import nothing), nothing else (typing alone took
# 5 ms of the 8.1 ms).
STARTUP_EXTRA = {"gpuwatchd", "gpuwatchd.rank", "gpuwatchd.rank.autobeat"}


def test_the_pth_file_costs_three_tiny_modules_at_start_up(world: dict, wheel_env: Path) -> None:
    probe = "import sys; print(' '.join(sorted(sys.modules)))"
    env = {k: v for k, v in world["env"].items() if k != "PYTHONPATH"}
    base = set(_run([str(wheel_env), "-c", probe], env, world["tmp"]).split())
    env["GPUWATCHD_HEARTBEAT"] = "1"
    on = set(_run([str(wheel_env), "-c", probe], env, world["tmp"]).split())
    assert on - base == STARTUP_EXTRA, sorted(on - base)
    assert "typing" not in on
