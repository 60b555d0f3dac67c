#!/usr/bin/env python3
"""Write the small /proc tree of tests/fixtures/proc/golden (the golden exposition test).

    python3 tools/make_proc_fixture.py tests/fixtures/proc/golden

The processes are those of the NVML recording tests/fixtures/nvml/h200_orphan_dataloader.json
(tests/fixtures/nvml/README.md says what ran): PID 447 the rank (with one DataLoader worker, 448,
that holds no GPU memory), 449/450 started by the same shell (412) but registered by nobody, 453
whose shell was killed (reparented to init). The files hold exactly what gpuwatchd reads
(sources/procfs.py): ``stat`` (btime), and per PID ``stat``, ``status``, ``limits``, ``environ``,
``cgroup``, ``fd/`` (one empty file per descriptor) and ``task/PID/children``.
"""

import os
import sys

BTIME = 1795930000
# pid: (comm, state, ppid, utime, stime, threads, start ticks, rss pages, fds, children, environ)
PROCS = {
    1: ("systemd", "S", 0, 900, 400, 1, 1, 3000, 8, [], ""),
    412: ("bash", "S", 1, 12, 3, 1, 571000, 900, 4, [447, 449, 450], "PATH=/usr/bin"),
    447: (
        "python3",
        "S",
        412,
        5230,
        410,
        37,
        571200,
        310000,
        12,
        [448],
        "PATH=/usr/bin\0RANK=0\0LOCAL_RANK=0\0WORLD_SIZE=1\0NCCL_ASYNC_ERROR_HANDLING=1",
    ),
    448: ("pt_data_worker", "S", 447, 210, 40, 3, 571900, 52000, 6, [], "PATH=/usr/bin"),
    449: ("python3", "S", 412, 2100, 150, 21, 571300, 180000, 8, [], "PATH=/usr/bin"),
    450: ("python3", "S", 412, 2080, 149, 21, 571310, 179000, 8, [], "PATH=/usr/bin"),
    453: ("python3", "S", 1, 800, 90, 12, 560000, 240000, 6, [], "PATH=/usr/bin"),
}


def stat_line(pid: int, p: tuple) -> str:
    comm, state, ppid, utime, stime, threads, start, rss = p[:8]
    f = [
        state,
        ppid,
        pid,
        pid,
        0,
        -1,
        4194304,
        0,
        0,
        0,
        0,
        utime,
        stime,
        0,
        0,
        20,
        0,
        threads,
        0,
        start,
        1 << 33,
        rss,
    ] + [0] * 30
    return f"{pid} ({comm}) " + " ".join(str(x) for x in f) + "\n"


def write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def main(root: str) -> None:
    write(os.path.join(root, "stat"), f"cpu  1 2 3 4\nbtime {BTIME}\nprocesses 9000\n")
    # the node's memory and its pressure, as tests/fixtures/memcg/v2/proc has them
    write(
        os.path.join(root, "meminfo"),
        "MemTotal:       2113494528 kB\nMemFree:         10485760 kB\n"
        "MemAvailable:    41943040 kB\nBuffers:          1048576 kB\n",
    )
    write(
        os.path.join(root, "pressure", "memory"),
        "some avg10=1.50 avg60=0.40 avg300=0.10 total=5000000\nfull avg10=0.50 avg60=0.10 avg300=0.02 total=2000000\n",
    )
    for pid, p in PROCS.items():
        d = os.path.join(root, str(pid))
        write(os.path.join(d, "stat"), stat_line(pid, p))
        write(os.path.join(d, "status"), f"Name:\t{p[0]}\nState:\t{p[1]}\nPPid:\t{p[2]}\nNSpid:\t{pid}\n")
        write(
            os.path.join(d, "limits"),
            "Limit                     Soft Limit           Hard Limit           Units\n"
            "Max open files            1048576              1048576              files\n",
        )
        write(os.path.join(d, "environ"), p[10] + ("\0" if p[10] else ""))
        write(os.path.join(d, "cgroup"), "0::/system.slice/golden.service\n")
        write(os.path.join(d, "task", str(pid), "children"), "".join(f"{c} " for c in p[9]))
        for fd in range(p[8]):
            write(os.path.join(d, "fd", str(fd)), "")


if __name__ == "__main__":
    main(sys.argv[1])
