"""A store that lies about its answers: real servers (moto, fake-gcs-server) behind the
fault proxy (``tests.support.servers.FaultProxy``), whose ``"rewrite"`` fault changes
what the server said before the client sees it.

Each test says what happened before the fix it guards. The checkpoints are written
once per module, by stock DCP (no checksums: wrong bytes would load silently) unless a
test says otherwise; each test loads one item, ``b``, whose bytes start past byte 0."""

from __future__ import annotations

import gzip
import json
import logging
import pickle
import re
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

import storage
from extensions import ZStandard
from extensions.errors import UnsafeCheckpointError
from storage.backends import LocalFileSystem
from storage.backends.gcs import _direct as gcs_direct
from storage.checkpoint import heartbeat
from storage.checkpoint import storage_format as fmt
from storage.ops.copy import copy_checkpoint
from storage.ops.uploads import stale_uploads
from tests.hostile.test_bounds import MiB, _zstd_bomb
from tests.support.servers import (
    Asked,
    FaultProxy,
    Reply,
    boto3_client,
    create_bucket,
    gcs_endpoint_with_bucket,
    gcs_options,
    moto_endpoint,
    s3_options,
)

pytestmark = pytest.mark.timeout(120)

BUCKET = "dcp-liar"
FAST = {"retries": {"mode": "standard", "total_max_attempts": 2}, "read_timeout": 10}
STATE = {"a": torch.full((256,), 1.0), "b": torch.full((256,), 2.0)}

# How each backend reads: the S3 direct path, S3 through s3fs, GCS over pooled
# connections, GCS through gcsfs's aiohttp session.
READERS = ["s3-direct", "s3-s3fs", "gcs-direct", "gcs-streamed"]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    """The stock checkpoint on each server, and a proxy in front of each."""
    s3 = moto_endpoint()
    create_bucket(s3, BUCKET)
    gcs = gcs_endpoint_with_bucket(BUCKET)
    prefix = uuid.uuid4().hex
    dcp.save(STATE, storage_writer=FsspecWriter(f"s3://{BUCKET}/{prefix}/ckpt", **s3_options(s3)))
    dcp.save(STATE, storage_writer=FsspecWriter(f"gs://{BUCKET}/{prefix}/ckpt", **gcs_options(gcs)))
    with FaultProxy(s3) as s3_proxy, FaultProxy(gcs) as gcs_proxy:
        yield {"s3": s3_proxy, "gs": gcs_proxy, "prefix": prefix, "s3-server": s3}


def _reader(servers: dict[str, Any], reader: str) -> tuple[FaultProxy, Any, str]:
    """The proxy, a filesystem reading through it as ``reader`` does, and the URL."""
    scheme = "gs" if reader.startswith("gcs") else "s3"
    proxy: FaultProxy = servers[scheme]
    proxy.clear()
    fs: Any
    if scheme == "gs":
        extra = {"session_kwargs": {"trust_env": False}} if reader == "gcs-streamed" else {}
        fs = storage.GCSFileSystem(storage_options=gcs_options(proxy.url, **extra))
        fs.fs.retries = 2
        assert (gcs_direct.direct_get(fs.fs) is not None) == (reader == "gcs-direct")
    else:
        opts = s3_options(proxy.url, config_kwargs=FAST)
        fs = storage.S3FileSystem(storage_options=opts, direct=reader == "s3-direct")
    return proxy, fs, f"{scheme}://{BUCKET}/{servers['prefix']}/ckpt"


def _load_b(fs: Any, url: str) -> torch.Tensor:
    target = {"b": torch.zeros(256)}
    storage.load(target, url, filesystem=fs)
    return target["b"]


def _data_get(asked: Asked) -> bool:
    return asked.method == "GET" and "range" in asked.headers


def _gzipped(asked: Asked, reply: Reply) -> Reply:
    """A proxy that compresses answers (as ``Accept-Encoding`` allows)."""
    if reply.status in (200, 206):
        reply.body = gzip.compress(reply.body)
        reply.headers["Content-Encoding"] = "gzip"
    return reply


@pytest.mark.parametrize("reader", READERS)
def test_a_body_with_a_content_encoding_is_refused_naming_the_item(
    servers: dict[str, Any], reader: str
) -> None:
    """Before, every reader took a gzipped body as the stored bytes: a stock item was
    refused as "not plain data ... it could run code", an item written here as
    "truncated: restore the file", neither naming what the store did. gcsfs's session
    decodes gzip itself: there the item loads."""
    proxy, fs, url = _reader(servers, reader)
    proxy.add("rewrite", path=r"\.distcp", rewrite=_gzipped)
    if reader == "gcs-streamed":
        assert torch.equal(_load_b(fs, url), STATE["b"])
        return
    with pytest.raises(storage.RangeMismatchError, match="Content-Encoding 'gzip'") as caught:
        _load_b(fs, url)
    assert f"{url}: item 'b" in str(caught.value)


@pytest.mark.parametrize("reader", READERS)
def test_a_body_shorter_than_its_content_range_is_resumed(
    servers: dict[str, Any], reader: str
) -> None:
    """A ``206`` whose ``Content-Length`` (and body) holds half the range its
    ``Content-Range`` names. Before, the reader took the end of the body for the end of
    the object: the load failed with "data file is truncated; restore the file", the
    object whole and unharmed. Now the rest is asked for again."""
    proxy, fs, url = _reader(servers, reader)

    def halved(asked: Asked, reply: Reply) -> Reply:
        reply.body = reply.body[: len(reply.body) // 2]
        return reply

    proxy.add("rewrite", path=r"\.distcp", rewrite=halved, count=1)
    assert torch.equal(_load_b(fs, url), STATE["b"])
    gets = [r for r in proxy.settle() if r.method == "GET" and ".distcp" in r.target]
    assert len(gets) == 2


def test_a_body_that_never_reaches_its_content_range_fails_saying_so(
    servers: dict[str, Any],
) -> None:
    """Every answer ends before its range does (an empty body): the reader asks again a
    bounded number of times, then fails saying what the answers did."""
    proxy, fs, url = _reader(servers, "s3-direct")

    def empty(asked: Asked, reply: Reply) -> Reply:
        reply.body = b""
        return reply

    proxy.add("rewrite", path=r"\.distcp", rewrite=empty)
    with pytest.raises(OSError, match="though its Content-Range runs to byte"):
        _load_b(fs, url)


def test_a_length_far_past_the_body_allocates_nothing_and_loads(
    servers: dict[str, Any],
) -> None:
    """A ``Content-Length`` of 1 TiB on answers whose bodies hold the bytes asked for
    (then the connection closes): the direct path reads into the target, never into a
    buffer of the announced size, and takes what it asked for."""
    proxy, fs, url = _reader(servers, "s3-direct")

    def huge(asked: Asked, reply: Reply) -> Reply:
        reply.length = 1 << 40
        return reply

    proxy.add("rewrite", method="GET", rewrite=huge)
    assert torch.equal(_load_b(fs, url), STATE["b"])


def test_an_fsspec_clients_own_error_names_the_object(servers: dict[str, Any]) -> None:
    """Through ``FsspecFileSystem`` (s3fs's ``cat_file``), a body short of its
    ``Content-Length``. Before, aiohttp's ``ClientPayloadError`` came out of the load
    raw, naming no object (and, past a slice's first window, it was reported as damage
    to the item being decoded)."""
    proxy, _, url = _reader(servers, "s3-s3fs")
    fs = storage.FsspecFileSystem(storage_options=s3_options(proxy.url), protocol="s3")

    def huge(asked: Asked, reply: Reply) -> Reply:
        reply.length = len(reply.body) + 100
        return reply

    proxy.add("rewrite", path=r"\.distcp", rewrite=huge)
    with pytest.raises(OSError, match=re.escape(f"{url}/__0_0.distcp: reading failed")):
        _load_b(fs, url)


@pytest.mark.parametrize("reader", ["s3-direct", "gcs-direct"])
def test_an_html_page_for_the_metadata_says_so(servers: dict[str, Any], reader: str) -> None:
    """A proxy's error page answered ``200`` for ``.metadata``. Before: "not a readable
    DCP metadata file (invalid pickle opcode 0x3c); the checkpoint is damaged", sending
    the user to restore a checkpoint that was never touched."""
    proxy, fs, url = _reader(servers, reader)
    page = b"<!DOCTYPE html><html><body><h1>502 Bad Gateway</h1></body></html>"

    def error_page(asked: Asked, reply: Reply) -> Reply:
        return Reply(200, {"Content-Type": "text/html"}, page)

    proxy.add("rewrite", method="GET", path=r"metadata", rewrite=error_page)
    with pytest.raises(UnsafeCheckpointError, match="HTML/XML page") as caught:
        _load_b(fs, url)
    assert f"{url}/.metadata" in str(caught.value)


@pytest.mark.parametrize("reader", ["s3-direct", "gcs-direct"])
def test_a_listing_names_only_what_is_under_the_prefix(
    servers: dict[str, Any], reader: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A listing that also names keys outside the prefix asked for, ``..`` and a
    duplicate. Before, S3's ``ls`` cut every key at the prefix's length (a key of
    another checkpoint, ``ckpt-other/x``, became the name ``-other``) and the fsspec
    one (GCS) took a stray key's last part (``elsewhere/.metadata`` -> ``.metadata``,
    ``ckpt-other/x`` -> ``x``); ``..``, joined to the path, names its parent. Each
    name is then open to a deletion."""
    proxy, fs, url = _reader(servers, reader)
    base = f"{servers['prefix']}/ckpt"
    lies = [f"{base}-other/x", "elsewhere/__1_0.distcp", f"{base}/..", f"{base}/.metadata"]

    def s3_listing(asked: Asked, reply: Reply) -> Reply:
        extra = "".join(f"<Contents><Key>{key}</Key><Size>1</Size></Contents>" for key in lies)
        end = b"</ListBucketResult>"
        reply.body = reply.body.replace(end, extra.encode() + end)
        return reply

    def gcs_listing(asked: Asked, reply: Reply) -> Reply:
        page = json.loads(reply.body)
        item = page["items"][0]
        page["items"] += [{**item, "name": key} for key in lies]
        reply.body = json.dumps(page).encode()
        return reply

    if reader == "s3-direct":
        proxy.add("rewrite", method="GET", path=r"list-type=2", rewrite=s3_listing)
    else:
        proxy.add("rewrite", method="GET", path=r"/o\?", rewrite=gcs_listing)
    with caplog.at_level(logging.WARNING):
        names = fs.ls(url)
    assert names == [".metadata", "__0_0.distcp"]
    assert "not under it, left out" in caplog.text


@pytest.fixture(scope="module")
def bomb_checkpoint(servers: dict[str, Any]) -> str:
    """A checkpoint (ours, zstd) whose non-tensor item ``blob`` is a zstd bomb of 2 KiB
    (64 MiB of zeros) claiming 2**40 stored bytes, on the S3 server itself."""
    fs = storage.S3FileSystem(storage_options=s3_options(servers["s3-server"]))
    url = f"s3://{BUCKET}/{servers['prefix']}/bomb"
    storage.save(
        {"blob": b"small", "t": torch.ones(4)}, url, filesystem=fs, transforms=[ZStandard()]
    )
    path = url.removeprefix("s3://")
    metadata = pickle.loads(fs.read_bytes(f"{path}/.metadata"))
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "blob")
    data_file = f"{path}/{info.relative_path}"
    data = fs.read_bytes(data_file)
    info.offset, info.length = len(data), 1 << 40
    getattr(info, fmt.EXTRA).pop("crc32c", None)
    fs.write_atomic(data_file, data + _zstd_bomb(64 * MiB))
    fs.write_atomic(f"{path}/.metadata", pickle.dumps(metadata))
    return url


def _overstated(asked: Asked, reply: Reply) -> Reply:
    """A HEAD that says the object holds 2 TiB."""
    reply.length = 1 << 41
    return reply


@pytest.mark.parametrize("what", ["load", "transcoding copy"])
def test_a_size_the_store_overstates_does_not_raise_the_bomb_bound(
    servers: dict[str, Any], bomb_checkpoint: str, what: str, tmp_path: Path
) -> None:
    """A non-tensor item may decode to 64 times the stored bytes its file holds; the
    reader took that from the store's HEAD. Before, a HEAD that said 2 TiB let the
    2 KiB bomb claiming 2**40 bytes decode whole (64 MiB here, +140 MB peak; 32 GiB a
    MiB of stored bomb) before the read found the file shorter; a transcoding copy
    wrote it all out."""
    proxy, fs, _ = _reader(servers, "s3-direct")
    proxy.add("rewrite", method="HEAD", rewrite=_overstated)
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeCheckpointError, match="'blob'.*decodes to more than 16777216"):
            if what == "load":
                storage.load({"blob": b"", "t": torch.zeros(4)}, bomb_checkpoint, filesystem=fs)
            else:
                src = bomb_checkpoint.removeprefix("s3://")
                local = LocalFileSystem()
                copy_checkpoint(fs, src, local, str(tmp_path / "dst"), transforms=[ZStandard()])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 48 * MiB


def _understated(asked: Asked, reply: Reply) -> Reply:
    """A HEAD that says the object holds 60 bytes."""
    reply.length = 60
    return reply


def _whole_gets(proxy: FaultProxy, key: str) -> list[int]:
    """The bytes of each GET of ``key`` through ``proxy`` that asked for all of it."""
    return [
        r.body_bytes for r in proxy.records if r.method == "GET" and key in r.target and not r.range
    ]


@pytest.mark.parametrize("reader", ["s3-direct", "s3-s3fs"])
def test_a_heartbeat_the_store_understates_is_read_within_its_bound(
    servers: dict[str, Any], reader: str
) -> None:
    """``gc`` reads each heartbeat in a checkpoint directory to age it, if its HEAD says
    it is small. Before, that read had no bound: a HEAD that understated the object (or
    one replaced between the two requests) had ``gc`` fetch the whole object, here 8
    MiB, into memory."""
    proxy, fs, url = _reader(servers, reader)
    directory = f"{BUCKET}/{uuid.uuid4().hex}"
    name = ".heartbeat-abc"
    fs.write_atomic(f"{directory}/{name}", b" " * (8 * MiB))
    proxy.add("rewrite", method="HEAD", rewrite=_understated)
    fresh, stale = heartbeat.live(fs, directory, 3600)
    assert name in fresh + stale
    assert not _whole_gets(proxy, name)


@pytest.mark.parametrize("reader", ["s3-direct", "s3-s3fs"])
def test_an_exclusive_publish_refused_by_the_store_reads_what_is_there_within_its_bound(
    servers: dict[str, Any], reader: str
) -> None:
    """An exclusive publish the store refuses (412: the name is taken) reads the object
    there to tell a retried PUT of its own from another's object. Before, it read that
    object whole: whoever took the name first with a large object (here 8 MiB; a
    ``.metadata`` a commit is racing for) had the committing process fetch all of it
    into memory."""
    proxy, fs, url = _reader(servers, reader)
    path = f"{BUCKET}/{uuid.uuid4().hex}/.metadata"
    fs.write_atomic(path, b" " * (8 * MiB))
    with pytest.raises(FileExistsError):
        fs.write_atomic(path, b"small payload", exclusive=True)
    assert not _whole_gets(proxy, ".metadata")


def test_a_drain_whose_metadata_the_store_acknowledges_but_loses_ends(
    servers: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store answers 200 to the PUT of a drained step's ``.metadata`` but keeps
    nothing (or a cache keeps answering the 404 of the look before it). Before, the drain
    pass saw the step still not committed at the root and drained it again, and again:
    it re-uploaded the whole step for ever, ``wait()`` never returned and no later pass
    ran (here the store gives up lying after a few PUTs, so the test ends: it did with
    the lie's own error). Now each pass drains a step at most once, says that the root
    does not show it, and keeps the local copy; a later pass drains it again."""
    proxy: FaultProxy = servers["s3"]
    proxy.clear()
    server = boto3_client(servers["s3-server"])
    prefix = f"{uuid.uuid4().hex}/run"
    lies: list[str] = []

    def lost(asked: Asked, reply: Reply) -> Reply:
        lies.append(asked.target)
        if len(lies) > 3:
            return Reply(500, {}, b"enough")
        server.delete_object(Bucket=BUCKET, Key=f"{prefix}/step-2/.metadata")
        return reply

    fs = storage.S3FileSystem(storage_options=s3_options(proxy.url, config_kwargs=FAST))
    mgr = storage.CheckpointManager(
        f"s3://{BUCKET}/{prefix}", filesystem=fs, local=tmp_path / "local", keep_local=1
    )
    mgr.save(1, {"w": torch.full((64,), 1.0)})
    mgr.wait()
    proxy.add("rewrite", method="PUT", path=r"/step-2/\.metadata(\?|$)", rewrite=lost)
    with caplog.at_level(logging.WARNING, logger="storage.ops.tiers"):
        mgr.save(2, {"w": torch.full((64,), 2.0)})
        mgr.wait()
    assert len(lies) == 1
    assert "step 2 was published at" in caplog.text and "does not show it" in caplog.text
    assert mgr.durable_steps() == [1]
    assert mgr.tiers is not None and 2 in mgr.tiers.local.steps()  # kept: not durable
    proxy.clear()
    mgr.save(3, {"w": torch.full((64,), 3.0)})
    mgr.wait()  # the next pass drains step 2 again, then step 3
    assert mgr.durable_steps() == [1, 2, 3]


def test_a_listing_of_uploads_names_only_what_is_under_the_prefix(
    servers: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A listing of incomplete multipart uploads that also names another team's upload,
    outside the prefix asked for (the store or a proxy answers wrongly). Before,
    ``stale_uploads(..., abort=True)`` (``gc --abort-uploads``) took it for one of the
    root's and aborted it: the other job's checkpoint upload in flight was lost."""
    proxy: FaultProxy = servers["s3"]
    proxy.clear()
    server = boto3_client(servers["s3-server"])
    prefix = f"{uuid.uuid4().hex}/run"
    theirs = f"{uuid.uuid4().hex}/other/step-1/__0_0-0123456789ab.distcp"
    upload = server.create_multipart_upload(Bucket=BUCKET, Key=theirs)["UploadId"]
    stray = (
        f"<Upload><Key>{theirs}</Key><UploadId>{upload}</UploadId>"
        "<Initiated>2010-11-10T20:48:33.000Z</Initiated></Upload>"
    )

    def listing(asked: Asked, reply: Reply) -> Reply:
        end = b"</ListMultipartUploadsResult>"
        reply.body = reply.body.replace(end, stray.encode() + end)
        return reply

    proxy.add("rewrite", method="GET", path=r"\?uploads", rewrite=listing)
    fs = storage.S3FileSystem(storage_options=s3_options(proxy.url, config_kwargs=FAST))
    with caplog.at_level(logging.WARNING):
        assert stale_uploads(fs, f"{BUCKET}/{prefix}", 0, abort=True) == []
    assert "not under it, left out" in caplog.text
    listed = server.list_multipart_uploads(Bucket=BUCKET, Prefix=theirs)
    assert [u["UploadId"] for u in listed.get("Uploads", [])] == [upload]
    server.abort_multipart_upload(Bucket=BUCKET, Key=theirs, UploadId=upload)


def _tiered_on(proxy: FaultProxy, prefix: str, tmp_path: Path, **options: Any) -> Any:
    """A tiered manager (local tier under ``tmp_path``, ``keep_local=1``) whose root,
    ``prefix`` in the bucket, is read and written through ``proxy``."""
    fs = storage.S3FileSystem(storage_options=s3_options(proxy.url, config_kwargs=FAST))
    return storage.CheckpointManager(
        f"s3://{BUCKET}/{prefix}", filesystem=fs, local=tmp_path / "local", keep_local=1, **options
    )


def _load_root_step(servers: dict[str, Any], prefix: str, step: int) -> torch.Tensor:
    """``w`` of ``step`` as the S3 server itself holds it (no proxy)."""
    fs = storage.S3FileSystem(storage_options=s3_options(servers["s3-server"]))
    target = {"w": torch.zeros(64)}
    storage.load(target, f"s3://{BUCKET}/{prefix}/step-{step}", filesystem=fs)
    return target["w"]


def test_a_store_that_says_a_lost_metadata_exists_does_not_cost_the_local_copy(
    servers: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store acknowledges the PUT of a drained step's ``.metadata`` but keeps
    nothing, and its HEAD (or a cache in front of it) answers 200 for that name all the
    same. Before, a HEAD was all that made a step durable: the next save's pass pruned
    the local copy (``keep_local=1``) while the root held no metadata for it, the only
    good copy lost. Now the root's ``.metadata`` is read back and compared with what the
    drain published: missing, the step stays local and the next pass drains it again."""
    proxy: FaultProxy = servers["s3"]
    proxy.clear()
    server = boto3_client(servers["s3-server"])
    prefix = f"{uuid.uuid4().hex}/run"
    key = f"{prefix}/step-2/.metadata"

    def lost(asked: Asked, reply: Reply) -> Reply:
        server.delete_object(Bucket=BUCKET, Key=key)
        return reply

    def there(asked: Asked, reply: Reply) -> Reply:
        return Reply(200, {"Content-Type": "binary/octet-stream", "ETag": '"0"'}, b"", 100)

    mgr = _tiered_on(proxy, prefix, tmp_path)
    assert mgr.tiers is not None
    mgr.save(1, {"w": torch.full((64,), 1.0)})
    mgr.wait()
    proxy.add("rewrite", method="PUT", path=r"/step-2/\.metadata(\?|$)", rewrite=lost, count=1)
    proxy.add("rewrite", method="HEAD", path=r"/step-2/\.metadata(\?|$)", rewrite=there)
    with caplog.at_level(logging.WARNING, logger="storage.ops.tiers"):
        mgr.save(2, {"w": torch.full((64,), 2.0)})
        mgr.wait()
    assert "step 2 was published at" in caplog.text and "does not show it" in caplog.text
    assert 2 in mgr.tiers.local.steps()
    mgr.save(3, {"w": torch.full((64,), 3.0)})  # step 2 is drained again, then pruned
    mgr.wait()
    assert torch.equal(_load_root_step(servers, prefix, 2), torch.full((64,), 2.0))
    assert mgr.tiers.local.steps() == [3]


def test_a_store_that_serves_another_saves_metadata_keeps_the_local_copy(
    servers: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store (a cache in front of it) answers the read of a drained step's
    ``.metadata`` with another object's bytes: here step 1's, as a stale cache holding
    an older save at that name would. Before, the HEAD that found the name made the
    step durable and the local copy was pruned: had the store lost the object, the only
    good copy was gone. Now the step stays local while the root's ``.metadata`` is not
    the one the drain published, with one warning naming the step, the root and what
    differs; the next pass looks again and prunes it once the root answers right."""
    proxy: FaultProxy = servers["s3"]
    proxy.clear()
    server = boto3_client(servers["s3-server"])
    prefix = f"{uuid.uuid4().hex}/run"
    mgr = _tiered_on(proxy, prefix, tmp_path)
    assert mgr.tiers is not None
    mgr.save(1, {"w": torch.full((64,), 1.0)})
    mgr.wait()
    older = server.get_object(Bucket=BUCKET, Key=f"{prefix}/step-1/.metadata")["Body"].read()

    proxy.add("rewrite", method="GET", path=r"/step-2/\.metadata(\?|$)", rewrite=_serving(older))
    with caplog.at_level(logging.WARNING, logger="storage.ops.tiers"):
        mgr.save(2, {"w": torch.full((64,), 2.0)})
        mgr.wait()
        mgr.save(3, {"w": torch.full((64,), 3.0)})
        mgr.wait()
    assert mgr.tiers.local.steps() == [2, 3]  # 2 kept: the root does not show our copy
    warnings = [r.getMessage() for r in caplog.records if "step 2 at" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert f"s3://{BUCKET}/{prefix}/step-2" in warnings[0]
    assert f"{len(older)} bytes" in warnings[0]
    proxy.clear()
    mgr.save(4, {"w": torch.full((64,), 4.0)})
    mgr.wait()
    assert mgr.tiers.local.steps() == [4]
    assert mgr.durable_steps() == [1, 2, 3, 4]


def test_a_drained_reference_needs_the_content_fingerprint_of_the_roots_base(
    servers: dict[str, Any], tmp_path: Path
) -> None:
    """An incremental step drained where the root holds its base keeps its references
    to the base's bytes when the root's base records the same stored bytes for the
    item. Before, "the same" was index, transform chain, length and CRC32C only: a
    root whose base ``.metadata`` records another content fingerprint for the item (the
    store serves another save's metadata at that name; here an edited copy) still got
    the reference, to bytes it says hold other content. Now the fingerprint must match
    too, else the item's bytes are copied into the step."""
    proxy: FaultProxy = servers["s3"]
    proxy.clear()
    server = boto3_client(servers["s3-server"])
    prefix = f"{uuid.uuid4().hex}/run"
    mgr = _tiered_on(proxy, prefix, tmp_path, incremental=True)
    same = torch.full((64,), 7.0)
    mgr.save(1, {"w": same, "v": torch.full((64,), 1.0)})
    mgr.wait()
    key = f"{prefix}/step-1/.metadata"
    metadata = pickle.loads(server.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "w")
    facts = getattr(info, fmt.EXTRA)
    assert facts[fmt.CONTENT].startswith("xxh3_128:")
    facts[fmt.CONTENT] = "xxh3_128:" + "0" * 32
    other = pickle.dumps(metadata)

    proxy.add("rewrite", method="GET", path=r"/step-1/\.metadata(\?|$)", rewrite=_serving(other))
    mgr.save(2, {"w": same, "v": torch.full((64,), 2.0)})
    assert mgr.tiers is not None
    assert fmt.stored_item(_item(mgr.tiers.local.model(2), "w")).ref == "step-1"  # locally
    mgr.wait()
    proxy.clear()
    drained = pickle.loads(
        server.get_object(Bucket=BUCKET, Key=f"{prefix}/step-2/.metadata")["Body"].read()
    )
    w = next(v for k, v in drained.storage_data.items() if k.fqn == "w")
    assert fmt.stored_item(w).ref is None  # its bytes copied into step-2
    assert torch.equal(_load_root_step(servers, prefix, 2), same)


def _item(checkpoint: Any, fqn: str) -> Any:
    """The storage info of item ``fqn`` in ``checkpoint``'s ``.metadata``."""
    metadata = checkpoint.global_metadata
    return next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)


def _serving(body: bytes) -> Callable[[Asked, Reply], Reply]:
    """A rewrite that answers a GET (ranged or not) with ``body``: a store serving other
    bytes than those it was given."""

    def serve(asked: Asked, reply: Reply) -> Reply:
        headers = {"Content-Type": "binary/octet-stream", "ETag": '"0"'}
        if "range" in asked.headers:
            headers["Content-Range"] = f"bytes 0-{len(body) - 1}/{len(body)}"
            return Reply(206, headers, body)
        return Reply(200, headers, body)

    return serve
