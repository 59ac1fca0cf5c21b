"""The staging areas (``.dcp-staging-<id>/``) that consolidating safetensors saves killed
mid-save leave: swept by the next save to the same model folder and by ``dcp-storage
gc``, reported by ``verify``, never while a save is still using one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import storage
from storage.backends import LocalFileSystem
from storage.checkpoint import heartbeat
from storage.checkpoint.safetensors import save_safetensors
from storage.checkpoint.safetensors.staging import STAGING_PREFIX, beating, remove_staging
from storage.cli import main
from tests.support.servers import ServerUnavailable, boto3_client, create_bucket, s3_endpoint
from tests.support.subprocess_jobs import kill_when_marked

_LONG_AGO = time.time() - 7 * 24 * 3600


def _killed_area(model: Path, name: str = ".dcp-staging-0123456789ab") -> Path:
    """What a consolidating save killed after staging leaves: each rank's staging object
    and a heartbeat that stopped beating, all dated a week back."""
    area = model / name
    area.mkdir(parents=True)
    for rank in range(2):
        (area / f"rank-{rank:05d}.bin").write_bytes(os.urandom(256))
    (area / heartbeat.name_of("dead")).write_text(json.dumps({"time": _LONG_AGO}))
    for entry in [*area.iterdir(), area]:
        os.utime(entry, (_LONG_AGO, _LONG_AGO))
    return area


def _model() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(8, 4), "b": torch.arange(4)}


def test_the_next_save_removes_a_killed_saves_staging_area(tmp_path: Path) -> None:
    """Before, a save killed between staging and its commit left its staging area (each
    rank's share of the model) in the model folder forever; the next save now removes it."""
    model = tmp_path / "hf"
    killed = _killed_area(model)
    save_safetensors(_model(), model)
    assert not killed.exists()
    assert sorted(p.name for p in model.iterdir()) == ["model.safetensors"]


def test_the_next_save_keeps_the_area_of_a_save_still_running(tmp_path: Path) -> None:
    """A concurrent save's area stays: one whose heartbeat is live (its objects dated as
    old as a killed save's), one whose objects are young (a save that keeps no
    heartbeat), and one holding files that are not ours."""
    model = tmp_path / "hf"
    live = _killed_area(model, ".dcp-staging-aaaaaaaaaaaa")
    young = model / ".dcp-staging-bbbbbbbbbbbb"
    young.mkdir()
    (young / "rank-00000.bin").write_bytes(b"x" * 64)
    foreign = _killed_area(model, ".dcp-staging-cccccccccccc")
    (foreign / "notes.txt").write_text("mine")
    os.utime(foreign / "notes.txt", (_LONG_AGO, _LONG_AGO))
    fs = storage.LocalFileSystem()
    with beating(fs, str(model), live.name):
        save_safetensors(_model(), model)
        assert (live / "rank-00000.bin").exists()
    assert (young / "rank-00000.bin").exists() and (foreign / "rank-00000.bin").exists()


def test_gc_lists_and_removes_staging_areas_of_killed_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, ``gc`` neither listed nor removed staging areas; now it treats them as
    interrupted saves (older than --grace, no live heartbeat), in the root and in each
    step, and keeps a live save's."""
    root = tmp_path / "run"
    in_root = _killed_area(root)
    in_step = _killed_area(root / "step-3" / "hf")  # not a step's own folder: not looked at
    step_area = _killed_area(root / "step-4", ".dcp-staging-444444444444")
    live = _killed_area(root / "step-5", ".dcp-staging-555555555555")
    gc = ["gc", str(root), "--keep-last", "5", "--json"]
    with beating(storage.LocalFileSystem(), str(live.parent), live.name):
        assert main([*gc, "--dry-run"]) == 0
        listed = json.loads(capsys.readouterr().out)["staging"]
        assert sorted(Path(u).name for u in listed) == [in_root.name, step_area.name]
        assert in_root.exists() and step_area.exists()
        assert main(gc) == 0
        assert len(json.loads(capsys.readouterr().out)["staging"]) == 2
        assert not in_root.exists() and not step_area.exists()
        assert live.exists() and in_step.exists()
    assert main([*gc[:-1]]) == 0
    assert "staging area of an interrupted safetensors save" in capsys.readouterr().out


def test_verify_notes_a_staging_area_beside_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``verify`` of a model says which staging areas lie beside it and how they go."""
    model = tmp_path / "hf"
    save_safetensors(_model(), model)
    area = _killed_area(model)
    assert main(["verify", str(model)]) == 0
    out = capsys.readouterr().out
    assert area.name in out and "`dcp-storage gc` removes it" in out


def test_gc_in_a_bucket_removes_a_killed_area_and_aborts_its_upload(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In a bucket: a killed save's staging objects are removed by ``gc`` (grace 0), a
    live save's stay, and the open upload of a rank killed mid-stage is listed and
    aborted like a data file's (before, gc skipped it: not a checkpoint file name)."""
    try:
        endpoint = s3_endpoint("moto")
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    create_bucket(endpoint, "staging")
    prefix = f"{uuid.uuid4().hex}/run"
    s3 = boto3_client(endpoint)
    dead, live = f"{prefix}/.dcp-staging-dead00000000", f"{prefix}/.dcp-staging-111100000000"
    for area in (dead, live):
        s3.put_object(Bucket="staging", Key=f"{area}/rank-00000.bin", Body=b"x" * 64)
    s3.create_multipart_upload(Bucket="staging", Key=f"{dead}/rank-00001.bin")
    s3.put_object(
        Bucket="staging",
        Key=f"{live}/{heartbeat.name_of('alive')}",
        Body=json.dumps({"time": time.time()}).encode(),
    )
    options = [
        f"--storage-option=endpoint_url={endpoint}",
        "--storage-option=key=testing",
        "--storage-option=secret=testing",
    ]
    gc = ["gc", f"s3://staging/{prefix}", "--keep-last", "1", "--grace", "0", *options]
    assert main([*gc, "--abort-uploads", "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert out["staging"] == [f"s3://staging/{dead}"]
    assert [u["url"] for u in out["uploads"]] == [f"s3://staging/{dead}/rank-00001.bin"]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="staging", Prefix=prefix)["Contents"]]
    assert sorted(keys) == [f"{live}/{heartbeat.name_of('alive')}", f"{live}/rank-00000.bin"]
    assert not s3.list_multipart_uploads(Bucket="staging", Prefix=prefix).get("Uploads")


_PARK_ON_PUBLISH = """
import os, sys, time
from storage.backends._local import LocalFileSystem
from storage.cli import main
rename_in = LocalFileSystem.rename_in
def parked(self, directory, name, new_name):  # the first shard written whole, unpublished
    open(sys.argv[3], "w").close()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # killed here; ends by itself if the test died
        time.sleep(0.05)
    rename_in(self, directory, name, new_name)
LocalFileSystem.rename_in = parked
main(["export", sys.argv[1], sys.argv[2], "--format", "safetensors", "--max-shard-size", "300KB"])
"""


def test_an_export_killed_mid_file_leaves_a_temporary_that_gc_and_the_next_export_remove(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dcp-storage export` killed with kill -9 while a model file is under its
    temporary name. Before, `model-00001-of-0000N.safetensors.tmp-<id>` (up to a shard's
    size, 5 GB by default) stayed in the model folder for good: neither `gc` nor the
    next export to the folder looked at it. Now both remove it once older than the
    grace, and the export run again without --overwrite gives a model that loads."""
    src, dst, mark = tmp_path / "ck", tmp_path / "hf", tmp_path / "parked"
    state = {
        f"t{i}": torch.randn(256, 256, generator=torch.Generator().manual_seed(i)) for i in range(3)
    }
    storage.save(state, str(src))
    kill_when_marked(
        _PARK_ON_PUBLISH, [str(src), str(dst), str(mark)], mark, "the export's first publish"
    )
    temporaries = [p for p in dst.iterdir() if ".safetensors.tmp-" in p.name]
    assert temporaries and not (dst / "model.safetensors.index.json").exists()
    # Within the grace it is left alone: it may be an export still writing.
    assert main(["gc", str(dst), "--keep-last", "1", "--dry-run", "-q"]) == 0
    assert all(p.exists() for p in temporaries)
    for path in temporaries:
        os.utime(path, (_LONG_AGO, _LONG_AGO))
    capsys.readouterr()
    assert main(["gc", str(dst), "--keep-last", "1", "--grace", "60", "--dry-run", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["staging"]
    assert sorted(listed) == sorted(str(p) for p in temporaries)
    assert all(p.exists() for p in temporaries)  # listed, not removed
    assert (
        main(
            [
                "export",
                str(src),
                str(dst),
                "--format",
                "safetensors",
                "--max-shard-size",
                "300KB",
                "-q",
            ]
        )
        == 0
    )
    assert not [p for p in dst.iterdir() if ".tmp-" in p.name]
    assert main(["verify", str(dst), "-q"]) == 0
    out = {name: torch.zeros(256, 256) for name in state}
    dcp.load(out, storage_reader=storage.SafetensorsReader(str(dst)), no_dist=True)
    assert all(torch.equal(out[name], tensor) for name, tensor in state.items())


_KILLED_EXPORT = """
import sys
from storage.cli import main
main(["export", sys.argv[1], sys.argv[2], "--format", "safetensors",
      "--dst-storage-option=endpoint_url=" + sys.argv[3],
      "--dst-storage-option=key=testing", "--dst-storage-option=secret=testing",
      "--dst-storage-option=default_block_size=5242880"])
"""


def test_gc_in_a_bucket_aborts_the_upload_of_an_export_killed_mid_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dcp-storage export ... s3://...` killed with kill -9 while its model file's
    multipart upload is open: the parts stay stored and billed, invisible to listings.
    Before, `gc --abort-uploads` skipped the upload (not a checkpoint file name) and
    nothing ever reported it; now it is listed and aborted like a data file's."""
    from tests.support.servers import FaultProxy

    try:
        endpoint = s3_endpoint("moto")
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    create_bucket(endpoint, "exports")
    prefix = f"{uuid.uuid4().hex}/hf"
    src = tmp_path / "ck"
    storage.save({"w": torch.randn(3 << 20)}, str(src))  # 12 MiB: 3 parts of 5 MiB
    s3 = boto3_client(endpoint)
    with FaultProxy(endpoint) as proxy:
        proxy.add("delay", method="POST", path=r"uploadId=", delay=300.0)  # never completes
        args = [str(src), f"s3://exports/{prefix}", proxy.url]
        export = subprocess.Popen([sys.executable, "-c", _KILLED_EXPORT, *args])
        try:
            deadline = time.monotonic() + 300  # a new interpreter: torch's import first
            while not any(m == "POST" and "uploadId=" in t for m, t in proxy.arrivals):
                assert export.poll() is None, "the export ended before completing its upload"
                assert time.monotonic() < deadline, "the export never began its upload"
                time.sleep(0.05)
        finally:
            export.kill()  # every part is up, the upload is never completed
            export.wait(10)
    listing = s3.list_multipart_uploads(Bucket="exports", Prefix=prefix).get("Uploads", [])
    assert [u["Key"] for u in listing] == [f"{prefix}/model.safetensors"]
    options = [
        f"--storage-option=endpoint_url={endpoint}",
        "--storage-option=key=testing",
        "--storage-option=secret=testing",
    ]
    gc = ["gc", f"s3://exports/{prefix}", "--keep-last", "1", "--grace", "0", *options]
    assert main([*gc, "--abort-uploads", "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert [u["url"] for u in out["uploads"]] == [f"s3://exports/{prefix}/model.safetensors"]
    assert out["uploads"][0]["aborted"] is True
    assert not s3.list_multipart_uploads(Bucket="exports", Prefix=prefix).get("Uploads")


def test_a_saves_staging_is_removed_under_a_linked_path_the_user_names(tmp_path: Path) -> None:
    """The staging objects a save wrote into a directory the user reaches through their
    own link go once the save is done: removed in the directory the link resolves to
    (never through the link itself, which kept them and warned)."""
    real, area = tmp_path / "real", STAGING_PREFIX + "abc"
    (real / area).mkdir(parents=True)
    (real / area / "rank-00000.bin").write_bytes(b"x")
    (tmp_path / "mine").symlink_to(real, target_is_directory=True)
    remove_staging(LocalFileSystem(), str(tmp_path / "mine"), [f"{area}/rank-00000.bin"])
    assert list(real.iterdir()) == []
