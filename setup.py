"""Only for the wheel's .pth file (issue 22): setuptools' pyproject tables cannot place a file at
the top of site-packages, so build_py copies gpuwatchd/rank/gpuwatchd-heartbeat.pth there. It does
nothing unless GPUWATCHD_HEARTBEAT is set (gpuwatchd/rank/autobeat.py). Everything else is in
pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "gpuwatchd-heartbeat.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("gpuwatchd", "rank", PTH), os.path.join(self.build_lib, PTH))


setup(cmdclass={"build_py": BuildPyWithPth})
