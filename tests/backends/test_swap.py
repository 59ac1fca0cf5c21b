"""Compare and swap of a small object (``storage.backends.swap``) on local disk, on
real S3 servers (moto, SeaweedFS) and on fake-gcs-server: a replacement (and, where the
backend swaps removals, a removal) happens only while the object is the version read,
and a refused one changes nothing."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from storage import LocalFileSystem
from storage.backends.base import FileSystemBase
from storage.backends.swap import Swapping, SwappingRemovals

BUCKET = "dcp-swap"


def _backend(kind: str, tmp_path: Path) -> tuple[FileSystemBase, str]:
    """A backend of ``kind`` and a directory of it with nothing in it."""
    if kind == "local":
        return LocalFileSystem(), str(tmp_path)
    directory = f"{BUCKET}/{uuid.uuid4().hex}"
    if kind == "gcs":
        from storage import GCSFileSystem
        from tests.support.servers import gcs_endpoint_with_bucket, gcs_options

        options = gcs_options(gcs_endpoint_with_bucket(BUCKET))
        return GCSFileSystem(storage_options=options), directory
    from storage import S3FileSystem
    from tests.support.servers import ServerUnavailable, create_bucket, s3_endpoint, s3_options

    try:
        endpoint = s3_endpoint(kind)
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    create_bucket(endpoint, BUCKET)
    return S3FileSystem(storage_options=s3_options(endpoint)), directory


@pytest.fixture(params=["local", "moto", "seaweedfs", "gcs"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[FileSystemBase, str]:
    """A backend that swaps replacements and an empty directory of it."""
    return _backend(request.param, tmp_path)


@pytest.fixture(params=["local", "moto", "seaweedfs"])
def removing(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[FileSystemBase, str]:
    """A backend that swaps removals too and an empty directory of it (not GCS:
    fake-gcs-server ignores preconditions on deletes, see ``storage.backends.swap``)."""
    return _backend(request.param, tmp_path)


def _read(fs: FileSystemBase, path: str) -> Callable[[], bytes | None]:
    def read() -> bytes | None:
        try:
            return fs.read_bytes(path)
        except FileNotFoundError:
            return None

    return read


def test_a_replacement_happens_only_while_the_object_is_the_version_read(
    where: tuple[FileSystemBase, str],
) -> None:
    # Before: backends had no way to replace an object only while it was unchanged, so
    # two processes updating it at once undid each other's update unseen (GCS had none
    # until its generations were compared).
    fs, directory = where
    assert isinstance(fs, Swapping)
    path = fs.concat_path(directory, "obj")
    now = _read(fs, path)
    assert fs.replace_if(directory, "obj", b"one", None) and now() == b"one"
    assert not fs.replace_if(directory, "obj", b"two", None) and now() == b"one"
    data, first = fs.read_versioned(path, limit=64)
    assert data == b"one"
    assert fs.replace_if(directory, "obj", b"two", first) and now() == b"two"
    assert not fs.replace_if(directory, "obj", b"three", first) and now() == b"two"
    second = fs.read_versioned(path, limit=64)[1]
    assert second != first
    assert fs.replace_if(directory, "obj", b"three", second) and now() == b"three"
    absent = _read(fs, fs.concat_path(directory, "absent"))
    assert not fs.replace_if(directory, "absent", b"four", second) and absent() is None
    with pytest.raises(FileNotFoundError):
        fs.read_versioned(fs.concat_path(directory, "absent"), limit=64)


def test_a_removal_happens_only_while_the_object_is_the_version_read(
    removing: tuple[FileSystemBase, str],
) -> None:
    # Before: a removal decided on a version read removed a replacement made since.
    fs, directory = removing
    assert isinstance(fs, SwappingRemovals)
    path = fs.concat_path(directory, "obj")
    now = _read(fs, path)
    assert fs.replace_if(directory, "obj", b"one", None) and now() == b"one"
    first = fs.read_versioned(path, limit=64)[1]
    assert fs.replace_if(directory, "obj", b"two", first) and now() == b"two"
    assert not fs.remove_if(directory, "obj", first) and now() == b"two"
    second = fs.read_versioned(path, limit=64)[1]
    assert fs.remove_if(directory, "obj", second) and now() is None
    assert not fs.replace_if(directory, "obj", b"four", second) and now() is None
    assert not fs.remove_if(directory, "obj", second)
    with pytest.raises(FileNotFoundError):
        fs.read_versioned(path, limit=64)
