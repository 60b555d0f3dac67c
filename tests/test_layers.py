"""The folder tree is the design: the import contracts of ``gpuwatchd/`` (docs/architecture.md).

An ``ast`` walk over every module, counting module-level *and* function-level imports (and
``importlib.import_module("gpuwatchd...")`` with a literal name), so that a deferred import cannot
hide a cycle or a wrong-way dependency. Contracts:

1. Layers, lowest first; a module imports only its own layer or lower ones.
2. Code that runs inside a rank (``gpuwatchd/__init__.py``, ``gpuwatchd/rank/``, the zero-code
   heartbeat ``gpuwatchd/rank/autobeat.py`` and its launcher ``gpuwatchd/rank/run.py``) reaches, through
   everything it imports, nothing of the daemon, the sources, the web server or prometheus_client.
3. Finding rules are independent of each other: a rule imports ``findings.context`` only.
4. No import cycle, function-level imports included.
5. No I/O in the pure layers: the trackers of ``join/`` and the rules of ``findings/`` make no call
   that touches the host (``open``, the ``os`` file calls, ``os.path``'s stat calls (``getsize``,
   ``exists`` ...), ``subprocess``, ``socket``, ``shutil``, ``tempfile``, ``Path.read_*``/``write_*``)
   and import nothing of ``gpuwatchd.sources``.
6. Narrow rule imports: a rule imports only ``findings.context``, ``model``, ``units`` and ``config``.
7. ``findings.context`` (what every rule imports) reaches no source and no ``subprocess``,
   checked in a fresh interpreter.
8. No module of ``daemon/`` imports a subsystem but the wiring: subsystems meet through the
   cycle's inputs and the shared services (daemon/services.py), never each other.

Each holds of the whole tree, with no exception listed: the value types that cross layers live
in ``model``, the stall tracker's looks in ``sources/stall_looks.py`` (issue 26).

The checker is tested on a small package with one bad import of each kind, so that a contract that
silently stopped checking anything fails here too.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "gpuwatchd"

# Lowest first. A module belongs to the first entry whose prefix names it or a package above it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "core",
        (
            "gpuwatchd.model",
            "gpuwatchd.config",
            "gpuwatchd.paths",
            "gpuwatchd.units",
            "gpuwatchd.escape",
            "gpuwatchd.counters",
            "gpuwatchd.isolation",
            "gpuwatchd.statefile",
            "gpuwatchd.logs",
        ),
    ),
    ("rank", ("gpuwatchd.rank",)),
    ("sources", ("gpuwatchd.sources",)),
    ("events", ("gpuwatchd.events",)),
    # the join's trackers; the findings read their verdicts, join.state runs the rules last
    (
        "join",
        (
            "gpuwatchd.join.orphans",
            "gpuwatchd.join.stall",
            "gpuwatchd.join.kernel_events",
            "gpuwatchd.join.xid_dedup",
            "gpuwatchd.join.rank_claims",
            "gpuwatchd.join.memory_tracker",
            "gpuwatchd.join.oom_history",
            "gpuwatchd.join.bus_lost",
            "gpuwatchd.join",
        ),
    ),
    ("findings", ("gpuwatchd.findings",)),
    ("join.state", ("gpuwatchd.join.state",)),
    ("outputs", ("gpuwatchd.exporter", "gpuwatchd.web")),
    ("daemon", ("gpuwatchd.daemon",)),
    ("cli", ("gpuwatchd.cli", "gpuwatchd.__main__")),
)
RANK_SIDE = ("gpuwatchd", "gpuwatchd.rank")
RANK_FORBIDDEN = (
    "gpuwatchd.daemon",
    "gpuwatchd.sources",
    "gpuwatchd.web",
    "gpuwatchd.exporter",
    "gpuwatchd.cli",
    "prometheus_client",
    "yaml",
)
# (pynvml is allowed: the CUDA-OOM hook snapshots co-tenants at the moment of the error, lazily.)

PURE = ("gpuwatchd.join", "gpuwatchd.findings")
IO_OS_CALLS = frozenset(
    {
        "open",
        "fdopen",
        "stat",
        "lstat",
        "fstat",
        "scandir",
        "listdir",
        "read",
        "write",
        "unlink",
        "remove",
        "replace",
        "rename",
        "makedirs",
        "mkdir",
        "rmdir",
        "readlink",
        "walk",
        "kill",
        "chmod",
        "chown",
        "pipe",
        "fork",
        "system",
        "popen",
    }
)
# os.path's calls that stat the host (os.path.join, basename ... only compute on strings)
IO_OS_PATH_CALLS = frozenset(
    {
        "exists",
        "lexists",
        "isfile",
        "isdir",
        "islink",
        "ismount",
        "getsize",
        "getmtime",
        "getatime",
        "getctime",
        "realpath",
        "samefile",
    }
)
IO_MODULES = frozenset({"subprocess", "socket", "shutil", "tempfile"})
IO_METHODS = frozenset(
    {"read_text", "read_bytes", "write_text", "write_bytes", "iterdir", "mkdir", "unlink", "touch", "glob", "rglob"}
)
RULE_IMPORTS = ("gpuwatchd.findings.context", "gpuwatchd.model", "gpuwatchd.units", "gpuwatchd.config")


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(tree: ast.AST, module: str, is_pkg: bool) -> Iterator[str]:
    pkg = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for a in node.names:
                yield f"{base}.{a.name}"  # a submodule if there is one, else resolved to base
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value


def graph(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between the package's modules, third-party top-level names each module imports)."""
    mods = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    external: dict[str, set[str]] = {m: set() for m in mods}
    top = root.name
    for m, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name in _targets(tree, m, path.name == "__init__.py"):
            if name != top and not name.startswith(top + "."):
                external[m].add(name.split(".")[0])
                continue
            while name not in mods:
                name = name.rpartition(".")[0]
            if name != m:
                edges[m].add(name)
    return edges, external


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer index): the longest prefix wins
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), i)
    return None if best is None else best[1]


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for m, targets in sorted(edges.items()):
        lm = layer_of(m)
        for t in sorted(targets):
            lt = layer_of(t)
            if lm is not None and lt is not None and lt > lm:
                out.append(f"{m} ({LAYERS[lm][0]}) imports {t} ({LAYERS[lt][0]})")
    return out


def rank_violations(edges: dict[str, set[str]], external: dict[str, set[str]]) -> list[str]:
    out = []
    for start in edges:
        if not any(start == r or start.startswith(r + ".") for r in RANK_SIDE[1:]) and start != RANK_SIDE[0]:
            continue
        seen, todo = {start}, [start]
        while todo:
            m = todo.pop()
            for name in sorted(edges[m] | external[m]):
                if any(name == f or name.startswith(f + ".") for f in RANK_FORBIDDEN):
                    out.append(f"{start} reaches {name} (through {m})")
                if name in edges and name not in seen:
                    seen.add(name)
                    todo.append(name)
    return sorted(set(out))


def finding_violations(edges: dict[str, set[str]], pkg: str = "gpuwatchd.findings") -> list[str]:
    out = []
    for m, targets in sorted(edges.items()):
        if m.startswith(pkg + ".") and m != f"{pkg}.context":
            out += [
                f"{m} imports {t}"
                for t in sorted(targets)
                if (t == pkg or t.startswith(pkg + ".")) and t != f"{pkg}.context"
            ]
    return out


def io_calls(path: Path) -> list[str]:
    """The calls in ``path`` that touch the host ("line: what"), by an ``ast`` walk."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        what = ""
        if isinstance(f, ast.Name) and f.id == "open":
            what = "open"
        elif isinstance(f, ast.Attribute):
            base = f.value
            if isinstance(base, ast.Name) and base.id == "os" and f.attr in IO_OS_CALLS:
                what = f"os.{f.attr}"
            elif (
                isinstance(base, ast.Attribute)
                and isinstance(base.value, ast.Name)
                and base.value.id == "os"
                and base.attr == "path"
                and f.attr in IO_OS_PATH_CALLS
            ):
                what = f"os.path.{f.attr}"
            elif isinstance(base, ast.Name) and base.id in IO_MODULES:
                what = f"{base.id}.{f.attr}"
            elif f.attr in IO_METHODS:
                what = f".{f.attr}"
        if what:
            out.append(f"{node.lineno}: {what}")
    return out


def io_violations(root: Path) -> dict[str, list[str]]:
    """Pure-layer modules -> their I/O calls and their imports of sources."""
    edges, external = graph(root)
    top = root.name
    out: dict[str, list[str]] = {}
    for m, path in modules(root).items():
        if not any(m == f"{top}.{p.split('.', 1)[1]}" or m.startswith(f"{top}.{p.split('.', 1)[1]}.") for p in PURE):
            continue
        found = io_calls(path) + [f"imports {t}" for t in sorted(edges[m]) if t.startswith(f"{top}.sources")]
        found += [f"imports {x}" for x in sorted(external[m] & IO_MODULES)]
        if found:
            out[m] = found
    return out


def wide_rules(edges: dict[str, set[str]], pkg: str = "gpuwatchd") -> dict[str, list[str]]:
    """Rules (``findings/*`` but the context and the package) -> what they import beyond
    ``RULE_IMPORTS``."""
    allowed = tuple(a.replace("gpuwatchd", pkg, 1) for a in RULE_IMPORTS)
    out: dict[str, list[str]] = {}
    for m, targets in sorted(edges.items()):
        if not m.startswith(f"{pkg}.findings.") or m == f"{pkg}.findings.context":
            continue
        wide = [t for t in sorted(targets) if not any(t == a or t.startswith(a + ".") for a in allowed)]
        if wide:
            out[m] = wide
    return out


def context_reaches(pythonpath: str | None = None) -> list[str]:
    """What importing ``gpuwatchd.findings.context`` loads of sources/ and subprocess, in a fresh
    interpreter (``pythonpath``: where the package is, for the checker's own test)."""
    import os
    import subprocess

    code = (
        "import sys, gpuwatchd.findings.context; print(sorted(m for m in sys.modules if m == 'subprocess' "
        "or m == 'gpuwatchd.sources' or m.startswith('gpuwatchd.sources.')))"
    )
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
        cwd=pythonpath or None,
    )
    return list(ast.literal_eval(out.stdout.strip()))


def subsystem_modules(root: Path) -> set[str]:
    """The ``daemon/`` modules that define a ``Subsystem`` subclass."""
    out = set()
    for m, path in modules(root).items():
        if not m.startswith(f"{root.name}.daemon."):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id == "Subsystem" for b in node.bases
            ):
                out.add(m)
    return out


def subsystem_imports(root: Path) -> list[str]:
    """``daemon/`` modules, but the wiring, that import a subsystem's module."""
    edges, _ = graph(root)
    subs = subsystem_modules(root)
    wiring = f"{root.name}.daemon.wiring"
    return [
        f"{m} imports {t}"
        for m, targets in sorted(edges.items())
        if m.startswith(f"{root.name}.daemon.") and m != wiring
        for t in sorted(targets & subs)
    ]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def unresolved(root: Path) -> list[str]:
    """Imports of the package that name no module of it (mypy's ignore_missing_imports would not
    say so)."""
    mods = modules(root)
    out = []
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            out += [f"{m}: {n}" for n in names if (n == root.name or n.startswith(root.name + ".")) and n not in mods]
    return out


def test_every_import_names_a_module() -> None:
    assert unresolved(PKG) == []


def test_every_module_has_a_layer() -> None:
    edges, _ = graph(PKG)
    assert [m for m in edges if m != "gpuwatchd" and layer_of(m) is None] == []


def test_imports_point_down_the_layers() -> None:
    edges, _ = graph(PKG)
    assert layer_violations(edges) == []


def test_rank_side_code_imports_nothing_of_the_daemon() -> None:
    edges, external = graph(PKG)
    assert rank_violations(edges, external) == []


def test_finding_rules_are_independent() -> None:
    edges, _ = graph(PKG)
    assert finding_violations(edges) == []


def test_no_import_cycles() -> None:
    edges, _ = graph(PKG)
    assert cycles(edges) == []


def test_no_io_in_the_pure_layers() -> None:
    found = io_violations(PKG)
    assert found == {}


def test_rules_import_only_the_context_model_units_and_config() -> None:
    edges, _ = graph(PKG)
    assert wide_rules(edges) == {}


def test_the_rules_context_reaches_no_source_in_a_fresh_interpreter() -> None:
    assert context_reaches() == []


def test_no_daemon_module_imports_another_subsystem() -> None:
    assert len(subsystem_modules(PKG)) >= 8  # the checker sees the subsystems
    assert subsystem_imports(PKG) == []


def test_the_purity_checkers_catch_planted_violations(tmp_path: Path) -> None:
    """A package with one violation of each of contracts 5-8; each checker must report it, and
    report nothing of the clean modules beside it."""
    root = tmp_path / "gpuwatchd"
    files = {
        "__init__.py": "",
        "model.py": "",
        "units.py": "",
        "events/__init__.py": "",
        "events/log.py": "",
        "sources/__init__.py": "",
        "sources/pyspy.py": "",
        "join/__init__.py": "",
        "join/clean.py": "import os\nx = os.path.join('a', 'b')\n",
        "join/opens.py": "def f(p):\n    with open(p) as fh:\n        return fh.read()\n",
        "join/unlinks.py": "import os\ndef f(p):\n    os.unlink(p)\n",
        "join/sizes.py": "import os\ndef f(p):\n    return os.path.getsize(p)\n",
        "join/spawns.py": "import subprocess\ndef f():\n    subprocess.run(['true'])\n",
        "join/reads.py": "from pathlib import Path\ndef f():\n    return Path('x').read_text()\n",
        "join/uses_source.py": "from gpuwatchd.sources import pyspy\n",
        "findings/__init__.py": "",
        "findings/context.py": "import gpuwatchd.sources.pyspy\n",
        "findings/narrow.py": "from gpuwatchd.findings.context import x\nfrom gpuwatchd import model, units\n",
        "findings/wide.py": "from gpuwatchd.events.log import Event\n",
        "daemon/__init__.py": "",
        "daemon/subsystem.py": "class Subsystem: ...\n",
        "daemon/kernel_log.py": "from gpuwatchd.daemon.subsystem import Subsystem\nclass K(Subsystem): ...\n",
        "daemon/memory.py": (
            "from gpuwatchd.daemon.subsystem import Subsystem\n"
            "from gpuwatchd.daemon.kernel_log import K\nclass M(Subsystem): ...\n"
        ),
        "daemon/wiring.py": "from gpuwatchd.daemon import kernel_log, memory\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    found = io_violations(root)
    assert found == {
        "gpuwatchd.findings.context": ["imports gpuwatchd.sources.pyspy"],
        "gpuwatchd.join.opens": ["2: open"],
        "gpuwatchd.join.reads": ["3: .read_text"],
        "gpuwatchd.join.sizes": ["3: os.path.getsize"],
        "gpuwatchd.join.spawns": ["3: subprocess.run", "imports subprocess"],
        "gpuwatchd.join.unlinks": ["3: os.unlink"],
        "gpuwatchd.join.uses_source": ["imports gpuwatchd.sources.pyspy"],
    }
    edges, _ = graph(root)
    assert wide_rules(edges) == {"gpuwatchd.findings.wide": ["gpuwatchd.events.log"]}
    assert context_reaches(str(tmp_path)) == ["gpuwatchd.sources", "gpuwatchd.sources.pyspy"]
    assert subsystem_imports(root) == ["gpuwatchd.daemon.memory imports gpuwatchd.daemon.kernel_log"]


def test_importing_gpuwatchd_loads_no_daemon_code() -> None:
    """What a training script pays for ``import gpuwatchd``: checked in a fresh interpreter."""
    import subprocess

    code = (
        "import sys, gpuwatchd; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('prometheus_client', 'pynvml', 'yaml') or m.startswith(('gpuwatchd.daemon', "
        "'gpuwatchd.sources', 'gpuwatchd.web', 'gpuwatchd.exporter'))); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_checker_catches_each_kind_of_bad_import(tmp_path: Path) -> None:
    """A package with one violation of each contract: every contract must report it."""
    root = tmp_path / "gpuwatchd"
    files = {
        "__init__.py": "from gpuwatchd.rank import api\n",
        "model.py": "",
        "rank/__init__.py": "",
        "rank/api.py": "def f():\n    import gpuwatchd.daemon.core  # deferred: still counted\n",
        "sources/__init__.py": "",
        "sources/procfs.py": "import prometheus_client\n",
        "findings/__init__.py": "",
        "findings/context.py": "",
        "findings/a.py": "from gpuwatchd.findings import b\n",
        "findings/b.py": "from gpuwatchd.findings.context import x\n",
        "daemon/__init__.py": "",
        "daemon/core.py": "import importlib\nimportlib.import_module('gpuwatchd.daemon.nvml')\n",
        "daemon/nvml.py": "from gpuwatchd.daemon.core import Daemon\nimport gpuwatchd.sources.procfs\n",
        "sources/nvml.py": "from gpuwatchd.daemon import nvml\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    edges, external = graph(root)
    assert "gpuwatchd.sources.nvml (sources) imports gpuwatchd.daemon.nvml (daemon)" in layer_violations(edges)
    assert "gpuwatchd.rank.api (rank) imports gpuwatchd.daemon.core (daemon)" in layer_violations(edges)
    assert "gpuwatchd.rank.api reaches gpuwatchd.daemon.core (through gpuwatchd.rank.api)" in rank_violations(
        edges, external
    )
    assert "gpuwatchd reaches prometheus_client (through gpuwatchd.sources.procfs)" in rank_violations(edges, external)
    assert finding_violations(edges) == ["gpuwatchd.findings.a imports gpuwatchd.findings.b"]
    assert ["gpuwatchd.daemon.core", "gpuwatchd.daemon.nvml"] in cycles(edges)
    (root / "cli.py").write_text("from gpuwatchd.daemon.core.gone import x\n")
    assert unresolved(root) == ["gpuwatchd.cli: gpuwatchd.daemon.core.gone"]
