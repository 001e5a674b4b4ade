"""Fixtures of the worker tests: data-plane TLS directories (``certs``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers.certs import write_tls_dir


@pytest.fixture(scope="session")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job's TLS directory for loopback: the certificate covers localhost and 127.0.0.1."""
    return write_tls_dir(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def foreign_tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another job's TLS directory: a different CA, for the same names."""
    return write_tls_dir(tmp_path_factory.mktemp("foreign-tls"))
