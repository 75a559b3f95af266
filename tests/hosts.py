"""Test hosts on one machine: network namespaces joined by a bridge, sshd in each, and a
one-node Slurm (slurmctld, slurmd, munged). Everything is started here and ended by pid.

Needs root and Debian's iproute2, openssh-server (and openssh-client), openmpi-bin,
slurm-wlm and munge (.ci/run installs them). `skip_reason(...)` says what is missing.

The network: a bridge in the root namespace holds the "controller" address 10.213.S.1/24
(S from the pid, so that two test sessions do not collide); host i is namespace
`tplab-<pid>-hi` with 10.213.S.(i+1) on a veth whose other end is on the bridge. Hosts
reach each other and the controller over the bridge; the namespaces share the machine's
file system and pids, so the tests check every namespace's processes by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from pids import alive, wait_gone

TOOLS = {"ip": "iproute2", "sshd": "openssh-server", "ssh": "openssh-client",
         "ssh-keygen": "openssh-client", "mpiexec": "openmpi-bin", "slurmctld": "slurm-wlm",
         "slurmd": "slurm-wlm", "munged": "munge"}
SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")


def which(tool: str) -> str | None:
    return shutil.which(tool) or next(
        (os.path.join(d, tool) for d in SBIN if os.path.exists(os.path.join(d, tool))), None)


def skip_reason(*tools: str) -> str | None:
    """Why a multi-host test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd, slurmd); CI runs as root"
    missing = [t for t in tools if which(t) is None]
    if missing:
        pkgs = sorted({TOOLS.get(t, t) for t in missing})
        return (f"missing {', '.join(missing)}: apt-get install -y {' '.join(pkgs)} "
                "(.ci/run does this)")
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """`n` test hosts in network namespaces; `.controller` is the bridge address."""

    def __init__(self, n: int = 2):
        tag = os.getpid() % 100000
        self.subnet = f"10.213.{os.getpid() % 250 + 1}"
        self.bridge = f"tpb{tag}"
        self.controller = f"{self.subnet}.1"
        self.names = [f"tplab-{tag}-h{i + 1}" for i in range(n)]
        self.addresses = [f"{self.subnet}.{i + 2}" for i in range(n)]
        self._veths = [f"tpv{tag}h{i + 1}" for i in range(n)]
        self.tmp = tempfile.mkdtemp(prefix="tplab-hosts-")
        self.sshd_pids: dict[str, int] = {}
        self.ssh_config = os.path.join(self.tmp, "ssh_config")

    def start(self) -> Hosts:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Hosts:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.controller}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for ns, veth, addr in zip(self.names, self._veths, self.addresses, strict=True):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                 "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def ns_pids(self, ns: str) -> list[int]:
        """The processes running in namespace `ns`, by pid (sshd excluded)."""
        out = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        sshd = self.sshd_pids.get(ns)
        return [int(p) for p in out if int(p) != sshd and alive([int(p)])]

    def leftovers(self) -> dict[str, list[str]]:
        """ns -> 'pid cmdline' of every process still there (sshd aside)."""
        import psutil

        found = {}
        for ns in self.names:
            rows = []
            for pid in self.ns_pids(ns):
                try:
                    rows.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:120]}")
                except psutil.Error:
                    continue
            if rows:
                found[ns] = rows
        return found

    def start_sshd(self) -> None:
        """sshd in every namespace on port 22 of its address, with a key made here."""
        key = os.path.join(self.tmp, "id_ed25519")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        host_key = os.path.join(self.tmp, "host_ed25519")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key)
        shutil.copy(key + ".pub", os.path.join(self.tmp, "authorized_keys"))
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        with open(self.ssh_config, "w") as f:
            f.write(f"Host {self.subnet}.*\n  IdentityFile {key}\n  IdentitiesOnly yes\n"
                    "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                    "  BatchMode yes\n  LogLevel ERROR\n  User root\n")
        for ns, addr in zip(self.names, self.addresses, strict=True):
            config = os.path.join(self.tmp, f"sshd_{ns}")
            with open(config, "w") as f:
                f.write(f"ListenAddress {addr}\nPort 22\nHostKey {host_key}\n"
                        f"AuthorizedKeysFile {self.tmp}/authorized_keys\n"
                        "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                        f"PidFile {self.tmp}/sshd_{ns}.pid\nMaxStartups 100\n"
                        "MaxSessions 100\nSubsystem sftp internal-sftp\n")
            proc = subprocess.Popen(["ip", "netns", "exec", ns, which("sshd"), "-D", "-e",
                                     "-f", config], stdout=subprocess.DEVNULL,
                                    stderr=open(os.path.join(self.tmp, f"sshd_{ns}.log"), "w"))
            self.sshd_pids[ns] = proc.pid  # `ip netns exec` execs sshd: the same pid
        for addr in self.addresses:
            _wait_port(addr, 22, 10)

    def ssh(self, host: str, command: str) -> subprocess.CompletedProcess:
        return _run("ssh", "-F", self.ssh_config, host, command, check=False)

    def stop(self) -> None:
        for pid in self.sshd_pids.values():
            _kill(pid)
        wait_gone(list(self.sshd_pids.values()), 5)
        for ns in self.names:  # anything a failed test left behind, by pid
            for pid in self.ns_pids(ns):
                _kill(pid)
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _wait_port(host: str, port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Slurm:
    """A one-node Slurm cluster (this machine), from ../shared/notes/slurm-one-node.md
    (with `cpus` CPUs whatever the machine has: SlurmdParameters=config_overrides):
    munged with a key made here, slurmctld and slurmd with a slurm.conf in a temporary
    folder. `env` holds SLURM_CONF for every Slurm command."""

    def __init__(self, cpus: int = 4):
        self.tmp = tempfile.mkdtemp(prefix="tplab-slurm-")
        self.cpus = cpus
        self.pids: list[int] = []
        self.procs: list[subprocess.Popen] = []  # waited for at stop: no zombie is left
        self.conf = os.path.join(self.tmp, "slurm.conf")
        self.env = {"SLURM_CONF": self.conf}
        self.munge_dir = ""

    def start(self) -> Slurm:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Slurm:
        import pwd

        munge_dir = self.munge_dir = tempfile.mkdtemp(prefix="tplab-munge-")  # munge's own
        uid = pwd.getpwnam("munge").pw_uid
        key = os.path.join(munge_dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        socket_path = "/run/munge/munge.socket.2"  # where slurm's auth/munge looks
        if os.path.exists(socket_path):
            os.unlink(socket_path)  # a stale one; _wait_file waits for ours
        os.makedirs("/run/munge", exist_ok=True)
        for path in (munge_dir, key, "/run/munge"):
            os.chown(path, uid, -1)
        os.chmod(munge_dir, 0o700)
        munged = subprocess.Popen(
            ["runuser", "-u", "munge", "--", which("munged"), "-F", "--force",
             f"--key-file={key}", f"--socket={socket_path}",
             f"--seed-file={munge_dir}/seed"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(munge_dir, "munged.log"), "w"))
        self.pids.append(munged.pid)
        self.procs.append(munged)
        _wait_file(socket_path, 10)
        import psutil

        # munged itself, a child of runuser (in the foreground munged writes no pid file)
        self.pids += [c.pid for c in psutil.Process(munged.pid).children()]
        host = socket.gethostname()
        for d in ("state", "spool", "log"):
            os.makedirs(os.path.join(self.tmp, d))
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=tplabtest
SlurmctldHost={host}
SlurmUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
StateSaveLocation={self.tmp}/state
SlurmdSpoolDir={self.tmp}/spool
SlurmctldPidFile={self.tmp}/slurmctld.pid
SlurmdPidFile={self.tmp}/slurmd.pid
SlurmctldLogFile={self.tmp}/log/slurmctld.log
SlurmdLogFile={self.tmp}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=2
SlurmdParameters=config_overrides
NodeName={host} CPUs={self.cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
""")
        env = {**os.environ, **self.env}
        for daemon in ("slurmctld", "slurmd"):
            proc = subprocess.Popen([which(daemon), "-D", "-f", self.conf], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.pids.append(proc.pid)
            self.procs.append(proc)
        deadline = time.monotonic() + 30
        while "idle" not in self.sinfo():
            if time.monotonic() > deadline or not all(alive([p]) for p in self.pids):
                raise RuntimeError(f"Slurm did not come up: {self.sinfo()!r}; logs in "
                                   f"{self.tmp}/log")
            time.sleep(0.3)
        return self

    def sinfo(self) -> str:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                             env={**os.environ, **self.env}, timeout=10)
        return out.stdout.strip()

    def jobs(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True,
                             env={**os.environ, **self.env}, timeout=10)
        return [x for x in out.stdout.splitlines() if x.strip()]

    def left_running(self) -> list[int]:
        """This cluster's processes that are not its daemons: slurmstepd daemonizes (its
        parent is init, not slurmd), so ending slurmd leaves a step daemon still cleaning up
        running. Each holds slurmd's log, a file in this cluster's folder: that, not a process
        name, says it is ours."""
        import psutil

        found = []
        for proc in psutil.process_iter():
            if proc.pid in self.pids or proc.pid == os.getpid():
                continue
            try:
                if any(f.path.startswith(self.tmp + os.sep) for f in proc.open_files()):
                    found.append(proc.pid)
            except psutil.Error:  # gone meanwhile, or not ours to read
                continue
        return found

    def stop(self) -> None:
        for pid in reversed(self.pids):  # slurmd, slurmctld, then munged
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        if wait_gone(self.pids, 10):
            for pid in self.pids:
                _kill(pid)
        wait_gone(self.pids, 5)
        steps = self.left_running()  # slurmd is gone: no new step daemon can start
        for pid in steps:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        for pid in wait_gone(steps, 10):
            _kill(pid)
        wait_gone(steps, 5)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)
        shutil.rmtree(self.munge_dir, ignore_errors=True)


def _wait_file(path: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {seconds} s")
        time.sleep(0.05)
