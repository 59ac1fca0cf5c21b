"""No credential in any message or log, no key in any repr.

Each test makes a backend fail with a credential that cannot be sent (a trailing
newline, as a key or token read from a file keeps it) or with an answer that makes a
client quote a credential-bearing URL, then greps every message the caller can see (the
raised error and its whole chain, as a traceback prints it and beyond) and every log
record for the secret. Before, the S3 direct path raised ``OSError: ... Invalid header
value b'<token>\\n'`` (http.client quoting the signed header), a GCS token reached the
message through gcsfs's ``tokeninfo?access_token=...`` URL, and a GCS resumable
session URL (``upload_id=``: whoever holds it can write to the upload) was quoted in
upload errors.
"""

from __future__ import annotations

import json
import logging
import re
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import storage
from storage.backends._secrets import Redactor
from storage.cli.main import main
from tests.support.servers import (
    FaultProxy,
    create_bucket,
    fake_gcs_endpoint,
    gcs_create_bucket,
    gcs_options,
    moto_endpoint,
    s3_options,
)

BUCKET = "dcp-secrets"
ACCESS_KEY = "AKIAHOSTILE0SECRET01"
SECRET_KEY = "hostile/secret+key0123456789abcdefghijklm"
TOKEN = "FwoGZXIvYXdzEHOSTILESESSIONTOKEN0123456789"
GCS_TOKEN = "ya29.HOSTILEACCESSTOKEN0123456789"
# What a leak looks like besides the secrets themselves: a SigV4 signature, a session.
LEAKS = [r"Signature=[0-9a-f]{64}", r"upload_id=(?!<redacted>)[\w-]+"]


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]


def _texts(exc: BaseException, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Everything a user could read: the traceback, every chained exception (printed or
    not) and every log record (ours at DEBUG, everyone's at INFO and above)."""
    texts = ["".join(traceback.format_exception(exc))]
    texts += [f"{e!s} {e!r} {getattr(e, 'args', '')}" for e in _chain(exc)]
    texts += [r.getMessage() for r in caplog.records]
    return texts


def _assert_no_secret(texts: list[str], *secrets: str) -> None:
    for text in texts:
        for secret in secrets:
            core = secret.strip()
            assert core not in text, f"{core!r} leaked: {text[:2000]}"
            assert repr(core)[1:-1] not in text, f"{core!r} leaked: {text[:2000]}"
        for leak in LEAKS:
            assert re.search(leak, text) is None, f"{leak} leaked: {text[:2000]}"


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="storage")
    return caplog


def _attempt(action: Any) -> BaseException:
    try:
        action()
    except BaseException as exc:  # noqa: BLE001 - the test inspects whatever it was
        return exc
    raise AssertionError("the operation succeeded with an unusable credential")


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "s3fs"])
@pytest.mark.parametrize("broken", ["key", "token"])
def test_s3_credential_with_a_newline_never_reaches_a_message(
    caplog: pytest.LogCaptureFixture, direct: bool, broken: str
) -> None:
    endpoint = moto_endpoint()
    create_bucket(endpoint, BUCKET)
    creds = {"key": ACCESS_KEY, "secret": SECRET_KEY, "token": TOKEN}
    creds[broken] += "\n"
    fail_fast = {"retries": {"mode": "standard", "total_max_attempts": 2}}
    options = s3_options(endpoint, **creds, config_kwargs=fail_fast)
    fs = storage.S3FileSystem(storage_options=options, part_size=5 << 20, direct=direct)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    state = {"w": torch.randn(3 << 19)}  # 6 MiB: a multipart upload
    for action in (
        lambda: fs.read_bytes(f"{BUCKET}/anything"),
        lambda: storage.save(state, url, filesystem=fs),
        lambda: storage.load({"w": torch.zeros(3 << 19)}, url, filesystem=fs),
    ):
        exc = _attempt(action)
        assert isinstance(exc, OSError)
        _assert_no_secret(_texts(exc, caplog), ACCESS_KEY, SECRET_KEY, TOKEN)


def test_gcs_token_with_a_newline_never_reaches_a_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    endpoint = fake_gcs_endpoint()
    fs = storage.GCSFileSystem(storage_options=gcs_options(endpoint, token=GCS_TOKEN + "\n"))
    exc = _attempt(lambda: fs.read_bytes(f"{BUCKET}/anything"))
    _assert_no_secret(_texts(exc, caplog), GCS_TOKEN)


@pytest.fixture
def gcs_proxy() -> Iterator[FaultProxy]:
    endpoint = fake_gcs_endpoint()
    gcs_create_bucket(endpoint, BUCKET)
    with FaultProxy(endpoint) as proxy:
        yield proxy


def test_gcs_resumable_session_url_never_reaches_a_message(
    caplog: pytest.LogCaptureFixture, gcs_proxy: FaultProxy
) -> None:
    # Every chunk of a resumable upload is refused as if its session were gone (404):
    # gcsfs names the session URL, upload_id and all, in the error it raises.
    gcs_proxy.add("gcs404", method="PUT", path=r"upload_id=")
    fs = storage.GCSFileSystem(
        storage_options=gcs_options(gcs_proxy.url), part_size=256 << 10, single_request_size=0
    )
    url = f"gs://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    exc = _attempt(lambda: storage.save({"w": torch.randn(1 << 17)}, url, filesystem=fs))
    assert isinstance(exc, OSError)
    assert any("upload_id=" in target for _, target in gcs_proxy.arrivals)  # it was there
    _assert_no_secret(_texts(exc, caplog))


def test_cli_never_echoes_a_malformed_storage_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["ls", f"s3://{BUCKET}/x", "--storage-option", SECRET_KEY]) == 1
    err = capsys.readouterr().err
    assert "KEY=VALUE" in err and SECRET_KEY not in err


def test_redaction_by_form_and_by_value() -> None:
    """The forms a credential takes in client messages, each removed."""
    redactor = Redactor([TOKEN + "\n", "short"])
    text = (
        f"Invalid header value b'{TOKEN}\\n' | Authorization: AWS4-HMAC-SHA256 "
        f"Credential={ACCESS_KEY}/20250101/us-east-1/s3/aws4_request, SignedHeaders=host, "
        f"Signature={'ab' * 32} | https://x/upload?upload_id=ADPycdt&name=k | "
        f"tokeninfo?access_token={GCS_TOKEN}%0A | {{'Authorization': 'Bearer {GCS_TOKEN}'}} "
        f"| X-Amz-Security-Token: {TOKEN} | {json.dumps({'private_key': 'PEMDATA'})} "
        "| https://user:hunter2@proxy:3128/ | short"
    )
    cleaned = redactor.redact(text)
    for secret in (TOKEN, ACCESS_KEY, "ab" * 32, "ADPycdt", GCS_TOKEN, "PEMDATA", "hunter2"):
        assert secret not in cleaned, cleaned
    assert cleaned.endswith("short")  # a value under 8 characters is removed by form only


def test_key_bytes_never_reach_the_repr_of_what_holds_them(tmp_path: Any) -> None:
    # Before: ReaderOptions (a manager's reader_options, the Lightning plugin's) and the
    # LoadContext of every load were dataclasses whose repr printed keys={'prod': b'...'}:
    # the master key reached any log, debugger or error report that showed them.
    from extensions import AES256GCM

    key = bytes(range(100, 132))
    mgr = storage.CheckpointManager(
        tmp_path / "root", transforms=[AES256GCM(key=key, key_id="prod")], keys={"prod": key}
    )
    mgr.save(1, {"w": torch.ones(4)})
    reader = storage.CheckpointReader(tmp_path / "root" / "step-1", keys={"prod": key})
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    shown = repr(mgr.reader_options) + repr(reader._set_up())
    assert "ReaderOptions(" in shown and "LoadContext(" in shown
    for secret in (repr(key), key.hex(), key.decode("latin-1")):
        assert secret not in shown
