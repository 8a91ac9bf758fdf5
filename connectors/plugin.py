"""vLLM general-plugin entry point: makes ``kv_connector: KvferryConnector`` resolvable."""

import contextlib


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # already registered in this process
        KVConnectorFactory.register_connector(
            "KvferryConnector", "kvferry.connectors.connector", "KvferryConnector")
