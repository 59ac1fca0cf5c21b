"""Loading a Hub-layout safetensors model from SeaweedFS: ours against its peers.

    python benchmarks/safetensors_load.py                    # 1024 MB, shards of 256 MB
    python benchmarks/safetensors_load.py --size-mb 512 --repeat 2
    python benchmarks/safetensors_load.py --capped           # through a 100 MB/s proxy

The model: bf16 tensors shaped like a small LLM's (hidden 2048, MLP 5632, vocabulary
32000: embeddings, then decoder layers of q/k/v/o, gate/up/down and two norms until
``--size-mb``, then the final norm and ``lm_head``), written once with
``storage.save_safetensors`` in shards of ``--max-shard-size-mb`` with
``model.safetensors.index.json``, as ``save_pretrained`` lays it out.

Rows, each load in a fresh process (imports, target allocation and the bit-exact check
untimed; everything from the first request to the last byte in the target timed):

- ours: ``storage.load_safetensors(targets, "s3://bench/model", storage_options=...)``,
  straight into the preallocated targets;
- runai-model-streamer: its ``SafetensorsStreamer`` (``stream_files`` over the shards
  the index names, read with boto3 in the timed part; ``get_tensors``, each tensor copied
  into its target), reaching the server through ``AWS_ENDPOINT_URL`` and path-style
  addressing;
- download + load_file: boto3 ``download_file`` of each shard to a temporary directory,
  then ``safetensors.torch.load_file`` of each and a copy into the targets; both phases
  timed and reported apart;
- the raw GET ceiling of :mod:`benchmarks.s3_peers` (8 x 32 MiB in 8 threads, boto3),
  scaled to the same bytes.

Client CPU is user+sys of the child (``getrusage``) per GB. With ``--capped`` every
client and the ceiling go through :class:`tests.support.capped_proxy.CappedProxy`
(``--rate`` bytes per second both ways together, ``--latency`` per request).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.s3_peers import BUCKET, _cpu, delete_prefix, raw_ceiling  # noqa: E402
from tests.support.capped_proxy import CappedProxy  # noqa: E402
from tests.support.servers import KEY, SECRET, SeaweedFS, boto3_client, s3_options  # noqa: E402

MB = 1e6
HIDDEN, MLP, VOCAB = 2048, 5632, 32000
LoadFn = Callable[[dict[str, torch.Tensor], str], dict[str, float]]


def model_shapes(size_mb: float) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a small LLM of about ``size_mb`` MB in bf16."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    layer = {
        "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        "self_attn.k_proj.weight": (HIDDEN, HIDDEN),
        "self_attn.v_proj.weight": (HIDDEN, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        "mlp.gate_proj.weight": (MLP, HIDDEN),
        "mlp.up_proj.weight": (MLP, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, MLP),
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
    }
    per_layer = sum(2 * torch.Size(s).numel() for s in layer.values())
    fixed = 2 * (2 * VOCAB * HIDDEN + HIDDEN)
    layers = max(1, round((size_mb * MB - fixed) / per_layer))
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def build_model(size_mb: float, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        for name, shape in model_shapes(size_mb).items()
    }


# --- the loaders, run in a fresh process ---------------------------------------------


def _shards(endpoint: str, prefix: str) -> list[str]:
    index = boto3_client(endpoint).get_object(
        Bucket=BUCKET, Key=f"{prefix}/model.safetensors.index.json"
    )
    return sorted(set(json.loads(index["Body"].read())["weight_map"].values()))


def _ours(endpoint: str) -> LoadFn:
    import storage
    import storage.backends.s3  # noqa: F401 - imported untimed, as the peers' modules are

    def load(target: dict[str, torch.Tensor], prefix: str) -> dict[str, float]:
        url = f"s3://{BUCKET}/{prefix}"
        storage.load_safetensors(target, url, storage_options=s3_options(endpoint))
        return {}

    return load


def _runai(endpoint: str) -> LoadFn:
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=KEY,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_DEFAULT_REGION="us-east-1",
        RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
        AWS_EC2_METADATA_DISABLED="true",
    )
    from runai_model_streamer import SafetensorsStreamer

    def load(target: dict[str, torch.Tensor], prefix: str) -> dict[str, float]:
        paths = [f"s3://{BUCKET}/{prefix}/{f}" for f in _shards(endpoint, prefix)]
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(paths)
            for name, tensor in streamer.get_tensors():
                target[name].copy_(tensor)
        return {}

    return load


def _download(endpoint: str) -> LoadFn:
    from safetensors.torch import load_file

    client = boto3_client(endpoint)

    def load(target: dict[str, torch.Tensor], prefix: str) -> dict[str, float]:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            files = []
            for shard in _shards(endpoint, prefix):
                files.append(os.path.join(tmp, shard))
                client.download_file(BUCKET, f"{prefix}/{shard}", files[-1])
            downloaded = time.perf_counter()
            for path in files:
                for name, tensor in load_file(path).items():
                    target[name].copy_(tensor)
            return {"download": downloaded - start, "load_file": time.perf_counter() - downloaded}

    return load


CLIENTS: dict[str, Callable[[str], LoadFn]] = {
    "ours": _ours,
    "runai-model-streamer": _runai,
    "download + load_file": _download,
}


def child_load(name: str, endpoint: str, prefix: str, size_mb: float) -> None:
    expected = build_model(size_mb)
    target = {k: torch.zeros_like(v) for k, v in expected.items()}  # allocated and touched
    load = CLIENTS[name](endpoint)
    before, start = _cpu(), time.perf_counter()
    phases = load(target, prefix)
    wall = time.perf_counter() - start
    cpu = _cpu() - before
    ok = all(torch.equal(target[k], expected[k]) for k in expected)
    print(json.dumps({"wall": wall, "cpu": cpu, "ok": ok, **phases}))


def load_in_fresh_process(name: str, endpoint: str, prefix: str, size_mb: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-load", name, endpoint, prefix]
    out = subprocess.run(
        [*cmd, "--size-mb", str(size_mb)], capture_output=True, text=True, timeout=600
    )
    if out.returncode:
        raise RuntimeError(f"{name} load failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if not result["ok"]:
        raise AssertionError(f"{name}: loaded tensors differ from the saved ones")
    return result


# --- driver --------------------------------------------------------------------------


def save_model(endpoint: str, prefix: str, size_mb: float, max_shard_mb: float) -> int:
    import storage
    import storage.backends.s3  # noqa: F401

    model = build_model(size_mb)
    storage.save_safetensors(
        model,
        f"s3://{BUCKET}/{prefix}",
        storage_options=s3_options(endpoint),
        max_shard_size=int(max_shard_mb * MB),
    )
    return sum(t.numel() * t.element_size() for t in model.values())


def run(args: argparse.Namespace, endpoint: str, via: str, proxy: CappedProxy | None) -> None:
    """Save the model once (directly), warm every client and the server up on a small
    model, then ``--repeat`` rounds of one fresh-process load per client (the order
    rotating) and one raw ceiling; print the medians."""
    names = list(CLIENTS)
    warm, prefix = f"warm-{uuid.uuid4().hex}", f"model-{uuid.uuid4().hex}"
    save_model(endpoint, warm, 20, args.max_shard_size_mb / 8)
    logical = save_model(endpoint, prefix, args.size_mb, args.max_shard_size_mb)
    shards = len(_shards(endpoint, prefix))
    for name in names:
        load_in_fresh_process(name, via, warm, 20)
    raw_ceiling(via)
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names + ["raw GET ceiling"]}
    for round_ in range(args.repeat):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            for key, value in load_in_fresh_process(name, via, prefix, args.size_mb).items():
                if key != "ok":
                    samples[name].setdefault(key, []).append(value)
        raw = raw_ceiling(via)
        scale = logical / raw["bytes"]
        samples["raw GET ceiling"].setdefault("wall", []).append(raw["load"] * scale)
        samples["raw GET ceiling"].setdefault("cpu", []).append(raw["load_cpu"] * scale)
    delete_prefix(endpoint, warm)
    delete_prefix(endpoint, prefix)
    report(samples, logical, shards, args, proxy)


def report(
    samples: dict[str, dict[str, list[float]]],
    logical: int,
    shards: int,
    args: argparse.Namespace,
    proxy: CappedProxy | None,
) -> None:
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    mb, gb = logical / MB, logical / 1e9
    where = "SeaweedFS on loopback"
    if proxy and proxy.bucket:
        where = (
            f"SeaweedFS behind the capped proxy ({proxy.bucket.rate / MB:.0f} MB/s both ways, "
            f"{proxy.latency * 1e3:.0f} ms per request; proxy CPU {proxy.cpu_seconds():.1f} s)"
        )
    print(
        f"\n{where}: {mb:.0f} MB bf16 model in {shards} shards of <= "
        f"{args.max_shard_size_mb:.0f} MB, median of {args.repeat}, each load in a fresh process"
    )
    print("| client | load s | MB/s | client CPU s/GB | vs runai (time, CPU) | % of GET ceiling |")
    print("|---|---|---|---|---|---|")
    peer, ceiling = med["runai-model-streamer"], med["raw GET ceiling"]
    for name, m in med.items():
        phases = ""
        if "download" in m:
            phases = f" (download {m['download']:.2f} s + load_file {m['load_file']:.2f} s)"
        print(
            f"| {name} | {m['wall']:.2f}{phases} | {mb / m['wall']:.0f} | {m['cpu'] / gb:.2f} "
            f"| {peer['wall'] / m['wall']:.2f}x, {m['cpu'] / peer['cpu']:.2f}x "
            f"| {100 * ceiling['wall'] / m['wall']:.0f}% |"
        )
    ours = med["ours"]
    goal = ours["wall"] <= peer["wall"] and ours["cpu"] <= peer["cpu"]
    print(
        f"\ngoal (ours >= runai-model-streamer's throughput at <= its client CPU per GB): "
        f"{'met' if goal else 'NOT met'}; vs runai: time = its time / this row's (> 1: "
        "faster), CPU = this row's CPU per GB / its (< 1: cheaper)"
    )
    print("raw samples:", json.dumps(samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--max-shard-size-mb", type=float, default=256)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--capped", action="store_true", help="reach the server via the proxy")
    parser.add_argument("--rate", type=float, default=100e6, help="proxy cap, bytes/s in all")
    parser.add_argument("--latency", type=float, default=0.005, help="proxy delay per request, s")
    parser.add_argument("--child-load", nargs=3, metavar=("CLIENT", "ENDPOINT", "PREFIX"))
    args = parser.parse_args()
    if args.child_load:
        client, endpoint, prefix = args.child_load
        child_load(client, endpoint, prefix, args.size_mb)
        return
    with SeaweedFS(bucket=BUCKET) as server:
        print(f"SeaweedFS {server.url} (data in {server.dir})", flush=True)
        if not args.capped:
            run(args, server.url, server.url, None)
            return
        with CappedProxy(server.url, rate=args.rate, latency=args.latency) as proxy:
            run(args, server.url, proxy.url, proxy)


if __name__ == "__main__":
    main()
