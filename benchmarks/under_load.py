"""A command's speed when other work shares the cores, with the competition made here so anyone can
reproduce it: the measured command runs alone, then beside N busy processes of a fixed kind, in turn, and
the table gives its rate against its rate alone and against its fair share of the cores.

The measured command prints a JSON object (its last line that parses as one) holding the rate under --key,
e.g. benchmarks/train_throughput.py --json (tokens_per_s) or benchmarks/decode_speed.py --json.

Loads (--loads, comma-separated, each measured --repeat times, interleaved):
  none       nothing else runs (beyond what already ran on the machine: `uptime` is printed)
  train      a second training, 2 threads: benchmarks/train_throughput.py on the quickstart's model in a loop
             (OMP_NUM_THREADS=2, CODEFORGE_THREADS=2, OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=0,
             CODEFORGE_MALLOC=system: a well-behaved neighbour, the same before and after any change to
             codeforge's own policy)
  same       the measured command itself, run again and again beside it (a second identical job: two
             quickstarts at once); it counts as busy on every core, so the fair share is half the idle rate
  spinN      N pure-Python busy loops (one runnable thread each), e.g. spin6 for a load of 6

Sessions (--sessions): `own` (the default) starts each neighbour in a session of its own, as a program started
from another terminal or service is; `shared` starts them in this benchmark's session, as jobs started from
the same shell are. It matters where the kernel groups by session (Linux's autogroup, /proc/sys/kernel/
sched_autogroup_enabled = 1, the default on most desktops and on this VM): the CPU is then shared between
sessions first, so with `own` the measured command's whole session gets c / (1 + N) cores beside N
single-process neighbours, whatever its threads or processes (the "of session" column); with `shared`, or
with autogroup off, the kernel shares per thread, as the fair share below assumes.

Fair share: with c cores (os.sched_getaffinity) and k competing busy threads (train: 2, spinN: N), a command
that would use all c cores alone gets c / (c + k) of them, so its fair rate is idle * c / (c + k).

    python benchmarks/under_load.py --loads none,train,spin6 -- \\
        python benchmarks/train_throughput.py --preset cpu-small --batch-size 16 --block-size 256 --json
    CODEFORGE_THREADS=... OMP_WAIT_POLICY=ACTIVE python benchmarks/under_load.py ...   (a policy to compare)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = [sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--preset", "cpu-small",
         "--batch-size", "16", "--block-size", "256", "--steps", "1000000", "--warmup", "0"]
SPIN = [sys.executable, "-c", "while True: pass"]


def competitors(load: str, cmd: list[str] = ()) -> tuple[list[list[str]], dict, int]:
    """(commands, extra env, busy threads) of a load; `cmd`: the measured command (for `same`)."""
    if load == "none":
        return [], {}, 0
    if load == "same":  # the measured command itself, again and again, as a second identical job would be
        return [["bash", "-c", 'while true; do "$@" >/dev/null 2>&1; done', "same", *cmd]], {}, \
            len(os.sched_getaffinity(0))
    if load == "train":
        return [TRAIN], {"OMP_NUM_THREADS": "2", "CODEFORGE_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE",
                         "GOMP_SPINCOUNT": "0", "CODEFORGE_MALLOC": "system"}, 2
    if load.startswith("spin") and load[4:].isdigit():
        n = int(load[4:])
        return [SPIN] * n, {}, n
    raise SystemExit(f"unknown load {load!r}: none, train, same or spinN")


def rate_of(out: str, key: str) -> float:
    for line in reversed(out.strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and key in obj:
            return float(obj[key])
        if isinstance(obj, list) and obj and isinstance(obj[-1], dict) and key in obj[-1]:
            return float(obj[-1][key])
    raise SystemExit(f"the command printed no JSON object with {key!r}; its output ends:\n{out[-2000:]}")


def autogroup() -> bool:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def measure(cmd: list[str], load: str, key: str, settle: float, sessions: str = "own") -> float:
    cmds, env, _ = competitors(load, cmd)
    # own: a session each (start_new_session); shared: this session, a process
    # group each (so killpg is theirs)
    where = {"start_new_session": True} if sessions == "own" else {"process_group": 0}
    procs = [subprocess.Popen(c, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, **where) for c in cmds]
    try:
        time.sleep(settle if procs else 0)  # let the neighbours start working (a training loads its model)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"the measured command failed ({r.returncode}):\n{r.stderr[-2000:]}")
        return rate_of(r.stdout, key)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default="none,train,spin6", help="comma-separated: none, train, same, spinN")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each load, interleaved (median quoted)")
    ap.add_argument("--key", default="tokens_per_s", help="the rate in the command's JSON output")
    ap.add_argument("--settle", type=float, default=8.0, help="seconds the neighbours run before the command")
    ap.add_argument("--sessions", choices=("own", "shared"), default="own",
                    help="own: each neighbour in a session of its own; shared: in this one (see above)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the measured command")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: the finally blocks stop the neighbours
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the measured command after --")
    loads = a.loads.split(",")
    cores = len(os.sched_getaffinity(0))
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} | {cores} cores | load before: {os.getloadavg()[0]:.2f} | "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} "
          f"CODEFORGE_THREADS={os.environ.get('CODEFORGE_THREADS', '(unset)')} | autogroup "
          f"{'on' if autogroup() else 'off'}, neighbours' sessions: {a.sessions} | {' '.join(cmd)}",
          flush=True)
    by_session = autogroup() and a.sessions == "own"
    rates: dict[str, list[float]] = {x: [] for x in loads}
    for _ in range(a.repeat):
        for load in loads:
            rates[load].append(measure(cmd, load, a.key, a.settle, a.sessions))
            print(f"#   {load}: {rates[load][-1]:,.1f}", flush=True)
    idle = statistics.median(rates["none"]) if "none" in rates else None
    rows = []
    for load in loads:
        med = statistics.median(rates[load])
        k = competitors(load, cmd)[2]
        fair = idle * cores / (cores + k) if idle else None
        # the kernel's own share when it groups by session: 1 / (1 + neighbour processes) of the machine
        group = idle / (1 + len(competitors(load, cmd)[0])) if idle and by_session else None
        rows.append({"load": load, "busy_threads": k, "rate": med, "min": min(rates[load]),
                     "max": max(rates[load]),
                     "of_idle": med / idle if idle else None, "of_fair": med / fair if fair else None,
                     "of_session": med / group if group else None})
    if a.json:
        print(json.dumps(rows))
        return
    print(f"{'load':8s} {'threads':>7s} {a.key:>14s} {'min':>10s} {'max':>10s} {'of idle':>8s} "
          f"{'of fair':>8s} {'of session':>10s}")
    pct = lambda v: f"{v:.0%}" if v is not None else "-"  # noqa: E731
    for r in rows:
        print(f"{r['load']:8s} {r['busy_threads']:7d} {r['rate']:14,.1f} {r['min']:10,.1f} {r['max']:10,.1f} "
              f"{pct(r['of_idle']):>8s} {pct(r['of_fair']):>8s} {pct(r['of_session']):>10s}")


if __name__ == "__main__":
    main()
