"""kv_connector_extra_config parsing (connectors/config.py): removed settings are still
accepted and ignored, as they always were; any other unknown key fails at start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvferry.connectors.config import REMOVED, ConnectorConfig


def test_a_removed_setting_is_accepted_and_ignored() -> None:
    cfg = ConnectorConfig.from_extra({"transfer_mode": "push", "recv_timeout_s": 7.0})
    assert cfg.recv_timeout_s == 7.0
    assert "transfer_mode" in REMOVED and "transfer_mode" not in cfg.model_dump()
    assert cfg == ConnectorConfig(recv_timeout_s=7.0)


def test_an_unknown_setting_is_a_clear_error() -> None:
    with pytest.raises(ValidationError) as e:
        ConnectorConfig.from_extra({"transfer_mod": "push"})
    assert e.value.errors()[0]["loc"] == ("transfer_mod",)
    assert e.value.errors()[0]["type"] == "extra_forbidden"


def test_a_bad_value_is_still_refused() -> None:
    with pytest.raises(ValidationError) as e:
        ConnectorConfig.from_extra({"recv_timeout_s": 0})
    assert e.value.errors()[0]["loc"] == ("recv_timeout_s",)
