"""Issue 37 R5: launcher variables (RANK, SLURM_PROCID, ...) are numbers of ASCII digits only.

``str.isdigit()`` is true for "²" (and int() refuses it) and for "٣" (which int() reads as 3). On
a7db82e one process of any user with ``RANK=²`` in its environment made ``claim_from_env`` raise
ValueError out of rank discovery at every pass (the discovered list froze), and crashed a
zero-code-heartbeat job at its first optimizer step. Real processes, a real second user.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from userutil import setpriv, shared_rank_world, users_fixture

from gpuwatchd.paths import HostPaths
from gpuwatchd.rank.rankfile import claim_from_env
from gpuwatchd.sources.discovery import discover
from gpuwatchd.sources.procfs import ProcfsReader

U1 = "gw-r5-u1"
REPO = Path(__file__).resolve().parent.parent
SLEEP = ["/usr/bin/python3", "-c", "import time; time.sleep(120)"]
ODD = ["²", "٣", "１", "3²", "0x1", "+1", "1_000", " 7\u00a0"]


@pytest.mark.parametrize("value", ODD)
def test_only_ascii_digits_name_a_rank(value: str) -> None:
    for env in (
        {"TORCHELASTIC_RUN_ID": "j", "RANK": value},
        {"SLURM_JOB_ID": "5", "SLURM_PROCID": value},
        {"OMPI_COMM_WORLD_RANK": value},
    ):
        assert claim_from_env(env, ("torchrun", "slurm", "openmpi")) is None
    assert claim_from_env({"TORCHELASTIC_RUN_ID": "j", "RANK": "3", "LOCAL_RANK": value}, ("torchrun",)) == (
        "j",
        3,
        None,
        None,
    )


user = users_fixture(U1)


def test_another_users_odd_rank_does_not_stop_discovery(user: int) -> None:
    job = f"r5-{uuid.uuid4().hex[:8]}"
    base = {"PATH": "/usr/bin:/bin", "TORCHELASTIC_RUN_ID": job}
    odd = subprocess.Popen([*setpriv(U1), *SLEEP], env={**base, "RANK": "²"})
    mine = subprocess.Popen(SLEEP, env={**base, "TORCHELASTIC_RUN_ID": f"{job}-root", "RANK": "0"})
    try:
        found = discover(ProcfsReader(HostPaths()), ("torchrun", "slurm", "openmpi"))
    finally:
        for p in (odd, mine):
            p.kill()
            p.wait()
    assert [(e.job_id, e.rank, e.pid) for e in found if e.job_id.startswith(job)] == [(f"{job}-root", 0, mine.pid)]


def test_a_zero_code_heartbeat_job_with_an_odd_rank_trains_on(user: int) -> None:
    """The job (U1's) runs to its end with one warning, instead of dying at its first step."""
    with shared_rank_world("gw-r5-") as world:
        lib = world / "lib" / "torch" / "optim"
        lib.mkdir(parents=True)
        (lib.parent / "__init__.py").write_text("from torch import optim\n")
        (lib / "__init__.py").write_text("from torch.optim.optimizer import Optimizer\n")
        (lib / "optimizer.py").write_text(
            textwrap.dedent("""
            _hooks = []
            def register_optimizer_step_post_hook(hook):
                _hooks.append(hook)
            class Optimizer:
                def step(self):
                    for hook in _hooks:
                        hook(self, (), {})
        """)
        )
        train = world / "train.py"
        train.write_text(
            "import torch.optim\nopt = torch.optim.Optimizer()\nfor _ in range(5):\n    opt.step()\nprint('trained')\n"
        )
        for p in world.rglob("*"):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        env = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": f"{world / 'lib'}:{REPO}",
            "GPUWATCH_RANK_DIR": str(world / "ranks"),
            "TORCHELASTIC_RUN_ID": "r5",
            "RANK": "²",
        }
        out = subprocess.run(
            [
                "setpriv",
                f"--reuid={U1}",
                f"--regid={U1}",
                "--clear-groups",
                "/usr/bin/python3",
                "-m",
                "gpuwatchd.rank.run",
                str(train),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=world,
        )
    assert out.returncode == 0 and "trained" in out.stdout, out.stderr
    assert out.stderr.count("could not register rank") == 1, out.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
