"""A real Kubernetes control plane on loopback, for tests and for a throwaway cluster.

Runs etcd, kube-apiserver (RBAC, token auth, ServiceAccount token issuing), kube-controller-manager
(garbage collector, namespaces, service accounts, jobs, node lifecycle ...), kube-scheduler and kwok
(simulated kubelets, with the chaos stages of ``e2e/kwok-stages.yaml``) on free loopback ports, then
registers fake GPU nodes (``nvidia.com/gpu`` allocatable, tainted ``nvidia.com/gpu:NoSchedule``; the
API server's ExtendedResourceToleration admission plugin adds the toleration to pods that request
GPUs) and one untainted CPU node.

With ``real_node=True`` (``up --real-node``) it adds one real node, ``rljob-node`` (containerd +
runc + kubelet + kube-proxy + CoreDNS inside a network namespace, see ``e2e/realnode.py``), labelled
and tainted ``rljob.io/real-node=true:NoSchedule`` so only pods that select and tolerate it run
there (kwok's nodes never take them: they lack the label). Needs root and ``scripts/setup.sh``'s
node set-up (Debian packages, kubelet/kube-proxy/coredns, images imported into containerd).

Command line::

    python -m e2e.cluster up [--dir DIR] [--gpu-nodes N] [--kueue] [--real-node]  # kubeconfig path
    python -m e2e.cluster status [--dir DIR]
    python -m e2e.cluster down [--dir DIR]

``--kueue`` also starts the Kueue controller manager (built from its Go module; see e2e/kueue.py);
``jobset=True`` the JobSet controller manager (built on demand for ``bench.controllers``; see
e2e/jobset.py). ``controller_qps`` raises the client rate limit of kube-controller-manager and
kube-scheduler (``--kube-api-qps``, burst twice that) from their defaults (20 and 50);
``node_grace_seconds`` is how long a node may miss heartbeats before it is NotReady (40 s).

As a library, ``LocalCluster(...).up()`` / ``.down()``; with ``tie_to_parent=True`` every process
gets PR_SET_PDEATHSIG so it dies with the process that started it, even on SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from e2e import jobset, kueue, realnode
from rljob_workers.ports import free_port

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = Path(os.environ.get("RLJOB_CLUSTER_DIR", "/tmp/rljob-cluster"))
ADMIN_TOKEN = "rljob-local-admin-token"
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "kueue",
    "jobset",
    *realnode.NODE_COMPONENTS,
)
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
DEFAULT_STORAGE_CLASS: dict[str, object] = {
    "apiVersion": "storage.k8s.io/v1",
    "kind": "StorageClass",
    "metadata": {
        "name": "standard",
        "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
    },
    "provisioner": "kubernetes.io/host-path",
    "reclaimPolicy": "Delete",
    "volumeBindingMode": "Immediate",
}
"""The cluster's default StorageClass, as most clusters have one: the controller-manager's
hostPath provisioner (test-only, one machine) binds claims that name no class at once."""
HOSTPATH_PROVISIONER_DIR = Path("/tmp/hostpath_pv")
"""Where the controller-manager's hostPath provisioner makes a directory per volume."""


def _versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (REPO / "scripts" / "versions.env").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def cache_dir() -> Path:
    """The setup cache (same rule as scripts/lib.sh)."""
    if "RLJOB_CACHE" in os.environ:
        return Path(os.environ["RLJOB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rljob-operator"


def binary(name: str) -> Path:
    """Path of a control-plane binary built by scripts/build_controlplane.sh."""
    v = _versions()
    if name == "containerd":
        return Path(shutil.which("containerd") or "/usr/bin/containerd")
    folder = {
        "etcd": f"etcd-{v['ETCD_VERSION']}",
        "kwok": f"kwok-{v['KWOK_VERSION']}",
        "helm": f"helm-{v['HELM_VERSION']}",
        "kueue": f"kueue-{v['KUEUE_VERSION']}",
        "jobset": f"jobset-{v.get('JOBSET_VERSION', '')}",
        "kubelet": f"kubenode-{v['K8S_VERSION']}",
        "kube-proxy": f"kubenode-{v['K8S_VERSION']}",
        "coredns": f"coredns-{v.get('COREDNS_VERSION', '')}",
    }.get(name, f"kubernetes-{v['K8S_VERSION']}")
    path = cache_dir() / "bin" / folder / name
    if not path.exists():
        how = "scripts/build_controlplane.sh jobset" if name == "jobset" else "scripts/setup.sh"
        raise FileNotFoundError(f"{path} is missing: run {how} (it builds the binaries)")
    return path


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _preexec(tie_to_parent: bool, netns: str | None) -> Callable[[], None] | None:
    if not tie_to_parent and netns is None:
        return None

    def run() -> None:
        if tie_to_parent:
            _die_with_parent()
        if netns is not None:
            realnode.setns(netns)

    return run


def real_node_missing() -> str | None:
    """Why a real node cannot start here (None when it can): root, packages, binaries, images."""
    if os.geteuid() != 0:
        return "a real node needs root (containerd, network namespaces, cgroups)"
    for tool in ("containerd", "runc", "ctr", "iptables", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is missing: run scripts/setup.sh (its node step installs it)"
    if not Path("/usr/lib/cni/bridge").exists():
        return "CNI plugins missing in /usr/lib/cni: run scripts/setup.sh"
    for name in ("kubelet", "kube-proxy", "coredns"):
        try:
            binary(name)
        except FileNotFoundError as e:
            return str(e)
    marker = cache_dir() / "images" / "imported.json"
    if not marker.exists():
        return f"images not imported into containerd ({marker} missing): run scripts/setup.sh"
    return None


@dataclass
class LocalCluster:
    """One local control plane rooted at ``workdir`` (state, logs and kubeconfig live there)."""

    workdir: Path = DEFAULT_DIR
    gpu_nodes: int = 4
    gpus_per_node: int = 8
    tie_to_parent: bool = False
    kueue: bool = False
    real_node: bool = False
    jobset: bool = False
    controller_qps: int | None = None
    node_grace_seconds: int = 40
    apiserver_profiling: bool = False
    """Serve kube-apiserver's /debug/pprof (bench.ramp profiles it); off by default."""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def node(self) -> realnode.NodePaths:
        return realnode.NodePaths(self.workdir)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.workdir / "state.json"

    def _ports(self) -> dict[str, int]:
        return json.loads(self.state_file.read_text())["ports"]  # type: ignore[no-any-return]

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self._ports()['apiserver']}"

    # ---------------------------------------------------------------- lifecycle

    def up(self, timeout: float = 180.0, progress: Callable[[str], None] | None = None) -> float:
        """Start every component, register nodes, wait until usable; return seconds to ready."""
        say = progress or (lambda _msg: None)
        start = time.monotonic()
        if self.running_pids():
            raise RuntimeError(f"a cluster is already running in {self.workdir}: run `down` first")
        if self.real_node:
            self._check_real_node_possible()
        self.workdir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)  # a throwaway cluster starts empty
        (self.workdir / "logs").mkdir(exist_ok=True)
        names = ["etcd", "etcd_peer", "apiserver", "kcm", "sched", "kwok"]
        if self.kueue:
            names += list(kueue.PORTS)
        if self.jobset:
            names += list(jobset.PORTS)
        ports = {k: free_port() for k in names}
        state: dict[str, object] = {"ports": ports, "pids": {}}
        if self.real_node:
            # recorded before anything is changed, so `down` can undo it after any crash
            state["real_node"] = {"sysctls": realnode.read_sysctls()}
        self.state_file.write_text(json.dumps(state))
        self._write_credentials()
        self._write_kubeconfig()
        try:
            if self.real_node:
                say(f"creating network namespace {self.node.netns}")
                realnode.make_network(self.node)
            say("starting etcd")
            self._start("etcd", self._etcd_args(ports))
            self._wait(
                lambda: self._http_ok(f"http://127.0.0.1:{ports['etcd']}/health"), 60, "etcd"
            )
            say("starting kube-apiserver")
            self._start("kube-apiserver", self._apiserver_args(ports))
            self._wait(lambda: self._api_ok("/readyz"), timeout, "kube-apiserver /readyz")
            say("starting controller-manager, scheduler, kwok")
            self._start("kube-controller-manager", self._kcm_args(ports))
            self._start("kube-scheduler", self._scheduler_args(ports))
            self._start("kwok", self._kwok_args(ports))
            say(f"registering {self.gpu_nodes} fake GPU nodes + 1 CPU node")
            self._create_nodes()
            self._wait(self._nodes_ready, timeout, "nodes Ready")
            self._wait(
                lambda: self._api_ok("/api/v1/namespaces/default/serviceaccounts/default"),
                timeout,
                "default ServiceAccount (controller-manager)",
            )
            if self.kueue:
                say("starting kueue")
                self._start_kueue(ports)
            if self.jobset:
                say("starting jobset")
                self._start_jobset(ports)
            if self.real_node:
                self._up_real_node(ports, timeout, say)
        except BaseException:
            self.down()
            raise
        return time.monotonic() - start

    def down(self) -> None:
        """Stop every process of this cluster (by pid file, then by scanning /proc for strays);
        with a real node, also remove everything it left on the host, and the directories the
        hostPath provisioner made for this cluster's claims."""
        provisioned = self._provisioned_dirs()
        self._stop_processes()
        for path in provisioned:
            shutil.rmtree(path, ignore_errors=True)
        state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
        node = state.get("real_node")
        if node is not None or Path(self.node.netns_path).exists():
            left = realnode.teardown(self.node, (node or {}).get("sysctls", {}))
            if left:
                raise RuntimeError(f"real node teardown left behind: {left}")
            state.pop("real_node", None)
            self.state_file.write_text(json.dumps(state))

    def _provisioned_dirs(self) -> list[Path]:
        """Directories of this cluster's dynamically provisioned volumes (read from the API
        server while it runs; none when it does not). The provisioner only deletes them when a
        claim is deleted before the cluster stops."""
        if not self.kubeconfig.exists() or not self.running_pids().get("kube-apiserver"):
            return []
        cmd = [str(binary("kubectl")), f"--kubeconfig={self.kubeconfig}", "--request-timeout=5s"]
        try:
            out = subprocess.run(
                [*cmd, "get", "pv", "-o", "json"], capture_output=True, text=True, timeout=15
            )
            volumes = json.loads(out.stdout).get("items", []) if out.returncode == 0 else []
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return []
        paths = (Path((v["spec"].get("hostPath") or {}).get("path") or "/") for v in volumes)
        return [p for p in paths if p.parent == HOSTPATH_PROVISIONER_DIR]

    def _stop_processes(self) -> None:
        pids = dict(self._recorded_pids())
        for name, proc in self.procs.items():
            pids.setdefault(name, proc.pid)
        for pid in self._stray_pids():
            pids.setdefault(f"stray-{pid}", pid)
        order = [*reversed(COMPONENTS)]
        for name in sorted(pids, key=lambda n: order.index(n) if n in order else -1):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[name], signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
            for proc in self.procs.values():
                with contextlib.suppress(Exception):
                    proc.poll()
            time.sleep(0.2)
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        self.procs.clear()
        if self.state_file.exists():
            state = json.loads(self.state_file.read_text())
            state["pids"] = {}
            self.state_file.write_text(json.dumps(state))

    def running_pids(self) -> dict[str, int]:
        """Components of this cluster that are alive now."""
        alive = {n: p for n, p in self._recorded_pids().items() if _alive(p)}
        for pid in self._stray_pids():
            alive.setdefault(f"stray-{pid}", pid)
        return alive

    def status(self) -> dict[str, object]:
        """A summary: which components run, the server address, the nodes."""
        info: dict[str, object] = {"dir": str(self.workdir), "running": self.running_pids()}
        if self.state_file.exists() and self.running_pids():
            info["server"] = self.server
            info["kubeconfig"] = str(self.kubeconfig)
            with contextlib.suppress(Exception):
                info["nodes"] = self.kubectl("get", "nodes", "-o", "wide").stdout
        return info

    # ---------------------------------------------------------------- helpers for tests

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, token: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the locally built kubectl against this cluster."""
        cmd = [str(binary("kubectl")), f"--kubeconfig={self.kubeconfig}"]
        if token is not None:
            cmd += [f"--token={token}"]
        return subprocess.run(
            [*cmd, *args], input=input, text=True, capture_output=True, check=check, timeout=120
        )

    def env(self) -> dict[str, str]:
        """Environment for a child process that should talk to this cluster."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    # ---------------------------------------------------------------- internals

    def _start_kueue(self, ports: dict[str, int]) -> None:
        args = kueue.prepare(self, binary("kueue").parent, ports)
        self._start("kueue", args)
        health = f"http://127.0.0.1:{ports['kueue_health']}/readyz"
        self._wait(lambda: self._http_ok(health), 180, "kueue /readyz")
        # ready once its webhooks answer: a server-side dry-run create goes through them
        flavor = {
            "apiVersion": f"kueue.x-k8s.io/{kueue.API_VERSION}",
            "kind": "ResourceFlavor",
            "metadata": {"name": "webhook-probe"},
        }
        self._wait(
            lambda: (
                self.kubectl(
                    "create", "--dry-run=server", "-f", "-", input=json.dumps(flavor), check=False
                ).returncode
                == 0
            ),
            120,
            "kueue webhooks",
        )

    def _start_jobset(self, ports: dict[str, int]) -> None:
        self._start("jobset", jobset.prepare(self, binary("jobset").parent, ports))
        health = f"http://127.0.0.1:{ports['jobset_health']}/readyz"
        self._wait(lambda: self._http_ok(health), 180, "jobset /readyz")
        probe = json.dumps(jobset.probe())
        last: list[str] = []

        def webhooks_answer() -> bool:
            done = self.kubectl("create", "--dry-run=server", "-f", "-", input=probe, check=False)
            last[:] = [done.stderr.strip()]
            return done.returncode == 0

        try:
            self._wait(webhooks_answer, 120, "jobset webhooks")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; last dry-run create of a JobSet: {last}") from None

    def _start(
        self, name: str, args: Sequence[str], *, netns: str | None = None, cmd: Sequence[str] = ()
    ) -> None:
        log = open(self.workdir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            [*(cmd or [str(binary(name))]), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.workdir,
            preexec_fn=_preexec(self.tie_to_parent, netns),
            start_new_session=not self.tie_to_parent,
        )
        log.close()
        self.procs[name] = proc
        state = json.loads(self.state_file.read_text())
        state["pids"][name] = proc.pid
        self.state_file.write_text(json.dumps(state))

    def _recorded_pids(self) -> dict[str, int]:
        if not self.state_file.exists():
            return {}
        return {
            k: int(v) for k, v in json.loads(self.state_file.read_text()).get("pids", {}).items()
        }

    def _stray_pids(self) -> list[int]:
        """Processes whose command line mentions this cluster's directory (lost pid files)."""
        marker = str(self.workdir.resolve()).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            exe = cmdline.split(b"\0", 1)[0].rsplit(b"/", 1)[-1].decode(errors="replace")
            if marker in cmdline and exe in COMPONENTS:
                found.append(int(entry.name))
        return found

    def _check_real_node_possible(self) -> None:
        why = real_node_missing()
        if why:
            raise RuntimeError(f"cannot start a real node: {why}")
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
                if cmd[0].rsplit(b"/", 1)[-1] == b"containerd":
                    raise RuntimeError(
                        "cannot start a real node: containerd already runs (pid "
                        f"{entry.name}: {b' '.join(cmd).decode(errors='replace')}); the node "
                        "store is shared, so one real node at a time: `python -m e2e.cluster "
                        "down --dir DIR` on the other cluster first"
                    )

    def _up_real_node(
        self, ports: dict[str, int], timeout: float, say: Callable[[str], None]
    ) -> None:
        n = self.node
        api = ports["apiserver"]
        realnode.write_node_files(n, api_port=api, cache=cache_dir(), kubeconfig_token=ADMIN_TOKEN)
        realnode.make_cgroups(n)
        say("real node: forwarder to the apiserver, containerd")
        forward = [n.netns_path, f"{realnode.NODE_IP}:{api}", f"127.0.0.1:{api}", str(self.workdir)]
        self._start(
            "forwarder",
            ["forward", *forward],
            cmd=[sys.executable, str(REPO / "e2e" / "realnode.py")],
        )
        self._start("containerd", ["--config", str(n.dir / "containerd.toml")], netns=n.netns_path)
        self._wait(lambda: _ctr_ok(n.socket), 60, "containerd")
        say("real node: coredns, kube-proxy, kubelet")
        self._start("coredns", ["-conf", str(n.dir / "Corefile")], netns=n.netns_path)
        self._start("kube-proxy", ["--config", str(n.dir / "kube-proxy.json")], netns=n.netns_path)
        self._start(
            "kubelet",
            [
                f"--config={n.dir / 'kubelet.json'}",
                f"--kubeconfig={n.dir / 'kubeconfig'}",
                f"--root-dir={n.kubelet_root}",
                f"--cert-dir={n.kubelet_root / 'pki'}",
                f"--hostname-override={realnode.NODE_NAME}",
                f"--node-ip={realnode.NODE_IP}",
                f"--node-labels={realnode.NODE_LABEL}=true",
                "--v=1",
            ],
            netns=n.netns_path,
        )
        self._wait(self._real_node_ready, timeout, f"real node {realnode.NODE_NAME} Ready")

    def _real_node_ready(self) -> bool:
        out = self.kubectl("get", "node", realnode.NODE_NAME, "-o", "json", check=False)
        if out.returncode != 0:
            return False
        conditions = json.loads(out.stdout).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _write_credentials(self) -> None:
        pki = self.workdir / "pki"
        pki.mkdir(exist_ok=True)
        # the apiserver makes its serving cert for the advertised address: make it again each time
        for name in ("apiserver.crt", "apiserver.key"):
            (pki / name).unlink(missing_ok=True)
        if not (pki / "sa.key").exists():
            subprocess.run(
                ["openssl", "genrsa", "-out", str(pki / "sa.key"), "2048"],
                check=True,
                capture_output=True,
            )
            subprocess.run(
                [
                    "openssl",
                    "rsa",
                    "-in",
                    str(pki / "sa.key"),
                    "-pubout",
                    "-out",
                    str(pki / "sa.pub"),
                ],
                check=True,
                capture_output=True,
            )
        (pki / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n')

    def _write_kubeconfig(self) -> None:
        ports = self._ports()
        self.kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: rljob-local
  cluster:
    server: https://127.0.0.1:{ports["apiserver"]}
    insecure-skip-tls-verify: true
users:
- name: admin
  user:
    token: {ADMIN_TOKEN}
contexts:
- name: rljob-local
  context: {{cluster: rljob-local, user: admin}}
current-context: rljob-local
""")

    def _etcd_args(self, p: dict[str, int]) -> list[str]:
        return [
            "--name=rljob-local",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{p['etcd']}",
            f"--advertise-client-urls=http://127.0.0.1:{p['etcd']}",
            f"--listen-peer-urls=http://127.0.0.1:{p['etcd_peer']}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{p['etcd_peer']}",
            f"--initial-cluster=rljob-local=http://127.0.0.1:{p['etcd_peer']}",
            "--unsafe-no-fsync",
            "--quota-backend-bytes=4294967296",
            "--log-level=warn",
        ]

    def _apiserver_args(self, p: dict[str, int]) -> list[str]:
        pki = self.workdir / "pki"
        node: list[str] = []
        if self.real_node:
            # pods reach the apiserver through the forwarder at the node address: advertise that
            # (the `kubernetes` Service's endpoint, and an IP in the self-made serving cert)
            node = [
                f"--advertise-address={realnode.NODE_IP}",
                "--endpoint-reconciler-type=lease",
                "--kubelet-preferred-address-types=InternalIP",
            ]
        return [
            *node,
            f"--etcd-servers=http://127.0.0.1:{p['etcd']}",
            "--bind-address=127.0.0.1",
            *([] if self.real_node else ["--advertise-address=127.0.0.1"]),
            f"--secure-port={p['apiserver']}",
            f"--cert-dir={pki}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--enable-admission-plugins=NamespaceLifecycle,ServiceAccount,DefaultTolerationSeconds,"
            "ExtendedResourceToleration,LimitRanger,ResourceQuota,Priority,"
            "OwnerReferencesPermissionEnforcement",
            *([] if self.real_node else ["--endpoint-reconciler-type=none"]),
            "--allow-privileged=true",
            f"--profiling={'true' if self.apiserver_profiling else 'false'}",
            "--enable-priority-and-fairness=false",
            "--event-ttl=30m",
            "--v=1",
        ]

    def _kcm_args(self, p: dict[str, int]) -> list[str]:
        pki = self.workdir / "pki"
        return [
            f"--kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={p['kcm']}",
            "--controllers=*",
            # a dynamic provisioner, so claims with the default StorageClass bind (the per-job
            # checkpoint claims): directories under /tmp/hostpath_pv on this machine
            "--enable-hostpath-provisioner",
            "--leader-elect=false",
            "--use-service-account-credentials=false",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'apiserver.crt'}",
            f"--node-monitor-grace-period={self.node_grace_seconds}s",
            "--node-monitor-period=2s",
            *self._qps_args(),
            "--v=1",
        ]

    def _qps_args(self) -> list[str]:
        if self.controller_qps is None:
            return []
        return [
            f"--kube-api-qps={self.controller_qps}",
            f"--kube-api-burst={2 * self.controller_qps}",
        ]

    def _scheduler_args(self, p: dict[str, int]) -> list[str]:
        return [
            f"--kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={p['sched']}",
            "--leader-elect=false",
            *self._qps_args(),
            "--v=1",
        ]

    def _kwok_args(self, p: dict[str, int]) -> list[str]:
        return [
            f"--kubeconfig={self.kubeconfig}",
            f"--config={REPO / 'e2e' / 'kwok-stages.yaml'}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--node-lease-duration-seconds=40",
            "--cidr=10.0.0.1/16",
            "--node-ip=10.0.0.1",
            f"--server-address=127.0.0.1:{p['kwok']}",
        ]

    def _create_nodes(self) -> None:
        docs: list[dict[str, object]] = [
            self._node(f"gpu-{i}", gpus=self.gpus_per_node) for i in range(self.gpu_nodes)
        ]
        docs.append(self._node("cpu-0", gpus=0))
        docs.append(DEFAULT_STORAGE_CLASS)
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
        )

    @staticmethod
    def _node(name: str, *, gpus: int) -> dict[str, object]:
        resources = {"cpu": "96", "memory": "1Ti", "pods": "110"}
        labels = {
            "type": "kwok",
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
        }
        spec: dict[str, object] = {}
        if gpus:
            resources["nvidia.com/gpu"] = str(gpus)
            labels |= {
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.memory": "81559",  # MiB, as GPU feature discovery labels it
            }
            spec["taints"] = [GPU_TAINT]
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": labels,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": spec,
            "status": {"allocatable": resources, "capacity": resources},
        }

    def _nodes_ready(self) -> bool:
        out = self.kubectl("get", "nodes", "-o", "json", check=False)
        if out.returncode != 0:
            return False
        items = json.loads(out.stdout)["items"]
        ready = [
            n
            for n in items
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions", [])
            )
        ]
        return len([n for n in ready if n["metadata"]["name"] != realnode.NODE_NAME]) == (
            self.gpu_nodes + 1
        )

    def _api_ok(self, path: str) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        req = urllib.request.Request(
            self.server + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def _wait(self, check: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    log = (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} while waiting for "
                        f"{what}; last log lines:\n{log[-3000:]}"
                    )
            if check():
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.workdir / 'logs'}"
        )


def _ctr_ok(sock: Path) -> bool:
    if not sock.exists():
        return False
    r = subprocess.run(["ctr", "-a", str(sock), "version"], capture_output=True, timeout=10)
    return r.returncode == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.cluster", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state directory")
    parser.add_argument("--gpu-nodes", type=int, default=4)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--kueue", action="store_true", help="also run the Kueue controller")
    parser.add_argument(
        "--real-node",
        action="store_true",
        help="add one real node (containerd + kubelet in a network namespace; needs root)",
    )
    args = parser.parse_args(argv)
    cluster = LocalCluster(
        args.dir.resolve(),
        gpu_nodes=args.gpu_nodes,
        gpus_per_node=args.gpus_per_node,
        kueue=args.kueue,
        real_node=args.real_node,
    )
    if args.command == "up":
        seconds = cluster.up(
            progress=lambda m: print(f"[cluster] {m}", file=sys.stderr, flush=True)
        )
        print(
            f"[cluster] ready in {seconds:.1f}s; export KUBECONFIG={cluster.kubeconfig}",
            file=sys.stderr,
        )
        print(cluster.kubectl("get", "nodes", "-o", "wide").stdout, end="")
    elif args.command == "down":
        cluster.down()
        print(f"[cluster] stopped ({args.dir})", file=sys.stderr)
    else:
        print(json.dumps(cluster.status(), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
