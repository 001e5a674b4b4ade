"""Children, desired vs observed: the objects the spec asks for (ConfigMaps, Services, RBAC,
PodGroup, checkpoint claim, pods), which of them are missing or drifted and must be applied,
which pods go (a config change running workers cannot take live, a scale-down, suspend), and
the Events that say so.
"""

from __future__ import annotations

from typing import Any

from rljob_operator.api import RLJob, RLJobSpec
from rljob_operator.builders import (
    ANNOTATION_CONFIG_HASH,
    LABEL_ROLE,
    VOLCANO,
    JobRef,
    Topology,
    build_children,
    covers,
    gang_flavour,
    next_secret_name,
    secret_name,
)
from rljob_operator.reconcile.shared import (
    EventSpec,
    ObjectRef,
    Observed,
    Policy,
    _Pass,
    _pod_phase,
    _pod_ready,
    _role,
)
from rljob_workers.config import Control

TOKEN_PLACEHOLDER = "__generated__"
RBAC_KINDS = ("ServiceAccount", "Role", "RoleBinding", "PodGroup")

QUEUE_IGNORED = (
    "spec.scheduling.queue is the Volcano queue of the job's PodGroup and takes effect only with "
    "gang: true and schedulerName: volcano; to queue through Kueue put the label "
    "kueue.x-k8s.io/queue-name=<LocalQueue> on the RLJob"
)
GANG_UNAVAILABLE = (
    "spec.scheduling.gang: no PodGroup API (Volcano or scheduler-plugins coscheduling) is "
    "installed; pods are created without gang scheduling. Install one, or set gang: false"
)


def _differs(desired: dict[str, Any], observed: dict[str, Any] | None) -> bool:
    """Missing, or (for the operator-owned config) different data; progress is workers' to write."""
    if observed is None:
        return True
    return "data" in desired and observed.get("data") != desired["data"]


SYNCED_KINDS = ("Service", "ServiceAccount", "Role", "RoleBinding", "PodGroup", "NetworkPolicy")
"""Children kept in sync with the spec each pass (pods roll by config hash, the token Secret is
never rewritten, ConfigMaps compare their data)."""


def _desired_children(
    job: RLJob,
    ref: JobRef,
    topology: Topology,
    work: _Pass,
    control: Control,
    policy: Policy,
    observed_pods: tuple[dict[str, Any], ...] = (),
) -> list[dict[str, Any]]:
    """Every child the spec asks for this pass (pods resume from ``status.resumeFrom``)."""
    return build_children(
        job,
        ref,
        topology,
        token=TOKEN_PLACEHOLDER,
        restart_epochs={},
        control=control,
        resume_from=work.status.get("resumeFrom"),
        worker_env=policy.worker_env,
        metrics_from=policy.metrics_from,
        tls=data_plane_tls(work.status, policy),
        token_secret=token_secret(work, ref, observed_pods, job.spec.suspend),
    )


def token_secret(
    work: _Pass, ref: JobRef, pods: tuple[dict[str, Any], ...], suspended: bool
) -> str:
    """The token Secret this pass's pods read. Once pods have run with a token
    (``status.tokenSecretServed``) and every pod of the job is gone (a resume after suspend, a
    restart of every role), the pods that start again get a fresh token in a new Secret
    (``<job>-token-2``, ``-3``...): a token seen by earlier pods (their logs, a core dump) opens
    nothing of the new run. While a pod runs the token stays: they all share it."""
    current = str(work.status.get("tokenSecret") or secret_name(ref))
    if pods:
        if work.status.get("tokenSecret"):
            work.status["tokenSecretServed"] = current
        return current
    if work.status.get("tokenSecretServed") == current and not suspended:
        return next_secret_name(ref, current)
    return current


def data_plane_tls(status: dict[str, Any], policy: Policy) -> bool:
    """Whether a job's data plane runs over TLS: as its token Secret was made (it carries the
    certificate or not, and the operator cannot read or rewrite it); a job whose Secret is yet
    to be made follows the operator's ``--data-plane-tls``, except one that ran under an earlier
    operator (its Secret exists, without a certificate)."""
    if status.get("tokenSecret"):
        return bool(status.get("tokenSecretTLS"))
    return policy.data_plane_tls and not status.get("startTime")


def _sync_children(
    work: _Pass,
    desired: list[dict[str, Any]],
    observed: Observed,
    spec: RLJobSpec,
    topology: Topology,
) -> list[dict[str, Any]]:
    """The children to apply (missing or drifted; no pods of a role held in its backoff); and
    into ``work.delete`` the pods to go: those on an old config (controlled restart) and those
    no longer desired (scale-down, suspend)."""
    pods_by_name = {p["metadata"]["name"]: p for p in observed.pods}
    deleting = {d.name for d in work.delete}
    hold = work.hold_roles | _draining_groups(observed.pods, deleting)
    to_apply = [o for o in desired if _missing(o, observed, pods_by_name, deleting, hold)]
    desired_pods = {o["metadata"]["name"] for o in desired if o["kind"] == "Pod"}
    _controlled_restart(work, desired, pods_by_name, topology)
    deleting = {d.name for d in work.delete}
    scaled = []
    for name, pod in sorted(pods_by_name.items()):
        if name not in desired_pods and name not in deleting and _pod_phase(pod) != "Terminating":
            work.delete.append(ObjectRef("v1", "Pod", name))
            scaled.append(name)
    if scaled and not spec.suspend:
        work.events.append(EventSpec("Normal", "ScaledDown", f"deleted {', '.join(scaled)}"))
    if spec.suspend and scaled:
        work.events.append(EventSpec("Normal", "Suspended", f"deleted {len(scaled)} pods"))
    return to_apply


def _draining_groups(pods: tuple[dict[str, Any], ...], deleting: set[str]) -> set[str]:
    """Group roles (trainer, actor) with a member still going away: none of the new group is
    created until every pod of the old one is gone, so two incarnations never rendezvous."""
    return {
        _role(p)
        for p in pods
        if _role(p) != "rollout"
        and (_pod_phase(p) == "Terminating" or p["metadata"]["name"] in deleting)
    }


def _created_events(
    work: _Pass, to_apply: list[dict[str, Any]], spec: RLJobSpec, gang_api: bool
) -> None:
    """CreatedPods, with a warning when gang scheduling or the Volcano queue cannot apply."""
    created = [o["metadata"]["name"] for o in to_apply if o["kind"] == "Pod"]
    if created:
        work.events.append(EventSpec("Normal", "CreatedPods", f"created {', '.join(created)}"))
        if spec.scheduling.gang and not gang_api:
            work.events.append(EventSpec("Warning", "PodGroupUnavailable", GANG_UNAVAILABLE))
        if spec.scheduling.queue and not (spec.scheduling.gang and gang_flavour(spec) == VOLCANO):
            work.events.append(EventSpec("Warning", "QueueIgnored", QUEUE_IGNORED))


def _missing(
    obj: dict[str, Any],
    observed: Observed,
    pods: dict[str, dict[str, Any]],
    deleting: set[str],
    hold_roles: set[str],
) -> bool:
    name, kind = obj["metadata"]["name"], obj["kind"]
    if kind in SYNCED_KINDS and (kind, name) in observed.children:  # re-apply when it drifted
        fields = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}  # not in lists
        return not covers(observed.children[(kind, name)], fields)
    if kind == "Pod":
        held = obj["metadata"]["labels"].get(LABEL_ROLE) in hold_roles
        return name not in pods and name not in deleting and not held
    if kind == "Service":
        return name not in observed.services
    if kind == "Secret":
        return name not in observed.secrets
    if kind == "PodGroup" and not observed.gang_api:
        return False
    if kind in RBAC_KINDS:
        return (kind, name) not in observed.present
    if kind == "ConfigMap":
        return _differs(obj, observed.configmaps.get(name))
    if kind == "PersistentVolumeClaim":  # created once; its spec is the server's from then on
        return observed.checkpoint_claim is None
    return True


def _controlled_restart(
    work: _Pass,
    desired: list[dict[str, Any]],
    pods: dict[str, dict[str, Any]],
    topology: Topology,
) -> None:
    """Roll out a config change that running workers cannot take live (see builders.restart_hash):
    rollouts one at a time, and only while all the others are ready; the trainer group (or the
    colocated gang) together, so ranks never mix configs. Live changes never get here."""
    want = {
        o["metadata"]["name"]: o["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
        for o in desired
        if o["kind"] == "Pod"
    }
    deleting = {d.name for d in work.delete}
    stale: dict[str, list[str]] = {}
    for name, pod in pods.items():
        have = pod["metadata"].get("annotations", {}).get(ANNOTATION_CONFIG_HASH)
        if (
            name in want
            and name not in deleting
            and _pod_phase(pod) != "Terminating"
            and have != want[name]
        ):
            stale.setdefault(_role(pod), []).append(name)
    for role, names in sorted(stale.items()):
        if role == "rollout":
            peers = [p for n, p in pods.items() if _role(p) == "rollout" and n not in names]
            if all(_pod_ready(p) for p in peers) and not any(
                _pod_phase(p) == "Terminating" for p in pods.values() if _role(p) == "rollout"
            ):
                victim = sorted(names)[0]
                work.delete.append(ObjectRef("v1", "Pod", victim))
                work.events.append(EventSpec("Normal", "RollingRestart", f"{victim}: new config"))
        else:
            group = [
                n for n, p in pods.items() if _role(p) == role and _pod_phase(p) != "Terminating"
            ]
            for name in sorted(group):
                work.delete.append(ObjectRef("v1", "Pod", name))
            work.events.append(
                EventSpec(
                    "Normal", "RollingRestart", f"restarting the {role} group for a new config"
                )
            )
