"""Real hosts on one machine: Linux network, mount and UTS namespaces joined by a bridge.

A :class:`Cluster` makes ``n`` hosts ``h0 .. h{n-1}`` (addresses ``10.<net>.0.1 ..``) and,
on request, one more host ``s3`` for an object store. Each host is a *holder* process
started with ``unshare -n -m -u``: its own network stack (``lo`` and ``eth0``, a veth pair
whose other end sits on a bridge in a separate switch namespace, so the machine's own
network is never touched), its own hostname and its own ``/dev/shm`` (a tmpfs mounted
in its mount namespace: a host's memory tier lives and dies with it). Every process of a
host is started by :meth:`Host.popen` through ``nsenter`` into the holder's namespaces, so
a host's processes and memory belong to it.

Faults (only the namespaces' own addresses and links are ever touched):

* :meth:`Host.kill` — SIGKILL every process of the host and wipe its ``/dev/shm`` (the
  node is replaced by a fresh one with the same address and an empty memory);
* :meth:`Host.freeze` / :meth:`Host.thaw` — SIGSTOP / SIGCONT every process of the host
  (a stopped VM, a host stuck in the kernel: it stops heartbeating, then comes back);
* :meth:`Host.fill_shm` / :meth:`Host.free_shm` — fill the host's own ``/dev/shm`` tmpfs
  (its node memory: the mem tier and the replicas it keeps) to the last byte, then free it;
* :meth:`Host.partition` / :meth:`Host.heal` — ``ip link set eth0 down|up`` on the host;
* :meth:`Host.cap` — a ``tc tbf`` bandwidth cap on the host's link (this kernel has no
  ``netem``: latency, loss and resets come from :class:`FaultyTCP`, a fault-injecting TCP
  proxy run inside a host, see ``python -m netns proxy``).

* :meth:`Cluster.delay` — latency between the training hosts. This kernel has no
  ``netem`` (nor ``fq``/``etf``, which an eBPF departure-time program would need); ``tbf``
  and ``htb`` only shape bandwidth (a packet waits only when the bucket is empty, so a
  tiny rate adds queueing that grows with the traffic, not a fixed latency). So the
  delay is a router host ``dly`` on the bridge whose forwarded packets go through a TUN
  device to a userspace delay line (:class:`DelayLine`, ``python netns.py delay``) and
  back: every packet between two training hosts (gloo, the c10d store, replication)
  takes ``ms`` longer each way, whatever its protocol or port.

:func:`unavailable` says why namespaces cannot be used here (tests skip with it).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

_NSENTER = ("-n", "-m", "-u")  # network, mount (own /dev/shm), hostname


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, timeout=60)


def unavailable() -> str | None:
    """Why this machine cannot make namespaced hosts (None: it can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux / iproute2)"
    probe = subprocess.run(
        ["unshare", "-n", "-m", "-u", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs tmpfs /dev/shm && ip link add t0 type veth peer name t1"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if probe.returncode != 0:
        return (
            "namespaces are not permitted here (run as root, or with CAP_SYS_ADMIN and "
            f"CAP_NET_ADMIN): {probe.stderr.strip() or probe.returncode}"
        )
    return None


class Host:
    """One namespaced host: a holder process whose namespaces every process joins."""

    def __init__(self, name: str, address: str, *, shm_size: str = "512m") -> None:
        self.name = name
        self.address = address
        self.shm_size = shm_size
        script = (
            f"mount -t tmpfs -o size={shm_size} tmpfs /dev/shm && hostname {name} && "
            "ip link set lo up && echo ready && exec sleep infinity"
        )
        self.holder = subprocess.Popen(
            ["unshare", "-n", "-m", "-u", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.holder.stdout is not None
        line = self.holder.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"host {name} did not start: {self.holder.stderr.read()}")  # type: ignore[union-attr]
        self.pid = self.holder.pid
        self.procs: list[subprocess.Popen[bytes]] = []

    # -- running things in the host ----------------------------------------------------
    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespaces."""
        return ["nsenter", "-t", str(self.pid), *_NSENTER, "--", *argv]

    def run(self, argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a short command in the host and wait for it."""
        return _run(self.argv(argv), check=check)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen[bytes]:
        """Start a process of this host (its own session: a kill reaches its children)."""
        proc = subprocess.Popen(self.argv(argv), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process in this host's network namespace but the holder."""
        mine = os.readlink(f"/proc/{self.pid}/ns/net")
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.pid:
                continue
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/net") == mine:
                    out.append(int(entry))
        return out

    # -- faults ------------------------------------------------------------------------
    def kill(self, *, wipe: bool = True) -> None:
        """The host dies: SIGKILL all its processes; ``wipe``: its memory (``/dev/shm``)
        is gone too (a replacement node with the same address and empty memory)."""
        for _ in range(3):  # children forked while we were killing
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.procs = [p for p in self.procs if p.poll() is None]
        if wipe:
            self.run(
                [
                    "sh",
                    "-c",
                    f"umount /dev/shm; mount -t tmpfs -o size={self.shm_size} tmpfs /dev/shm",
                ]
            )

    def freeze(self) -> None:
        """The host stops (SIGSTOP to every one of its processes): no heartbeat, no
        packet answered, nothing lost; :meth:`thaw` resumes it where it stopped."""
        for _ in range(2):  # a process forked meanwhile
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Resume a frozen host (SIGCONT to every one of its processes)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def fill_shm(self, leave: int = 0) -> int:
        """Fill the host's ``/dev/shm`` but ``leave`` bytes (0: to the last byte, ``dd``
        until ENOSPC after a fast ``fallocate`` of the bulk); the bytes it holds now."""
        free = int(self.run(["df", "-B1", "--output=avail", "/dev/shm"]).stdout.split()[-1])
        n = len(
            self.run(["sh", "-c", "ls /dev/shm/.filler* 2>/dev/null"], check=False).stdout.split()
        )
        bulk = free - max(leave, 1 << 20)
        if bulk > 0:
            self.run(["fallocate", "-l", str(bulk), f"/dev/shm/.filler{n}"])
        if not leave:
            self.run(
                ["sh", "-c", f"dd if=/dev/zero of=/dev/shm/.filler{n}b bs=4k 2>/dev/null; true"]
            )
        out = self.run(["sh", "-c", "du -cb /dev/shm/.filler* | tail -1"]).stdout.split()
        return int(out[0]) if out else 0

    def free_shm(self) -> None:
        """Remove what :meth:`fill_shm` wrote (the operator frees the disk)."""
        self.run(["sh", "-c", "rm -f /dev/shm/.filler*"])

    def shm_files(self) -> list[str]:
        """Files under this host's ``/dev/shm`` (relative paths)."""
        out = self.run(["sh", "-c", "cd /dev/shm && find . -type f"], check=False).stdout
        return sorted(line[2:] for line in out.splitlines() if line.startswith("./"))

    def partition(self) -> None:
        """Cut the host's link (``ip link set eth0 down``)."""
        self.run(["ip", "link", "set", "eth0", "down"])

    def heal(self) -> None:
        """Bring the host's link back."""
        self.run(["ip", "link", "set", "eth0", "up"])

    def cap(self, rate: str = "8mbit", burst: str = "32kb", latency: str = "200ms") -> None:
        """A ``tc tbf`` bandwidth cap on what the host sends."""
        self.run(["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                  "burst", burst, "latency", latency])  # fmt: skip

    def uncap(self) -> None:
        self.run(["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)

    def close(self) -> None:
        self.kill(wipe=False)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.holder.wait(timeout=10)


class Cluster:
    """``n`` hosts on one bridge (``10.<net>.0.<i+1>``) and optionally an ``s3`` host
    (``10.<net>.0.100``). A context manager: everything it started is gone after it."""

    def __init__(self, n: int, *, s3: bool = False, net: int | None = None, shm_size: str = "512m"):
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.net = net if net is not None else random.randint(40, 250)
        self.switch = Host("switch", "-", shm_size="1m")
        self.switch.run(["ip", "link", "add", "br0", "type", "bridge"])
        self.switch.run(["ip", "link", "set", "br0", "up"])
        self.hosts: list[Host] = []
        try:
            for i in range(n):
                self.hosts.append(self._add(f"h{i}", i + 1, shm_size))
            self.s3 = self._add("s3", 100, "1m") if s3 else None
            self._hosts_file()
        except BaseException:
            self.close()
            raise

    def _hosts_file(self) -> None:
        """Every host resolves every host's name (torchrun's rendezvous looks its own up):
        one ``/etc/hosts`` bind-mounted in each host's mount namespace."""
        import tempfile

        every = [*self.hosts, *([self.s3] if self.s3 else [])]
        fd, path = tempfile.mkstemp(prefix="netns-hosts-")
        with os.fdopen(fd, "w") as f:
            f.write("127.0.0.1 localhost\n::1 localhost\n")
            f.writelines(f"{h.address} {h.name}\n" for h in every)
        os.chmod(path, 0o644)
        self._hosts_path = path
        for host in every:
            host.run(["mount", "--bind", path, "/etc/hosts"])

    def _add(self, name: str, octet: int, shm_size: str) -> Host:
        host = Host(name, f"10.{self.net}.0.{octet}", shm_size=shm_size)
        port = f"v{name}"
        self.switch.run(["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0",
                         "netns", str(host.pid)])  # fmt: skip
        self.switch.run(["ip", "link", "set", port, "master", "br0", "up"])
        host.run(["ip", "addr", "add", f"{host.address}/24", "dev", "eth0"])
        host.run(["ip", "link", "set", "eth0", "up"])
        return host

    def delay(self, ms: float) -> None:
        """Add ``ms`` milliseconds each way to every packet between two training hosts
        (0: none). The first call adds the router host ``dly`` (see the module doc)."""
        if getattr(self, "router", None) is None:
            self.router = self._add("dly", 254, "1m")
            self.router.run(["sh", "-c", "; ".join([
                "sysctl -qw net.ipv4.ip_forward=1",
                "for k in all default eth0; do sysctl -qw net.ipv4.conf.$k.send_redirects=0; "
                "sysctl -qw net.ipv4.conf.$k.rp_filter=0; done",
                "ip rule add iif eth0 lookup 100",
            ])])  # fmt: skip
            self.line: subprocess.Popen[bytes] | None = None
        if self.line is not None:
            self.line.kill()
            self.line.wait()
            self.line = None
        for host in self.hosts:  # routes back to direct; redirects never honoured
            host.run(["sysctl", "-qw", "net.ipv4.conf.all.accept_redirects=0"])
            for other in self.hosts:
                if other is not host:
                    host.run(["ip", "route", "del", f"{other.address}/32"], check=False)
        if ms <= 0:
            return
        self.line = self.router.popen(
            [sys.executable, os.path.abspath(__file__), "delay", "--ms", str(ms)],
            stdout=subprocess.PIPE,
        )
        assert self.line.stdout is not None
        if self.line.stdout.readline().strip() != b"ready":
            raise RuntimeError("the delay line did not start on the router host")
        self.router.run(["sh", "-c", "ip link set tun0 up && "
                         "ip route replace default dev tun0 table 100"])  # fmt: skip
        for host in self.hosts:
            for other in self.hosts:
                if other is not host:
                    host.run(["ip", "route", "replace", f"{other.address}/32", "via",
                              self.router.address])  # fmt: skip

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        extra = [h for h in (getattr(self, "s3", None), getattr(self, "router", None)) if h]
        for host in [*self.hosts, *extra]:
            with contextlib.suppress(Exception):
                host.close()
        with contextlib.suppress(Exception):
            self.switch.close()
        with contextlib.suppress(Exception):
            os.unlink(self._hosts_path)


class FaultyTCP:
    """A TCP proxy that adds latency, drops connections (resets) and stalls, in front of
    a server: run inside a host (``python netns.py proxy LISTEN_PORT TARGET_HOST:PORT
    --delay S --reset P``), so that only namespace addresses are involved."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], *, delay: float = 0.0,
                 reset: float = 0.0, seed: int | None = None) -> None:  # fmt: skip
        self.listen, self.target = listen, target
        self.delay, self.reset = delay, reset
        self.rng = random.Random(seed)
        self.counts = {"connections": 0, "resets": 0}

    def serve(self) -> None:
        server = socket.create_server(self.listen, reuse_port=True)
        while True:
            conn, _ = server.accept()
            self.counts["connections"] += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(self.target, timeout=30)
        except OSError:
            conn.close()
            return
        # A reset: the connection is cut after a random part of the first request.
        cut = self.rng.random() < self.reset
        if cut:
            self.counts["resets"] += 1
        threading.Thread(target=self._pipe, args=(up, conn, False), daemon=True).start()
        self._pipe(conn, up, cut)

    def _pipe(self, src: socket.socket, dst: socket.socket, cut: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self.delay:
                    time.sleep(self.delay * (0.5 + self.rng.random()))
                if cut:
                    dst.sendall(data[: len(data) // 2])
                    # linger 0: close() sends a reset, as a dropped connection does
                    src.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()


class DelayLine:
    """A userspace ``netem delay``: packets read from a TUN device are written back into it
    ``ms`` later, in order (run in the router host, see :meth:`Cluster.delay`)."""

    TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000

    def __init__(self, ms: float, name: str = "tun0") -> None:
        import collections
        import fcntl

        self.seconds = ms / 1000
        self.fd = os.open("/dev/net/tun", os.O_RDWR)
        ifr = struct.pack("16sH", name.encode(), self.IFF_TUN | self.IFF_NO_PI)
        fcntl.ioctl(self.fd, self.TUNSETIFF, ifr)
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()

    def serve(self) -> None:
        threading.Thread(target=self._write, daemon=True).start()
        while True:
            packet = os.read(self.fd, 65536)
            with self.ready:
                self.queue.append((time.monotonic() + self.seconds, packet))
                self.ready.notify()

    def _write(self) -> None:
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                due, packet = self.queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with contextlib.suppress(OSError):
                os.write(self.fd, packet)


def _main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="netns.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    px = sub.add_parser("proxy", help="a fault-injecting TCP proxy (run inside a host)")
    px.add_argument("listen", type=int)
    px.add_argument("target")
    px.add_argument("--delay", type=float, default=0.0, help="seconds added per packet (mean)")
    px.add_argument("--reset", type=float, default=0.0, help="fraction of connections cut")
    px.add_argument("--seed", type=int, default=None)
    dl = sub.add_parser("delay", help="a delay line on a TUN device (run inside a host)")
    dl.add_argument("--ms", type=float, required=True)
    args = p.parse_args(argv)
    if args.cmd == "delay":
        line = DelayLine(args.ms)
        print("ready", flush=True)
        line.serve()
        return
    host, port = args.target.rsplit(":", 1)
    proxy = FaultyTCP(("0.0.0.0", args.listen), (host, int(port)), delay=args.delay,
                      reset=args.reset, seed=args.seed)  # fmt: skip
    print("ready", flush=True)
    proxy.serve()


if __name__ == "__main__":
    _main(sys.argv[1:])
