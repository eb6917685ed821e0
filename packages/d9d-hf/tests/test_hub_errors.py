"""A Hub id the Hub cannot provide gives one short error that names the repo id and the way out."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from d9d.hf import resolve_snapshot


def test_offline_without_a_cached_copy_names_the_repo_in_a_short_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The real Hub client, offline (no network is touched) over an empty cache: in-process, with the
    # settings HF_HUB_OFFLINE=1 and HF_HOME would give it (huggingface_hub reads them at import).
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    with pytest.raises(FileNotFoundError) as caught:
        resolve_snapshot("nobody/no-such-model")

    # what an uncaught raise prints: the traceback from this frame down, chained causes included
    printed = "".join(traceback.format_exception(caught.value)).strip()
    last = printed.splitlines()[-1]
    assert last.startswith("FileNotFoundError: nobody/no-such-model: not a local directory"), printed
    assert "HF_HUB_OFFLINE=1" in last and "local checkpoint directory" in last
    # the traceback is the one raise, not the Hub client's chain of network errors
    assert "During handling" not in printed and "direct cause" not in printed
    assert len(printed.splitlines()) < 15, printed


class _Unreachable:
    """snapshot_download as it fails without network and without a cached copy."""

    def __call__(self, **kwargs: object) -> str:
        try:
            raise ConnectionError("[Errno -3] Temporary failure in name resolution")
        except ConnectionError as cause:
            raise LocalEntryNotFoundError(
                "Got: ConnectError: [Errno -3] Temporary failure in name resolution\n"
                "An error happened while trying to locate the files on the Hub ..."
            ) from cause


@pytest.mark.parametrize(
    ("revision", "named"),
    [
        (None, "org/model:"),  # the repo id alone
        ("v2", "org/model (revision 'v2'):"),  # and the revision asked for
    ],
)
def test_an_unreachable_hub_raises_one_error_naming_the_repo(
    monkeypatch: pytest.MonkeyPatch, revision: str | None, named: str
) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _Unreachable())
    with pytest.raises(FileNotFoundError) as caught:
        resolve_snapshot("org/model", revision=revision)

    message = str(caught.value)
    assert message.startswith(named), message
    assert "LocalEntryNotFoundError: Got: ConnectError" in message  # the Hub's reason, in one line
    assert "\n" not in message
    assert caught.value.__suppress_context__ and caught.value.__cause__ is None
