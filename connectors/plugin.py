"""vLLM general-plugin entry point: makes ``kv_connector: KvferryConnector`` resolvable.

vLLM loads general plugins in every process it starts (API server, engine core, each
worker) before a model runs, so this is also where a worker gets the AMX permission its
CPU kernels need (`cpu_amx`).
"""

import contextlib

from kvferry.connectors.cpu_amx import request_amx_permission


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    request_amx_permission()
    with contextlib.suppress(ValueError):  # already registered in this process
        KVConnectorFactory.register_connector(
            "KvferryConnector", "kvferry.connectors.connector", "KvferryConnector")
