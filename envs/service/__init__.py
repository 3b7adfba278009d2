"""Environments as services (docs/env-service.md): any registered env behind a small HTTP+JSON protocol
(``pettingflow env serve NAME``), and the trainer's side that runs episodes on it when ``env.server`` is set.

* ``protocol``: the version, the error types, the JSON codec of env state, arguments and results, which env methods
  a service exposes, an episode's snapshot;
* ``server``: ``EnvService`` (the episodes) and ``create_app``/``serve`` (FastAPI on uvicorn, bearer token beyond
  loopback);
* ``client``: ``ServiceClient`` (one per URL, retries of idempotent calls), ``RemoteEnv`` (an ``Env`` whose methods
  run on a service) and ``RemoteEnvs`` (what the rollout builds episodes with).

The rollout imports ``client`` and ``protocol`` only; ``server`` (and its web framework) is for the service.
"""

from pettingflow.envs.service.client import (
    EnvServiceError,
    RemoteEnv,
    RemoteEnvError,
    RemoteEnvs,
    ServiceClient,
    Timeouts,
    remote_class,
)
from pettingflow.envs.service.protocol import PROTOCOL, TOKEN_ENV, CodecError, ProtocolError, from_json, to_json

__all__ = [
    "PROTOCOL",
    "TOKEN_ENV",
    "CodecError",
    "EnvServiceError",
    "ProtocolError",
    "RemoteEnv",
    "RemoteEnvError",
    "RemoteEnvs",
    "ServiceClient",
    "Timeouts",
    "from_json",
    "remote_class",
    "to_json",
]
