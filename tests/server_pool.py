"""Object-store servers started once for a whole mutation run (tools/mutants.py), leased one per pytest session.

mutmut runs each mutant's tests in a pytest session of its own: the `s3` and `gcs` fixtures started a moto server
(a Python process importing moto: ~3 CPU-s) and a fake-gcs-server for every mutant whose tests reach an object
store, over a thousand of the ledger's. With MESHGEN_TEST_SERVERS naming a folder of running servers, a session
instead takes one that no other session holds (an flock, dropped when the session's process ends) and empties
its bucket first, so each session still starts from an empty store of its own.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

POOL_ENV = "MESHGEN_TEST_SERVERS"


def lease(kind: str):
    """(the URL of a free `kind` server of the pool, the open lock file that holds it), or None: no pool, or every
    server of it is held."""
    pool = os.environ.get(POOL_ENV)
    for entry in sorted(Path(pool).glob(f"{kind}-*.url")) if pool else ():
        hold = open(entry.with_suffix(".lock"), "w")
        try:
            fcntl.flock(hold, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            hold.close()
            continue
        return entry.read_text().strip(), hold
    return None


def empty_s3(bucket: str) -> None:
    import boto3
    from botocore.exceptions import ClientError

    client = boto3.client("s3")
    try:
        client.create_bucket(Bucket=bucket)
    except ClientError:  # there from an earlier session
        pass
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def empty_gcs(bucket: str) -> None:
    from launcher.ledger.gcs import gcs_client

    client = gcs_client()
    if client.lookup_bucket(bucket) is None:
        client.create_bucket(bucket)
    for blob in client.list_blobs(bucket):
        blob.delete()
