"""The folder tree is the design: the import contracts of ``gpuwatchd/`` (docs/architecture.md).

An ``ast`` walk over every module, counting module-level *and* function-level imports (and
``importlib.import_module("gpuwatchd...")`` with a literal name), so that a deferred import cannot
hide a cycle or a wrong-way dependency. Contracts:

1. Layers, lowest first; a module imports only its own layer or lower ones.
2. Code that runs inside a rank (``gpuwatchd/__init__.py``, ``gpuwatchd/rank/``, the zero-code
   heartbeat ``gpuwatchd/autobeat.py`` and its launcher shim ``gpuwatchd/run.py``) reaches, through
   everything it imports, nothing of the daemon, the sources, the web server or prometheus_client.
3. Finding rules are independent of each other: a rule imports ``findings.context`` only.
4. No import cycle, function-level imports included.

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
    ("core", ("gpuwatchd.model", "gpuwatchd.config", "gpuwatchd.config_checks", "gpuwatchd.strict_yaml",
              "gpuwatchd.paths", "gpuwatchd.units", "gpuwatchd.escape", "gpuwatchd.counters",
              "gpuwatchd.isolation", "gpuwatchd.statefile")),
    ("rank", ("gpuwatchd.rank", "gpuwatchd.autobeat", "gpuwatchd.run")),
    ("sources", ("gpuwatchd.sources",)),
    ("events", ("gpuwatchd.events",)),
    # the join's trackers; the findings read their verdicts, join.state runs the rules last
    ("join", ("gpuwatchd.join.orphans", "gpuwatchd.join.stall", "gpuwatchd.join.kernel_events",
              "gpuwatchd.join.xid_dedup", "gpuwatchd.join.rank_claims", "gpuwatchd.join.memory_tracker",
              "gpuwatchd.join.oom_history", "gpuwatchd.join.bus_lost", "gpuwatchd.join")),
    ("findings", ("gpuwatchd.findings",)),
    ("join.state", ("gpuwatchd.join.state",)),
    ("outputs", ("gpuwatchd.exporter", "gpuwatchd.web")),
    ("daemon", ("gpuwatchd.daemon",)),
    ("cli", ("gpuwatchd.cli", "gpuwatchd.__main__")),
)
RANK_SIDE = ("gpuwatchd", "gpuwatchd.rank", "gpuwatchd.autobeat", "gpuwatchd.run")
RANK_FORBIDDEN = ("gpuwatchd.daemon", "gpuwatchd.sources", "gpuwatchd.web", "gpuwatchd.exporter",
                  "gpuwatchd.cli", "prometheus_client", "yaml")
# (pynvml is allowed: the CUDA-OOM hook snapshots co-tenants at the moment of the error, lazily.)


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
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
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
            out += [f"{m} imports {t}" for t in sorted(targets)
                    if (t == pkg or t.startswith(pkg + ".")) and t != f"{pkg}.context"]
    return out


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
            out += [f"{m}: {n}" for n in names
                    if (n == root.name or n.startswith(root.name + ".")) and n not in mods]
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


def test_importing_gpuwatchd_loads_no_daemon_code() -> None:
    """What a training script pays for ``import gpuwatchd``: checked in a fresh interpreter."""
    import subprocess

    code = ("import sys, gpuwatchd; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('prometheus_client', 'pynvml', 'yaml') or m.startswith(('gpuwatchd.daemon', "
            "'gpuwatchd.sources', 'gpuwatchd.web', 'gpuwatchd.exporter'))); print(bad)")
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
        "daemon/core.py": "import importlib\nimportlib.import_module('gpuwatchd.daemon.gpu')\n",
        "daemon/gpu.py": "from gpuwatchd.daemon.core import Daemon\nimport gpuwatchd.sources.procfs\n",
        "sources/nvml.py": "from gpuwatchd.daemon import gpu\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    edges, external = graph(root)
    assert "gpuwatchd.sources.nvml (sources) imports gpuwatchd.daemon.gpu (daemon)" in layer_violations(edges)
    assert "gpuwatchd.rank.api (rank) imports gpuwatchd.daemon.core (daemon)" in layer_violations(edges)
    assert "gpuwatchd.rank.api reaches gpuwatchd.daemon.core (through gpuwatchd.rank.api)" in rank_violations(
        edges, external)
    assert "gpuwatchd reaches prometheus_client (through gpuwatchd.sources.procfs)" in rank_violations(
        edges, external)
    assert finding_violations(edges) == ["gpuwatchd.findings.a imports gpuwatchd.findings.b"]
    assert ["gpuwatchd.daemon.core", "gpuwatchd.daemon.gpu"] in cycles(edges)
    (root / "cli.py").write_text("from gpuwatchd.daemon.core.gone import x\n")
    assert unresolved(root) == ["gpuwatchd.cli: gpuwatchd.daemon.core.gone"]
