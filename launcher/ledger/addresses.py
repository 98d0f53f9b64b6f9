"""Credentials inside an address (`s3://KEY:SECRET@bucket/run`, `s3://b/run?secret_key=...`, `https://user:pw@host/`,
a presigned URL's `X-Amz-Signature=...`) are refused, in the config and in the environment's S3 endpoints.

pyarrow would accept them, and then the secret would be everywhere an address goes: run.json, every run's
record, the terminal, the workers' logs, the dataset card, the rerun command that status.py prints. Removing
them from each of those is a promise that every new line of output would have to keep; refusing them keeps it
in one place. So an address that carries user information is exit 2 before anything is printed or written,
with a line that shows the address with the credentials masked and says where credentials belong: the
environment (the `AWS_*` variables for S3, application default credentials for GCS, `HF_TOKEN` for the hub).

A Hub address (`hf://`) is taken where something reads it or pushes to it: `dataset.path` (a prompt source,
read-only: launcher/sources/hub_source.py) and `output.publish`. Anywhere else it is refused here, in one line:
pyarrow would open it through fsspec and an output folder on the Hub would half-work (no atomic renames, no
conditional creates, a commit per file).
"""

from __future__ import annotations

import re

from launcher.errors import ConfigError

# scheme://userinfo@host...: userinfo is anything up to the first '@' before the first '/' after the scheme.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@")
WHERE = (
    "use the environment's credentials instead: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) "
    "for s3://, gcloud application default credentials for gs://, HF_TOKEN for the hub"
)


# A query parameter that carries a credential: pyarrow takes `access_key`/`secret_key` in an s3:// address, and
# presigned URLs carry X-Amz-* / X-Goog-* signatures. Its value runs to the next '&', '#', quote or space.
_QUERY_SECRET = re.compile(
    r"(?i)(?P<key>[?&;](?:access_key|secret_key|secret_access_key|session_token|security_token|token|"
    r"access_token|api_key|apikey|key|sig|signature|password|passwd|pwd|credential|"
    r"x-amz-credential|x-amz-signature|x-amz-security-token|x-goog-credential|x-goog-signature)=)"
    r"(?P<value>[^&#\s'\"]+)"
)
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+")
ENDPOINTS = re.compile(r"AWS_ENDPOINT_URL\w*")  # the environment's endpoints for S3 clients (pyarrow, boto3)


def masked(text: str) -> str:
    """`text` with every address's user information and credential query values replaced by `***`, and the user
    information of any address in the environment (an endpoint) wherever it appears: a library's message may
    quote only the host it could not resolve, and that may be a user name."""
    text = _QUERY_SECRET.sub(lambda m: f"{m['key']}***", _USERINFO.sub(lambda m: f"{m['scheme']}***@", text))
    for part in _environment_userinfo():
        text = text.replace(part, "***")
    return text


def _environment_userinfo() -> set[str]:
    """The user names and passwords inside the addresses that environment variables hold (3 characters or more:
    shorter ones would mask parts of ordinary words)."""
    import os

    parts = set()
    for value in os.environ.values():
        for m in _USERINFO.finditer(value):
            parts.update(p for p in m["userinfo"].split(":") if len(p) >= 3)
    return parts


def has_credentials(text: str) -> bool:
    return bool(_USERINFO.search(text)) or any(_QUERY_SECRET.search(u) for u in _URL.findall(text))


def check_environment() -> None:
    """Refuse an S3 endpoint from the environment that carries credentials (SigV4 never reads them there: pyarrow
    then takes the user name for the host), naming the variable, its value masked."""
    import os

    for name, value in sorted(os.environ.items()):
        if ENDPOINTS.fullmatch(name):
            check_address(value, name)


HUB_KEYS = ("dataset.path", "output.publish")  # the keys that take hf://


def check_address(address: str, what: str = "") -> None:
    """Refuse an address that carries credentials (exit 2), or a Hub address where none is read; `what` names where
    it came from (a config key; none for a run folder's address)."""
    shown = f"{what}={masked(address)}" if what else masked(address)
    if has_credentials(address):
        raise ConfigError(f"{shown} carries credentials in its address; remove them from it and {WHERE}")
    if address.startswith("hf://") and what not in HUB_KEYS:
        if what.startswith("model."):
            fix = "give the Hub's id as ORG/NAME, without hf://"
        else:  # output.dir, a tool's run folder
            fix = (
                "a run folder is a local path, gs:// or s3://; push its dataset to the Hub with "
                "output.publish=hf://datasets/ORG/NAME or tools/publish"
            )
        raise ConfigError(f"{shown}: a Hub address is not read or written here; {fix}")


def check_config(cfg, prefix: str = "") -> None:
    """Refuse any address with credentials anywhere in the composed config, naming its key (and, at the top, in
    the environment's S3 endpoints)."""
    from omegaconf import DictConfig, ListConfig

    if not prefix:
        check_environment()

    items = cfg.items_ex(resolve=False) if isinstance(cfg, DictConfig) else enumerate(cfg)
    for key, value in items:
        name = f"{prefix}.{key}" if prefix and isinstance(cfg, DictConfig) else f"{prefix}[{key}]" if prefix else key
        if isinstance(value, (DictConfig, ListConfig)):
            check_config(value, str(name))
        elif isinstance(value, str):
            check_address(value, str(name))
