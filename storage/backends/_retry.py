"""The one retry policy of the object stores' own requests: how many attempts, which
errors are worth another, and how long to wait before each.

Each backend states its policy once, from its client library's configuration (S3:
botocore's attempts and standard-mode waits; GCS: gcsfs's attempts and retry rule), and
every retry loop of its data path - the direct path's requests, gcsfs-session requests,
a ranged GET opened again, a response body resumed - asks that policy. Requests the
client library sends itself keep the library's own loop (one layer, never two)."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable

from storage.backends.cancel import Cancel


def never(exc: BaseException) -> bool:
    """The predicate of a layer that retries nothing itself (its client library does)."""
    return False


@dataclasses.dataclass(frozen=True)
class Retry:
    """``attempts`` tries in all (the first included); an error is tried again only if
    ``retryable(exc)``; before try ``n + 1`` the wait is drawn uniformly from
    ``[0, min(cap, base * 2 ** (n - 1))]`` seconds (exponential backoff with full
    jitter, as botocore's standard mode waits)."""

    attempts: int
    retryable: Callable[[BaseException], bool] = never
    base: float = 1.0
    cap: float = 20.0

    def delay(self, attempt: int) -> float:
        """The wait after failed try ``attempt`` (1, 2, ...)."""
        return random.random() * min(self.cap, self.base * 2 ** (attempt - 1))

    def wait(self, attempt: int, cancel: Cancel | None = None) -> None:
        """Sleep :meth:`delay`; with ``cancel``, raise as soon as it is cancelled."""
        if cancel is None:
            time.sleep(self.delay(attempt))
        else:
            cancel.wait(self.delay(attempt))

    def resuming(self) -> Retry:
        """This policy for a response body that broke off mid-stream: the store
        answered, so the same attempts (in a row, without a byte received), with short
        waits (at most 0.2, 0.4, ... 5 s)."""
        return dataclasses.replace(self, base=0.2, cap=5.0)
