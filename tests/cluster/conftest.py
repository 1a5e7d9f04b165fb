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

from helpers import free_port


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
