"""What the docs tell a user to install, read as a new user reads it: no instruction installs
gpuwatchd by name from a package index (none holds it: the wheels are built from this repository,
docs/packaging.md), and every paragraph about what goes into a training image or pod names the
``gpuwatchd-client`` wheel (standard library only), not the daemon's wheel, whose dependencies
(py-spy, PyYAML, bcrypt, pyudev, h11, nvidia-ml-py: about 16 MB) a training image does not need
and whose pins conflict with its own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted(
    [
        REPO / "README.md",
        REPO / "client" / "README.md",
        *REPO.glob("docs/*.md"),
        *REPO.glob("deploy/**/*.md"),
        *REPO.glob("deploy/**/*.yaml"),
        *REPO.glob("deploy/**/*.sh"),
        *REPO.glob("grafana/*.md"),
    ]
)
# `pip install gpuwatchd` (or -client) by name: resolved from an index, which has neither
BY_NAME = re.compile(r"pip3? install\s+(?:-\S+\s+)*gpuwatchd(?:-client|\[[^\]]*\])?(?=[\s`'\")]|$)")
# what goes into a training image or pod: "the image", "training image", "in the image" ...
TRAINING_IMAGE = re.compile(
    r"training (?:image|pod|environment)|in the image|image has|"
    r"(?:jobs'?|pod's|job's) image",
    re.I,
)
INSTALL = re.compile(r"pip|wheel|install", re.I)
CLIENT = re.compile(r"gpuwatchd[-_]client|client wheel")


def paragraphs(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph; in YAML and shell files, each comment block."""
    lines = path.read_text().splitlines()
    if path.suffix in (".yaml", ".sh"):
        lines = [ln.split("#", 1)[1] if "#" in ln else "" for ln in lines]
    out, start, cur = [], 0, []
    for i, ln in enumerate([*lines, ""], 1):
        if ln.strip():
            start = start or i
            cur.append(ln.strip())
        elif cur:
            out.append((start, " ".join(cur)))
            start, cur = 0, []
    return out


def test_the_files_are_found() -> None:
    assert REPO / "deploy/kubernetes/README.md" in DOCS
    assert REPO / "deploy/kubernetes/training-pod.example.yaml" in DOCS


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_instruction_installs_gpuwatchd_from_an_index(path: Path) -> None:
    bad = [
        (n, m.group(0))
        for n, text in paragraphs(path)
        for m in BY_NAME.finditer(text)
        if not re.search(r"never\W+$", text[: m.start()][-20:])
    ]
    assert bad == [], f"{path}: {bad}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_a_training_image_gets_the_client_wheel(path: Path) -> None:
    bad = [
        (n, text[:160])
        for n, text in paragraphs(path)
        if TRAINING_IMAGE.search(text)
        and INSTALL.search(text)
        and not CLIENT.search(text)
        and not re.search(r"not (?:in|into) the training image", text)
    ]
    assert bad == [], f"{path}: a training image's install that names no gpuwatchd-client: {bad}"


def _build_commands(text: str) -> list[str]:
    """Each `podman build` / `docker buildx build` command of ``text``, continuation lines joined
    (the Containerfile's header comment's leading '#' dropped)."""
    lines = [re.sub(r"^#\s?", "", ln).strip() for ln in text.splitlines()]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [ln for ln in joined.splitlines() if re.match(r"(podman|docker buildx|docker) build ", ln)]


def test_every_documented_image_build_fills_the_oci_labels() -> None:
    """The Containerfile's labels take the revision, the creation time and the timestamp from
    build arguments with no usable default (REVISION=unknown, CREATED empty): a documented build
    command that leaves one out makes an image labelled revision "unknown" or created "" (the
    docker buildx commands did)."""
    cf = (REPO / "Containerfile").read_text()
    final = cf[cf.rindex("\nFROM ") :]
    required = {
        name
        for name, default in re.findall(r"^ARG (\w+)(?:=(.*))?$", final, re.M)
        if default in ("", "unknown") and name != "BASE"
    }
    assert required == {"REVISION", "CREATED", "SOURCE_DATE_EPOCH"}, required
    commands = [
        (path.name, c)
        for path in (REPO / "Containerfile", REPO / "docs/packaging.md")
        for c in _build_commands(path.read_text())
    ]
    assert {c.split()[0] for _, c in commands} == {"podman", "docker"}, commands
    for where, c in commands:
        given = set(re.findall(r"--build-arg (\w+)=", c))
        assert required <= given, (where, c, required - given)
