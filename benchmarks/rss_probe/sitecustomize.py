"""The resident-set probe of benchmarks/bench_rss_timeline.py. Python imports `sitecustomize` at start-up
from the path, so every process started with this folder on PYTHONPATH loads it: the dpcompare launcher,
its probes and each rank. It does nothing unless DPCOMPARE_RSS_PROBE names a folder.

Where it does, a daemon thread reads the process's resident set (/proc/self/statm) every
DPCOMPARE_RSS_PROBE_MS milliseconds (default 0.5) and, at each new maximum by at least 4 MiB, appends one
JSON line to <folder>/<pid>.jsonl: seconds since start, VmRSS, RssAnon and RssFile, glibc's heap
(mallinfo2: what it holds from the kernel, what is in use, what is free but kept) and the main thread's
Python stack. Why at maxima only: the peak is what the question is about, and the stack of a peak says
which phase (forward, backward, optimizer, checkpoint) and which call put it there.

A forked child (torch's CPU ranks under `compare.launch.spawn --fork`) starts its own thread and file: a thread
does not survive fork, and the ranks of a torch job at N=2 had written nothing.

Linux only (it reads /proc); mallinfo2 needs glibc 2.33 or later, else the heap fields are null.
"""
import os


def _start(folder: str) -> None:
    import ctypes
    import json
    import sys
    import threading
    import time
    import traceback

    page = os.sysconf("SC_PAGE_SIZE")
    period = float(os.environ.get("DPCOMPARE_RSS_PROBE_MS", "0.5")) / 1e3
    step = 4 * 2**20
    started = time.monotonic()
    main = threading.main_thread()
    out_path = os.path.join(folder, f"{os.getpid()}.jsonl")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
        mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        mallinfo2 = None

    def heap() -> dict:
        if mallinfo2 is None:
            return {"heap_bytes": None, "heap_in_use_bytes": None, "heap_free_bytes": None, "mmapped_bytes": None}
        m = mallinfo2()
        return {"heap_bytes": m.arena, "heap_in_use_bytes": m.uordblks, "heap_free_bytes": m.fordblks,
                "mmapped_bytes": m.hblkhd}

    def status() -> dict:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    fields[key] = int(value.split()[0]) * 1024
        return {"rss_anon_bytes": fields.get("RssAnon"), "rss_file_bytes": fields.get("RssFile")}

    def stack() -> list[str]:
        frame = sys._current_frames().get(main.ident)
        if frame is None:
            return []
        return [f"{s.filename}:{s.lineno} {s.name}" for s in traceback.extract_stack(frame)[-40:]]

    def sample() -> None:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        highest = 0
        with open(out_path, "a") as out:
            out.write(json.dumps({"pid": os.getpid(), "argv": sys.argv[:8], "period_s": period,
                                  "env_rank": {k: os.environ[k] for k in ("RANK", "MLX_RANK", "OMPI_COMM_WORLD_RANK")
                                               if k in os.environ}}) + "\n")
            out.flush()
            while True:
                rss = int(os.pread(fd, 64, 0).split()[1]) * page
                if rss >= highest + step:
                    highest = rss
                    record = {"t_s": round(time.monotonic() - started, 4), "rss_bytes": rss, **status(), **heap(),
                              "stack": stack()}
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                time.sleep(period)

    threading.Thread(target=sample, name="rss-probe", daemon=True).start()


if os.environ.get("DPCOMPARE_RSS_PROBE") and os.path.exists("/proc/self/statm"):
    try:
        _start(os.environ["DPCOMPARE_RSS_PROBE"])
        os.register_at_fork(after_in_child=lambda: _start(os.environ["DPCOMPARE_RSS_PROBE"]))
    except Exception as err:  # noqa: BLE001 - a probe must never stop the process it watches
        import sys

        print(f"rss probe: not started: {type(err).__name__}: {err}", file=sys.stderr)
