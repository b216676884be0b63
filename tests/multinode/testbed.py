"""A few SSH hosts on this machine: network namespaces, veth links, one sshd each.

Layout (``T`` is a short tag unique to one test bed)::

    root ns ── T-r ═ T-rh ─┐
                            br0 (in ns T-hub)
    ns T-h1: eth0 ═ T-1 ───┤   10.213.0.11
    ns T-h2: eth0 ═ T-2 ───┘   10.213.0.12

The /24 exists only on these links.  Each host runs ``sshd -D`` with its own config, host key
and authorized key under a temp dir, with its own hostname (``unshare --uts``).  Everything is
removed by :meth:`Testbed.down`, which is safe to call twice and after a failed ``up``.  Needs
root, ``ip``, ``unshare`` and ``/usr/sbin/sshd``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SUBNET = "10.213.0"


def missing_requirements() -> str | None:
    """Why a test bed cannot be built here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "multi-node test bed needs root (network namespaces)"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"multi-node test bed needs `{tool}` (run scripts/testbed-up)"
    if not os.access(SSHD, os.X_OK):
        return f"multi-node test bed needs {SSHD} (run scripts/testbed-up: openssh-server)"
    return None


@dataclass(frozen=True)
class TestHost:
    """One namespace host."""

    name: str  # ssh alias and hostname
    netns: str
    address: str
    ifname: str = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=20)


#: Inside each host's mount namespace, root's shell startup files are empty: sshd runs a
#: session's command through the login shell, and bash sources ~/.bashrc for it. This machine's
#: .bashrc runs `pyenv init`, whose rehash takes a lock that a session killed mid-way (a cut
#: link, a lost daemon: what these tests do) leaves behind, and every later session then waits
#: on it. A node of the test bed is a plain host: no user's shell set-up.
QUIET_SHELL_STARTUP = (
    "for f in /root/.bashrc /root/.profile /root/.bash_profile; do"
    ' [ -f "$f" ] && mount --bind /dev/null "$f"; done;'
)


class Testbed:
    """``n_hosts`` SSH hosts reachable from the root namespace."""

    __test__ = False  # not a pytest class

    def __init__(self, n_hosts: int = 2, tag: str | None = None, subnet: str = SUBNET) -> None:
        self.tag = tag or ("pt" + secrets.token_hex(2))
        #: the first three octets of the bed's /24: two beds up at once need two subnets
        self.subnet = subnet
        self.dir = Path(tempfile.mkdtemp(prefix=f"pollux-{self.tag}-"))
        os.chmod(self.dir, 0o755)  # readable by a second test user too
        #: A directory the hosts do NOT share with the root namespace: each host mounts its
        #: own empty tmpfs over it (to test the "checkpoint dir not shared" failure).
        self.private_dir = self.dir / "private"
        self.private_dir.mkdir()
        self.hub = f"{self.tag}-hub"
        self.hosts = [
            TestHost(
                name=f"{self.tag}-h{i}", netns=f"{self.tag}-h{i}", address=f"{subnet}.{10 + i}"
            )
            for i in range(1, n_hosts + 1)
        ]
        self.key = self.dir / "id_ed25519"
        self.ssh_config = self.dir / "ssh_config"
        self._sshd: dict[str, subprocess.Popen[bytes]] = {}

    # -- building -------------------------------------------------------------------------
    def up(self) -> Testbed:
        reason = missing_requirements()
        if reason:
            raise RuntimeError(reason)
        try:
            self._keys()
            self._network()
            for host in self.hosts:
                self._start_sshd(host)
            self._write_ssh_config()
            for host in self.hosts:
                self._wait_ssh(host)
        except BaseException:
            self.down()
            raise
        return self

    def _keys(self) -> None:
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)],
            check=True,
            timeout=20,
        )
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / "host_key")],
            check=True,
            timeout=20,
        )
        shutil.copy(self.dir / "id_ed25519.pub", self.dir / "authorized_keys")

    def _network(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        _ip("-n", self.hub, "link", "set", "lo", "up")
        # root namespace <-> hub
        _ip("link", "add", f"{self.tag}-r", "type", "veth", "peer", "name", f"{self.tag}-rh")
        _ip("link", "set", f"{self.tag}-rh", "netns", self.hub)
        _ip("-n", self.hub, "link", "set", f"{self.tag}-rh", "master", "br0", "up")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", f"{self.tag}-r")
        _ip("link", "set", f"{self.tag}-r", "up")
        for i, host in enumerate(self.hosts, start=1):
            _ip("netns", "add", host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("link", "add", f"{self.tag}-{i}", "type", "veth",
                "peer", "name", host.ifname, "netns", host.netns)  # fmt: skip
            _ip("link", "set", f"{self.tag}-{i}", "netns", self.hub)
            _ip("-n", self.hub, "link", "set", f"{self.tag}-{i}", "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")

    def _start_sshd(self, host: TestHost) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        config = self.dir / f"sshd_{host.name}.conf"
        config.write_text(
            "\n".join(
                [
                    "Port 22",
                    f"ListenAddress {host.address}",
                    f"HostKey {self.dir / 'host_key'}",
                    f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    "UsePAM no",
                    "StrictModes no",
                    "PidFile none",
                    "MaxSessions 64",
                    "MaxStartups 64",
                    "ClientAliveInterval 2",
                    "ClientAliveCountMax 3",
                    "LogLevel ERROR",
                    "",
                ]
            )
        )
        log = open(self.dir / f"sshd_{host.name}.log", "wb")  # noqa: SIM115 - lives with sshd
        self._sshd[host.name] = subprocess.Popen(
            [
                "ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount", "sh", "-c",
                f"hostname {host.name}; mount -t tmpfs -o size=1m none {self.private_dir};"
                f" {QUIET_SHELL_STARTUP} exec {SSHD} -D -f {config} -E {self.dir / (host.name + '.sshd.log')}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def _write_ssh_config(self) -> None:
        blocks = []
        for host in self.hosts:
            blocks.append(
                "\n".join(
                    [
                        f"Host {host.name}",
                        f"  HostName {host.address}",
                        "  User root",
                        f"  IdentityFile {self.key}",
                        "  IdentitiesOnly yes",
                        "  StrictHostKeyChecking no",
                        "  UserKnownHostsFile /dev/null",
                        "  LogLevel ERROR",
                    ]
                )
            )
        self.ssh_config.write_text("\n\n".join(blocks) + "\n")

    def ssh_options(self) -> tuple[str, ...]:
        """Options that make ``ssh HOSTNAME`` reach a test host."""
        return ("-F", str(self.ssh_config))

    def _wait_ssh(self, host: TestHost, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            proc = subprocess.run(
                ["ssh", *self.ssh_options(), "-o", "BatchMode=yes", "-o", "ConnectTimeout=2",
                 host.name, "hostname"],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            if proc.returncode == 0 and proc.stdout.strip() == host.name:
                return
            last = proc.stderr.strip() or proc.stdout.strip()
            sshd = self._sshd[host.name]
            if sshd.poll() is not None:
                log = (self.dir / f"sshd_{host.name}.log").read_text(errors="replace")
                raise RuntimeError(f"sshd on {host.name} exited: {log.strip()[-300:]}")
            time.sleep(0.2)
        raise RuntimeError(f"sshd on {host.name} did not answer within {timeout_s:g} s: {last}")

    # -- faults ---------------------------------------------------------------------------
    def cut_link(self, host: TestHost) -> None:
        """Take the host's only interface down (a pulled cable: packets are dropped)."""
        _ip("-n", host.netns, "link", "set", host.ifname, "down")

    def restore_link(self, host: TestHost) -> None:
        _ip("-n", host.netns, "link", "set", host.ifname, "up")

    def ssh(
        self, host: TestHost, command: str, timeout_s: float = 20.0
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ssh", *self.ssh_options(), "-o", "BatchMode=yes", host.name, command],
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip

    # -- teardown -------------------------------------------------------------------------
    def down(self) -> None:
        for sshd in self._sshd.values():
            if sshd.poll() is None:
                sshd.terminate()
                try:
                    sshd.wait(5)
                except subprocess.TimeoutExpired:
                    sshd.kill()
                    sshd.wait(5)
        self._sshd.clear()
        for host in self.hosts:
            # Processes started in the namespace (replicas of a test) go with it.
            pids = _ip("netns", "pids", host.netns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", f"{self.tag}-r", check=False)
        _ip("netns", "del", self.hub, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def remove_leftovers(prefix: str = "pt") -> list[str]:
    """Delete namespaces and links left by crashed test beds (names ``ptXXXX-*``)."""
    removed = []
    listing = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listing:
        name = line.split(" ")[0]
        if name.startswith(prefix) and "-h" in name and len(name.split("-")[0]) == 6:
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix) and name.endswith("-r") and len(name) == 8:
                _ip("link", "del", name, check=False)
                removed.append(name)
    for path in Path(tempfile.gettempdir()).glob(f"pollux-{prefix}????-*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed
