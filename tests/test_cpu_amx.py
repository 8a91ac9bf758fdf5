"""AMX tile-data permission (connectors/cpu_amx.py), checked in fresh processes: the
permission is process-wide and cannot be dropped once granted."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
from kvferry.connectors import cpu_amx
before = cpu_amx.xtiledata_state()
{call}
print(before, cpu_amx.xtiledata_state())
"""


def states(call: str) -> tuple[str, str]:
    # No timeout of its own: importing the plugin imports vLLM (10 s alone, over 60 s once
    # on CI's two cores beside the engine tests, .ci/test); pytest-timeout bounds a hang.
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(call=call)], check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], out[1]


def test_request_grants_xtiledata_where_the_cpu_has_it() -> None:
    before, after = states("cpu_amx.request_amx_permission()")
    if before == "unsupported":  # no AMX here: nothing to grant, and nothing granted
        assert after == "unsupported"
    else:
        assert before == "not_permitted"  # a fresh process starts without it
        assert after == "permitted"


def test_plugin_registration_grants_it() -> None:
    """vLLM calls the plugin in each worker before its first forward."""
    before, after = states("from kvferry.connectors.plugin import register; register()")
    assert after == ("unsupported" if before == "unsupported" else "permitted")
