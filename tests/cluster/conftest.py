"""Real cluster programs on one machine: an sshd answering on 127.0.0.1 and 127.0.0.2, and a two-node
SLURM cluster (munged, slurmctld, two slurmd) on loopback. Each fixture starts its servers in a
temporary directory, waits until they answer, and stops them afterwards. Where a program is missing
or we are not root, the test is skipped with the reason (make test installs the packages)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import free_port


def need(*programs: str) -> None:
    missing = [p for p in programs if not (shutil.which(p) or Path("/usr/sbin", p).exists())]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (make test installs them with apt-get as root)")
    if os.geteuid() != 0:
        pytest.skip("these servers are started as root (sshd logins, slurmd); run the tests as root")


def wait_for(check, what: str, timeout: float = 30.0, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not come up in {timeout:.0f}s" + (f"\n{log.read_text()[-3000:]}"
                                                                      if log and log.exists() else ""))


def answers(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Sshd:
    port: int
    bin_dir: Path  # holds an `ssh` that uses this server's client key; put it first in PATH


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    need("sshd", "ssh", "ssh-keygen", "pdsh")
    d = tmp_path_factory.mktemp("sshd")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", d / "host_key"], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", d / "client_key"], check=True)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    port = free_port()
    (d / "sshd_config").write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", "ListenAddress 127.0.0.2", f"HostKey {d / 'host_key'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "PermitRootLogin prohibit-password", "StrictModes no",
        f"PidFile {d / 'sshd.pid'}", "LogLevel ERROR", ""]))
    (d / "ssh_config").write_text(f"Host *\n  IdentityFile {d / 'client_key'}\n  IdentitiesOnly yes\n"
                                  "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    bin_dir = d / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {d / 'ssh_config'} \"$@\"\n")
    (bin_dir / "ssh").chmod(0o755)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    sshd_bin = shutil.which("sshd") or "/usr/sbin/sshd"
    log = d / "sshd.log"
    proc = subprocess.Popen([sshd_bin, "-D", "-f", d / "sshd_config", "-E", log])
    try:
        wait_for(lambda: answers("127.0.0.1", port) and answers("127.0.0.2", port), "sshd", log=log)
        yield Sshd(port, bin_dir)
    finally:
        stop([proc])


@dataclass
class Slurm:
    conf: Path
    log_dir: Path

    def env(self, base: dict) -> dict:
        return dict(base, SLURM_CONF=str(self.conf))

    def job(self, job_id: str) -> dict:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                             env=self.env(dict(os.environ)))
        return dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))


@pytest.fixture(scope="module")
def slurm():
    """munged (as user munge), slurmctld and slurmd n1, n2 (one CPU each), all on 127.0.0.1."""
    need("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "runuser")
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="dstrain-slurm-"))  # not under pytest's 0700 tmp: munge must reach it
    d.chmod(0o755)
    munge_dir = d / "munge"
    munge_dir.mkdir()
    munge_dir.chmod(0o711)  # munged wants its socket directory searchable by all, its key private
    (munge_dir / "munge.key").write_bytes(os.urandom(1024))
    (munge_dir / "munge.key").chmod(0o400)
    subprocess.run(["chown", "-R", "munge:munge", munge_dir], check=True)
    socket_path = munge_dir / "munge.sock"
    ctld_port, *node_ports = free_port(), free_port(), free_port()
    for sub in ("state", "spool/n1", "spool/n2"):
        (d / sub).mkdir(parents=True)
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=dstraintest", f"SlurmctldHost={socket.gethostname()}(127.0.0.1)", f"SlurmctldPort={ctld_port}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        # cred_expire (default 120 s) is also how long a requeued job waits before it may start again
        f"AuthInfo=socket={socket_path},cred_expire=10", f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        # the main scheduling pass every 2 s instead of 60: a requeued job is otherwise started by the next one
        "AccountingStorageType=accounting_storage/none", "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=2",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2", "MpiDefault=none",
        "JobRequeue=1", "MinJobAge=600", "KillWait=30", "SlurmdTimeout=60", "SlurmctldTimeout=60",
        *(f"NodeName=n{i} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=1 State=UNKNOWN"
          for i, port in enumerate(node_ports, 1)),
        "PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP", ""]))
    env = dict(os.environ, SLURM_CONF=str(conf))
    procs = [subprocess.Popen(["runuser", "-u", "munge", "--", shutil.which("munged") or "/usr/sbin/munged",
                               "--foreground", f"--key-file={munge_dir / 'munge.key'}", f"--socket={socket_path}",
                               f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={munge_dir / 'munged.log'}",
                               f"--seed-file={munge_dir / 'munged.seed'}"])]
    slurm = Slurm(conf, d)
    try:
        wait_for(socket_path.exists, "munged", log=munge_dir / "munged.log")
        procs.append(subprocess.Popen(["slurmctld", "-D", "-f", conf], env=env))
        wait_for(lambda: answers("127.0.0.1", ctld_port), "slurmctld", log=d / "slurmctld.log")
        procs += [subprocess.Popen(["slurmd", "-D", "-N", name, "-f", conf], env=env) for name in ("n1", "n2")]

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=env).stdout
            return out.count("idle") == 2
        wait_for(idle, "two idle slurmd nodes", timeout=60, log=d / "slurmd-n2.log")
        yield slurm
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        stop(procs[:0:-1])  # slurmd, slurmctld, then munged
        stop(procs[:1])
        shutil.rmtree(d, ignore_errors=True)
