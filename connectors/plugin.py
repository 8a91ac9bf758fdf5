"""vLLM general-plugin entry point: makes ``kv_connector: KvferryConnector`` resolvable.

vLLM loads general plugins in every process it starts (API server, engine core, each
worker) before a model runs, so this is also where a worker gets the AMX permission its
CPU kernels need (`cpu_amx`), and where the API server's detokenizer is primed with the
prompt's tail when ``KVFERRY_DETOKENIZE_WINDOW`` asks for it (`detokenizer_window`).
"""

import contextlib

from kvferry.connectors.cpu_amx import request_amx_permission
from kvferry.connectors.detokenizer_window import install_from_env


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    request_amx_permission()
    install_from_env()
    with contextlib.suppress(ValueError):  # already registered in this process
        KVConnectorFactory.register_connector(
            "KvferryConnector", "kvferry.connectors.connector", "KvferryConnector")
