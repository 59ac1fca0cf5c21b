"""torch_checkpointing 0.1 (real package): its CheckpointManager on our object-store
Storage, to SeaweedFS and fake-gcs-server.

The end-to-end test trains a tiny model a few steps with torch_checkpointing's default
(asynchronous, subprocess-writer) saver, then resumes in a fresh process. The others
drive its synchronous saver in this process to check the commit protocol: nothing of a
failed or in-progress save is visible, a committed checkpoint is never written over,
a deletion uncommits first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("torch_checkpointing", reason="pip install 'dcp-storage[torch-checkpointing]'")

from tests.support.servers import (  # noqa: E402
    boto3_client,
    endpoint_with_bucket,
    fake_gcs_endpoint,
    gcs_create_bucket,
    gcs_options,
    list_keys,
    s3_options,
)

BUCKET = "tcp"


@pytest.fixture(scope="module")
def endpoint(request: Any) -> str:
    request.param = "seaweedfs"
    return endpoint_with_bucket(request, BUCKET)


def _manager(url: str, options: dict[str, Any], **config: Any) -> Any:
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig

    from storage.integrations.torch_checkpointing import ObjectStoreConfig

    return CheckpointManager(
        CheckpointManager.Config(
            storage_config=ObjectStoreConfig(url, storage_options=options),
            save=SyncCheckpointSaverConfig(),
            **config,
        )
    )


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=gen)}, "step": seed}


def test_train_save_resume_bit_exact(endpoint: str, tmp_path: Any) -> None:
    """Steps 1..6 saving at 2 and 4; a fresh process with a differently initialised
    model and optimizer resumes from step_4 and reaches step 6 bit for bit."""
    url = f"s3://{BUCKET}/{tmp_path.name}"
    job = {"url": url, "options": s3_options(endpoint)}
    _run({**job, "seed": 0, "resume": None, "out": str(tmp_path / "a.pt")})
    keys = list_keys(boto3_client(endpoint), BUCKET, f"{tmp_path.name}/")
    assert {k.split("/")[1] for k in keys} == {"step_2", "step_4"}, keys  # no tmp_ copies
    assert f"{tmp_path.name}/step_4/.dcp-storage-commit" in keys

    _run({**job, "seed": 1, "resume": "step_4", "out": str(tmp_path / "b.pt")})
    first, resumed = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert resumed["start"] == 5 and first["start"] == 1
    for key, value in first["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    for index, state in first["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, resumed["optim"]["state"][index][name]), (index, name)


def test_a_failed_save_stays_invisible_and_a_retry_commits(endpoint: str, tmp_path: Any) -> None:
    url = f"s3://{BUCKET}/{tmp_path.name}"

    def fail(args: Any) -> None:  # runs after every file is written, before the commit
        raise RuntimeError("killed before the commit")

    failing = _manager(url, s3_options(endpoint), pre_finalize_callback=fail)
    with pytest.raises(RuntimeError, match="killed before the commit"):
        failing.save("step_1", _state(1))
    failing.close()
    keys = list_keys(boto3_client(endpoint), BUCKET, f"{tmp_path.name}/")
    assert f"{tmp_path.name}/step_1/.dcp-storage-pending" in keys and len(keys) > 1
    manager = _manager(url, s3_options(endpoint))
    storage = manager._storage_config.create_storage()
    assert not storage.exists("step_1") and storage.ls("") == []
    with pytest.raises(FileNotFoundError):
        manager.load("step_1", into={"model": None, "step": None})

    manager.save("step_1", _state(1))  # the retry writes over the leftovers and commits
    assert storage.exists("step_1") and storage.ls("") == ["step_1"]
    loaded = manager.load("step_1", into={"model": None, "step": None})
    assert torch.equal(loaded["model"]["w"], _state(1)["model"]["w"]) and loaded["step"] == 1
    manager.close()


def test_a_committed_checkpoint_is_never_written_over(endpoint: str, tmp_path: Any) -> None:
    url = f"s3://{BUCKET}/{tmp_path.name}"
    client = boto3_client(endpoint)
    manager = _manager(url, s3_options(endpoint))
    manager.save("step_1", _state(1))
    before = {k: client.head_object(Bucket=BUCKET, Key=k)["ETag"] for k in _keys(client, tmp_path)}
    with pytest.raises(FileExistsError, match="is a committed checkpoint.*new name"):
        manager.save("step_1", _state(2))
    after = {k: client.head_object(Bucket=BUCKET, Key=k)["ETag"] for k in _keys(client, tmp_path)}
    assert after == before
    loaded = manager.load("step_1", into={"model": None, "step": None})
    assert torch.equal(loaded["model"]["w"], _state(1)["model"]["w"])

    storage = manager._storage_config.create_storage()
    storage.rmdir("step_1")
    assert _keys(client, tmp_path) == [] and not storage.exists("step_1")
    manager.save("step_1", _state(2))  # the name is free again
    assert manager.load("step_1", into={"model": None, "step": None})["step"] == 2
    manager.close()


def test_rmdir_uncommits_before_it_deletes(endpoint: str, tmp_path: Any) -> None:
    """A deletion that stops midway must leave a directory nobody loads: the commit
    marker goes first, after the directory is marked pending."""
    from storage.integrations.torch_checkpointing import COMMIT_NAME, ObjectStoreStorage

    manager = _manager(f"s3://{BUCKET}/{tmp_path.name}", s3_options(endpoint))
    manager.save("step_1", _state(1))
    storage = manager._storage_config.create_storage()
    assert isinstance(storage, ObjectStoreStorage)
    removed: list[str] = []
    real_rm = storage.fs.rm_file

    def rm_then_stop(path: str) -> None:
        real_rm(path)
        removed.append(path.rsplit("/", 1)[1])
        if len(removed) == 2:
            raise ConnectionError("stopped midway")

    storage.fs.rm_file = rm_then_stop  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        storage.rmdir("step_1")
    assert removed[0] == COMMIT_NAME
    assert not storage.exists("step_1") and storage.ls("") == []
    manager.close()


def test_gcs(tmp_path: Any) -> None:
    endpoint = fake_gcs_endpoint()
    gcs_create_bucket(endpoint, "tcp-gcs")
    manager = _manager(f"gs://tcp-gcs/{tmp_path.name}", gcs_options(endpoint))
    manager.save("step_3", _state(3))
    storage = manager._storage_config.create_storage()
    assert storage.ls("") == ["step_3"] and storage.remap_path("step_3").startswith("gs://")
    loaded = manager.load("step_3", into={"model": None, "step": None})
    assert torch.equal(loaded["model"]["w"], _state(3)["model"]["w"])
    with pytest.raises(FileExistsError):
        manager.save("step_3", _state(4))
    manager.close()


def _keys(client: Any, tmp_path: Any) -> list[str]:
    return list_keys(client, BUCKET, f"{tmp_path.name}/")


def _run(job: dict[str, Any]) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integrations.test_integration_torch_checkpointing",
            json.dumps(job),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


# --- the job, run in a fresh process (torch_checkpointing's default saver: a subprocess) --


def job(spec: dict[str, Any]) -> None:
    from torch_checkpointing import CheckpointManager

    from storage.integrations.torch_checkpointing import ObjectStoreConfig

    torch.manual_seed(spec["seed"])
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(
        CheckpointManager.Config(
            storage_config=ObjectStoreConfig(spec["url"], storage_options=spec["options"])
        )
    )
    start = 1
    if spec["resume"] is not None:
        loaded = manager.load(spec["resume"], into={"model": None, "optim": None, "step": None})
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optim"])
        start = loaded["step"] + 1
    for step in range(start, 7):
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 8, generator=data), torch.randn(32, 1, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with manager.lock():  # as torch_checkpointing asks: no update while it stages
            optimizer.step()
        if step in (2, 4) and spec["resume"] is None:
            state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
            manager.save(f"step_{step}", state)
    manager.close()  # waits for the last write
    torch.save(
        {"start": start, "model": model.state_dict(), "optim": optimizer.state_dict()},
        spec["out"],
    )


if __name__ == "__main__":
    job(json.loads(sys.argv[1]))


def _committed_on_local_disk(root: Any) -> Any:
    from storage.integrations.torch_checkpointing import ObjectStoreConfig

    storage = ObjectStoreConfig(str(root)).create_storage()
    storage.write("tmp_step_1/model.bin", b"weights")
    storage.rename("tmp_step_1", "step_1", is_directory=True)  # the writer's commit
    return storage


def test_rmdir_never_deletes_through_a_link_inside_the_checkpoint(tmp_path: Any) -> None:
    # Before: torch_checkpointing's retention (rmdir) walked into `step_1/evil ->
    # ~/project`, a link anyone who could write the checkpoint put there, and deleted
    # every file of the project.
    victim = tmp_path / "project"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    storage = _committed_on_local_disk(tmp_path / "root")
    (tmp_path / "root" / "step_1" / "evil").symlink_to(victim, target_is_directory=True)
    storage.rmdir("step_1")
    assert (victim / "thesis.tex").read_text() == "years of work"
    assert not (tmp_path / "root" / "step_1").exists()


def test_rmdir_refuses_a_checkpoint_that_is_a_link(tmp_path: Any) -> None:
    # Before: rmdir of `step_0 -> /shared/pretrained` deleted the shared checkpoint's
    # files through the link.
    from extensions.errors import UnsafeCheckpointError

    storage = _committed_on_local_disk(tmp_path / "shared")
    (tmp_path / "shared" / "step_0").symlink_to(
        tmp_path / "shared" / "step_1", target_is_directory=True
    )
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.rmdir("step_0")
    assert (tmp_path / "shared" / "step_1" / "model.bin").read_bytes() == b"weights"


def test_rmdir_never_uncommits_through_a_checkpoint_swapped_for_a_link(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: rmdir checked that the checkpoint is no link, marked it pending, then
    # removed its commit marker by path: the directory swapped for a link in between
    # (by whoever can write the root), it uncommitted the victim, a checkpoint elsewhere.
    import shutil

    from extensions.errors import UnsafeCheckpointError
    from storage.integrations.torch_checkpointing import COMMIT_NAME

    storage = _committed_on_local_disk(tmp_path / "root")
    step, victim = tmp_path / "root" / "step_1", tmp_path / "victim"
    shutil.copytree(step, victim)
    write_atomic_in = storage.fs.write_atomic_in

    def mark_then_swap(directory: str, name: str, data: bytes, **kwargs: Any) -> None:
        write_atomic_in(directory, name, data, **kwargs)
        step.rename(tmp_path / "moved")
        step.symlink_to(victim, target_is_directory=True)

    monkeypatch.setattr(storage.fs, "write_atomic_in", mark_then_swap)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.rmdir("step_1")
    assert (victim / COMMIT_NAME).exists()
    assert (victim / "model.bin").read_bytes() == b"weights"


def test_a_save_never_writes_through_a_checkpoint_swapped_for_a_link_after_its_mkdir(
    tmp_path: Any,
) -> None:
    # Before: the writer made `tmp_step_2`, then its files and markers were opened by
    # path; the directory swapped for a link in between (by whoever can write the
    # root), they landed in the victim's directory, and the commit marker with them.
    from extensions.errors import UnsafeCheckpointError
    from storage.integrations.torch_checkpointing import COMMIT_NAME

    storage = _committed_on_local_disk(tmp_path / "root")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "model.bin").write_bytes(b"victim's")
    step = tmp_path / "root" / "step_2"
    storage.mkdir("tmp_step_2")
    step.rename(tmp_path / "moved")
    step.symlink_to(victim, target_is_directory=True)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.write("tmp_step_2/model.bin", b"ours")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.rename("tmp_step_2", "step_2", is_directory=True)
    assert sorted(p.name for p in victim.iterdir()) == ["model.bin"]
    assert (victim / "model.bin").read_bytes() == b"victim's"
    assert not (victim / COMMIT_NAME).exists()


def test_files_outside_a_staged_directory_never_go_through_a_link(tmp_path: Any) -> None:
    # Before: with write_to_temp_dir=False (or any file torch_checkpointing writes,
    # renames or deletes outside its temporary directory) files went by path: the
    # checkpoint directory swapped for a link after its mkdir (by whoever can write the
    # root), the write truncated the victim's model.bin, the rename replaced its file,
    # and the deletion removed one.
    from extensions.errors import UnsafeCheckpointError
    from storage.integrations.torch_checkpointing import ObjectStoreConfig

    storage = ObjectStoreConfig(str(tmp_path / "root")).create_storage()
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("model.bin", "opt.tmp", "kept.bin"):
        (victim / name).write_bytes(b"victim's")
    storage.mkdir("step_3")
    storage.write("step_3/opt.tmp", b"ours")
    step = tmp_path / "root" / "step_3"
    step.rename(tmp_path / "moved")
    step.symlink_to(victim, target_is_directory=True)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.write("step_3/model.bin", b"ours")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.rename("step_3/opt.tmp", "step_3/kept.bin")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.delete("step_3/kept.bin")
    assert sorted(p.name for p in victim.iterdir()) == ["kept.bin", "model.bin", "opt.tmp"]
    assert all(p.read_bytes() == b"victim's" for p in victim.iterdir())


def test_files_outside_a_staged_directory_are_written_renamed_and_deleted(
    tmp_path: Any,
) -> None:
    """Without a temporary directory, under a root that is the user's own link: files
    land in place, a file rename replaces its target, a deletion removes one."""
    from storage.integrations.torch_checkpointing import ObjectStoreConfig

    real = tmp_path / "disk"
    real.mkdir()
    (tmp_path / "root").symlink_to(real, target_is_directory=True)
    storage = ObjectStoreConfig(str(tmp_path / "root")).create_storage()
    storage.mkdir("step_4")
    storage.write("step_4/a.tmp", b"a")
    storage.write("step_4/b", b"old")
    storage.rename("step_4/a.tmp", "step_4/b")
    storage.write("step_4/c", b"c")
    storage.delete("step_4/c")
    assert sorted(p.name for p in (real / "step_4").iterdir()) == ["b"]
    assert (real / "step_4" / "b").read_bytes() == b"a"
