"""S3 and S3-compatible stores: the filesystem (``_filesystem``) and its data path
(``_io``: streamed ranged GETs with resume, concurrent multipart uploads).

Importing this package imports s3fs; the registry only does so for ``s3://`` URLs."""

from storage.backends.s3._filesystem import S3FileSystem

__all__ = ["S3FileSystem"]
