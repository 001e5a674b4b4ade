"""Apply: carry out a reconcile plan against the API server (the only writes)."""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC
from typing import Any

from kubernetes.client.exceptions import ApiException

from rljob_operator.api import GROUP, VERSION
from rljob_operator.builders import ANNOTATION_TLS_HOSTS, TLS_KEYS, JobRef, owned_by, secret_name
from rljob_operator.kube import Kube
from rljob_operator.kueue import WORKLOAD_API
from rljob_operator.pki import issue_certificates
from rljob_operator.reconcile import (
    GANG_UNAVAILABLE,
    POD_INPUTS,
    TOKEN_PLACEHOLDER,
    EventSpec,
    Plan,
    Refusal,
    child_digest,
)

log = logging.getLogger(__name__)


REFUSED = (400, 403, 404, 409, 422)
"""Statuses that mean the API server refused a child as written (retrying at once cannot help).
Any other API error on a child is reported too (a 500 can be a schema or patch-construction
failure that no retry cures), with its status code; every refused child is retried with backoff."""
POD_WRITERS = 16
"""Child writes in flight at once, shared by every job (a 64-pod job was 64 round trips in a
row; the Job controller creates its pods in parallel too). Below the client's connection pool
(32)."""
_writers: ThreadPoolExecutor | None = None
_writers_lock = threading.Lock()


def apply_plan(
    kube: Kube, job: dict[str, Any], plan: Plan, tokens: set[str] | None = None
) -> tuple[Refusal, ...]:
    """Server-side apply the desired children, delete the unwanted, write status, post Events.

    Returns the API server's refusals of children; an API error on one child never stops the
    others, the status or the Events. The next pass reports them in a condition and an Event and
    writes them again only after a backoff."""
    meta = job["metadata"]
    for ref in plan.delete:  # deletes first: a crash after them never double-counts a restart
        kube.delete(
            ref.api_version, ref.kind, meta["namespace"], ref.name, grace_seconds=ref.grace_seconds
        )
    refused: list[Refusal] = []
    for batch in _batches(plan.apply):
        if batch[0]["kind"] == "Pod" and any(r.kind in POD_INPUTS for r in refused):
            continue  # the pods would read an object the job does not own, or none at all
        if len(batch) == 1:
            outcomes = [_apply_child(kube, job, batch[0], tokens)]
        else:  # written concurrently, every one tried before an error is raised
            outcomes = list(_pool().map(lambda o: _apply_child(kube, job, o, tokens), batch))
        refused += [o for o in outcomes if o is not None]
    if plan.status_patch is not None:  # only on the job as observed (409 otherwise: no Events)
        try:
            _patch_status(
                kube,
                job,
                {
                    "metadata": {"resourceVersion": meta["resourceVersion"]},
                    "status": plan.status_patch,
                }
                if meta.get("resourceVersion")
                else {"status": plan.status_patch},
            )
        except ApiException as exc:
            if exc.status not in STATUS_REFUSED:
                raise
            status_refused(kube, job, exc)
    for patch in plan.workload_patches:  # Kueue: spec.active, release of quota, Finished
        try:
            kube.merge_patch(
                WORKLOAD_API,
                "Workload",
                meta["namespace"],
                patch.name,
                patch.body,
                subresource=patch.subresource,
            )
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone, or changed since read: the next pass
                raise
            log.info("Workload %s: %s; retried next pass", patch.name, exc.reason)
    if plan.scale_to is not None:
        kube.merge_patch(
            f"{GROUP}/{VERSION}",
            "RLJob",
            meta["namespace"],
            meta["name"],
            {"spec": {"replicas": plan.scale_to}},
            subresource="scale",
        )
    for event in plan.events:
        apply_event(kube, job, event)
    return tuple(refused)


AFTER_THEIR_TARGETS = ("RoleBinding",)
"""Kinds that need other objects of their run to exist first: a RoleBinding's Role (the API
server checks the binding against the Role's rules and refuses it while the Role is missing)."""


def _batches(objs: Sequence[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """The plan's objects in order, grouped into runs of Pods and runs of other kinds: a batch
    is written only after the one before it, so whatever precedes a pod (its ServiceAccount,
    which admission requires, the ConfigMap, the Services) exists before it, and whatever
    follows the pods (a Kueue Workload) is written after them. Within a run of other kinds the
    RoleBindings go last, after the Role they bind."""
    runs: list[list[dict[str, Any]]] = []
    for obj in objs:
        if not runs or (runs[-1][-1]["kind"] == "Pod") != (obj["kind"] == "Pod"):
            runs.append([])
        runs[-1].append(obj)
    for run in runs:
        first = [o for o in run if o["kind"] not in AFTER_THEIR_TARGETS]
        then = [o for o in run if o["kind"] in AFTER_THEIR_TARGETS]
        yield from (batch for batch in (first, then) if batch)


def _pool() -> ThreadPoolExecutor:
    global _writers
    with _writers_lock:
        if _writers is None:
            _writers = ThreadPoolExecutor(POD_WRITERS, thread_name_prefix="rljob-write")
        return _writers


def _apply_child(
    kube: Kube, job: dict[str, Any], obj: dict[str, Any], tokens: set[str] | None
) -> Refusal | None:
    """Write one child; the API server's refusal or None."""
    try:
        if obj["kind"] == "Secret":
            _create_token(kube, job, obj)
            if tokens is not None:
                tokens.add(str(job["metadata"].get("uid")))
        else:
            _write_owned(kube, job, obj)
    except NotOurs as exc:
        return Refusal(obj["kind"], obj["metadata"]["name"], str(exc), child_digest(obj))
    except ApiException as exc:
        if obj["kind"] == "PodGroup" and exc.status == 404:
            apply_event(kube, job, EventSpec("Warning", "PodGroupUnavailable", GANG_UNAVAILABLE))
        elif namespace_terminating(exc):
            raise  # the job goes with its namespace: nothing to report
        else:
            message = server_message(exc)
            if exc.status not in REFUSED:
                message += f" (API error {exc.status})"
            return Refusal(obj["kind"], obj["metadata"]["name"], message, child_digest(obj))
    return None


class NotOurs(Exception):
    """A child's name is taken by an object this job does not own: it is left as it is."""

    def __init__(self, obj: dict[str, Any], job: dict[str, Any], why: str) -> None:
        kind, name = obj["kind"], obj["metadata"]["name"]
        super().__init__(
            f"{kind} {name} already exists and {why}; the operator neither overwrites nor "
            f"adopts it (RLJob {job['metadata']['name']} would own it and garbage collection "
            f"would delete it with the job). Delete or rename that {kind}, or rename the RLJob"
        )


def _write_owned(kube: Kube, job: dict[str, Any], obj: dict[str, Any]) -> None:
    """Create the child; when its name is taken, update it (server-side apply) only if this job
    owns it (a pod that exists is left as it is: pods are never updated). An object of that
    name that another owner or nobody owns raises NotOurs and is not touched."""
    try:
        kube.create(obj)
        return
    except ApiException as exc:
        if exc.status != 409:
            raise
    meta = obj["metadata"]
    existing = kube.get(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
    if existing is not None and not owned_by(existing, job["metadata"].get("uid")):
        raise NotOurs(obj, job, "is not owned by this job (no ownerReference to its uid)")
    if obj["kind"] != "Pod":
        kube.server_side_apply(obj)


def namespace_terminating(exc: ApiException) -> bool:
    """The API server refused a write because the namespace is being deleted."""
    return exc.status == 403 and "NamespaceTerminating" in str(exc.body)


def server_message(exc: ApiException) -> str:
    """The ``message`` of the API server's Status body (else its reason)."""
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except ValueError:
        return str(exc.reason)


def _create_token(kube: Kube, job: dict[str, Any], obj: dict[str, Any]) -> None:
    """Create the job's token Secret once and record it in ``status.tokenSecret`` (never
    rewritten: running workers hold the token). The operator may not read Secrets, so a Secret
    of that name it did not record is someone else's: its value would reach pods that run the
    job's image, and it is refused (NotOurs). A job that ran under an operator from before the
    record (it has a startTime) keeps the Secret it has, which is recorded then."""
    name = obj["metadata"]["name"]
    status = job.get("status") or {}
    try:
        kube.create(_with_generated_token(obj))
    except ApiException as exc:
        if exc.status != 409:
            raise
        if status.get("tokenSecret") == name:
            return
        first = secret_name(JobRef.from_metadata(job["metadata"]))
        if not status.get("startTime") or name != first:  # an earlier operator made only that
            raise NotOurs(obj, job, "was not created by the operator for this job") from None
        _record_token(kube, job, name, tls=False)  # made by an earlier operator: no certificate
        return
    _record_token(kube, job, name, tls=any(k in obj.get("stringData", {}) for k in TLS_KEYS))


def _record_token(kube: Kube, job: dict[str, Any], name: str, *, tls: bool) -> None:
    meta = job["metadata"]
    record = {"tokenSecret": name, "tokenSecretTLS": tls}
    written = _patch_status(kube, job, {"status": record})
    job.setdefault("status", {}).update(record)
    version = ((written or {}).get("metadata") or {}).get("resourceVersion")
    if version and meta.get("resourceVersion"):  # the pass's status write follows this one
        meta["resourceVersion"] = version


DATA_PLANE_CERT_VALIDITY = datetime.timedelta(days=3 * 365)
"""Lifetime of a job's data-plane certificate (issued once, with its token Secret)."""


def _with_generated_token(obj: dict[str, Any]) -> dict[str, Any]:
    """The token Secret with its placeholders filled: a 256-bit token, and with TLS a fresh CA
    and a serving certificate for the names the builder listed (the CA key is not kept)."""
    data = dict(obj.get("stringData", {}))
    hosts = ((obj["metadata"].get("annotations") or {}).get(ANNOTATION_TLS_HOSTS) or "").split(",")
    if any(data.get(k) == TOKEN_PLACEHOLDER for k in TLS_KEYS):
        now = datetime.datetime.now(datetime.UTC)
        certs = issue_certificates([h for h in hosts if h], DATA_PLANE_CERT_VALIDITY, now)
        data |= {"ca.crt": certs.ca, "tls.crt": certs.cert, "tls.key": certs.key}
    for key, value in data.items():
        if value == TOKEN_PLACEHOLDER:
            data[key] = secrets.token_hex(32)
    return {**obj, "stringData": data}


_EVENT_CACHE_SIZE = 4096
_posted: OrderedDict[tuple[str, str, str, str], tuple[str, int]] = OrderedDict()
"""(job uid, type, reason, message) → (Event name, count): repeats update one Event's count."""


STATUS_REFUSED = (400, 422)
"""Statuses of a status write the API server refused as written: retrying the same write
cannot help, so it is reported instead of retried every few seconds."""


def status_refused(kube: Kube, job: dict[str, Any], exc: ApiException) -> None:
    """The API server refused the pass's status: a Warning Event with its reason, and the
    condition StatusRejected (written alone, beside the conditions the job has), so the user
    sees it in ``kubectl describe`` and ``kubectl get -o yaml``, not only in the operator log.
    The next pass writes its status again; it does not raise (a raise is retried at once)."""
    meta = job["metadata"]
    reason = _api_message(exc)
    message = (
        f"the API server refused the job's status ({exc.status}): {reason}; the status is "
        "not updated until a pass writes one it accepts"
    )
    log.warning("%s/%s: %s", meta["namespace"], meta["name"], message)
    apply_event(kube, job, EventSpec("Warning", "StatusRejected", message))
    now = datetime.datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    kept = [
        c
        for c in (job.get("status") or {}).get("conditions") or []
        if c.get("type") != "StatusRejected"
    ]
    condition = {
        "type": "StatusRejected",
        "status": "True",
        "reason": "Invalid",
        "message": message[:1024],
        "lastTransitionTime": now,
        "observedGeneration": int(meta.get("generation", 1)),
    }
    try:
        _patch_status(kube, job, {"status": {"conditions": [*kept, condition]}})
    except ApiException as again:
        log.warning(
            "%s/%s: the StatusRejected condition was refused too: %s",
            meta["namespace"],
            meta["name"],
            again.reason,
        )


def _patch_status(kube: Kube, job: dict[str, Any], body: dict[str, Any]) -> Any:
    """A merge patch of the job's status subresource; the job as written."""
    meta = job["metadata"]
    return kube.merge_patch(
        f"{GROUP}/{VERSION}", "RLJob", meta["namespace"], meta["name"], body, subresource="status"
    )


def _api_message(exc: ApiException) -> str:
    """The API server's message of a refusal (its Status body), else the HTTP reason."""
    try:
        body = json.loads(exc.body or "{}")
    except ValueError:
        body = {}
    text = body.get("message") if isinstance(body, dict) else None
    return str(text or exc.reason)[:600]


def apply_event(kube: Kube, job: dict[str, Any], event: EventSpec) -> None:
    """Post a core/v1 Event about the job, or bump the count of the identical one posted before
    (best effort: a failed Event never fails a reconcile)."""
    meta = job["metadata"]
    now = datetime.datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    message = event.message[:1024]
    key = (str(meta.get("uid")), event.type, event.reason, message)
    try:
        if key in _posted and _bump(kube, meta["namespace"], key, now):
            return
        created = kube.create(_event_body(job, event.type, event.reason, message, now))
    except ApiException as exc:
        if not namespace_terminating(exc):
            log.warning(
                "could not post event %s for %s: %s", event.reason, meta["name"], exc.reason
            )
        return
    _posted[key] = (str(created["metadata"]["name"]), 1)
    while len(_posted) > _EVENT_CACHE_SIZE:
        _posted.popitem(last=False)


def _bump(kube: Kube, namespace: str, key: tuple[str, str, str, str], now: str) -> bool:
    """Count one more occurrence on the Event posted before; False when it is gone (expired)."""
    name, count = _posted[key]
    try:
        kube.merge_patch("v1", "Event", namespace, name, {"count": count + 1, "lastTimestamp": now})
    except ApiException as exc:
        if exc.status == 404:
            del _posted[key]
            return False
        raise
    _posted[key] = (name, count + 1)
    _posted.move_to_end(key)
    return True


def _event_body(
    job: dict[str, Any], type_: str, reason: str, message: str, now: str
) -> dict[str, Any]:
    meta = job["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": job["apiVersion"],
            "kind": job["kind"],
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        },
        "type": type_,
        "reason": reason,
        "message": message,
        "source": {"component": "rljob-operator"},
        "reportingComponent": "rljob-operator",
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
