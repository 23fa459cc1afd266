"""shmhb inside vLLM: ``ShmhbConnector`` wraps a KV connector and makes a dead, hung or
restarted peer fail fast (see docs/VLLM.md).  Importing this package imports vLLM;
``import shmhb`` alone never does."""

from __future__ import annotations

from .connector import ShmhbConnector

__all__ = ["ShmhbConnector", "register"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: makes ``"kv_connector": "ShmhbConnector"``
    work without ``kv_connector_module_path``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector("ShmhbConnector", "shmhb.vllm.connector",
                                              "ShmhbConnector")
    except ValueError:
        pass  # registered already (plugins load once per process, but tests may repeat)
