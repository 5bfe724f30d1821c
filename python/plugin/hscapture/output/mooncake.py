"""Mooncake's own client (``mooncake.store.MooncakeDistributedStore``, from ``mooncake-transfer-engine`` or its
non-CUDA build) as the object store the Rust core puts samples into (``crates/worker/src/py/store.rs``): the
core decides the object, its key and what a failure leaves behind (``output/sinks/store.rs``, ``output/sinks/packed.rs``);
this module only opens the client and turns its status codes into typed errors.

Settings are the connector's ``kv_connector_extra_config["mooncake"]``, with speculators' names and defaults
(``hs_connectors.mooncake_store.MooncakeStoreConfig``) so that one block serves the server and the trainer, plus
``put_timeout_s``: how long a put waits for the store to have room (the trainer frees it as it reads) before the
sample fails.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..errors import ConfigError, OutputError

DEFAULTS: dict[str, Any] = {
    "local_hostname": "localhost",
    "metadata_server": "P2PHANDSHAKE",
    "master_server_address": "127.0.0.1:50051",
    "global_segment_size": 4 << 30,
    "local_buffer_size": 2 << 30,
    "protocol": "tcp",
    "device_name": "",
    "num_writer_threads": 4,
    "put_timeout_s": 60.0,
}
_INTS = ("global_segment_size", "local_buffer_size", "num_writer_threads")
_TEXTS = ("local_hostname", "metadata_server", "master_server_address", "protocol", "device_name")

# Mooncake's status codes (docs/source/troubleshooting/error-code.md in Mooncake's repository).
CODES = {
    -200: "NO_AVAILABLE_HANDLE: the store has no room",
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL: the master is unreachable",
    -901: "RPC_TIMEOUT: the master did not answer",
}
_NO_ROOM = -200
# A missing master otherwise holds set-up for about 90 s (20 tries); set before the client is made.
_SETUP_RETRIES = ("MC_STORE_CLIENT_SETUP_RETRIES", "3")


def settings(given: Any, where: str) -> dict[str, Any]:
    """``given`` (the ``mooncake`` block) over the defaults, checked; raises ``ConfigError`` naming the key."""
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise ConfigError(f"{where} is {given!r}; expected a mapping of Mooncake settings ({sorted(DEFAULTS)})")
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"{where} has unknown keys {sorted(unknown)}; Mooncake's settings are {sorted(DEFAULTS)}")
    out = {**DEFAULTS, **given}  # num_writer_threads, when given, is the writer's thread count (connector.py)
    for key in _INTS:
        if (
            isinstance(out[key], bool)
            or not isinstance(out[key], int)
            or out[key] < (1 if key == "num_writer_threads" else 0)
        ):
            raise ConfigError(f'{where}["{key}"] is {out[key]!r}; expected a non-negative integer (bytes or threads)')
    for key in _TEXTS:
        if not isinstance(out[key], str):
            raise ConfigError(f'{where}["{key}"] is {out[key]!r}; expected text')
    if out["protocol"] not in ("tcp", "rdma"):
        raise ConfigError(f'{where}["protocol"] is {out["protocol"]!r}; expected "tcp" or "rdma"')
    t = out["put_timeout_s"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
        raise ConfigError(f'{where}["put_timeout_s"] is {t!r}; expected seconds, a number >= 0')
    return out


def describe(code: Any) -> str:
    return f"status {code} ({CODES.get(code, 'see Mooncake error-code.md')})" if isinstance(code, int) else repr(code)


class Store:
    """One Mooncake client: ``open()`` sets it up, ``put`` stores bytes under a key (the Rust sink's calls)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.client: Any = None
        self.replicate: Any = None

    def open(self) -> Store:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ConfigError(
                f"the mooncake format needs Mooncake's client, which does not import here ({e}); install "
                "mooncake-transfer-engine (CUDA) or mooncake-transfer-engine-non-cuda (CPU) in the server's environment"
            ) from None
        os.environ.setdefault(*_SETUP_RETRIES)
        c = self.config
        try:
            client = MooncakeDistributedStore()
            rc = client.setup(
                c["local_hostname"],
                c["metadata_server"],
                c["global_segment_size"],
                c["local_buffer_size"],
                c["protocol"],
                c["device_name"],
                c["master_server_address"],
            )
        except Exception as e:  # noqa: BLE001 - the client raises untyped errors (pybind RuntimeError)
            rc = f"{type(e).__name__}: {e}"
        if rc != 0:
            raise ConfigError(
                f"the Mooncake client did not set up: {describe(rc)}; expected a master at "
                f"{c['master_server_address']} (metadata {c['metadata_server']}, protocol {c['protocol']}): start "
                "`mooncake_master` there or set kv_connector_extra_config.mooncake.master_server_address"
            )
        try:  # pinned: never evicted to make room (silently); a full store makes the put wait, then fail
            from mooncake.store import ReplicateConfig

            self.replicate = ReplicateConfig()
            self.replicate.with_hard_pin = True
        except (ImportError, AttributeError):
            self.replicate = None
        self.client = client
        return self

    def put(self, key: str, address: int, size: int) -> None:
        """Stores ``size`` bytes read from ``address`` under ``key`` (replacing a stale object of that key). Waits
        up to ``put_timeout_s`` while the store has no room; raises ``OutputError`` otherwise."""
        client = self.client
        if client is None:
            raise OutputError(f"the Mooncake client is closed; {key} was not stored")
        rdma = self.config["protocol"] == "rdma"
        if rdma:  # RDMA reads registered memory only
            rc = client.register_buffer(address, size)
            if rc != 0:
                raise OutputError(f"Mooncake register_buffer for {key} ({size} bytes) failed: {describe(rc)}")
        try:
            deadline = time.monotonic() + float(self.config["put_timeout_s"])
            delay = 0.01
            while True:
                rc = self._put_once(client, key, address, size)
                if rc == 0:
                    return
                if rc != _NO_ROOM or time.monotonic() >= deadline:
                    break
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        finally:
            if rdma:
                client.unregister_buffer(address)
        hint = (
            f"waited {self.config['put_timeout_s']} s for room: give the store more (global_segment_size of the "
            "master's clients) or let the trainer read faster"
            if rc == _NO_ROOM
            else f"check the master at {self.config['master_server_address']}"
        )
        raise OutputError(f"Mooncake put of {key} ({size} bytes) failed: {describe(rc)}; {hint}")

    def _put_once(self, client: Any, key: str, address: int, size: int) -> Any:
        upsert = getattr(client, "upsert_from", None)  # put_from keeps an existing object's old bytes
        put = upsert if upsert is not None else client.put_from
        return put(key, address, size, self.replicate) if self.replicate is not None else put(key, address, size)

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()
