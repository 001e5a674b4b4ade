"""One real Kubernetes node (containerd + runc + kubelet + kube-proxy + CoreDNS) inside a network
namespace that the project creates, beside the kwok nodes of ``e2e.cluster``.

Network (DESIGN.md §6; traffic stays on loopback or inside the namespace)::

    root namespace                         namespace rljob-<id>
    kube-apiserver 127.0.0.1:P   <------   forwarder listens on 10.203.0.2:P (socket made in the
                                           namespace, connects to 127.0.0.1:P in the root one)
    veth rlj<id> 10.203.0.1/30   ------>   veth eth0 10.203.0.2/30: kubelet :10250, CoreDNS :53,
    route 10.204.0.0/24 via .2             bridge cni0 10.204.0.1/24 -> pods 10.204.0.x

The apiserver advertises 10.203.0.2:P, so the ``kubernetes`` Service (10.96.0.1:443, kube-proxy in
iptables mode) leads pods to the forwarder. The root namespace reaches the node (logs/exec, the
apiserver's service proxy) over the veth pair; a mangle rule inside the namespace drops every new
connection that would leave it through that pair, so nothing inside opens one toward the root
namespace. The namespace has no default route and CoreDNS serves cluster names only.

Everything the node leaves on the host is recorded in the cluster's ``state.json`` before it is
made, so ``down`` removes it even after the owner was SIGKILLed: processes (also containers and
shims, found by cgroup and socket), mounts, pod namespaces, the namespace and its veth, cgroups,
``/var/log/containers`` links, and the global sysctls the kubelet rewrites.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000
NODE_NAME = "rljob-node"
NODE_LABEL = "rljob.io/real-node"
NODE_TAINT = {"key": NODE_LABEL, "value": "true", "effect": "NoSchedule"}
LINK_ROOT_IP = "10.203.0.1"
NODE_IP = "10.203.0.2"
POD_CIDR = "10.204.0.0/24"
POD_GATEWAY = "10.204.0.1"
SERVICE_CIDR = "10.96.0.0/16"
KUBELET_SYSCTLS = (
    "kernel/panic",
    "kernel/panic_on_oops",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
CGROUP_BASE = Path("/sys/fs/cgroup")
NODE_COMPONENTS = ("containerd", "kubelet", "kube-proxy", "coredns")
SANDBOX_IMAGE = "rljob.local/pause:1"
LOCK = Path("/run/rljob-real-node.lock")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


def setns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc().setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def in_netns(path: str) -> Iterator[None]:
    """Run the block in another network namespace, then come back."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        setns(path)
        yield
    finally:
        if _libc().setns(home, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back to the root namespace failed")
        os.close(home)


def node_id(workdir: Path) -> str:
    """A short id for the namespace, link and cgroup names of the node of ``workdir``."""
    return hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:6]


@dataclass(frozen=True)
class NodePaths:
    """Every name and path the node of one cluster directory uses (all derived, so ``down`` can
    find them from the directory alone)."""

    workdir: Path

    @property
    def id(self) -> str:
        return node_id(self.workdir)

    @property
    def netns(self) -> str:
        return f"rljob-{self.id}"

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    @property
    def veth_root(self) -> str:
        return f"rlj{self.id}"

    @property
    def cgroup_root(self) -> str:
        return f"rljob-node-{self.id}"

    @property
    def dir(self) -> Path:
        return self.workdir / "node"

    @property
    def state(self) -> Path:
        """containerd's state directory (sockets, task bundles, sandbox /dev/shm mounts)."""
        return Path(f"/run/rljob-node-{self.id}")

    @property
    def socket(self) -> Path:
        return self.state / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.dir / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.dir / "pod-logs"


def containerd_root(cache: Path) -> Path:
    """Shared with scripts/build_images.py, which imports the images into it at set-up."""
    return cache / "containerd" / "root"


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=60)


# ------------------------------------------------------------------------------- set-up pieces


def read_sysctls() -> dict[str, str]:
    """The global sysctls the kubelet rewrites, as they are now."""
    out = {}
    for key in KUBELET_SYSCTLS:
        with contextlib.suppress(OSError):
            out[key] = Path("/proc/sys", key).read_text().strip()
    return out


def restore_sysctls(saved: dict[str, str]) -> None:
    for key, value in saved.items():
        with contextlib.suppress(OSError):
            Path("/proc/sys", key).write_text(value + "\n")


def make_network(p: NodePaths) -> None:
    """The namespace, its veth pair, addresses and routes, and the rule that keeps new
    connections from leaving it toward the root namespace."""
    _sh("ip", "netns", "add", p.netns)
    _sh("ip", "link", "add", p.veth_root, "type", "veth", "peer", "name", "eth0", "netns", p.netns)
    _sh("ip", "addr", "add", f"{LINK_ROOT_IP}/30", "dev", p.veth_root)
    _sh("ip", "link", "set", p.veth_root, "up")
    _sh("ip", "route", "add", POD_CIDR, "via", NODE_IP, "dev", p.veth_root)

    def inside(*cmd: str) -> None:
        _sh("ip", "netns", "exec", p.netns, *cmd)

    inside("ip", "link", "set", "lo", "up")
    inside("ip", "addr", "add", f"{NODE_IP}/30", "dev", "eth0")
    inside("ip", "link", "set", "eth0", "up")
    # Service IPs need a route for the kernel to accept the connect() that kube-proxy then DNATs;
    # nothing un-NATed can leave anyway (the rule below).
    inside("ip", "route", "add", SERVICE_CIDR, "dev", "eth0")
    inside("sysctl", "-qw", "net.ipv4.ip_forward=1")
    for chain in ("POSTROUTING",):
        inside(
            "iptables", "-t", "mangle", "-I", chain, "1", "-o", "eth0",
            "-m", "conntrack", "--ctstate", "NEW,INVALID", "-j", "DROP",
        )  # fmt: skip


def write_node_files(p: NodePaths, *, api_port: int, cache: Path, kubeconfig_token: str) -> None:
    """containerd, CNI, kubelet, kube-proxy and CoreDNS configuration under ``workdir/node``."""
    d = p.dir
    for sub in ("cni", "ipam", "kubelet", "pod-logs"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    kubeconfig = f"""apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {{server: "https://{NODE_IP}:{api_port}", insecure-skip-tls-verify: true}}
users:
- name: node
  user: {{token: {kubeconfig_token}}}
contexts:
- name: local
  context: {{cluster: local, user: node}}
current-context: local
"""
    (d / "kubeconfig").write_text(kubeconfig)
    (d / "containerd.toml").write_text(f"""version = 2
root = "{containerd_root(cache)}"
state = "{p.state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{p.socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{SANDBOX_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{d / "cni"}"
""")
    cni = {
        "cniVersion": "0.4.0",
        "name": "rljob-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(d / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    (d / "cni" / "10-rljob.conflist").write_text(json.dumps(cni, indent=1))
    (d / "resolv.conf").write_text(f"nameserver {NODE_IP}\n")
    kubelet = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{p.cgroup_root}",
        "containerRuntimeEndpoint": f"unix://{p.socket}",
        "address": NODE_IP,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        # reachable only inside the namespace and from the apiserver over the veth pair
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [NODE_IP],
        "clusterDomain": "cluster.local",
        "resolvConf": str(d / "resolv.conf"),
        "failSwapOn": False,
        "podLogsDir": str(p.pod_logs),
        # a 6-7 GiB worker image on a shared disk must not be collected or trigger evictions
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "serializeImagePulls": False,
        "registerWithTaints": [NODE_TAINT],
        "maxPods": 40,
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "0s",
        "localStorageCapacityIsolation": True,
        "protectKernelDefaults": False,
        "shutdownGracePeriod": "0s",
    }
    (d / "kubelet.json").write_text(json.dumps(kubelet, indent=1))
    proxy = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(d / "kubeconfig")},
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "hostnameOverride": NODE_NAME,
        "bindAddress": NODE_IP,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "iptables": {"masqueradeAll": True, "syncPeriod": "10s", "minSyncPeriod": "0s"},
        # leave the global conntrack table size alone
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
        "nodePortAddresses": [f"{NODE_IP}/32"],
    }  # fmt: skip
    (d / "kube-proxy.json").write_text(json.dumps(proxy, indent=1))
    (d / "Corefile").write_text(f"""cluster.local:53 in-addr.arpa:53 {{
    errors
    kubernetes cluster.local in-addr.arpa {{
        kubeconfig {d / "kubeconfig"} local
        pods insecure
        fallthrough in-addr.arpa
        ttl 5
    }}
    cache 5
}}
.:53 {{
    errors
}}
""")


def make_cgroups(p: NodePaths) -> None:
    """The kubelet's cgroup root in every v1 hierarchy (it must exist before the kubelet starts)."""
    for hier in _hierarchies():
        (hier / p.cgroup_root).mkdir(exist_ok=True)


def _hierarchies() -> list[Path]:
    if not CGROUP_BASE.is_dir():
        return []
    return [h for h in sorted(CGROUP_BASE.iterdir()) if h.is_dir() and not h.is_symlink()]


# ------------------------------------------------------------------------------- teardown


def node_pids(p: NodePaths) -> list[int]:
    """Every process of the node: in its cgroups (containers, pause), a shim of its containerd,
    or a node component started for it."""
    found: set[int] = set()
    marker = str(p.workdir.resolve()).encode()
    state = str(p.state).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cgroups = (entry / "cgroup").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        in_cgroup = f"/{p.cgroup_root}/" in cgroups or f"/{p.cgroup_root}\n" in cgroups
        ours = state in cmdline or (marker in cmdline and b"realnode.py" in cmdline)
        if in_cgroup or ours:
            found.add(int(entry.name))
        else:
            exe = cmdline.split(b"\0", 1)[0].rsplit(b"/", 1)[-1].decode(errors="replace")
            if exe in NODE_COMPONENTS and marker in cmdline:
                found.add(int(entry.name))
    return sorted(found)


def _mounts_under(prefixes: list[str]) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == pre or point.startswith(pre.rstrip("/") + "/") for pre in prefixes):
            out.append(point)
    return out


def unmount_all(prefixes: list[str]) -> None:
    """Unmount everything mounted at or below ``prefixes`` (deepest first, lazily if busy)."""
    libc = _libc()
    for _ in range(5):
        points = sorted(set(_mounts_under(prefixes)), key=len, reverse=True)
        if not points:
            return
        for point in points:
            if libc.umount2(point.encode(), 0) != 0:
                libc.umount2(point.encode(), 2)  # MNT_DETACH


def remove_cgroups(p: NodePaths, timeout: float = 30.0) -> None:
    """Remove the node's cgroups; killed processes leave a cgroup only once they are reaped
    (zombies still count), so try again for a while."""
    deadline = time.monotonic() + timeout
    while True:
        _remove_cgroups_once(p)
        if not any((h / p.cgroup_root).exists() for h in _hierarchies()):
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.5)


def _remove_cgroups_once(p: NodePaths) -> None:
    for hier in _hierarchies():
        root = hier / p.cgroup_root
        if not root.exists():
            continue
        for d in sorted((x for x in root.rglob("*") if x.is_dir()), key=lambda x: -len(x.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            root.rmdir()


def teardown(p: NodePaths, saved_sysctls: dict[str, str]) -> list[str]:
    """Remove everything of the node; returns what could not be removed (empty when clean)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = node_pids(p)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (10 if sig == signal.SIGTERM else 5)
        while time.monotonic() < deadline and any(_alive(x) for x in pids):
            time.sleep(0.2)
    # containerd names pod namespaces /run/netns/cni-<uuid>; only one real node runs at a time
    pod_ns = sorted(str(x) for x in Path("/run/netns").glob("cni-*"))
    unmount_all([str(p.state), str(p.kubelet_root), *pod_ns])
    for ns in pod_ns:
        with contextlib.suppress(OSError):
            Path(ns).unlink()
    if Path(p.netns_path).exists():
        _sh("ip", "netns", "del", p.netns, check=False)
    _sh("ip", "link", "del", p.veth_root, check=False)
    remove_cgroups(p)
    restore_sysctls(saved_sysctls)
    logs = Path("/var/log/containers")
    if logs.is_dir():
        for link in logs.iterdir():
            with contextlib.suppress(OSError):
                if link.is_symlink() and str(p.pod_logs) in os.readlink(link):
                    link.unlink()
    subprocess.run(["rm", "-rf", str(p.state)], check=False)
    return leftovers(p)


def leftovers(p: NodePaths) -> list[str]:
    """What of the node is still on the host (empty after a clean ``down``)."""
    left = [f"process {pid}" for pid in node_pids(p) if _alive(pid)]
    left += [f"mount {m}" for m in _mounts_under([str(p.state), str(p.kubelet_root)])]
    if Path(p.netns_path).exists():
        left.append(f"netns {p.netns}")
    if _sh("ip", "link", "show", p.veth_root, check=False).returncode == 0:
        left.append(f"veth {p.veth_root}")
    left += [f"cgroup {h / p.cgroup_root}" for h in _hierarchies() if (h / p.cgroup_root).exists()]
    return left


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ------------------------------------------------------------------------------- forwarder


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _serve(netns: str, listen: tuple[str, int], target: tuple[str, int]) -> None:
    import socket

    with in_netns(netns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(listen)
        sock.listen(256)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            tr, tw = await asyncio.open_connection(*target)
        except OSError:
            w.close()
            return
        await asyncio.gather(_pipe(r, tw), _pipe(tr, w))

    server = await asyncio.start_server(handle, sock=sock)
    async with server:
        await server.serve_forever()


def forward_main(argv: list[str]) -> int:
    """``python e2e/realnode.py forward NETNS LISTEN_IP:PORT TARGET_IP:PORT [WORKDIR]`` (the
    cluster directory is only there to tell this process apart in ``down``)."""
    netns, listen, target = argv[:3]
    lh, lp = listen.rsplit(":", 1)
    th, tp = target.rsplit(":", 1)
    asyncio.run(_serve(netns, (lh, int(lp)), (th, int(tp))))
    return 0


# ------------------------------------------------------------------------------- jobs on the node

ON_REAL_NODE: dict[str, Any] = {
    "nodeSelector": {NODE_LABEL: "true"},
    "tolerations": [{"key": NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
}


def volume_manifests(namespace: str, model_dir: Path, checkpoint_dir: Path) -> list[dict[str, Any]]:
    """hostPath PersistentVolumes bound to the claims ``models`` (read-only, the model) and
    ``ckpt`` (checkpoints) in ``namespace``."""
    return claim_manifests(
        namespace,
        [("models", model_dir, "ReadOnlyMany"), ("ckpt", checkpoint_dir, "ReadWriteMany")],
    )


def claim_manifests(namespace: str, claims: list[tuple[str, Path, str]]) -> list[dict[str, Any]]:
    """A hostPath PersistentVolume and its bound claim per ``(claim, directory, access mode)``."""
    docs: list[dict[str, Any]] = []
    for claim, path, mode in claims:
        pv = f"{namespace}-{claim}"
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": pv, "labels": {"rljob.io/demo-namespace": namespace}},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": [mode],
                    "hostPath": {"path": str(path), "type": "Directory"},
                    "storageClassName": "",
                    "claimRef": {"namespace": namespace, "name": claim},
                    "persistentVolumeReclaimPolicy": "Retain",
                },
            }
        )
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim, "namespace": namespace},
                "spec": {
                    "accessModes": [mode],
                    "resources": {"requests": {"storage": "1Gi"}},
                    "storageClassName": "",
                    "volumeName": pv,
                },
            }
        )
    return docs


def checkpoint_volume(namespace: str, job: str, directory: Path) -> dict[str, Any]:
    """A hostPath PersistentVolume for the per-job checkpoint claim ``<job>-checkpoints`` the
    operator creates (the node has no provisioner that writes as the pods' uid: this one is
    pre-bound to the claim, in the cluster's default StorageClass)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": f"{namespace}-{job}-checkpoints",
            "labels": {"rljob.io/demo-namespace": namespace},
        },
        "spec": {
            "capacity": {"storage": "10Gi"},
            "accessModes": ["ReadWriteOnce"],
            "hostPath": {"path": str(directory), "type": "Directory"},
            "storageClassName": "standard",
            "claimRef": {"namespace": namespace, "name": f"{job}-checkpoints"},
            "persistentVolumeReclaimPolicy": "Retain",
        },
    }


def job_for_real_node(
    job: dict[str, Any],
    *,
    steps: int | None = None,
    image: str | None = None,
    checkpoint_claim: str | None = "ckpt",
) -> dict[str, Any]:
    """An example manifest made to run on the real node: CPU pods (no GPU), the model on the
    ``models`` claim, checkpoints on ``checkpoint_claim`` (None: the per-job claim the operator
    creates), the locally imported image (never pulled), and the node chosen explicitly
    (selector + toleration)."""
    job = json.loads(json.dumps(job))
    spec = job["spec"]
    if steps is not None:
        spec["totalSteps"] = steps
    spec["model"]["volume"] = {"claimName": "models"}
    spec["checkpoint"] = {**spec.get("checkpoint", {}), "everySteps": 5}
    if checkpoint_claim:
        spec["checkpoint"]["claimName"] = checkpoint_claim
    # the pod settings sit under spec.worker from v1beta1 on, at the top of the spec before
    pods = (
        spec if job.get("apiVersion", "").endswith("/v1alpha1") else spec.setdefault("worker", {})
    )
    pods["imagePullPolicy"] = "Never"
    if image:
        pods["image"] = image
    resources = {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": "6Gi"}}
    for role in ("trainer", "rollout"):
        if role in spec or role == "trainer":
            spec.setdefault(role, {})["gpusPerReplica"] = 0
            spec[role]["resources"] = resources
    spec["scheduling"] = {**spec.get("scheduling", {}), **ON_REAL_NODE}
    return job


def prepare_namespace_main(argv: list[str]) -> int:
    """``python e2e/realnode.py prepare NAMESPACE DIR``: print (YAML) the namespace, the tiny
    model and checkpoint volumes under DIR; builds the model there first."""
    import yaml

    from rljob_workers.tinymodel import build_tiny_model

    namespace, root = argv[0], Path(argv[1]).resolve()
    model_dir, ckpt_dir = root / "models", root / "checkpoints"
    build_tiny_model(model_dir / "tiny-qwen2")  # a no-op when built; makes it readable
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir.chmod(0o777)
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    docs = [ns, *volume_manifests(namespace, model_dir, ckpt_dir)]
    print(yaml.safe_dump_all(docs), end="")
    return 0


def job_main(argv: list[str]) -> int:
    """``python e2e/realnode.py job EXAMPLE.yaml [STEPS]``: print the example made for the node."""
    import yaml

    job = yaml.safe_load(Path(argv[0]).read_text())
    steps = int(argv[1]) if len(argv) > 1 else None
    print(yaml.safe_dump(job_for_real_node(job, steps=steps)), end="")
    return 0


if __name__ == "__main__":
    commands = {"forward": forward_main, "prepare": prepare_namespace_main, "job": job_main}
    if len(sys.argv) > 1 and sys.argv[1] in commands:
        sys.exit(commands[sys.argv[1]](sys.argv[2:]))
    print(__doc__)
