"""gs:// clients: pyarrow's GcsFileSystem for every read and write, google-cloud-storage's for the conditional
create (`ifGenerationMatch=0`, which pyarrow lacks) and the preflight's bounded look.

`STORAGE_EMULATOR_HOST`, as Google's own clients read it (a local GCS server such as fake-gcs-server, with or
without `http://`), sends both to that server without credentials: pyarrow's client, opened from a gs:// address,
would not read it, and went on trying storage.googleapis.com in silence. There is no other endpoint setting.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

GCS_RETRY_S = 20  # how long pyarrow's GCS client tries one call again (Store._call retries on top of it)
GCS_PROBE_S = 10  # the preflight's look at a gs:// address: one request, no retry


def open_gcs(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's GCS client, its retries bounded: by default a store that does not answer is tried for 15 minutes
    in silence. With STORAGE_EMULATOR_HOST set, that server, anonymously."""
    from datetime import timedelta

    options: dict = {"retry_time_limit": timedelta(seconds=GCS_RETRY_S)}
    emulator = gcs_emulator()
    if emulator:
        scheme, _, host = emulator.partition("://")
        project = os.environ.get("GOOGLE_CLOUD_PROJECT", "meshgen")  # a bucket's creation asks for one
        options.update(anonymous=True, endpoint_override=host, scheme=scheme, project_id=project)
    return pafs.GcsFileSystem(**options), uri.removeprefix("gs://").rstrip("/")


def gcs_emulator() -> str | None:
    """STORAGE_EMULATOR_HOST as a URL (`http://` added where it names only a host and port), or None."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip().rstrip("/")
    if not host:
        return None
    return host if "://" in host else f"http://{host}"


def gcs_client():
    """google-cloud-storage's client, to the same server as `open_gcs`'s (it reads STORAGE_EMULATOR_HOST itself,
    but only with its scheme)."""
    from google.cloud import storage

    emulator = gcs_emulator()
    return storage.Client(client_options={"api_endpoint": emulator}) if emulator else storage.Client()


def probe_gcs(uri: str) -> None:
    """List at most one object under a gs:// address, within GCS_PROBE_S: raises what the store (or the lookup of
    the credentials) says. pyarrow's client would wait 2 minutes per request for a server that never answers."""
    bucket, _, prefix = uri.removeprefix("gs://").partition("/")
    blobs = gcs_client().list_blobs(bucket, prefix=prefix, max_results=1, timeout=GCS_PROBE_S, retry=None)
    list(blobs)


def create_exclusive(bucket: str, key: str, data: bytes) -> bool:
    """Create the object if it does not exist (`ifGenerationMatch=0`); False if it does."""
    from google.api_core.exceptions import PreconditionFailed

    try:
        gcs_client().bucket(bucket).blob(key).upload_from_string(data, if_generation_match=0)
    except PreconditionFailed:
        return False
    return True
