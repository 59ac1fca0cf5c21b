"""The one place the GCS backend touches private names of gcsfs.

Our data path makes its own requests (gcsfs's ``_call`` reads every body whole), with
what the gcsfs client would send: its session, query parameters, headers (credentials)
and endpoint. Each accessor names what it reaches, why, and the releases it was checked
on; a name gone in an installed release raises ``PrivateNameMissing`` naming gcsfs and
its version (``_private.py``). Checked on the lowest pinned gcsfs, 2024.12.0
(``constraints-lowest.txt``; ``tox -e lowest`` runs ``tests/backends/test_compat.py``
against it), and on gcsfs 2026.10.1.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import gcsfs

from storage.backends._private import private

GCSFS = "2024.12.0 to 2026.10.1"


def set_session(gcs: gcsfs.GCSFileSystem) -> Awaitable[Any]:
    """``GCSFileSystem._set_session()``: the client's aiohttp session, made on first use
    on its event loop (then ``gcs.session``)."""
    make = private(gcs, "_set_session", "gcsfs", "opening the client's aiohttp session", GCSFS)
    session: Awaitable[Any] = make()
    return session


def params(gcs: gcsfs.GCSFileSystem, given: dict[str, str]) -> dict[str, str]:
    """``GCSFileSystem._get_params(given)``: a request's query parameters as gcsfs sends
    them (``userProject`` for requester pays)."""
    found = private(gcs, "_get_params", "gcsfs", "a request's query parameters", GCSFS)
    result: dict[str, str] = found(given)
    return result


def headers(gcs: gcsfs.GCSFileSystem, given: dict[str, str] | None) -> dict[str, str]:
    """``GCSFileSystem._get_headers(given)``: a request's headers as gcsfs sends them
    (the access token, refreshed as gcsfs refreshes it; the user agent)."""
    found = private(gcs, "_get_headers", "gcsfs", "a request's headers (credentials)", GCSFS)
    result: dict[str, str] = found(given)
    return result


def location(gcs: gcsfs.GCSFileSystem) -> str:
    """``GCSFileSystem._location``: the endpoint requests go to (``endpoint_url``, the
    emulator's ``STORAGE_EMULATOR_HOST``, or Google's), without a path."""
    return str(private(gcs, "_location", "gcsfs", "the endpoint of uploads and GETs", GCSFS))


def uses_client_cert(gcs: gcsfs.GCSFileSystem) -> bool:
    """``GCSFileSystem._use_client_cert``: whether the client authenticates with a
    certificate (mTLS), which only its aiohttp session does. Releases without it have no
    mTLS support: ``False`` (a fallback, not an error)."""
    return bool(getattr(gcs, "_use_client_cert", False))
