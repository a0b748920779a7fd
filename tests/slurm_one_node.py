"""A one-node Slurm cluster on this machine, for trying `codeforge prepare --executor slurm` without a cluster
(and for tests/test_slurm_cluster.py).

    python tests/slurm_one_node.py start DIR     # prints the SLURM_CONF to export
    SLURM_CONF=DIR/slurm.conf codeforge prepare ... --executor slurm --slurm-partition debug
    python tests/slurm_one_node.py stop DIR      # cancels its jobs, stops its daemons

It needs root and Debian's packages (`apt-get install slurm-wlm munge`, which make /etc/munge/munge.key). It
starts, all as root except munged:
  munged     the machine's, if one answers already (it is then left running); else started as the munge user
             and stopped again by `stop`
  slurmctld  the controller, and slurmd, the one node (this host, its CPUs and 90% of its memory as
             `slurmd -C` reports them), on two free TCP ports, with one partition, `debug`
Everything else is under DIR: slurm.conf, the controller's state, slurmd's spool, both daemons' pid and log
files. A cluster already running on this machine (another DIR, the distribution's own) is left alone: each has
its own ports, state and SLURM_CONF. In code: `with OneNodeCluster(DIR) as c: subprocess.run(..., env=c.env)`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"
COMMANDS = ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")
MUNGE_KEY = Path("/etc/munge/munge.key")
PARTITION = "debug"


def _which(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SBIN}")


def why_not() -> str | None:
    """Why no one-node cluster can start here (not Linux, not root, a package missing), or None."""
    if not sys.platform.startswith("linux"):
        return "a one-node Slurm cluster needs Linux"
    if os.geteuid() != 0:
        return "a one-node Slurm cluster needs root (slurmctld and slurmd run as root here)"
    missing = [c for c in COMMANDS if not _which(c)]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)"
    if not MUNGE_KEY.exists():
        return f"{MUNGE_KEY} is missing (Debian's munge package makes it; or run mungekey)"
    return None


def _free_ports(n: int) -> list[int]:
    """n TCP ports nothing listens on now (held open together, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _node_line() -> str:
    """This host as slurm.conf names a node: `slurmd -C`'s line, with 90% of the memory it reports (a node
    configured with more memory than it has is drained), reached at the loopback address."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    words = out.splitlines()[0].split()
    fields = dict(w.split("=", 1) for w in words)
    fields["NodeName"] = socket.gethostname().split(".")[0]
    fields["NodeAddr"] = "127.0.0.1"  # no name lookup: a container's host name may resolve to nothing
    fields["RealMemory"] = str(max(500, int(int(fields.get("RealMemory", "1000")) * 0.9)))
    return " ".join(f"{k}={v}" for k, v in fields.items()) + " State=UNKNOWN"


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _stop_pid(pid: int, must_hold: list[str], seconds: float = 15) -> None:
    """SIGTERM to `pid` if its command line holds every string of `must_hold` (a pid file outlives its
    process, and the number may be another's now), SIGKILL after `seconds`."""
    line = " ".join(_cmdline(pid))
    if not line or not all(s in line for s in must_hold):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def munge_answers() -> bool:
    """Whether a munged answers on the default socket (a credential made and read back)."""
    try:
        cred = subprocess.run([_which("munge"), "-n"], capture_output=True, timeout=10)
        if cred.returncode:
            return False
        return subprocess.run([_which("unmunge")], input=cred.stdout, capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class OneNodeCluster:
    """munged (the machine's, or one started here), slurmctld and slurmd with their config and state under
    `root`; `env` is this process's environment with SLURM_CONF naming it, for sbatch, squeue and the jobs."""

    def __init__(self, root, partition: str = PARTITION):
        self.root = Path(root).resolve()
        self.partition = partition
        self.conf = self.root / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([_which(cmd[0]) or cmd[0], *cmd[1:]], capture_output=True, text=True,
                              env=self.env, check=check, timeout=timeout)

    # -- starting --------------------------------------------------------------------------------------------

    def start(self, seconds: float = 60) -> OneNodeCluster:
        why = why_not()
        if why:
            raise RuntimeError(why)
        if self.conf.exists() and _pid(self.root / "slurmctld.pid"):
            self.stop()  # a cluster this DIR ran before: started afresh, on new ports
        for d in ("state", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        try:
            self._munge()
            ctld, node = _free_ports(2)
            self.conf.write_text(self.config(ctld, node))
            self._run("slurmctld", "-f", str(self.conf))
            self._run("slurmd", "-f", str(self.conf))
            self._wait_idle(seconds)
        except BaseException:
            self.stop()
            raise
        return self

    def config(self, ctld_port: int, node_port: int) -> str:
        d = self.root
        return "\n".join([
            "ClusterName=codeforge", f"SlurmctldHost={self.host}(127.0.0.1)", "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "SchedulerType=sched/backfill", "ReturnToService=2",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd.log'}",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={node_port}",
            _node_line(),
            f"PartitionName={self.partition} Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            ""])

    def _munge(self) -> None:
        """The machine's munged if one answers; else one started as the munge user, its pid kept in
        DIR/munged.ours so that `stop` ends it (and only it)."""
        if munge_answers():
            return
        for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
            os.makedirs(d, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", _which("munged"), "--force"], check=True,
                       capture_output=True, text=True, timeout=30)
        deadline = time.monotonic() + 10
        while not munge_answers():
            if time.monotonic() > deadline:
                raise RuntimeError("munged started but does not answer (see /var/log/munge/munged.log)")
            time.sleep(0.1)
        pid = _pid(Path("/run/munge/munged.pid"))
        if pid:
            (self.root / "munged.ours").write_text(f"{pid}\n")

    def _wait_idle(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        state = ""
        while time.monotonic() < deadline:
            got = self._run("sinfo", "-h", "-n", self.host, "-o", "%t", check=False)
            state = got.stdout.strip()
            if got.returncode == 0 and state in ("idle", "mix", "alloc"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the node {self.host} is not idle after {seconds:.0f} s (sinfo: {state!r}):\n"
                           f"{self.log_tails()}")

    def log_tails(self, chars: int = 3000) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            p = self.root / name
            if p.exists():
                out.append(f"--- {p} (end)\n{p.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    # -- using it --------------------------------------------------------------------------------------------

    def jobs(self) -> list[str]:
        """The ids of the jobs in this cluster's queue (pending, running, completing); an array is one."""
        got = self._run("squeue", "-h", "-o", "%F %T")
        return sorted({line.split()[0] for line in got.stdout.splitlines() if line.strip()})

    def wait_empty(self, seconds: float) -> bool:
        """Wait until no job is left in the queue; whether that happened within `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self.jobs():
                return True
            time.sleep(0.5)
        return False

    # -- stopping --------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job of this cluster, stop slurmd and slurmctld (by their pid files, each checked to be
        this DIR's daemon), and munged if `start` started it."""
        conf = str(self.conf)
        if _pid(self.root / "slurmctld.pid"):
            try:
                ids = self.jobs()
                if ids:
                    self._run("scancel", *ids, check=False)
                    self.wait_empty(30)
            except (OSError, subprocess.SubprocessError):
                pass
        for name in ("slurmd", "slurmctld"):
            pid = _pid(self.root / f"{name}.pid")
            if pid:
                _stop_pid(pid, [name, conf])
        ours = self.root / "munged.ours"
        pid = _pid(ours)
        if pid:
            _stop_pid(pid, ["munged"])
            ours.unlink()

    def __enter__(self) -> OneNodeCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("start", "stop"))
    ap.add_argument("dir", help="where the config, state and logs go (made if missing)")
    a = ap.parse_args(argv)
    c = OneNodeCluster(a.dir)
    if a.action == "stop":
        c.stop()
        print(f"stopped the cluster of {c.conf}")
        return 0
    why = why_not()
    if why:
        print(f"cannot start a cluster here: {why}", file=sys.stderr)
        return 1
    c.start()
    print(f"a one-node cluster is up (partition {c.partition}, node {c.host}); in your shell:\n"
          f"  export SLURM_CONF={c.conf}\n  sinfo\nand to stop it: python {sys.argv[0]} stop {a.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
