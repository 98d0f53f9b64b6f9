"""Credentials inside an address (`s3://KEY:SECRET@bucket/run`, `https://user:pw@host/...`) are refused.

pyarrow would accept them, and then the secret would be everywhere an address goes: run.json, every run's
record, the terminal, the workers' logs, the dataset card, the rerun command that status.py prints. Removing
them from each of those is a promise that every new line of output would have to keep; refusing them keeps it
in one place. So an address that carries user information is exit 2 before anything is printed or written,
with a line that shows the address with the credentials masked and says where credentials belong: the
environment (the `AWS_*` variables for S3, application default credentials for GCS, `HF_TOKEN` for the hub).
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


def masked(text: str) -> str:
    """`text` with the user information of every address in it replaced by `***`."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}***@", text)


def has_credentials(text: str) -> bool:
    return bool(_USERINFO.search(text))


def check_address(address: str, what: str = "") -> None:
    """Refuse an address that carries credentials (exit 2); `what` names where it came from (a config key)."""
    if has_credentials(address):
        shown = f"{what}={masked(address)}" if what else masked(address)
        raise ConfigError(f"{shown} carries credentials in its address; remove them from it and {WHERE}")


def check_config(cfg, prefix: str = "") -> None:
    """Refuse any address with credentials anywhere in the composed config, naming its key."""
    from omegaconf import DictConfig, ListConfig

    items = cfg.items_ex(resolve=False) if isinstance(cfg, DictConfig) else enumerate(cfg)
    for key, value in items:
        name = f"{prefix}.{key}" if prefix and isinstance(cfg, DictConfig) else f"{prefix}[{key}]" if prefix else key
        if isinstance(value, (DictConfig, ListConfig)):
            check_config(value, str(name))
        elif isinstance(value, str):
            check_address(value, str(name))
