"""The tests' local S3 server: moto's, with its conditional create made atomic, as S3's own is.

moto answers a PUT with `If-None-Match: *` in two steps, a look for the key and then the write, and its threaded
server interleaves concurrent requests between them: two creates of one key could both succeed. Seen once as two
workers that both held a shard's first claim (the later one left the shard when the first released it: nothing was
lost or written twice, but the claim protocol rests on one winner). S3 decides such a race in one step; one lock
around moto's PUT of an object restores that. tests/test_contract_ledger.py races creates against it.

Usage: python tests/s3_server.py [moto_server's arguments]
"""

import subprocess
import sys
import threading
from pathlib import Path


def start(log: Path) -> tuple[subprocess.Popen, str]:
    """The server on a free loopback port, answering; (its process, its URL for AWS_ENDPOINT_URL)."""
    from gcs_server import free_port, wait_until_answering

    port = free_port()
    with open(log, "w") as f:
        cmd = [sys.executable, __file__, "-H", "127.0.0.1", "-p", str(port)]
        server = subprocess.Popen(cmd, stdout=f, stderr=f)
    wait_until_answering(server, port, log, "moto's S3 server")
    return server, f"http://127.0.0.1:{port}"


def _serve(argv: list[str]) -> None:
    from moto.s3.responses import S3Response
    from moto.server import main

    one_at_a_time, put_object = threading.Lock(), S3Response.put_object

    def atomic_put_object(self):
        with one_at_a_time:
            return put_object(self)

    S3Response.put_object = atomic_put_object
    main(argv)


if __name__ == "__main__":
    _serve(sys.argv[1:])
