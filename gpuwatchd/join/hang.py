"""Hang analysis: every Python thread of a stuck rank, folded, and the pattern it shows, in words.

Input (pure, no I/O): one ``py-spy dump`` (every Python thread's frames and GIL flag), the /proc
view of the same threads (state, wchan), each thread's CPU share since the previous look, where
each thread waits in the kernel (``sources/taskwait.py``: futex address, timed or not) and the
rank's worker processes (DataLoader workers are the rank's descendants). Output: a
``HangAnalysis`` with one line per group of identical threads ("14 threads idle in get
(queue.py)") and the patterns it recognises, each with its evidence:

- ``deadlock`` / ``lock_wait``: threads blocked acquiring locks (``with lock:``, ``acquire``,
  ``Condition.wait``) at ~0 CPU; two or more and no Python thread progressing is a likely deadlock
  (the futex addresses say whether they wait on different locks, except for a wait in CPython
  3.13's parking lot, whose futex word is the waiter's own: said so). A thread in ``Thread.join``
  (or the interpreter's exit joining non-daemon threads) waits for threads, not a lock: it is no
  part of a lock cycle;
- ``gpu_wait``: blocked in ``synchronize`` / ``.item()`` / a CUDA copy; the caller adds whether
  the rank's GPU is busy (a long kernel, an NCCL spin) or idle (a lost launch);
- ``native_spin``: a thread burning a core in native code without the GIL (a CUDA spin-wait when
  the rank holds a GPU; research §3.1: ``.item()`` shows no Python frame of its own);
- ``collective``: waiting in a ``torch.distributed`` collective (the odd-rank-out logic of
  ``stall.name_suspects`` and the flight recorder say who is missing);
- ``compiling``: torch.compile / Inductor / Triton frames while the rank's CPU is busy: not hung;
- ``starved``: the training thread waits on a queue while the rank's worker processes are dead,
  stopped or blocked.

Cost: linear in threads x frames of one dump (a torch rank: ~20 threads).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence

from gpuwatchd.join import lock_evidence
from gpuwatchd.model.stall import HangAnalysis, Pattern, ThreadGroup, ThreadView, WorkerView
from gpuwatchd.model.threads import Frame, SyscallWait, ThreadInfo, ThreadStack

IDLE_SHARE = 0.02  # at most 2 % of a core: not running
WORK_SHARE = 0.05  # as stall.WORK_SHARE: a thread between this and a spin is doing work
SPIN_SHARE = 0.9

# File prefixes of PyTorch's compiler stack (short file names as py-spy prints them).
COMPILE_FILES = ("torch/_dynamo/", "torch/_inductor/", "torch/_functorch/", "triton/",
                 "torch/fx/", "torch/_export/")  # fmt: skip
# where a compile thread waits for the compiler's workers (Inductor's async compile pools)
COMPILER_POOLS = ("torch/_inductor/async_compile.py", "torch/_inductor/compile_worker/subproc_pool.py",
                  "torch/_inductor/runtime/compile_tasks.py", "subprocess.py")  # fmt: skip
# Python-level functions that wait for the GPU (torch.cuda.synchronize, Stream/Event.synchronize).
GPU_WAIT_FUNCS = ("synchronize", "item", "tolist", "cpu", "numpy", "to", "copy_", "wait_stream",
                  "_local_scalar_dense")  # fmt: skip
# (function, file suffix) -> label of places where a thread idles waiting for work
QUEUE_WAITS = {
    ("get", "queue.py"): "queue.get",
    ("get", "multiprocessing/queues.py"): "multiprocessing queue get",
    ("_try_get_data", "torch/utils/data/dataloader.py"): "DataLoader _try_get_data",
    ("_get_data", "torch/utils/data/dataloader.py"): "DataLoader _get_data",
    ("_next_data", "torch/utils/data/dataloader.py"): "DataLoader _next_data",
    ("recv", "multiprocessing/connection.py"): "multiprocessing recv",
}
IDLE_WAITS = {
    ("wait", "threading.py"): "a wait",  # Event.wait / Condition.wait, refined below
    ("select", "selectors.py"): "select",
    ("_wait_for_tstate_lock", "threading.py"): "Thread.join",  # 3.10-3.12
    ("join", "threading.py"): "Thread.join",  # 3.13: _ThreadHandle.join (C) waits, no frame of its own
    ("_shutdown", "threading.py"): "Thread.join",  # the main thread's exit joins non-daemon threads
    ("accept", "socket.py"): "socket accept",
    ("serve_forever", "socketserver.py"): "serve_forever",
    ("poll", "multiprocessing/connection.py"): "multiprocessing poll",
    ("_recv", "multiprocessing/connection.py"): "multiprocessing recv",
}
LOCK_FUNCS = {("acquire", "threading.py"), ("__enter__", "threading.py")}


def _in(f: Frame, table: Mapping[tuple[str, str], str] | set[tuple[str, str]]) -> bool:
    return any(f.name.split(".")[-1] == fn and f.filename.endswith(suffix) for fn, suffix in table)


def _label(f: Frame, table: Mapping[tuple[str, str], str]) -> str:
    for (fn, suffix), label in table.items():
        if f.name.split(".")[-1] == fn and f.filename.endswith(suffix):
            return label
    return ""


def _is_compile(f: Frame) -> bool:
    name = f.filename.replace("\\", "/")
    return name.startswith(COMPILE_FILES) or "/site-packages/triton/" in name or (
        "autotune" in f.name and "triton" in name)  # fmt: skip


def _collective(frames: Sequence[Frame]) -> Frame | None:
    """The outermost c10d frame a thread is in (``all_reduce``, ``barrier``...), if any."""
    hits = [f for f in frames if f.filename.endswith("distributed_c10d.py")]
    return hits[-1] if hits else None


def collective_name(frames: Sequence[Frame]) -> str:
    """The name of the c10d collective a thread's frames are in (``all_reduce``), else ""."""
    coll = _collective(frames)
    return coll.name if coll else ""


def classify(s: ThreadStack, info: ThreadInfo | None, share: float | None,
             wait: SyscallWait | None, asleep: bool = False) -> ThreadView:  # fmt: skip
    """What one thread is doing, from its frames, kernel state and CPU share. ``asleep``: the
    thread has no task of its own (no tid), but every task of the process sleeps at ~0 CPU and
    enough of them in untimed futex waits (``lock_evidence.unjoined``)."""
    frames = s.frames
    top = frames[0] if frames else Frame("", "", None)
    state = info.state if info else ("S" if asleep else "")
    wchan = info.wchan if info else ""
    parked = wait is not None and wait.on_own_stack
    futex = wait.address if wait is not None and wait.futex and not parked else None
    # unknown share (the first look at a rank): a thread asleep in the kernel is not running now
    idle_cpu = share <= IDLE_SHARE if share is not None else state == "S"
    untimed = wait.untimed_futex if wait is not None else "futex" in wchan or asleep

    def view(kind: str, waits_on: str = "") -> ThreadView:
        return ThreadView(s.tid, s.name or "?", state, wchan, share, s.owns_gil, frames, kind,
                          waits_on, futex, parked)  # fmt: skip

    if any(_is_compile(f) for f in frames):
        return view("compile", "torch.compile")
    coll = _collective(frames)
    if coll is not None:
        return view("collective", f"collective {coll.name}")
    if top.name.split(".")[-1] in GPU_WAIT_FUNCS and top.filename.startswith("torch/"):
        return view("gpu", f"the GPU ({top.name})")
    for f in frames[:6]:
        label = _label(f, QUEUE_WAITS)
        if label:
            return view("queue", label)
    if _in(top, IDLE_WAITS):
        label = _label(top, IDLE_WAITS)
        if label == "Thread.join" or any(f.name.endswith("join") for f in frames[:3]):
            return view("join", "Thread.join")
        if label == "a wait" and len(frames) > 1:
            outer = frames[1].name
            # Python 3.10 has no qualified names: Event.wait is "wait" in threading.py there
            if outer.endswith("Event.wait") or (outer == "wait" and _in(frames[1], IDLE_WAITS)):
                return view("idle", "Event.wait")
            if untimed and idle_cpu:
                return view("lock", "Condition.wait")
        return view("idle", label)
    if _in(top, LOCK_FUNCS) or (untimed and idle_cpu and state in ("S", "")):
        what = "a lock" + (f" (futex {futex:#x})" if futex is not None else "")
        return view("lock", what)
    if share is not None and share >= SPIN_SHARE and not s.owns_gil:
        return view("native_spin", "native code")
    if share is not None and share >= WORK_SHARE:
        return view("running")
    return view("waiting", wchan)


def fold(views: Iterable[ThreadView]) -> tuple[ThreadGroup, ...]:
    """Identical stacks in the same state and kind fold into one group; most interesting first."""
    groups: dict[tuple[object, ...], list[ThreadView]] = collections.defaultdict(list)
    for v in views:
        share_bucket = None if v.cpu_share is None else round(v.cpu_share, 1)
        key = (v.kind, v.state, share_bucket, v.owns_gil,
               tuple((f.name, f.filename, f.line) for f in v.frames))  # fmt: skip
        groups[key].append(v)
    order = {"lock": 0, "gpu": 1, "native_spin": 1, "collective": 2, "compile": 2, "queue": 3,
             "join": 4, "running": 5, "waiting": 6, "idle": 7}  # fmt: skip
    out = []
    for members in groups.values():
        v = members[0]
        shares = [m.cpu_share for m in members if m.cpu_share is not None]
        out.append(ThreadGroup(
            count=len(members), names=tuple(m.name for m in members), kind=v.kind, state=v.state,
            cpu_share=(sum(shares) / len(shares)) if shares else None, frames=v.frames,
            owns_gil=v.owns_gil, waits_on=v.waits_on,
        ))  # fmt: skip
    main_first = sorted(out, key=lambda g: ("MainThread" not in g.names, order.get(g.kind, 9),
                                            -g.count))  # fmt: skip
    return tuple(main_first)


def _where(v: ThreadView) -> str:
    return str(v.frames[0]) if v.frames else "no Python frame"


def _patterns(views: Sequence[ThreadView], workers: WorkerView | None,
              tree_busy: float | None, unjoined: str = "") -> list[Pattern]:  # fmt: skip
    out: list[Pattern] = []
    shares = [v.cpu_share for v in views if v.cpu_share is not None]
    busy = max(shares, default=0.0)
    if tree_busy is not None:
        busy = max(busy, tree_busy)
    compiling = [v for v in views if v.kind == "compile"]
    # Inductor runs the C++ compiler as a child process (cpp_builder -> subprocess), Triton
    # compiles in a pool of workers (concurrent.futures): a compile thread waiting there is
    # waiting for the compiler, whose CPU the rank's own threads do not show.
    waits_for_compiler = [v for v in compiling if v.frames and (
        v.frames[0].filename.endswith("subprocess.py")
        or (v.frames[0].filename.endswith(("concurrent/futures/_base.py", "threading.py"))
        and any(f.filename.endswith(COMPILER_POOLS) for f in v.frames[:6])))]  # fmt: skip
    if compiling and (busy >= WORK_SHARE or waits_for_compiler):
        v = next((c for c in compiling if c.name == "MainThread"), compiling[0])
        inner = next((f for f in v.frames if _is_compile(f)), v.frames[0])
        how = f"with {busy:.0%} of a core busy" if busy >= WORK_SHARE else f"waiting for the compiler in {v.frames[0]}"
        out.append(
            Pattern(
                "compiling",
                (f'still compiling, not hung: "{v.name}" is in torch.compile ({inner}) {how}'),
                tuple(c.name for c in compiling),
            )
        )
        return out  # the rest of a compiling rank's threads wait for the compiler
    locks = [v for v in views if v.kind == "lock" and (v.cpu_share or 0.0) <= IDLE_SHARE]
    progressing = [v for v in views if v.kind in ("running", "native_spin")
                   or (v.cpu_share or 0.0) >= WORK_SHARE]  # fmt: skip
    joiners = [v for v in views if v.kind == "join"]
    if locks:
        names = ", ".join(f'"{v.name}" in {_where(v)}' for v in locks[:6])
        locks_text = lock_evidence.locks_text(
            {v.futex for v in locks if v.futex is not None}, [v.name for v in locks if v.parked]
        )
        join_text = ""
        if joiners:
            join_text = "; " + ", ".join(f'"{j.name}"' for j in joiners[:3]) + " waits for them in Thread.join"
        if len(locks) >= 2 and not progressing:
            out.append(Pattern("deadlock", (
                f"likely deadlock: {len(locks)} threads blocked acquiring locks at 0 % CPU, none "
                f"progressing: {names}{locks_text}{join_text}{unjoined}"),
                tuple(v.name for v in locks)))  # fmt: skip
        else:
            out.append(
                Pattern(
                    "lock_wait",
                    (
                        f"lock wait: {len(locks)} thread(s) blocked acquiring a lock at 0 % CPU: "
                        f"{names}{locks_text}{unjoined}"
                    ),
                    tuple(v.name for v in locks),
                )
            )
    for v in views:
        if v.kind == "gpu":
            cpu = "" if v.cpu_share is None else f" at {v.cpu_share:.0%} CPU"
            out.append(Pattern("gpu_wait", f'waiting on the GPU: "{v.name}" in {_where(v)}{cpu}', (v.name,)))
        elif v.kind == "native_spin":
            out.append(
                Pattern(
                    "native_spin",
                    (
                        f'"{v.name}" burns {v.cpu_share or 0:.0%} of a core in native code without the '
                        f"GIL at {_where(v)} (a CUDA spin-wait in .item()/synchronize/a copy when the rank "
                        "uses a GPU)"
                    ),
                    (v.name,),
                )
            )
    colls = [v for v in views if v.kind == "collective"]
    if colls:
        v = colls[0]
        coll = _collective(v.frames)
        out.append(Pattern("collective", (f'waiting in a collective: "{v.name}" in {coll or _where(v)}'), (v.name,)))
    queue = [v for v in views if v.kind == "queue"]
    if queue and not colls and workers is not None:
        v = next((q for q in queue if q.name == "MainThread"), queue[0])
        starved = workers.seen > 0 and not workers.running
        if starved:
            i = next((i for i, f in enumerate(v.frames[:6]) if _label(f, QUEUE_WAITS)), 0)
            where = " <- ".join(str(f) for f in v.frames[i : i + 2])
            out.append(
                Pattern(
                    "starved",
                    (
                        f'starved: "{v.name}" waits for data in {v.waits_on} ({where}) while its '
                        f"{workers.seen} worker process(es) are {workers.text()}"
                    ),
                    (v.name,),
                )
            )
    return out


def wait_tids(stacks: Sequence[ThreadStack], threads: Sequence[ThreadInfo]) -> list[int]:
    """The tasks whose /proc/TID/syscall the analysis needs: the dumped threads', or every task
    read when py-spy gave some thread no tid (Python 3.10, py-spy #567)."""
    if any(not s.tid for s in stacks):
        return [t.tid for t in threads]
    return [s.tid for s in stacks if s.tid]


def analyze(
    stacks: Sequence[ThreadStack],
    threads: Sequence[ThreadInfo] = (),
    shares: Mapping[int, float] | None = None,
    waits: Mapping[int, SyscallWait] | None = None,
    workers: WorkerView | None = None,
    tree_busy: float | None = None,
) -> HangAnalysis:
    """``shares``: tid -> cores since the previous look; ``tree_busy``: the busiest of the rank's
    descendant processes in cores (Inductor compiles in worker processes)."""
    # gpuwatchd's own flight-recorder responder (gpuwatchd/rank/flight_recorder.py) is no suspect
    stacks = [s for s in stacks if s.name != "gpuwatchd-fr"]
    by_tid = {t.tid: t for t in threads}
    shares = shares or {}
    waits = waits or {}
    views = tuple(classify(s, by_tid.get(s.tid or -1), shares.get(s.tid or -1), waits.get(s.tid or -1)) for s in stacks)
    unjoined = ""
    evidence = (lock_evidence.unjoined(threads, shares, waits, IDLE_SHARE)
                if any(not s.tid for s in stacks) else None)  # fmt: skip
    if evidence is not None:
        # no per-thread join: a thread whose frames show user code or a lock acquisition counts as
        # lock-blocked when the whole process sleeps and there are untimed futex waits for each
        asleep = tuple(classify(s, None, None, None, asleep=True) if not s.tid else v
                       for s, v in zip(stacks, views, strict=True))  # fmt: skip
        inferred = [a for a, v in zip(asleep, views, strict=True) if a.kind != v.kind]
        if inferred and len(inferred) <= evidence[0]:
            views, unjoined = asleep, evidence[1]
    return HangAnalysis(views, fold(views), tuple(_patterns(views, workers, tree_busy, unjoined)))
