"""The RLJob resource's names and served versions: ``v1beta1`` (the hub and storage version)
and ``v1alpha1`` (still served, converted by ``rljob_operator.conversion``)."""

from __future__ import annotations

from typing import Final

GROUP: Final = "rljob.io"
VERSION: Final = "v1beta1"
"""The hub: the version the operator reads and writes, and the storage version."""
API_VERSION: Final = "rljob.io/v1beta1"
V1ALPHA1: Final = "v1alpha1"
"""The older version, still served; converted losslessly to and from the hub
(``rljob_operator.conversion``)."""
VERSIONS: Final = (V1ALPHA1, VERSION)
KIND: Final = "RLJob"
LIST_KIND: Final = "RLJobList"
PLURAL: Final = "rljobs"
SINGULAR: Final = "rljob"
SHORT_NAMES = ("rlj",)
CATEGORIES = ("all", "rl")
