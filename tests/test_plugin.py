"""kvferry is loadable by name: the vllm.general_plugins entry point registers it."""

from __future__ import annotations

from importlib.metadata import entry_points


def test_entry_point_registers_connector_by_name():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvferry.connectors.connector import KvferryConnector

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvferry"]
    ep.load()()  # what vLLM's load_general_plugins() does in every engine process
    ep.load()()  # idempotent: a second registration must not raise
    assert KVConnectorFactory.get_connector_class_by_name("KvferryConnector") is KvferryConnector


def test_vllm_loads_general_plugins_including_kvferry():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert "KvferryConnector" in KVConnectorFactory._registry
