"""Apply: carry out a reconcile plan against the API server (the only writes)."""

from __future__ import annotations

import json
import logging
import secrets
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from rljob_operator.api import GROUP, VERSION
from rljob_operator.kube import Kube
from rljob_operator.reconcile import GANG_UNAVAILABLE, TOKEN_PLACEHOLDER, EventSpec, Plan

log = logging.getLogger(__name__)


REFUSED = (400, 403, 404, 409, 422)
"""Statuses that mean the API server refused a child as written (retrying at once cannot help)."""


def apply_plan(kube: Kube, job: dict[str, Any], plan: Plan) -> tuple[str, ...]:
    """Server-side apply the desired children, delete the unwanted, write status, post Events.

    Returns the API server's refusals of children (``<Kind> <name>: <server message>``); the
    next pass reports them in a condition and an Event and retries with backoff."""
    meta = job["metadata"]
    for ref in plan.delete:  # deletes first: a crash after them never double-counts a restart
        kube.delete(
            ref.api_version, ref.kind, meta["namespace"], ref.name, grace_seconds=ref.grace_seconds
        )
    refused: list[str] = []
    for obj in plan.apply:
        if obj["kind"] == "Secret":
            obj = _with_generated_token(obj)
        try:
            kube.server_side_apply(obj)
        except ApiException as exc:
            if obj["kind"] == "PodGroup" and exc.status == 404:
                apply_event(
                    kube, job, EventSpec("Warning", "PodGroupUnavailable", GANG_UNAVAILABLE)
                )
            elif exc.status in REFUSED:
                refused.append(f"{obj['kind']} {obj['metadata']['name']}: {server_message(exc)}")
            else:
                raise
    if plan.status_patch is not None:
        kube.merge_patch(
            f"{GROUP}/{VERSION}",
            "RLJob",
            meta["namespace"],
            meta["name"],
            {"status": plan.status_patch},
            subresource="status",
        )
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


def server_message(exc: ApiException) -> str:
    """The ``message`` of the API server's Status body (else its reason)."""
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except ValueError:
        return str(exc.reason)


def _with_generated_token(obj: dict[str, Any]) -> dict[str, Any]:
    data = dict(obj.get("stringData", {}))
    for key, value in data.items():
        if value == TOKEN_PLACEHOLDER:
            data[key] = secrets.token_hex(32)
    return {**obj, "stringData": data}


def apply_event(kube: Kube, job: dict[str, Any], event: EventSpec) -> None:
    """Post a core/v1 Event about the job (best effort: a failed Event never fails a reconcile)."""
    meta = job["metadata"]
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
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
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:1024],
        "source": {"component": "rljob-operator"},
        "reportingComponent": "rljob-operator",
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        kube.create(body)
    except ApiException as exc:
        log.warning("could not post event %s for %s: %s", event.reason, meta["name"], exc.reason)
