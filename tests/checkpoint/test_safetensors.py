"""SafetensorsWriter / SafetensorsReader: Hub-layout models on every backend, the files
byte-compatible with the safetensors library, transformers and torch's HF storage, the
commit (index last), CRC-32C per tensor, and hostile headers and indexes refused."""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from extensions import ZStandard
from extensions.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    UnsafeCheckpointError,
)
from storage.checkpoint.safetensors import (
    SafetensorsReader,
    SafetensorsWriter,
    load_safetensors,
    save_safetensors,
)
from storage.checkpoint.safetensors.header import CRC_KEY, encode_header, layout
from tests.support.distributed import gloo_group, spawn
from tests.support.servers import boto3_client, endpoint_with_bucket, s3_options
from tests.support.trees import tiny_llama

BUCKET = "safetensors"


def _model() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(32, 16, generator=gen).to(torch.bfloat16),
        "layers.0.w": torch.randn(16, 16, generator=gen),
        "layers.0.b": torch.randn(16, generator=gen).to(torch.float16),
        "ids": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.5, dtype=torch.float64),
        "fp8": torch.randn(4, generator=gen).to(torch.float8_e4m3fn),
        "empty": torch.empty(0, 3),
    }


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(_raw(a[key]), _raw(b[key])), key


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _zeros(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _load(url: str, sd: dict[str, torch.Tensor], **options: Any) -> dict[str, torch.Tensor]:
    out = _zeros(sd)
    load_safetensors(out, url, **options)
    return out


def test_header_and_bytes_are_the_safetensors_library_s() -> None:
    """Without our CRC metadata, a file is byte for byte ``safetensors.torch.save``'s."""
    sd = _model()
    shapes = {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}
    order = layout(shapes)
    data = b"".join(sd[k].reshape(-1).view(torch.uint8).numpy().tobytes() for k in order)
    assert encode_header(shapes, order, None) + data == save(sd, metadata={"format": "pt"})


@pytest.mark.parametrize("shard", [None, 300])
def test_written_model_loads_with_safetensors_torch_and_our_reader(
    tmp_path: Path, shard: int | None
) -> None:
    sd = _model()
    dcp.save(sd, storage_writer=SafetensorsWriter(tmp_path, max_shard_size=shard), no_dist=True)
    names = sorted(os.listdir(tmp_path))
    if shard is None:
        assert names == ["model.safetensors"]
        _equal(load_file(tmp_path / "model.safetensors"), sd)
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and names == [*files, "model.safetensors.index.json"]
        assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        loaded: dict[str, torch.Tensor] = {}
        for name in files:
            loaded.update(load_file(tmp_path / name))
        _equal(loaded, sd)
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in sd.values())
    plain = {k: v for k, v in sd.items() if k != "fp8"}  # torch's reader maps no float8
    out = _zeros(plain)
    dcp.load(out, storage_reader=HuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    _equal(out, plain)
    _equal(_load(str(tmp_path), sd), sd)


def test_transformers_from_pretrained_loads_our_files(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config, model = tiny_llama(0)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config.save_pretrained(tmp_path)
    writer = SafetensorsWriter(tmp_path, max_shard_size=64 << 10)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert (tmp_path / "model.safetensors.index.json").exists()
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for key, value in again.state_dict().items():
        assert torch.equal(value, sd[key]), key


@pytest.fixture(scope="module", params=["seaweedfs"])
def endpoint(request: pytest.FixtureRequest) -> str:
    return endpoint_with_bucket(request, BUCKET)


def _upload(endpoint: str, folder: Path) -> str:
    prefix = f"hub-{uuid.uuid4().hex[:8]}"
    client = boto3_client(endpoint)
    for name in os.listdir(folder):
        client.upload_file(str(folder / name), BUCKET, f"{prefix}/{name}")
    return f"s3://{BUCKET}/{prefix}"


def test_save_pretrained_and_torch_hf_writer_files_load_from_seaweedfs_bit_exact(
    endpoint: str, tmp_path: Path
) -> None:
    config, model = tiny_llama(1)
    options = s3_options(endpoint)
    for max_shard in ("50KB", "1GB"):  # shards plus index; one model.safetensors
        folder = tmp_path / f"pretrained-{max_shard}"
        model.save_pretrained(folder, max_shard_size=max_shard)
        on_disk: dict[str, torch.Tensor] = {}
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                on_disk.update(load_file(folder / name))
        _equal(_load(_upload(endpoint, folder), on_disk, storage_options=options), on_disk)

    sd = _model()
    del sd["fp8"]  # torch's writer maps no float8
    folder = tmp_path / "torch-hf"
    mapping = {k: 1 + i % 2 for i, k in enumerate(sd)}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(str(folder), mapping), no_dist=True)
    assert (folder / "model.safetensors.index.json").exists()
    _equal(_load(_upload(endpoint, folder), sd, storage_options=options), sd)


def test_writer_and_reader_round_trip_through_seaweedfs(endpoint: str) -> None:
    sd = _model()
    url = f"s3://{BUCKET}/ours-{uuid.uuid4().hex[:8]}"
    options = s3_options(endpoint)
    writer = SafetensorsWriter(url, storage_options=options, max_shard_size=300, thread_count=2)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    _equal(_load(url, sd, storage_options=options), sd)
    # A tensor of another dtype is converted on load; a region of a tensor is read by rows.
    out = {"layers.0.w": torch.zeros(16, 16, dtype=torch.float64)}
    dcp.load(out, storage_reader=SafetensorsReader(url, storage_options=options), no_dist=True)
    assert torch.equal(out["layers.0.w"], sd["layers.0.w"].double())


class _FailingPlanner(DefaultSavePlanner):
    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == "ids":
            raise RuntimeError("the save broke down")
        return super().resolve_data(write_item)


def test_a_failed_save_leaves_no_index_and_is_not_a_model(tmp_path: Path) -> None:
    """The index is written last: a save that fails while writing its files leaves none,
    and the reader refuses the folder instead of loading part of a model."""
    sd = _model()
    writer = SafetensorsWriter(tmp_path, max_shard_size=300)
    with pytest.raises(CheckpointException) as info:
        dcp.save(sd, storage_writer=writer, planner=_FailingPlanner(), no_dist=True)
    assert isinstance(writer.last_error, RuntimeError), info.value
    assert not (tmp_path / "model.safetensors.index.json").exists()
    with pytest.raises(CheckpointNotFoundError, match="no safetensors model there"):
        _load(str(tmp_path), sd)


def test_committed_model_is_refused_unless_overwrite_and_replaced_whole(tmp_path: Path) -> None:
    sd = _model()
    dcp.save(sd, storage_writer=SafetensorsWriter(tmp_path, max_shard_size=300), no_dist=True)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        save_safetensors(sd, tmp_path)
    other = {
        k: v + 1 if v.is_floating_point() and v.dtype.itemsize > 1 else v for k, v in sd.items()
    }
    dcp.save(other, storage_writer=SafetensorsWriter(tmp_path, overwrite=True), no_dist=True)
    assert not (tmp_path / "model.safetensors.index.json").exists()  # the stale index went
    _equal(_load(str(tmp_path), other), other)


@pytest.mark.parametrize(
    "refused",
    [{"step": 3}, {"__metadata__": torch.ones(2)}, {"z": torch.ones(2, dtype=torch.complex32)}],
    ids=["not-a-tensor", "reserved-name", "dtype"],
)
def test_a_refused_state_dict_leaves_the_model_it_would_overwrite(
    tmp_path: Path, refused: dict[str, Any]
) -> None:
    """The old model was uncommitted (its file removed) when the save set up, before
    the items were checked: overwrite=True with a state dict holding a step counter
    destroyed the model and saved nothing."""
    save_safetensors({"w": torch.ones(2)}, tmp_path)
    with pytest.raises(Exception, match="not a tensor|cannot be named|no safetensors"):
        save_safetensors({"w": torch.zeros(2), **refused}, tmp_path, overwrite=True)
    _equal(_load(str(tmp_path), {"w": torch.empty(2)}), {"w": torch.ones(2)})


def test_an_empty_state_dict_leaves_the_model_it_would_overwrite(tmp_path: Path) -> None:
    """The save found it held no tensors only after it had removed the old model's file:
    overwrite=True with an empty state dict destroyed the model and saved nothing."""
    save_safetensors({"w": torch.ones(2)}, tmp_path)
    with pytest.raises(ValueError, match="holds no tensors; nothing to save"):
        save_safetensors({}, tmp_path, overwrite=True)
    _equal(_load(str(tmp_path), {"w": torch.empty(2)}), {"w": torch.ones(2)})


def test_a_tensor_named_like_the_header_metadata_is_refused(tmp_path: Path) -> None:
    """A tensor named "__metadata__" replaced the header's metadata map: the save
    committed a model that no reader (ours, the safetensors library) could open."""
    with pytest.raises(Exception, match="'__metadata__'.*cannot be named"):
        save_safetensors({"__metadata__": torch.ones(2), "w": torch.ones(2)}, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_transforms_and_non_tensors_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="transforms .* do not apply"):
        SafetensorsWriter(tmp_path, transforms=[ZStandard()])
    with pytest.raises(Exception, match="'step' is not a tensor"):
        save_safetensors({"w": torch.ones(2), "step": 3}, tmp_path)
    with pytest.raises(ValueError, match="holds no tensors; nothing to save"):
        save_safetensors({}, tmp_path)


def test_a_damaged_tensor_fails_its_crc32c(tmp_path: Path) -> None:
    sd = {"w": torch.arange(64, dtype=torch.float32)}
    dcp.save(sd, storage_writer=SafetensorsWriter(tmp_path), no_dist=True)
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="'w'.*checksum mismatch"):
        _load(str(tmp_path), sd)


# --- many ranks ----------------------------------------------------------------------


def _two_rank_worker(rank: int, store: str, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with gloo_group(rank, 2, store):
        sd = _model()
        dcp.save(sd, storage_writer=SafetensorsWriter(path, max_shard_size=300))
        mesh = init_device_mesh("cpu", (2,))
        plain = {k: torch.zeros_like(v) for k, v in sd.items() if k != "layers.0.w"}
        full = torch.zeros(16, 16)
        plain["layers.0.w"] = distribute_tensor(full, mesh, [Shard(1)])  # columns: a region
        plain["embed.weight"] = distribute_tensor(  # rows: straight into the shard
            torch.zeros(32, 16, dtype=torch.bfloat16), mesh, [Shard(0)]
        )
        dcp.load(plain, storage_reader=SafetensorsReader(path))
        assert torch.equal(plain["layers.0.w"].full_tensor(), sd["layers.0.w"])
        assert torch.equal(plain["embed.weight"].full_tensor(), sd["embed.weight"])
        for key in sd.keys() - {"layers.0.w", "embed.weight"}:
            assert torch.equal(_raw(plain[key]), _raw(sd[key])), key


def test_two_ranks_save_one_model_and_load_it_into_dtensor_shards(tmp_path: Path) -> None:
    path = str(tmp_path / "model")
    spawn(_two_rank_worker, args=(str(tmp_path / "store"), path), nprocs=2, join=True)
    _equal(
        {
            k: v
            for f in sorted(os.listdir(path))
            if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(path, f)).items()
        },
        _model(),
    )


# --- hostile input -------------------------------------------------------------------


def _raw_file(header: Any, data: bytes = b"", length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


HOSTILE_FILES = {
    "a header length of 2**63": (_raw_file(b"{}", length=2**63), UnsafeCheckpointError, "claims"),
    "a header over the size limit": (
        _raw_file(b"{}", length=200 << 20),
        UnsafeCheckpointError,
        "MiB",
    ),
    "a header longer than the file": (_raw_file(b"{}", length=4096), IntegrityError, "truncated"),
    "offsets outside the file": (
        _raw_file({"w": _entry("F32", [4], 0, 16)}, b"\0" * 8),
        IntegrityError,
        "tensors end at byte",
    ),
    "overlapping tensors": (
        _raw_file({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 4, 12)}, b"\0" * 12),
        IntegrityError,
        "'b'.*overlaps",
    ),
    "offsets out of order": (
        _raw_file({"w": _entry("F32", [0], 8, 0)}, b"\0" * 8),
        IntegrityError,
        "'w'.*not \\[begin, end\\] in order",
    ),
    "a shape that does not match the bytes": (
        _raw_file({"w": _entry("F32", [3], 0, 8)}, b"\0" * 8),
        IntegrityError,
        "'w'.*need 12 bytes",
    ),
    "an unknown dtype": (
        _raw_file({"w": _entry("F128", [1], 0, 16)}, b"\0" * 16),
        IntegrityError,
        "'w'.*unknown dtype",
    ),
    "duplicate names": (
        _raw_file(
            b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
            b'"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
            b"\0\0",
        ),
        IntegrityError,
        "names 'w' twice",
    ),
    "a header that is not JSON": (_raw_file(b"{" * 100000), IntegrityError, "not valid JSON"),
    # A list of `{}` cost some 25x its bytes once parsed, before anything was checked.
    "a header that is a list": (
        _raw_file(b"[" + b",".join([b"{}"] * 1000) + b"]"),
        IntegrityError,
        "not a JSON object",
    ),
    # JSON in UTF-16 (json.loads detects it in bytes) loaded here, while the safetensors
    # library, transformers and vLLM refuse the file: a header is UTF-8.
    "a header in UTF-16": (
        _raw_file(json.dumps({"w": _entry("F32", [1], 0, 4)}).encode("utf-16-le"), b"\0" * 4),
        IntegrityError,
        "not valid JSON",
    ),
    # An empty tensor may have any other dimension: one past what torch.Size holds used
    # to pass the checks and fail as torch's "Overflow when unpacking long long".
    "an empty shape with a dimension of 2**64": (
        _raw_file({"w": _entry("F32", [0, 2**64], 0, 0)}),
        IntegrityError,
        "'w'.*shape",
    ),
    # So may dimensions that multiply out past what torch can make a tensor of ("Storage
    # size calculation overflowed"): such a file used to verify as sound.
    "an empty shape whose other dimensions multiply past 2**62": (
        _raw_file({"w": _entry("F32", [2**62, 2**62, 0], 0, 0)}),
        IntegrityError,
        "'w'.*multiplies out past",
    ),
    "a file shorter than a header length": (b"\x01\x02", IntegrityError, "too short"),
    # Offsets of 4000 digits (JSON's limit is 4300) each went into the message whole.
    "offsets of 4000 digits": (
        _raw_file({"w": _entry("U8", [1], 10**4000, 10**4000 + 1)}, b"\0"),
        IntegrityError,
        "'w'.*data_offsets.*in \\[0, 2\\*\\*62\\]",
    ),
    "a shape of 64 dimensions of 2**62": (
        _raw_file({"w": _entry("U8", [2**62] * 64, 0, 1)}, b"\0"),
        IntegrityError,
        "'w'.*need",
    ),
    # Python objects cost many times the JSON they come from (some 25x for `{}` in a
    # list): the structure is refused from the header's bytes before json builds them.
    "objects in a shape": (
        _raw_file(b'{"w":{"dtype":"U8","shape":[' + b",".join([b"{}"] * 1000) + b"]}}"),
        IntegrityError,
        "an array in its header holds something other than numbers",
    ),
    "an object nested in an entry": (
        _raw_file(b'{"w":{"dtype":"U8","shape":{"a":{}},"data_offsets":[0,0]}}'),
        IntegrityError,
        "not one object per tensor",
    ),
    "values that are not entries": (
        _raw_file(b'{"w":"' + b"x" * 100 + b'","v":1}'),
        IntegrityError,
        "not one object per tensor",
    ),
    "more entries than the header's length holds": (
        _raw_file(b"{" + b",".join(b'"%d":{}' % i for i in range(1000)) + b"}"),
        IntegrityError,
        "1000 objects, more than it can hold",
    ),
    "a metadata map of 5000 members": (
        _raw_file({"__metadata__": {str(i): "" for i in range(5000)}}),
        IntegrityError,
        "__metadata__ has over 4096 members",
    ),
    "two objects of four members": (
        _raw_file({name: dict.fromkeys("abcd", "") for name in "ab"}),
        IntegrityError,
        "more than one object in its header has over three members",
    ),
    "a checksum table of more names than tensors": (
        _raw_file(
            {
                "__metadata__": {CRC_KEY: json.dumps({str(i): "00000000" for i in range(50)})},
                "w": _entry("U8", [1], 0, 1),
            },
            b"\0",
        ),
        IntegrityError,
        "not a flat map of at most 1 names",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_FILES))
def test_hostile_headers_are_refused_naming_file_and_tensor(tmp_path: Path, case: str) -> None:
    content, error, message = HOSTILE_FILES[case]
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(error, match=message) as info:
        _load(str(tmp_path), {"w": torch.zeros(4)})
    assert "model.safetensors" in str(info.value)
    assert len(str(info.value)) < 1000  # a value from the file is quoted, bounded


@pytest.mark.parametrize(
    "escape",
    [
        "../outside.safetensors",
        "/etc/outside.safetensors",
        "s3://other/x.safetensors",
        "sub/x.safetensors",
        # Names that used to pass as plain: one longer than any file name may be (the
        # local open failed as "File name too long"), and unprintable ones that reached
        # messages and terminals as they were.
        "x" * 300 + ".safetensors",
        "\u202egpj.safetensors",
        "a\x7fb.safetensors",
        "a\u2028b.safetensors",
    ],
)
def test_index_whose_files_escape_the_model_is_refused_before_reading(
    tmp_path: Path, escape: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(save({"w": torch.zeros(4)}))
    index = {"metadata": {}, "weight_map": {"w": escape}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        UnsafeCheckpointError, match="'w' is mapped to .*not a \\*.safetensors file beside"
    ):
        _load(str(model), {"w": torch.zeros(4)})


def test_names_full_of_json_punctuation_load(tmp_path: Path) -> None:
    """The structure checked before parsing is the header's, not its names': strings
    (escaped quotes and backslashes included) are blanked before anything is counted."""
    names = ['a{"b":[{}]},\\"', "c:{[", "\\", 'x"y}}}}', "{}" * 40]
    tensors = {name: torch.arange(i + 1, dtype=torch.float32) for i, name in enumerate(names)}
    save_safetensors(tensors, str(tmp_path / "ours"), max_shard_size=8)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "model.safetensors").write_bytes(
        save(tensors, metadata={str(i): "{[:," for i in range(10)})
    )
    for where in ("ours", "theirs"):
        _equal(_load(str(tmp_path / where), tensors), tensors)


def test_an_index_of_more_values_than_its_length_holds_is_refused(tmp_path: Path) -> None:
    """A list of short strings in an index cost about 15x its bytes once parsed; an index
    is refused, from its bytes, when it has more values than a weight_map of that length."""
    junk = ",".join(['"ab"'] * 20000)
    shard = "model-00001-of-00001.safetensors"
    text = '{"metadata":{"x":[' + junk + ']},"weight_map":{"w":"' + shard + '"}}'
    (tmp_path / "model.safetensors.index.json").write_text(text)
    (tmp_path / shard).write_bytes(save({"w": torch.zeros(4)}))
    with pytest.raises(IntegrityError, match="not a safetensors index .* JSON values") as info:
        _load(str(tmp_path), {"w": torch.zeros(4)})
    assert "model.safetensors.index.json" in str(info.value)


def test_an_index_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    with open(tmp_path / "model.safetensors.index.json", "wb") as f:
        f.truncate((100 << 20) + 10)
    with pytest.raises(UnsafeCheckpointError, match="over 100 MiB"):
        _load(str(tmp_path), {"w": torch.zeros(4)})


def test_a_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (tmp_path / name).write_bytes(save({"w": torch.zeros(4)}))
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    # only one file is in the index: it loads; both listed is the duplicate
    index["weight_map"]["v"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(IntegrityError, match="'w' is in both"):
        _load(str(tmp_path), {"w": torch.zeros(4)})
