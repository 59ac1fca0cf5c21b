"""Credentials out of messages: the one redaction every backend runs its errors through.

A credential reaches an error message in ways no single check prevents: a header
validator quotes the bad value (``http.client``: ``Invalid header value b'<token>\\n'``
for a token with a trailing newline), a client quotes a URL that carries a token or a
signature (``?access_token=``, ``X-Amz-Signature=``, a GCS resumable session's
``upload_id=``, which lets anyone holding it write to the upload), a library dumps a
request's headers (``Authorization``). So each backend translates client errors in one
place (its ``_translate`` / ``_errors``) and passes the message and every exception of
its chain (``__cause__``, ``__context__``, whose text a traceback prints) through
:meth:`Redactor.scrub`, which removes

* the credential-bearing parts of any text, by their form: ``Authorization`` values,
  SigV4 ``Credential=`` and ``Signature=``, the ``X-Amz-Security-Token``,
  ``X-Amz-Credential`` and ``X-Amz-Signature`` headers and query parameters,
  ``access_token=``, ``upload_id=``, ``Bearer`` tokens, a URL's password, and the
  value ``http.client`` quotes when it refuses a header;
* every secret the backend knows (its ``storage_options`` credentials and the ones its
  client resolved) of at least :data:`MIN_SECRET` characters, wherever it appears, as
  written, stripped, escaped or URL-quoted.
"""

from __future__ import annotations

import contextlib
import re
import urllib.parse
from collections.abc import Iterable, Iterator

#: Shorter strings are removed only by form (a short "secret" is a test value, and
#: removing it everywhere would garble messages).
MIN_SECRET = 8
MASK = "<redacted>"

_FORMS = [
    # http.client: "Invalid header value b'...'" (the value itself, whatever it is).
    re.compile(r"(Invalid header (?:value|name) )(b?'(?:[^'\\]|\\.)*'|b?\"(?:[^\"\\]|\\.)*\")"),
    # A header or field named as a credential, then its value (quoted or not).
    re.compile(
        r"((?:authorization|x-amz-security-token|x-goog-iam-authorization-token"
        r"|x-amz-credential|x-amz-signature|access_token|refresh_token|client_secret"
        r"|private_key|upload_id|sig|signature|credential)"
        r"['\"]?\s*[:=]\s*)(b?'(?:[^'\\]|\\.)*'|b?\"(?:[^\"\\]|\\.)*\"|[^\s&,;'\")]+)",
        re.IGNORECASE,
    ),
    re.compile(r"(Bearer\s+)([^\s'\",;]+)", re.IGNORECASE),
    # The password of a URL's user information (https://user:password@host/).
    re.compile(r"(://[^/\s:@]+:)([^/\s@]+)(?=@)"),
]


class Redactor:
    """Removes credentials (see the module docstring) from text and exceptions."""

    def __init__(self, secrets: Iterable[object] = ()) -> None:
        found: set[str] = set()
        for secret in secrets:
            if not isinstance(secret, str) or len(secret.strip()) < MIN_SECRET:
                continue
            for form in (secret, secret.strip(), repr(secret)[1:-1], repr(secret.strip())[1:-1]):
                found.add(form)
                found.add(urllib.parse.quote(form, safe=""))
        # Longest first, so a secret is never half-removed by a shorter one inside it.
        self._secrets = sorted(found, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        for form in _FORMS:
            text = form.sub(lambda m: m.group(1) + MASK, text)
        return text

    def scrub(self, exc: BaseException) -> BaseException | None:
        """Redact the text of ``exc`` and of every exception it chains to, in place
        (their ``args``, ``message``/``msg`` and, for ``OSError``, ``strerror`` and
        ``filename``). An exception whose text still shows a credential afterwards
        (its ``__str__`` reads fields this cannot rewrite) is cut from the chain;
        returns ``exc``, or ``None`` when ``exc`` itself is such a one (then chain
        nothing to it: ``raise ... from None``)."""
        return exc if self._scrub(exc, set()) else None

    def _scrub(self, exc: BaseException, seen: set[int]) -> bool:
        seen.add(id(exc))
        self._scrub_one(exc)
        for name in ("__cause__", "__context__"):
            inner = getattr(exc, name)
            if inner is not None and id(inner) not in seen and not self._scrub(inner, seen):
                setattr(exc, name, None)
                exc.__suppress_context__ = True
        return self._is_clean(exc)

    def _is_clean(self, exc: BaseException) -> bool:
        try:
            texts = (str(exc), repr(exc))
        except Exception:
            return False
        return all(self.redact(text) == text for text in texts)

    def _scrub_one(self, exc: BaseException) -> None:
        with contextlib.suppress(AttributeError, TypeError):  # read-only on some types
            exc.args = tuple(self._clean(a) for a in exc.args)
        for name in ("message", "msg", "strerror", "filename"):
            value = getattr(exc, name, None)
            if isinstance(value, str):
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(exc, name, self.redact(value))

    def _clean(self, value: object) -> object:
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, bytes):
            return self.redact(value.decode("utf-8", "replace")).encode()
        if isinstance(value, BaseException):
            self._scrub_one(value)
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(self._clean(v) for v in value)
        return value


#: Removes credentials by form only (for code that knows no secrets of its own).
BY_FORM = Redactor()

# Option names whose values are credentials (``key``, ``secret``, ``token``,
# ``aws_secret_access_key``, ``password``, ``sas_token``, a service account's
# ``private_key``, ...); a mapping under such a name is secret as a whole.
_SECRET_NAME = re.compile(r"key|secret|token|passw|credential|sas|signature|private", re.I)


def secret_values(options: object, secret: bool = False) -> Iterator[str]:
    """The strings in client ``options`` (nested mappings and lists included) that are
    credentials by their option's name."""
    if isinstance(options, str):
        if secret:
            yield options
    elif isinstance(options, dict):
        for name, value in options.items():
            yield from secret_values(value, secret or bool(_SECRET_NAME.search(str(name))))
    elif isinstance(options, (list, tuple)):
        for value in options:
            yield from secret_values(value, secret)
