"""A hub id not in the local cache is downloaded here, by the launcher, once per host, before any worker starts.

Only what the pipeline loads: `DiffusionPipeline.download` reads model_index.json and the repo's file list and
keeps the components' weights in the format and variant `from_pretrained` would pick (safetensors, no
variant), not the repo's extra single-file checkpoints (about 24 GB of them for FLUX.1). Workers then load
from the cache offline. huggingface_hub's own progress bar shows the download.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from launcher.errors import ConfigError
from launcher.sizing.model_files import complete_in_cache, looks_like_hub_id

logger = logging.getLogger(__name__)


def ensure_downloaded(path: str) -> None:
    """Download hub id `path` (the files its pipeline loads) unless the cache already has them all."""
    if Path(path).is_dir() or not looks_like_hub_id(path) or os.environ.get("HF_HUB_OFFLINE") == "1":
        return  # a folder, a typo'd path (the model step says so), or offline: the cache is all there is
    if complete_in_cache(path):
        return  # downloaded before: no network at all, so a host without one runs from its cache
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        hub_answers(path, "model.path")
        from diffusers import DiffusionPipeline

        # One file first: a gated or missing repo answers here with its own error, before diffusers turns it
        # into a generic one; and model_index.json is the first file the download needs anyway.
        hf_hub_download(path, "model_index.json")
        logger.info("fetching %s from %s (only the files its pipeline loads)", path, constants.ENDPOINT)
        DiffusionPipeline.download(path)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure becomes one line; the chain names the cause
        cause = _root_cause(e, (GatedRepoError, RepositoryNotFoundError))
        if isinstance(cause, GatedRepoError):
            raise ConfigError(
                f"model.path {path} is a gated repo: log in (hf auth login, or set HF_TOKEN) with an account that "
                f"accepted its license at {constants.ENDPOINT}/{path}"
            ) from None
        if isinstance(cause, RepositoryNotFoundError):
            raise ConfigError(
                f"model.path {path} is not a repo on {constants.ENDPOINT} (or a private one: log in with "
                "hf auth login); check the id, or point model.path at a local folder"
            ) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"cannot download model.path {path} from {constants.ENDPOINT} ({first}); check the network, "
            f"or download it elsewhere (hf download {path}) into HF_HOME"
        ) from None


def hub_answers(repo_id: str, what: str) -> None:
    """One request for the repo's info, bounded by HF_HUB_ETAG_TIMEOUT and never retried: a hub that cannot be
    reached (no route, a proxy or a stranger that accepts and never answers) is one line within seconds. The
    downloads after it retry (5 times, with backoff, per request): minutes against a hub that does not answer.
    An HTTP answer is an answer: a missing repo raises for the caller; a busy hub (429, 5xx) is left to them."""
    import httpx2  # huggingface_hub's HTTP client: its transport errors are "no answer"
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    wait = constants.HF_HUB_ETAG_TIMEOUT
    try:
        HfApi(endpoint=constants.ENDPOINT).model_info(repo_id, timeout=wait)
    except HfHubHTTPError as e:
        status = e.response.status_code  # huggingface_hub's HTTP errors always carry their response
        if status != 429 and status < 500:
            raise
    except (httpx2.TransportError, OSError) as e:  # no HTTP answer: a timeout, a refused or reset connection
        raise ConfigError(
            f"{what} {repo_id}: the hub at {constants.ENDPOINT} did not answer within {wait} s "
            f"({type(e).__name__}); check the network and HF_ENDPOINT (HF_HUB_ETAG_TIMEOUT sets the wait), or "
            f"download it elsewhere (hf download {repo_id}) into HF_HOME"
        ) from None


def _root_cause(e: BaseException, wanted: tuple[type, ...]) -> BaseException:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, wanted):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return e
