"""The disaggregated experience stream, rollout → trainer, over authenticated HTTP.

``ExperienceServer`` runs in the trainer and feeds an ``ExperienceBuffer``; each rollout worker
delivers through an ``ExperienceClient`` (at-least-once, de-duplicated by trajectory id) and asks
the same server whether to hold back (``control``). Wire format: see ``codec``. Plain HTTP, or
HTTPS with a per-job CA (``tls``).
"""

from rljob_workers.transport.auth import TOKEN_ENV, AuthError, token_from_env
from rljob_workers.transport.client import ClientStats, ControlAnswer, ExperienceClient
from rljob_workers.transport.server import ExperienceServer, ServerStats, should_hold
from rljob_workers.transport.tls import client_context, server_context

__all__ = [
    "TOKEN_ENV",
    "AuthError",
    "ClientStats",
    "ControlAnswer",
    "ExperienceClient",
    "ExperienceServer",
    "ServerStats",
    "client_context",
    "server_context",
    "should_hold",
    "token_from_env",
]
