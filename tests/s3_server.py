"""The tests' local S3 server: moto's, with its conditional create made atomic, as S3's own is.

moto answers a PUT with `If-None-Match: *` in two steps, a look for the key and then the write, and its threaded
server interleaves concurrent requests between them: two creates of one key could both succeed. Seen once as two
workers that both held a shard's first claim (the later one left the shard when the first released it: nothing was
lost or written twice, but the claim protocol rests on one winner). S3 decides such a race in one step; one lock
around moto's PUT of an object restores that. tests/test_contract_ledger.py races creates against it.

Usage: python tests/s3_server.py [moto_server's arguments]
"""

import sys
import threading

from moto.s3.responses import S3Response
from moto.server import main

_one_at_a_time = threading.Lock()
_put_object = S3Response.put_object


def put_object(self):
    with _one_at_a_time:
        return _put_object(self)


S3Response.put_object = put_object

if __name__ == "__main__":
    main(sys.argv[1:])
