"""`dataset.path=hf://datasets/ORG/NAME[@REVISION][/glob]`: a Hub dataset repo as a prompt source, read-only.

huggingface_hub's HfFileSystem (fsspec) does the Hub's side: its listings, its block-by-block reads, its revision
syntax (`@v1.0`, `@<sha>`, `@refs/pr/3`, `@refs%2Fconvert%2Fparquet`), HF_ENDPOINT and HF_TOKEN. pyarrow reads it
through FSSpecHandler, so the readers, the glob walker and every row check are the ones a local file gets.
Two things it does not do, which a prompt source needs:
- its errors are httpx's (a refused connection is not an OSError): each becomes an OSError here, which the
  readers word as one line, and the repo is asked for once before anything is listed, so that no network, an
  unknown repo, a missing revision or a private one is one line naming the address and what to check;
- it writes: a prompt source is never written, so every write is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pyarrow as pa
import pyarrow.fs as pafs

from launcher.errors import ConfigError

SCHEME = "hf://"
FORM = "hf://datasets/ORG/NAME[@REVISION][/path or glob]"


def is_hub(path: str) -> bool:
    return path.startswith(SCHEME)


def hub_filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem over the Hub, and `path` within it (the address without `hf://`), after one check that
    the repo and revision answer (remembered for the process)."""
    from launcher.ledger import store

    repo, revision = _repo_of(path)
    if problem := _problem(_endpoint(), repo, revision):
        raise ConfigError(f"dataset.path {path}: {problem}")
    # An HTTP client with its pooled connections, as an object store's: this process is not forked (store.open_uri).
    store._OPENED["remote"] = True
    return pafs.PyFileSystem(_ReadOnlyHub(_hf())), path.removeprefix(SCHEME)


def whole_repo(path: str) -> bool:
    """Whether `path` names a repo (at a revision) with no path inside it: then its data files are the source."""
    if not is_hub(path):
        return False  # no import of huggingface_hub for a local source
    from huggingface_hub import parse_hf_uri

    try:
        return not parse_hf_uri(path.rstrip("/")).path_in_repo
    except ValueError:
        return False  # not an address: hub_filesystem says so


def repo_files(path: str) -> list[str]:
    """Every data file of a repo in the formats read here, sorted, each once; hidden ones (`.gitattributes`) left
    out, as `datasets` does for a repo without a loading script. Its README and other files are not data."""
    from launcher.sources.globs import expand
    from launcher.sources.prompts import FORMATS

    root = path.rstrip("/")
    fs, p = hub_filesystem(root)
    found = [f for f in expand(f"{root}/**/*", fs, f"{p}/**/*") if f.lower().endswith(FORMATS)]
    found = [f for f in found if fs.get_file_info(f.removeprefix(SCHEME)).type == pafs.FileType.File]
    if not found:
        raise ConfigError(
            f"dataset.path {path}: the repo holds no {', '.join(FORMATS)} files; point dataset.path at its "
            f"prompt files ({FORM})"
        )
    return found


def content_id(path: str) -> str | None:
    """What identifies a Hub file's content (`path` without the scheme): its LFS sha256, else its git blob id. The
    walker's listing has filled HfFileSystem's cache, so this asks the Hub nothing more."""
    info = _hf().info(path)
    lfs = info.get("lfs")
    if lfs:
        return f"sha256:{lfs['sha256']}"
    return f"blob:{info['blob_id']}" if info.get("blob_id") else None


def unreadable(path: str, first: str) -> str:
    return (
        f"dataset.path {path} cannot be read from the Hub at {_endpoint()} ({first}); check the network, "
        "HF_ENDPOINT, the repo name and revision, and HF_TOKEN (a private or gated repo)"
    )


def _endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it once, at its import)."""
    import os

    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _hf():
    from huggingface_hub import HfFileSystem

    return HfFileSystem(endpoint=_endpoint())  # one instance per endpoint and thread: fsspec keeps them


def _repo_of(path: str) -> tuple[str, str | None]:
    from huggingface_hub import parse_hf_uri

    try:
        uri = parse_hf_uri(path.rstrip("/"))
    except ValueError as e:
        raise ConfigError(f"dataset.path {path} is not a Hub address ({e}); write {FORM}") from None
    if uri.type != "dataset":
        raise ConfigError(f"dataset.path {path} is a {uri.type} repo; prompts come from a Hub dataset: {FORM}")
    return uri.id, uri.revision


@functools.cache
def _problem(endpoint: str, repo: str, revision: str | None) -> str | None:
    """Why the repo at `revision` cannot be read, with what to check; None where it answers (once per process)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    at = f"{endpoint} (HF_ENDPOINT)"
    try:
        _hf()._api.repo_info(repo, repo_type="dataset", revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except GatedRepoError:
        return f"{repo} is gated on {at}; accept its conditions on the Hub and set HF_TOKEN"
    except RevisionNotFoundError:
        return f"{repo} has no revision {revision!r} on {at}; check the branch, tag or commit after '@'"
    except RepositoryNotFoundError:
        return (
            f"{at} has no dataset repo {repo} that this token may read; check the repo name, and HF_TOKEN "
            "for a private repo"
        )
    except Exception as e:  # no network, a refused connection, a proxy's error page, HF_HUB_OFFLINE=1
        return f"the Hub does not answer at {at} ({_first_line(e)}); check the network, HF_ENDPOINT and HF_TOKEN"
    return None


def _first_line(e: BaseException) -> str:
    return ((str(e).strip().splitlines() or [""])[0] or type(e).__name__)[:300]


def _guarded(fn: Callable) -> Callable:
    """`fn`, whose failures are OSErrors: httpx's errors and the like are not, and the readers catch OSError."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

        try:
            return fn(*args, **kwargs)
        except GatedRepoError as e:  # its first line says only "401 Client Error."
            raise OSError(f"{_status(e)}the repo is gated: accept its conditions on the Hub, then set HF_TOKEN") from e
        except HfHubHTTPError as e:
            raise OSError(f"{_status(e)}{e.server_message or _first_line(e)}") from e
        except OSError:
            raise
        except Exception as e:
            if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2", "huggingface_hub"):
                raise OSError(f"{type(e).__name__}: {_first_line(e)}") from e
            raise

    return call


def _status(e) -> str:
    code = getattr(getattr(e, "response", None), "status_code", None)
    return f"HTTP {code}: " if code else ""


class _File:
    """An open Hub file whose reads raise OSErrors only."""

    def __init__(self, f):
        self._f = f

    def __getattr__(self, name: str):
        attr = getattr(self._f, name)
        return _guarded(attr) if callable(attr) else attr


def _refused(*_args, **_kwargs):
    raise PermissionError("a Hub prompt source is read, never written; publish with output.publish or tools/publish")


class _ReadOnlyHub(pafs.FSSpecHandler):
    """FSSpecHandler over HfFileSystem: reads only, each failure an OSError."""

    def get_file_info(self, paths):
        return _guarded(super().get_file_info)(paths)

    def get_file_info_selector(self, selector):
        return _guarded(super().get_file_info_selector)(selector)

    def open_input_stream(self, path):
        return self._open(path)

    def open_input_file(self, path):
        return self._open(path)

    @_guarded
    def _open(self, path):
        if not self.fs.isfile(path):
            raise FileNotFoundError(path)
        return pa.PythonFile(_File(self.fs.open(path, mode="rb")), mode="r")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = _refused
    move = copy_file = open_output_stream = open_append_stream = _refused
