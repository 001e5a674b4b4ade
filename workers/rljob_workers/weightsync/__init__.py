"""Versioned policy-weight sync from the trainer to rollout engines.

Three paths, one payload format (``codec``: safetensors + version metadata, optional ``bf16`` /
``fp8`` compression):

- ``httpsync``: ``WeightServer.publish`` / ``publish_stream`` (from shards) in the trainer,
  ``WeightClient.fetch_latest`` (long-poll) in each rollout — elastic: a late joiner gets the
  latest version at once;
- ``filesync``: ``publish_to_dir`` / ``load_latest`` on a shared volume, atomic renames;
- ``broadcast``: ``broadcast_weights`` over a torch.distributed group (NCCL on GPU, gloo on CPU).

Receivers hand the received ``DecodedWeights`` (or its ``named_tensors()``) to
``RolloutEngine.load_weights(version, source)``, which decompresses into its parameters.
"""

from rljob_workers.weightsync.broadcast import BroadcastReport, broadcast_weights
from rljob_workers.weightsync.codec import (
    COMPRESSIONS,
    Compression,
    DecodedWeights,
    SpoolFile,
    TensorSpec,
    decode_weights,
    encode_weights,
)
from rljob_workers.weightsync.filesync import (
    latest_version,
    load_latest,
    load_version,
    publish_to_dir,
    wait_for_version,
)
from rljob_workers.weightsync.httpsync import (
    PublishReport,
    ReceivedWeights,
    WeightClient,
    WeightServer,
)

__all__ = [
    "COMPRESSIONS",
    "BroadcastReport",
    "Compression",
    "DecodedWeights",
    "PublishReport",
    "ReceivedWeights",
    "SpoolFile",
    "TensorSpec",
    "WeightClient",
    "WeightServer",
    "broadcast_weights",
    "decode_weights",
    "encode_weights",
    "latest_version",
    "load_latest",
    "load_version",
    "publish_to_dir",
    "wait_for_version",
]
