"""S3FileSystem against moto's S3 server: conformance, DCP round trips, commit protocol."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from storage import S3FileSystem
from storage.base import FileSystemBase
from storage.testing import FileSystemTests
from tests.servers import boto3_client, create_bucket, moto_endpoint, s3_options

BUCKET = "dcp-tests"


@pytest.fixture(scope="module")
def endpoint() -> str:
    url = moto_endpoint()
    create_bucket(url, BUCKET)
    return url


@pytest.fixture(scope="module")
def s3(endpoint: str) -> Any:
    return boto3_client(endpoint)


class TestS3FileSystem(FileSystemTests):
    @pytest.fixture
    def fs(self, endpoint: str) -> FileSystemBase:
        return S3FileSystem(storage_options=s3_options(endpoint), part_size=5 << 20)

    @pytest.fixture
    def root(self, fs: FileSystemBase) -> str:
        return fs.init_path(f"s3://{BUCKET}/{uuid.uuid4().hex}")

    @pytest.fixture(autouse=True)
    def _client(self, s3: Any) -> None:
        self.s3 = s3

    def bypass_write(self, fs: FileSystemBase, path: str, data: bytes) -> None:
        bucket, _, key = path.partition("/")
        self.s3.put_object(Bucket=bucket, Key=key, Body=data)

    def bypass_read(self, fs: FileSystemBase, path: str) -> bytes:
        bucket, _, key = path.partition("/")
        return bytes(self.s3.get_object(Bucket=bucket, Key=key)["Body"].read())
