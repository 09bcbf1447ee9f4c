"""PROTOCOL.md's test vectors, checked both ways: whole, byte by byte, with trailing bytes."""

import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.protocol import ErrorCode, RemoteProtocolError
from blocktrain.protocol.connection import PROLOGUE
from blocktrain.protocol.events import MessageReader, frame_message
from blocktrain.protocol.handshake import NoiseHandshake
from blocktrain.protocol.statediagram import mermaid
from blocktrain.protocol.connection import Role

from vectors import PROTOCOL_MD, VALID, tables

VALID_ROWS = tables("Valid frames")
INVALID_ROWS = tables("Invalid frames")


def test_every_message_type_has_a_vector():
    names = {r[0] for r in VALID_ROWS}
    assert names == set(VALID)
    assert {type(m).TYPE for m in VALID.values()} == set(__import__("blocktrain.protocol", fromlist=["MESSAGES"]).MESSAGES)


def read_all(data: bytes, split: int | None = None):
    r = MessageReader()
    out = []
    chunks = [data] if split is None else [data[i:i + split] for i in range(0, len(data), split)]
    for c in chunks:
        r.feed(c)
        while (m := r.next_message()) is not None:
            out.append(m)
    return out


@pytest.mark.parametrize("name,hexstr", VALID_ROWS, ids=[r[0] for r in VALID_ROWS])
def test_valid_vector_encodes(name, hexstr):
    assert frame_message(VALID[name]).hex() == hexstr


@pytest.mark.parametrize("name,hexstr", VALID_ROWS, ids=[r[0] for r in VALID_ROWS])
@pytest.mark.parametrize("split", [None, 1, 7])
def test_valid_vector_decodes(name, hexstr, split):
    data = bytes.fromhex(hexstr)
    assert read_all(data, split) == [VALID[name]]


@pytest.mark.parametrize("name,hexstr", VALID_ROWS, ids=[r[0] for r in VALID_ROWS])
def test_valid_vector_with_trailing_bytes(name, hexstr):
    data = bytes.fromhex(hexstr)
    # trailing: the first bytes of another frame stay buffered, no event, no error
    r = MessageReader()
    r.feed(data + data[:10])
    assert r.next_message() == VALID[name]
    assert r.next_message() is None
    r.feed(data[10:])
    assert r.next_message() == VALID[name]


@pytest.mark.parametrize("name,hexstr,code", INVALID_ROWS, ids=[r[0] for r in INVALID_ROWS])
@pytest.mark.parametrize("split", [None, 1])
def test_invalid_vector_rejected(name, hexstr, code, split):
    with pytest.raises(RemoteProtocolError) as ei:
        read_all(bytes.fromhex(hexstr), split)
    assert ei.value.code is ErrorCode[code]


def test_oversized_length_rejected_from_header_alone():
    row = next(r for r in INVALID_ROWS if r[0].startswith("length over limit"))
    assert len(bytes.fromhex(row[1])) == 18  # no payload needed to reject it


def _hs_table():
    return {r[0]: bytes.fromhex(r[1]) for r in tables("Handshake")}


def test_handshake_vector_reproduced():
    v = _hs_table()
    key = lambda name: X25519PrivateKey.from_private_bytes(v[name])  # noqa: E731
    assert v["prologue"] == PROLOGUE
    i = NoiseHandshake(True, key("initiator static private"), v["psk"], PROLOGUE, key("initiator ephemeral private"))
    r = NoiseHandshake(False, key("responder static private"), v["psk"], PROLOGUE, key("responder ephemeral private"))
    m1 = i.write_message(b"")
    assert m1 == v["message 1 (payload empty)"]
    r.read_message(m1)
    m2 = r.write_message(bytes.fromhex("81a17601"))
    assert m2 == v["message 2 (payload 81a17601)"]
    assert i.read_message(m2) == bytes.fromhex("81a17601")
    m3 = i.write_message(b"")
    assert m3 == v["message 3 (payload empty)"]
    r.read_message(m3)
    assert i.handshake_hash == r.handshake_hash == v["handshake hash"]
    assert i.result[0].key == r.result[1].key == v["initiator-to-responder key"]
    assert i.result[1].key == r.result[0].key == v["responder-to-initiator key"]
    assert hashlib.sha256(v["initiator static public"]).digest() == v["initiator peer id"]


def test_handshake_vector_reproduced_by_noiseprotocol():
    """An independent implementation (the noiseprotocol package) produces the same bytes."""
    noise = pytest.importorskip("noise.connection")
    v = _hs_table()
    n = noise.NoiseConnection.from_name(b"Noise_XXpsk3_25519_AESGCM_SHA256")
    n.set_as_initiator()
    n.set_psks(v["psk"])
    n.set_prologue(v["prologue"])
    n.set_keypair_from_private_bytes(noise.Keypair.STATIC, v["initiator static private"])
    n.set_keypair_from_private_bytes(noise.Keypair.EPHEMERAL, v["initiator ephemeral private"])
    n.start_handshake()
    assert n.write_message(b"") == v["message 1 (payload empty)"]
    assert n.read_message(v["message 2 (payload 81a17601)"]) == bytes.fromhex("81a17601")
    assert n.write_message(b"") == v["message 3 (payload empty)"]
    assert n.get_handshake_hash() == v["handshake hash"]


def test_protocol_md_state_diagram_is_generated_from_the_table():
    text = PROTOCOL_MD.read_text()
    for role in Role:
        assert mermaid(role) in text, f"PROTOCOL.md's {role.value} diagram is stale; regenerate it"
