"""The code blocks of a doc page, ready to run against the test's SeaweedFS: the docs'
endpoint and bucket swapped for the test server's (credentials come from the
environment, as the docs advise)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from tests.support.servers import KEY, SECRET

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: The bucket the snippet tests create on their server.
BUCKET = "docs"


class Snippets:
    """``snippets(section, language)``: the ``language`` blocks under ``## section`` of
    ``doc`` (docs/ relative), each with the docs' endpoint and ``s3://bucket/run1``
    replaced by ``endpoint`` and a fresh run prefix (:attr:`run`)."""

    def __init__(self, doc: str, endpoint: str) -> None:
        self.text = (DOCS / doc).read_text()
        self.endpoint = endpoint
        self.run = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"

    def __call__(self, section: str, language: str) -> list[str]:
        body = self.text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
        found = re.findall(rf"```{language}\n(.*?)```", body, flags=re.S)
        assert found, f"no {language} block under '## {section}'"
        return [self._here(block) for block in found]

    def one(self, section: str, language: str) -> str:
        """The one ``language`` block under ``## section``."""
        found = self(section, language)
        assert len(found) == 1, f"one {language} block under '## {section}'"
        return found[0]

    def _here(self, block: str) -> str:
        return block.replace("https://s3.example.com", self.endpoint).replace(
            "s3://bucket/run1", self.run
        )


def snippets(doc: str, endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Snippets:
    """``doc``'s snippets, with the server's credentials in the environment as the docs
    advise."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    return Snippets(doc, endpoint)
