"""Signed offers (connectors/protocol/params.py): what D accepts, and everything it must refuse."""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.connectors.protocol.params import (
    SECRET_ENV,
    SIG,
    InvalidParams,
    RemotePrefill,
    blocks_needed,
    parse_offer,
    prompt_hash,
    secret,
    sign,
)

KEY = b"deployment-secret"


def offer(**kw) -> RemotePrefill:
    base = dict(remote_engine_id="P0", remote_host="10.0.0.1", remote_port=5600,
                remote_block_ids=[3, 4, 9], remote_request_id="req-1", remote_num_tokens=40,
                prompt_hash=prompt_hash(range(40)), remote_tp_size=1, transfer_id="t-1")
    base.update(kw)
    return RemotePrefill(**base)


def reason(params, key=KEY) -> str:
    with pytest.raises(InvalidParams) as e:
        parse_offer(params, key)
    return str(e.value)


# -- round trip ---------------------------------------------------------------------------
def test_sign_then_parse_round_trips_every_field():
    o = offer()
    signed = sign(o, KEY)
    assert signed[SIG] and signed["do_remote_prefill"] is True and signed["do_remote_decode"] is False
    assert parse_offer(signed, KEY) == o


def test_signed_offer_survives_json_transport_through_router():
    signed = sign(offer(), KEY)
    wire = msgspec.json.decode(msgspec.json.encode(signed))
    assert parse_offer(wire, KEY) == offer()


def test_signature_is_hmac_sha256_hex():
    sig = sign(offer(), KEY)[SIG]
    assert len(sig) == 64 and int(sig, 16) >= 0


def test_default_key_comes_from_env(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert secret() == b"from-env"
    signed = sign(offer())
    assert parse_offer(signed) == offer()
    assert parse_offer(signed, b"from-env") == offer()
    monkeypatch.setenv(SECRET_ENV, "rotated")
    assert "signature" in reason(signed, None)


def test_unknown_keys_added_by_vllm_do_not_break_verification():
    signed = sign(offer(), KEY)
    signed.update({"vllm_internal": {"x": [1, 2]}, "num_cached_tokens": 7, "request_id": "other"})
    assert parse_offer(signed, KEY) == offer()


def test_keys_order_does_not_matter():
    signed = sign(offer(), KEY)
    assert parse_offer(dict(reversed(list(signed.items()))), KEY) == offer()


# -- refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("remote_block_ids", [3, 4, 10]),
    ("remote_block_ids", [3, 4]),
    ("remote_engine_id", "P1"),
    ("remote_host", "10.0.0.2"),
    ("remote_port", 5601),
    ("remote_request_id", "req-2"),
    ("remote_num_tokens", 41),
    ("prompt_hash", prompt_hash(range(41))),
    ("remote_tp_size", 2),
    ("transfer_id", "t-2"),
    ("do_remote_decode", True),
])
def test_tampering_any_signed_field_is_rejected(field, value):
    signed = sign(offer(), KEY)
    signed[field] = value
    assert "signature" in reason(signed)


def test_adding_a_defaulted_field_with_another_value_is_tampering():
    body = sign(offer(), KEY)
    del body["transfer_id"]  # absence == default "" != signed "t-1"
    assert "signature" in reason(body)


def test_wrong_key_is_rejected():
    assert "another deployment" in reason(sign(offer(), b"other-deployment"))


def test_empty_key_signature_is_rejected_by_a_keyed_deployment():
    assert "signature" in reason(sign(offer(), b""))


@pytest.mark.parametrize("sig", [None, 123, b"00", ["x"]])
def test_missing_or_non_string_signature_is_unsigned(sig):
    body = msgspec.to_builtins(offer())
    if sig is not None:
        body[SIG] = sig
    assert "not signed" in reason(body)


def test_garbage_hex_signature_is_rejected():
    body = sign(offer(), KEY)
    body[SIG] = "0" * 64
    assert "signature" in reason(body)


def test_non_ascii_signature_is_invalid_params_not_type_error():
    body = sign(offer(), KEY)
    body[SIG] = "é" * 64
    assert "signature" in reason(body)


@pytest.mark.parametrize("params", [None, [], "offer", 5, [("kvferry_sig", "x")]])
def test_non_mapping_params_rejected(params):
    assert "must be an object" in reason(params)


@pytest.mark.parametrize("field,value", [
    ("remote_port", "5600"),
    ("remote_port", 5600.5),
    ("remote_block_ids", "3,4,9"),
    ("remote_block_ids", [3, "4"]),
    ("remote_block_ids", [3, 4.5]),
    ("remote_block_ids", None),
    ("remote_tp_size", True),
    ("remote_engine_id", 7),
])
def test_malformed_types_rejected_before_any_mac(field, value):
    body = sign(offer(), KEY)
    body[field] = value
    assert "malformed" in reason(body)


@pytest.mark.parametrize("missing", ["remote_engine_id", "remote_host", "remote_port",
                                     "remote_block_ids", "remote_request_id",
                                     "remote_num_tokens", "prompt_hash"])
def test_missing_required_field_is_malformed(missing):
    body = sign(offer(), KEY)
    del body[missing]
    assert "malformed" in reason(body)


def test_negative_block_id_rejected_even_if_signed():
    assert "negative" in reason(sign(offer(remote_block_ids=[0, -1]), KEY))


@pytest.mark.parametrize("port", [0, -1, 65536, 70000])
def test_bad_port_rejected_even_if_signed(port):
    assert "port" in reason(sign(offer(remote_port=port), KEY))


@pytest.mark.parametrize("tp", [0, -2])
def test_bad_tp_rejected_even_if_signed(tp):
    assert "tp" in reason(sign(offer(remote_tp_size=tp), KEY))


@pytest.mark.parametrize("port", [1, 65535])
def test_port_bounds_accepted(port):
    assert parse_offer(sign(offer(remote_port=port), KEY), KEY).remote_port == port


def test_empty_block_list_and_zero_id_accepted():
    assert parse_offer(sign(offer(remote_block_ids=[]), KEY), KEY).remote_block_ids == []
    assert parse_offer(sign(offer(remote_block_ids=[0]), KEY), KEY).remote_block_ids == [0]


def test_unset_secret_fails_closed(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    body = msgspec.to_builtins(offer())
    payload = msgspec.json.encode(body, order="sorted")
    body[SIG] = hmac.new(b"", payload, hashlib.sha256).hexdigest()  # what any client can compute
    with pytest.raises(InvalidParams):
        parse_offer(body)


# -- properties ------------------------------------------------------------------------------
ids = st.lists(st.integers(0, 2**31), max_size=20)


@given(ids, st.text(max_size=12), st.integers(1, 65535), st.integers(1, 8))
def test_any_valid_offer_round_trips(block_ids, rid, port, tp):
    o = offer(remote_block_ids=block_ids, remote_request_id=rid, remote_port=port, remote_tp_size=tp)
    assert parse_offer(sign(o, KEY), KEY) == o


@given(ids, ids)
def test_any_block_list_change_breaks_signature(a, b):
    signed = sign(offer(remote_block_ids=a), KEY)
    signed["remote_block_ids"] = b
    if a == b:
        assert parse_offer(signed, KEY).remote_block_ids == a
    else:
        with pytest.raises(InvalidParams):
            parse_offer(signed, KEY)


def test_prompt_hash_identifies_exact_sequence():
    assert prompt_hash([1, 2, 3]) == prompt_hash((1, 2, 3))
    assert prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 4])
    assert prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 3, 0])
    assert prompt_hash([]) != prompt_hash([0])
    assert len(prompt_hash([5])) == 32


@pytest.mark.parametrize("tokens,bs,n", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2)])
def test_blocks_needed_is_ceiling(tokens, bs, n):
    assert blocks_needed(tokens, bs) == n


# -- one MAC, versioned and typed ----------------------------------------------------------
def test_mac_binds_type_and_protocol_version(monkeypatch):
    from kvferry.connectors.protocol import params

    signed = sign(offer(), KEY)
    monkeypatch.setattr(params, "PROTOCOL_VERSION", params.PROTOCOL_VERSION + 1)
    assert "signature" in reason(signed)  # another version's offer never verifies

    class Lookalike(params.Signed):  # the same fields under another type name
        remote_engine_id: str

    assert params.mac(Lookalike("P0"), KEY) != params.mac(params.RemotePrefill(
        "P0", "", 0, [], "", 0, ""), KEY)


def test_mac_ok_fails_closed():
    from kvferry.connectors.protocol.params import mac, mac_ok

    o = offer()
    assert mac_ok(o, mac(o, KEY), KEY)
    assert not mac_ok(o, mac(o, b""), b"")  # an unset secret verifies nothing
    assert not mac_ok(o, "\u00e9" * 64, KEY) and not mac_ok(o, None, KEY)


def test_request_params_are_built_and_read_by_one_module():
    from kvferry.connectors.protocol.params import (
        kv_params,
        lease_params,
        lease_request,
        pull_prefill_params,
        push_decode_params,
        push_prefill_params,
        reuse_params,
    )

    assert pull_prefill_params("t") == {"do_remote_decode": True, "transfer_id": "t"}
    assert push_prefill_params("t") == {"do_remote_decode": True, "push": True, "transfer_id": "t"}
    d = kv_params(push_decode_params("t", "h", 5600))
    assert (d.do_remote_prefill, d.push, d.transfer_id, d.remote_host, d.remote_port) == (
        True, True, "t", "h", 5600)
    assert kv_params(reuse_params({"lease_id": "L"})).reuse == {"lease_id": "L"}
    assert lease_params("L") == {"lease": {"lease_id": "L"}}
    assert lease_request(lease_params("L", 60)["lease"]).ttl == 60.0
    assert kv_params(None) == kv_params({}) and not kv_params({"other": 1}).do_remote_decode
    with pytest.raises(InvalidParams, match="malformed"):
        kv_params({"do_remote_decode": True, "transfer_id": 7})


@pytest.mark.parametrize(("raw", "ttl"), [({"lease_id": "L", "ttl": 5}, 5.0),
                                          ({"lease_id": "L", "ttl": 0}, None),
                                          ({"lease_id": "L", "ttl": "60"}, None),
                                          ({"lease_id": "L", "ttl": True}, None),
                                          ({"lease_id": "L", "ttl": float("inf")}, None)])
def test_lease_request_ttl_is_positive_or_ds_own(raw, ttl):
    from kvferry.connectors.protocol.params import lease_request

    assert lease_request(raw).ttl == ttl


@pytest.mark.parametrize("raw", [None, "L", {"lease_id": 7}, {"lease_id": ""},
                                 {"lease_id": "x" * 129}, {"ttl": 5}])
def test_malformed_lease_request_is_refused(raw):
    from kvferry.connectors.protocol.params import lease_request

    with pytest.raises(InvalidParams):
        lease_request(raw)
