"""dcp-storage against stock DCP on one fake-gcs-server, with a raw ceiling row.

    python benchmarks/gcs_compare.py                      # 268 MB, warm-up + median of 3
    python benchmarks/gcs_compare.py --size-mb 128 --repeat 5

Rows: ours (``storage.CheckpointWriter`` / ``CheckpointReader`` through ``dcp.save`` /
``dcp.load`` on a ``gs://`` URL), stock ``FsspecWriter`` / ``FsspecReader``
(``thread_count=8``) on gcsfs with the same ``storage_options``; and a raw ceiling: 8
objects x 32 MiB uploaded (one ``uploadType=media`` POST each) then downloaded into
preallocated buffers in 8 threads with plain ``http.client``, no DCP, no gcsfs.

Protocol: the one of ``benchmarks/s3_peers.py`` (its helpers are shared): one server,
one seeded state dict built once, a warm-up save and load per client, then the clients
take turns (the order rotates every round) ``--repeat`` times; every save goes to a
fresh prefix, deleted after its load. Saves run in this long-lived process; every load
runs in a fresh process (imports, target allocation and the bit-exact check untimed;
client construction, metadata read and data timed). Client CPU is user+sys of the
process making the timed call, per GB of logical bytes. fake-gcs-server is an emulator
on the same two cores: its times are not GCS's; the ratios between clients are the
result.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import logging
import os
import sys
import urllib.parse
import urllib.request
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.s3_peers import (  # noqa: E402
    LoadFn,
    Samples,
    SaveFn,
    build_state,
    load_in_fresh_process,
    side_by_side,
    timed,
)
from benchmarks.s3_peers import report as table  # noqa: E402
from tests.support.servers import (  # noqa: E402
    gcs_create_bucket,
    gcs_list,
    gcs_options,
    start_fake_gcs,
)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
# Stock's metadata rename tries gcsfs's moveTo, which fake-gcs-server refuses (400); gcsfs
# logs the traceback and falls back to copy + delete (two requests, timed, as they would be).
logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
BUCKET = "bench"


def _ours(endpoint: str) -> tuple[SaveFn, LoadFn]:
    import storage
    import storage.backends.gcs  # noqa: F401 - imported untimed, as stock's gcsfs is

    opts = gcs_options(endpoint)

    def save(state: dict[str, Any], url: str) -> None:
        dcp.save(state, storage_writer=storage.CheckpointWriter(url, storage_options=opts))

    def load(state: dict[str, Any], url: str) -> None:
        dcp.load(state, storage_reader=storage.CheckpointReader(url, storage_options=opts))

    return save, load


def _stock(endpoint: str) -> tuple[SaveFn, LoadFn]:
    import gcsfs  # noqa: F401 - imported untimed, as ours is
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = gcs_options(endpoint)

    def save(state: dict[str, Any], url: str) -> None:
        dcp.save(state, storage_writer=FsspecWriter(url, thread_count=8, **opts))

    def load(state: dict[str, Any], url: str) -> None:
        dcp.load(state, storage_reader=FsspecReader(url, **opts))

    return save, load


CLIENTS: dict[str, Callable[[str], tuple[SaveFn, LoadFn]]] = {
    "ours": _ours,
    "stock fsspec": _stock,
}


def child_load(name: str, endpoint: str, url: str, size_mb: float) -> None:
    expected = build_state(size_mb)
    target = {k: torch.zeros_like(v) for k, v in expected.items()}  # allocated and touched
    _, load = CLIENTS[name](endpoint)
    wall, cpu = timed(lambda: load(target, url))
    ok = all(torch.equal(target[k], expected[k]) for k in expected)
    print(json.dumps({"wall": wall, "cpu": cpu, "ok": ok}))


# --- the raw ceiling -----------------------------------------------------------------


def raw_ceiling(endpoint: str, objects: int = 8, size: int = 32 << 20) -> dict[str, float]:
    host, port = urllib.parse.urlsplit(endpoint).netloc.split(":")
    payload = os.urandom(size)
    buffers = [bytearray(size) for _ in range(objects)]  # allocated and touched, untimed
    prefix = f"raw-{uuid.uuid4().hex}"
    names = [f"{prefix}/{i}" for i in range(objects)]
    conns = [http.client.HTTPConnection(host, int(port), timeout=120) for _ in names]

    def put(i: int) -> None:
        query = urllib.parse.urlencode({"uploadType": "media", "name": names[i]})
        conns[i].request("POST", f"/upload/storage/v1/b/{BUCKET}/o?{query}", body=payload)
        resp = conns[i].getresponse()
        resp.read()
        assert resp.status == 200, resp.status

    def get(i: int) -> None:
        quoted = urllib.parse.quote(names[i], safe="")
        conns[i].request("GET", f"/storage/v1/b/{BUCKET}/o/{quoted}?alt=media")
        resp = conns[i].getresponse()
        view, got = memoryview(buffers[i]), 0
        while got < size and (n := resp.readinto(view[got:])):
            got += n
        assert resp.status == 200 and got == size and not resp.read(1)

    with concurrent.futures.ThreadPoolExecutor(objects) as pool:
        saved = timed(lambda: list(pool.map(put, range(objects))))
        loaded = timed(lambda: list(pool.map(get, range(objects))))
    for conn in conns:
        conn.close()
    assert all(b == payload for b in buffers)
    delete_prefix(endpoint, prefix)
    return {
        "save": saved[0],
        "save_cpu": saved[1],
        "load": loaded[0],
        "load_cpu": loaded[1],
        "bytes": objects * size,
    }


def delete_prefix(endpoint: str, prefix: str) -> None:
    for name in gcs_list(endpoint, BUCKET, prefix):
        quoted = urllib.parse.quote(name, safe="")
        req = urllib.request.Request(
            f"{endpoint}/storage/v1/b/{BUCKET}/o/{quoted}", method="DELETE"
        )
        with urllib.request.urlopen(req) as resp:
            resp.read()


def server_rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident memory of the server process, in MB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) / 1e3, int(fields["VmHWM"].split()[0]) / 1e3


# --- driver --------------------------------------------------------------------------


def run(args: argparse.Namespace, endpoint: str) -> tuple[Samples, int]:
    here = os.path.abspath(__file__)
    return side_by_side(
        {name: make(endpoint) for name, make in CLIENTS.items()},
        args.size_mb,
        args.repeat,
        url=lambda prefix: f"gs://{BUCKET}/{prefix}",
        load=lambda name, url, mb: load_in_fresh_process(name, endpoint, url, mb, script=here),
        delete=lambda prefix: delete_prefix(endpoint, prefix),
        ceiling=lambda: raw_ceiling(endpoint),
    )


def report(samples: Samples, logical: int, repeat: int) -> None:
    table(samples, logical, repeat, store="fake-gcs-server", baseline="stock fsspec", short="stock")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=268)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--endpoint", help="use this GCS endpoint instead of starting one")
    parser.add_argument("--child-load", nargs=3, metavar=("CLIENT", "ENDPOINT", "URL"))
    args = parser.parse_args()
    if args.child_load:
        child_load(*args.child_load, args.size_mb)
        return
    if args.endpoint:
        gcs_create_bucket(args.endpoint, BUCKET)
        report(*run(args, args.endpoint), args.repeat)
        return
    server = start_fake_gcs()
    try:
        print(f"fake-gcs-server {server.url}", flush=True)
        gcs_create_bucket(server.url, BUCKET)
        samples, logical = run(args, server.url)
        rss, peak = server_rss_mb(server.proc.pid)
        report(samples, logical, args.repeat)
        print(f"fake-gcs-server RSS: {rss:.0f} MB now, {peak:.0f} MB peak")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
