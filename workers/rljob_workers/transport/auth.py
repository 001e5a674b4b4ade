"""Per-job authentication shared by every worker endpoint (experience stream, weights).

Each RLJob has one random token, stored in the job's Secret and handed to every pod as the
``RLJOB_TOKEN`` environment variable. Clients send it as ``Authorization: Bearer <token>``;
servers compare it in constant time (SHA-256 digests of both sides through
``hmac.compare_digest``, so neither the content nor the length leaks through timing).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from enum import Enum

__all__ = [
    "TOKEN_ENV",
    "AuthError",
    "AuthVerdict",
    "bearer_header",
    "check_bearer",
    "token_from_env",
]

TOKEN_ENV = "RLJOB_TOKEN"


class AuthError(PermissionError):
    """The server refused the request's token (HTTP 401 or 403); retrying will not help."""


class AuthVerdict(Enum):
    """Outcome of checking one request's credentials."""

    OK = "ok"
    MISSING = "missing_token"
    WRONG = "wrong_token"


def token_from_env(env: Mapping[str, str] | None = None) -> str:
    """The job's shared token from ``RLJOB_TOKEN``; ``ValueError`` when it is unset or empty."""
    source = os.environ if env is None else env
    token = source.get(TOKEN_ENV, "")
    if not token:
        raise ValueError(
            f"{TOKEN_ENV} is not set: mount the job's token Secret into the pod as {TOKEN_ENV} "
            "(the operator does this; for a local run export any non-empty value)"
        )
    return token


def bearer_header(token: str) -> dict[str, str]:
    """The request header that carries ``token``."""
    return {"Authorization": f"Bearer {token}"}


def check_bearer(authorization: str | None, expected: str) -> AuthVerdict:
    """Check an ``Authorization`` header value against the job's token, in constant time."""
    if not authorization:
        return AuthVerdict.MISSING
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return AuthVerdict.MISSING
    given_digest = hashlib.sha256(given.strip().encode()).digest()
    expected_digest = hashlib.sha256(expected.encode()).digest()
    return (
        AuthVerdict.OK if hmac.compare_digest(given_digest, expected_digest) else AuthVerdict.WRONG
    )
