"""Names the store chooses (file names in a checkpoint's directory, upload keys,
descriptors in its metadata) in the text the CLI prints: each is escaped inside its
line, so it can neither add a line that passes for one of ours nor send the terminal a
control sequence (``--json`` is escaped by ``json.dumps``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import storage
from extensions.errors import printable
from storage.checkpoint import storage_format as fmt
from storage.cli import main

# A line break that would start a forged line, a carriage return, a screen-clearing
# escape sequence, a right-to-left override and a Unicode line separator.
HOSTILE = "x\nremoved forged\r\x1b[2J\u202e\u2028y"
RAW = ("\n", "\r", "\x1b", "\u202e", "\u2028")


def _assert_one_escaped_line(out: str, name: str) -> str:
    (line,) = out.rstrip("\n").split("\n")
    assert printable(name) in line and not any(c in line for c in RAW), line
    return line


def test_rm_names_a_planted_file_it_leaves_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rm`` lists the files it leaves in place (names no metadata gave): a planted file
    whose name held a line break used to print the rest of its name as a line of its
    own, e.g. a forged "removed ..." line."""
    ckpt = tmp_path / "ckpt"
    storage.save({"w": torch.ones(8)}, str(ckpt))
    (ckpt / HOSTILE).write_bytes(b"planted")
    assert main(["rm", str(ckpt)]) == 0
    line = _assert_one_escaped_line(capsys.readouterr().out, HOSTILE)
    assert line.startswith(f"removed {ckpt}")
    # --json says the same, escaped by json.dumps, and a program reads the name back whole.
    storage.save({"w": torch.ones(8)}, str(ckpt))
    assert main(["rm", str(ckpt), "--json"]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in RAW[1:])  # JSON's own line breaks only
    assert json.loads(out)["kept"] == [HOSTILE]


def test_cp_names_a_hostile_transform_descriptor_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cp`` reports the source's transform chains, which its metadata names: a
    descriptor holding a line break used to print as two lines of the report."""
    src = tmp_path / "src"
    storage.save({"w": torch.ones(8)}, str(src))
    path = src / ".metadata"
    meta = fmt.load_metadata(path.read_bytes(), str(path))
    for info in meta.storage_data.values():
        info.transform_descriptors = [HOSTILE]
    path.write_bytes(fmt.dump_metadata(meta))
    assert main(["cp", str(src), str(tmp_path / "dst"), "-q"]) == 0
    line = _assert_one_escaped_line(capsys.readouterr().out, HOSTILE)
    assert line.startswith("copied ")


# moto routes no key holding a line break, but XML turns a carriage return in the key it
# lists into one (the listing gives "\n"): what a store keeping the "\n" gives too.
@pytest.mark.parametrize(("server", "brk"), [("moto", "\r"), ("seaweedfs", "\n")])
def test_gc_names_a_hostile_upload_key_escaped(
    server: str, brk: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gc`` lists the open multipart uploads of checkpoint files under the root, by
    key, which anyone who can write to the bucket chooses: a key whose directory held a
    line break used to print the rest of it as a line of its own, e.g. a forged
    "removed step-9 (retention)" line."""
    import uuid

    from tests.support.servers import (
        ServerUnavailable,
        boto3_client,
        create_bucket,
        open_uploads,
        s3_endpoint,
    )

    try:
        endpoint = s3_endpoint(server)
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    create_bucket(endpoint, "cli-hostile")
    prefix = f"{uuid.uuid4().hex}/run"
    s3 = boto3_client(endpoint)
    key = f"{prefix}/evil{brk}removed step-9 (retention)\u202e\u2028/__0_0-dead.distcp"
    s3.create_multipart_upload(Bucket="cli-hostile", Key=key)
    (listed_key,) = open_uploads(s3, "cli-hostile", prefix)
    assert "\n" in listed_key
    options = [
        f"--storage-option=endpoint_url={endpoint}",
        "--storage-option=key=testing",
        "--storage-option=secret=testing",
    ]
    root = f"s3://cli-hostile/{prefix}"
    gc = ["gc", root, "--keep-last", "1", "--grace", "0", *options]
    assert main(gc) == 0
    out = capsys.readouterr().out
    lines = out.rstrip("\n").split("\n")
    assert not [line for line in lines if line.startswith("removed")], out
    (upload,) = [line for line in lines if "multipart upload" in line]
    assert printable(listed_key.rsplit("/", 1)[0].rsplit("/", 1)[1]) in upload
    assert not any(c in out for c in RAW[1:]), out
    assert upload.endswith("left open (--abort-uploads aborts it)")
    assert main([*gc, "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)["uploads"]
    assert listed["url"] == f"s3://cli-hostile/{listed_key}"


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    # A process of its own: there nothing configured logging, as for a user's command.
    return subprocess.run(
        [sys.executable, "-m", "storage", *args], capture_output=True, text=True, timeout=120
    )


def test_gc_and_rm_name_a_hostile_referencing_sibling_escaped(tmp_path: Path) -> None:
    """A sibling directory holding an incremental checkpoint keeps its base from ``gc``
    and ``rm``, which name it: ``gc``'s warning printed its name raw (a line break
    started a forged line, an escape sequence reached the terminal), ``rm``'s error
    turned the line break into a space."""
    root = tmp_path / "run"
    storage.save({"w": torch.ones(8)}, str(root / "step-1"), fingerprint=True)
    storage.save({"w": torch.ones(8) * 2}, str(root / "step-2"))
    storage.save({"w": torch.ones(8)}, str(root / "side"), base=str(root / "step-1"))
    (root / "side").rename(root / HOSTILE)
    gc = _run_cli("gc", str(root), "--keep-last", "1")
    assert gc.returncode == 0, gc.stderr
    assert gc.stdout.splitlines()[-1] == "kept: step-1, step-2"
    line = _assert_one_escaped_line(gc.stderr, HOSTILE)
    assert line.startswith(f"kept {root / 'step-1'}: refusing to delete")
    rm = _run_cli("rm", str(root / "step-1"))
    assert rm.returncode == 1 and rm.stdout == ""
    line = _assert_one_escaped_line(rm.stderr, HOSTILE)
    assert line.startswith("dcp-storage: error: refusing to delete")
