"""Google Cloud Storage: the filesystem (``_filesystem``) and its data path: uploads
from reused buffers (``_upload``), ranged GETs in windows and in parallel, resumed
where a body breaks off (``_read``); the GETs over pooled connections (``_direct``) or
gcsfs's session (``_session``).

Importing this package imports gcsfs; the registry only does so for ``gs://`` URLs."""

import os

# gcsfs otherwise probes every bucket for hierarchical namespaces over gRPC/TLS, which
# hangs for a minute against emulators and private endpoints. Set before gcsfs loads.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from storage.backends.gcs._filesystem import GCSFileSystem  # noqa: E402

__all__ = ["GCSFileSystem"]
