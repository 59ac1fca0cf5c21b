"""The direct path for S3 data requests (storage/backends/s3/_http.py): part uploads and
ranged GETs over pooled HTTP connections, signed with the s3fs client's credentials,
and the configurations that send them through s3fs instead. Real servers only."""

from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import storage
from storage import S3FileSystem
from storage.backends.s3 import _http
from tests.support.servers import (
    FaultProxy,
    boto3_client,
    endpoint_with_bucket,
    list_keys,
    open_uploads,
    s3_options,
)

BUCKET = "dcp-direct"
BOTH_SERVERS = pytest.mark.parametrize("endpoint", ["moto", "seaweedfs"], indirect=True)


@pytest.fixture(scope="module")
def endpoint(request: pytest.FixtureRequest) -> str:
    return endpoint_with_bucket(request, BUCKET)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Counts the requests the direct path sends, by method (they still go out)."""
    counts: collections.Counter[str] = collections.Counter()
    send = _http.DirectPath._send

    def counting(self: _http.DirectPath, method: str, *args: Any, **kwargs: Any) -> Any:
        counts[method] += 1
        return send(self, method, *args, **kwargs)

    monkeypatch.setattr(_http.DirectPath, "_send", counting)
    yield counts


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(3 << 20, generator=gen),  # 12 MiB: a three-part upload
        "small": torch.randn(100, generator=gen),
    }


def _round_trip(fs: S3FileSystem) -> str:
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    state = _state()
    storage.save(state, url, filesystem=fs, thread_count=1)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(target, url, filesystem=fs)
    for key, value in state.items():
        assert torch.equal(target[key], value), key
    return url


@BOTH_SERVERS
def test_parts_and_reads_go_direct(endpoint: str, sent: collections.Counter[str]) -> None:
    fs = S3FileSystem(storage_options=s3_options(endpoint), part_size=5 << 20)
    _round_trip(fs)
    assert fs.client.direct(BUCKET) is not None
    assert sent["PUT"] == 3  # the parts; creating and completing the upload is s3fs's
    assert sent["GET"] >= 2  # the metadata and the data


@BOTH_SERVERS
def test_direct_false_sends_everything_through_s3fs(
    endpoint: str, sent: collections.Counter[str]
) -> None:
    fs = S3FileSystem(storage_options=s3_options(endpoint), part_size=5 << 20, direct=False)
    _round_trip(fs)
    assert fs.client.direct(BUCKET) is None and not sent


@pytest.mark.parametrize(
    "options",
    [
        {"config_kwargs": {"proxies": {"http": "http://127.0.0.1:9"}}},
        {"config_kwargs": {"retries": {"mode": "adaptive", "total_max_attempts": 3}}},
        {"config_kwargs": {"s3": {"payload_signing_enabled": True}}},
        {"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": "k" * 32}},
        {"requester_pays": True},
    ],
    ids=["proxy", "adaptive-retries", "signed-payload", "sse-c", "requester-pays"],
)
def test_what_only_botocore_does_goes_through_s3fs(endpoint: str, options: dict) -> None:
    fs = S3FileSystem(storage_options=s3_options(endpoint, **options))
    assert fs.client.direct(BUCKET) is None


@pytest.mark.parametrize("endpoint", ["seaweedfs"], indirect=True)  # moto refuses anonymous
def test_anonymous_requests_go_unsigned(endpoint: str, sent: collections.Counter[str]) -> None:
    fs = S3FileSystem(storage_options={"endpoint_url": endpoint, "anon": True}, part_size=5 << 20)
    _round_trip(fs)
    assert sent["PUT"] == 3


@pytest.fixture
def iam_key(endpoint: str) -> Iterator[dict[str, str]]:
    """An access key moto checks every signature of (IAM auth on), allowed all of S3."""
    import boto3
    import moto.settings

    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    user = f"u{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=user)
    policy = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
    iam.put_user_policy(
        UserName=user,
        PolicyName="s3",
        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [policy]}),
    )
    key = iam.create_access_key(UserName=user)["AccessKey"]
    old = moto.settings.INITIAL_NO_AUTH_ACTION_COUNT
    moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    try:
        yield {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    finally:
        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = old


@pytest.mark.parametrize("endpoint", ["moto"], indirect=True)
def test_direct_requests_carry_valid_signatures(
    endpoint: str, iam_key: dict[str, str], sent: collections.Counter[str]
) -> None:
    fs = S3FileSystem(storage_options=s3_options(endpoint, **iam_key), part_size=5 << 20)
    _round_trip(fs)
    assert sent["PUT"] == 3 and sent["GET"] >= 2
    forged = S3FileSystem(storage_options=s3_options(endpoint, key=iam_key["key"], secret="x"))
    with pytest.raises(PermissionError, match="check the credentials"):
        forged.read_bytes(f"{BUCKET}/anything")


@pytest.mark.parametrize("endpoint", ["moto"], indirect=True)
def test_refreshed_credentials_are_used(
    endpoint: str, iam_key: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiobotocore.credentials import AioRefreshableCredentials

    def stamp(seconds: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds))

    refreshes = []

    async def fetch() -> dict[str, str]:
        refreshes.append(1)
        # Inside botocore's 15-minute refresh window: every use refreshes again.
        return {**_secret(iam_key), "token": "", "expiry_time": stamp(600)}

    monkeypatch.setattr(_http, "CREDENTIALS_TTL", 0.0)
    fs = S3FileSystem(storage_options=s3_options(endpoint, **iam_key), part_size=5 << 20)
    assert fs.client.direct(BUCKET) is not None
    # Expired credentials whose secret moto would refuse: nothing may sign with them.
    stale = {"access_key": iam_key["key"], "secret_key": "stale", "token": ""}
    credentials = AioRefreshableCredentials.create_from_metadata(
        {**stale, "expiry_time": stamp(-60)}, fetch, "test"
    )
    monkeypatch.setattr(fs.fs.s3._request_signer, "_credentials", credentials)
    url = _round_trip(fs)
    before = len(refreshes)
    fs.read_bytes(url.removeprefix("s3://") + "/.metadata")
    assert len(refreshes) > before  # the direct GET asked the signer's credentials


def _secret(iam_key: dict[str, str]) -> dict[str, str]:
    return {"access_key": iam_key["key"], "secret_key": iam_key["secret"]}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "s3fs"])
def test_abort_interrupts_parts_in_flight(endpoint: str, direct: bool) -> None:
    path = f"{BUCKET}/{uuid.uuid4().hex}/file"
    with FaultProxy(endpoint) as proxy:
        # Held far longer than the bound below, which only a loaded machine nears.
        proxy.add("delay", method="PUT", path=r"partNumber=", delay=600.0)
        fs = S3FileSystem(storage_options=s3_options(proxy.url), part_size=5 << 20, direct=direct)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="boom"), fs.create_stream(path, "wb") as stream:
            stream.write(b"x" * (12 << 20))  # two parts on their way, held by the proxy
            time.sleep(0.5)
            raise RuntimeError("boom")
        assert time.monotonic() - start < 120  # not the 600 s the parts are held for
    s3 = boto3_client(endpoint)
    prefix = path.partition("/")[2]
    assert open_uploads(s3, BUCKET, prefix) == []
    assert list_keys(s3, BUCKET, prefix) == []


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1: (certificate file, key file)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("tls")
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


def test_https_uses_the_clients_tls_settings(
    endpoint: str, certificate: tuple[str, str], sent: collections.Counter[str]
) -> None:
    import ssl

    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(*certificate)
    with FaultProxy(endpoint, tls=tls) as proxy:
        trusted = s3_options(proxy.url, client_kwargs={"verify": certificate[0]})
        fs = S3FileSystem(storage_options=trusted, part_size=5 << 20)
        url = _round_trip(fs)
        assert sent["PUT"] == 3 and sent["GET"] >= 2
        # The default trust store does not know this certificate: refused, not sent.
        fail_fast = {"retries": {"mode": "standard", "total_max_attempts": 1}}
        untrusted = S3FileSystem(storage_options=s3_options(proxy.url, config_kwargs=fail_fast))
        assert untrusted.client.direct(BUCKET) is not None
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            untrusted.read_bytes(url.removeprefix("s3://") + "/.metadata")


@pytest.mark.parametrize("split", [False, True], ids=["window", "parallel"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "s3fs"])
def test_an_object_replaced_while_read_fails_naming_it(
    endpoint: str, direct: bool, split: bool
) -> None:
    """The GETs after a read's first are pinned to its ETag (``If-Match``): an object
    replaced between them fails the read with the message GCS gives for the same case
    (both backends share one reader now), never stitched from two versions. Before,
    S3 said only that reading failed because "a pre-condition did not hold"."""
    window = 5 << 20
    fs = S3FileSystem(storage_options=s3_options(endpoint), part_size=window, direct=direct)
    name = f"{uuid.uuid4().hex}/obj"
    s3 = boto3_client(endpoint)
    s3.put_object(Bucket=BUCKET, Key=name, Body=b"o" * (4 * window))
    path = f"{BUCKET}/{name}"
    target = bytearray(4 * window)
    view = memoryview(target)
    with fs.open_slice(path, 0, 4 * window) as reader:
        got = 0
        while got < window:  # the first window, the GET the reader opened
            got += reader.readinto(view[got:window])
        s3.put_object(Bucket=BUCKET, Key=name, Body=b"n" * (4 * window))
        rest = view[window:] if split else view[window : 2 * window]
        with pytest.raises(OSError, match=rf"s3://{path}: the object was replaced or deleted"):
            while rest:
                n = reader.readinto(rest)
                assert n
                rest = rest[n:]
    assert b"n" not in target
