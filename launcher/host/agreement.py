"""The hosts of one job agree on it before any of them generates or writes.

Each launcher of a multi-host job checks its own command; nothing else made host 1 run the job host 0 runs, so a
host started with `generate.guidance_scale=9` generated its share with it, into a folder whose run.json says 4.0.
So every launcher puts what determines its images into the job's store (the c10d TCPStore on MASTER_ADDR:PORT
that torch's launch and launcher/host/peers.py already use): the fingerprinted settings, the weights' digests, the
mesh and the versions of the libraries that make the images, as `meshgen/peer/<node>/job`. Each reads every
host's and compares them with host 0's; any difference is the same one line on every host, and exit 2, before a
worker starts or a file is written. The first host serves the store from here on: launcher/host/peers.py's watch
and torch's agent share the server (multi-tenant), so no host ever finds the port closed between the two.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf import OmegaConf

from launcher.checks.settings import store_address
from launcher.errors import ConfigError
from launcher.host.peers import CONNECT_FOR_S, OP_TIMEOUT_S, connect, key

# Keys each host may set for itself: where this host's progress goes, and the push that only host 0 makes.
LOCAL_KEYS = ("config.output.metrics", "config.output.publish", "config.run.overwrite")
READ_FOR_S = 30.0  # how long the first host keeps its store up for the others to read a mismatch
SHOWN = 8  # differing keys named in the line


def job_of(cfg) -> dict:
    """What must be the same on every host, flat (`generate.seed`, `model.weights.transformer`, `versions.torch`)."""
    from launcher.ledger.runs import versions
    from launcher.plan.shards import settings

    flat: dict = {}

    def put(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                put(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value

    put("", settings(cfg))
    put("mesh", {"dp": cfg.mesh.dp, "tp": cfg.mesh.tp})
    put("versions", versions())
    # Not fingerprinted, but each host's workers write with their own: the folder, how images are stored (one
    # host's shards must not have another schema or layout), the scores, the rows read, the execution.
    plain = OmegaConf.to_container(cfg, resolve=True)
    for group in ("output", "quality", "dataset", "run", "execution", "job"):
        put(f"config.{group}", plain.get(group))
    for k in LOCAL_KEYS:
        flat.pop(k, None)
    return json.loads(json.dumps(flat))  # as the other hosts read it


@contextmanager
def hosts_agree(cfg) -> Iterator[None]:
    """On a job over several hosts: agree with the others (ConfigError where any differs), then run the block
    with the first host still serving the store."""
    if cfg.mesh.nodes == 1:
        yield
        return
    from datetime import timedelta

    from torch.distributed import TCPStore

    node, nodes = int(os.environ.get("NODE_RANK", "0")), cfg.mesh.nodes
    addr, port = store_address()
    server = None
    if node == 0:
        try:
            server = TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True)
        except Exception as e:  # noqa: BLE001 - taken since the preflight looked (torch's error is pages long)
            raise ConfigError(
                f"MASTER_PORT {port} cannot be bound on this host ({type(e).__name__}); another program holds it: "
                "pick a free port and set MASTER_PORT to it on every host"
            ) from None
        server.set_timeout(timedelta(seconds=OP_TIMEOUT_S))
    store = server or connect(addr, port, lambda: False, time.monotonic() + CONNECT_FOR_S)
    if store is None:
        raise ConfigError(
            f"the first host's store ({addr}:{port}) never answered within {CONNECT_FOR_S:.0f} s; start host 0 "
            f"of this job (mesh.nodes={nodes}) and give every host its MASTER_ADDR and MASTER_PORT"
        )
    try:
        agree(store, node, nodes, job_of(cfg))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError, DistStoreError, RuntimeError
        raise ConfigError(
            f"the job's store ({addr}:{port}) stopped answering before the hosts agreed ({type(e).__name__}); "
            "run the same command on every host"
        ) from None
    yield  # `server` lives until the block ends; the watch and the agent share it meanwhile


def agree(store, node: int, nodes: int, mine: dict) -> None:
    """Publish this host's job, read every host's, and refuse any that differs from host 0's."""
    store.set(key(node, "job"), json.dumps(mine))
    keys = [key(n, "job") for n in range(nodes)]
    deadline = time.monotonic() + CONNECT_FOR_S
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [n for n in range(nodes) if not store.check([key(n, "job")])]
            raise ConfigError(
                f"hosts {missing} of this job (mesh.nodes={nodes}) never joined within {CONNECT_FOR_S:.0f} s; "
                "start every host with the same job, MASTER_ADDR and MASTER_PORT"
            )
        time.sleep(0.2)
    jobs = [json.loads(store.get(k)) for k in keys]
    store.set(key(node, "compared"), "1")
    lines = [
        f"host {n}'s settings differ from host 0's: {d}"
        for n in range(1, nodes)
        if (d := differences(jobs[n], jobs[0]))
    ]
    if not lines:
        return
    if node == 0:  # the others read through this host's store: keep it up until they have
        until = time.monotonic() + READ_FOR_S
        while not store.check([key(n, "compared") for n in range(nodes)]) and time.monotonic() < until:
            time.sleep(0.1)
    raise ConfigError("; ".join(lines) + "; start every host with the same job")


def differences(theirs: dict, first: dict) -> str:
    """`key theirs != first, ...` for each key whose values differ (at most SHOWN named); '' where none does."""
    keys = [k for k in (*first, *(k for k in theirs if k not in first)) if theirs.get(k) != first.get(k)]
    shown = [f"{k} {_value(theirs.get(k, None), k in theirs)} != {_value(first.get(k), k in first)}" for k in keys]
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join(shown[:SHOWN]) + more


def _value(v, present: bool) -> str:
    if not present:
        return "(none)"
    text = v if isinstance(v, str) else json.dumps(v)
    return text if len(text) <= 40 else f"{text[:12]}..."
