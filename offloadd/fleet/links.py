"""Build the daemon's fleet fill from its config: the index over the peers' logs and one
client per peer, with the engines' credentials (TLS/mTLS, bearer token)."""

from __future__ import annotations

from offloadd.client.offload_client import OffloadClient
from offloadd.config import OffloaddConfig
from offloadd.fleet.fill import FleetFill, PeerLink
from offloadd.fleet.index import FleetIndex
from offloadd.fleet.peers import parse_peers
from offloadd.tier.store import HostStore
from offloadd.tier.writes import StoreWriter
from rpc.redis_connect import connect
from rpc.retry import RetryPolicy
from rpc.tls import ClientSecurity


def connect_fleet(config: OffloaddConfig, store: HostStore, writer: StoreWriter) -> FleetFill | None:
    """None when no peer is configured."""
    peers = parse_peers(config.fleet_peers)
    if not peers:
        return None
    tls = bool(config.fleet_ca_file)
    security = ClientSecurity.from_files(
        config.fleet_ca_file, config.tls_cert_file if tls else "",
        config.tls_key_file if tls else "", config.auth_token_file,
    )
    redis = connect(config.redis_url, socket_timeout=config.redis_timeout_s,
                    socket_connect_timeout=config.redis_timeout_s)
    index = FleetIndex(redis, {p.name: p.namespace for p in peers})
    links = [PeerLink(p, OffloadClient(p.target, config.fleet_timeout_s, RetryPolicy(attempts=1),
                                       credentials=security.credentials, token=security.token),
                      security.token, config.fleet_timeout_s)
             for p in peers]
    return FleetFill(store, writer, index, links, config.fleet_node or config.namespace)
