"""The compat modules: every private name of a client library that dcp-storage reaches
resolves on the installed release (``tox -e lowest`` runs this file on the lowest
pinned ones), a name that is gone fails naming the library and its version, and no
module outside the compat modules reaches those names."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
from typing import Any

import pytest

import storage
from storage.backends._private import PrivateNameMissing, private
from tests.support.servers import fake_gcs_endpoint, gcs_options, moto_endpoint, s3_options

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_s3_accessors_resolve_on_the_installed_releases() -> None:
    from storage.backends.s3 import _compat as compat

    fs = storage.S3FileSystem(storage_options=s3_options(moto_endpoint()))
    s3 = fs.fs
    client = fs.client.run(s3.set_session)
    listed = fs.client.run(lambda: compat.call_s3(s3, "list_buckets"))
    assert "Buckets" in listed
    assert compat.method_kwargs(s3, client.get_object, Bucket="b", Key="k") == {
        "Bucket": "b",
        "Key": "k",
    }
    assert compat.credentials(client) is not None  # moto's test keys
    build = compat.ssl_contexts(client)
    assert build is not None and build(None) is not None
    assert compat.proxy_url_for(client, "http://127.0.0.1/") is None


def test_the_gcs_accessors_resolve_on_the_installed_release() -> None:
    import fsspec.asyn

    from storage.backends.gcs import _compat as compat

    endpoint = fake_gcs_endpoint()
    gcs = storage.GCSFileSystem(storage_options=gcs_options(endpoint)).fs
    fsspec.asyn.sync(gcs.loop, lambda: compat.set_session(gcs))
    assert gcs.session is not None
    assert compat.params(gcs, {}) == {}
    assert isinstance(compat.headers(gcs, {"Range": "bytes=0-1"}), dict)
    assert compat.location(gcs).rstrip("/") == endpoint.rstrip("/")
    assert compat.uses_client_cert(gcs) is False


def test_the_torchtune_accessors_resolve_on_the_installed_release() -> None:
    compat = pytest.importorskip("storage.integrations._torchtune_compat")
    compat.check_hooks()
    client: Any = object.__new__(compat.TorchtuneCheckpointClient)
    client._cfg, client._dcp_checkpointer = {"dcp_storage": {}}, None
    assert compat.client_config(client) == {"dcp_storage": {}}
    assert compat.cached_dcp_checkpointer(client) is None
    compat.cache_dcp_checkpointer(client, "x")
    assert compat.cached_dcp_checkpointer(client) == "x"


def test_a_private_name_that_is_gone_names_the_library_and_its_version() -> None:
    version = importlib.metadata.version("s3fs")
    with pytest.raises(PrivateNameMissing, match=rf"s3fs {re.escape(version)} has no _call_s3"):
        private(object(), "_call_s3", "s3fs", "sending requests", "2024.12.0 to 2026.9.0")


# Private names of client libraries, each allowed in its compat module only.
PRIVATE = {
    "storage/backends/s3/_compat.py": [
        "_call_s3",
        "_get_s3_method_kwargs",
        "_endpoint",
        "_request_signer",
        "_credentials",
        "_build_ssl_contexts",
        "_proxy_config",
    ],
    "storage/backends/gcs/_compat.py": [
        "_set_session",
        "_get_params",
        "_get_headers",
        "_location",
        "_use_client_cert",
    ],
    "storage/integrations/_torchtune_compat.py": [
        "_checkpointer",
        "_checkpoint_client",
        "_cfg",
        "_dcp_checkpointer",
        "_output_dir",
        "_checkpoint_future",
    ],
}


def offenders(root: pathlib.Path) -> list[str]:
    """Lines under ``root``/storage that reach a name of :data:`PRIVATE` outside its
    compat module."""
    found = []
    for home, names in PRIVATE.items():
        either = "|".join(names)
        # ``x._name`` for any ``x`` but ``self`` (a class's own attribute), ``f()._name``,
        # ``getattr(x, "_name")``, or an import of it.
        pattern = re.compile(
            rf"(\b(?!self\.)\w+|\))\.({either})\b|[\"']({either})[\"']|import .*\b({either})\b"
        )
        for file in sorted((root / "storage").rglob("*.py")):
            relative = file.relative_to(root).as_posix()
            if relative == home:
                continue
            for number, line in enumerate(file.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if code.lstrip().startswith("from storage"):
                    continue  # our own modules (``s3._endpoint``)
                if pattern.search(code):
                    found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_client_library_private_names_are_reached_only_from_their_compat_module() -> None:
    """Before the compat modules, these names were reached from eight modules (24
    sites), so a library upgrade that dropped one broke somewhere nobody had checked."""
    assert offenders(ROOT) == []
