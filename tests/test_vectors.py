"""PROTOCOL.md's test vectors, checked both ways: whole, byte by byte, with trailing bytes."""

import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from blocktrain.protocol import NEED_DATA, Error, ErrorCode, HandshakeComplete, Ping, Pong, RemoteProtocolError, State
from blocktrain.protocol.connection import PROLOGUE
from blocktrain.protocol.events import MessageReader, encode_payload, frame_message
from blocktrain.protocol.frames import encode_header
from blocktrain.protocol.handshake import NoiseHandshake
from blocktrain.protocol.statediagram import mermaid
from blocktrain.protocol.connection import Role

from vectors import (INVALID_FIRST, INVALID_HELLOS, INVALID_R4, PROTOCOL_MD, RANGE_HELLOS, REACH_HELLO, VALID,
                     fixed_connection, message3_with_hello, session_transcript, tables)

VALID_ROWS = tables("Valid frames")
INVALID_ROWS = tables("Invalid frames")
FIRST_ROWS = tables("Invalid first frames")
HELLO_ROWS = tables("Invalid hellos")
SESSION = {r[0]: bytes.fromhex(r[1]) for r in tables("Sealed session transcript")}
TRAILING = bytes.fromhex(VALID_ROWS[0][1])  # a whole valid frame after the invalid one


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


@pytest.mark.parametrize("name,hexstr,code,when", INVALID_ROWS, ids=[r[0] for r in INVALID_ROWS])
@pytest.mark.parametrize("split", [None, 1, "trailing"])
def test_invalid_vector_rejected(name, hexstr, code, when, split):
    data = bytes.fromhex(hexstr)
    with pytest.raises(RemoteProtocolError) as ei:
        read_all(data + TRAILING if split == "trailing" else data, 1 if split == 1 else None)
    assert ei.value.code is ErrorCode[code]


@pytest.mark.parametrize("name,hexstr,code,when", INVALID_ROWS, ids=[r[0] for r in INVALID_ROWS])
def test_invalid_vector_rejected_when_the_spec_says(name, hexstr, code, when):
    """"header": the 18 header bytes alone are rejected, before any payload is awaited."""
    assert when in ("header", "payload")
    r = MessageReader()
    r.feed(bytes.fromhex(hexstr)[:18])
    if when == "header":
        with pytest.raises(RemoteProtocolError) as ei:
            r.next_message()
        assert ei.value.code is ErrorCode[code]
    else:
        assert r.next_message() is None


def test_invalid_vectors_of_r4_encode():
    """The invalid frames added in r4 are made by tests/vectors.py's recipes, byte for byte."""
    rows = {r[0]: r[1] for r in INVALID_ROWS}
    for name, frame in INVALID_R4.items():
        assert rows[name] == frame.hex(), name
    assert {r[0]: r[1] for r in FIRST_ROWS} == {k: v.hex() for k, v in INVALID_FIRST.items()}


def feed_connection(conn, data: bytes, split):
    """Feed ``data`` whole, byte by byte (split=1) or followed by a valid frame ("trailing");
    returns the events delivered (none may come before an error)."""
    if split == "trailing":
        data += TRAILING
    events = []
    for c in [data] if split != 1 else [data[i:i + 1] for i in range(len(data))]:
        conn.receive_data(c)
        while (ev := conn.next_event()) is not NEED_DATA:
            events.append(ev)
    return events


def _check_refusal(conn, code):
    """The responder failed and tells the (unauthenticated) peer why, in a plain ERROR frame."""
    assert conn.state is State.ERROR and conn.peer is None
    r = MessageReader()
    r.feed(conn.data_to_send())
    (refusal,) = [m for m in iter(r.next_message, None) if isinstance(m, Error)]
    assert refusal.code == code


@pytest.mark.parametrize("name,hexstr,code,when", FIRST_ROWS, ids=[r[0] for r in FIRST_ROWS])
@pytest.mark.parametrize("split", [None, 1, "trailing"])
def test_invalid_first_frame_rejected_by_a_responder(name, hexstr, code, when, split):
    conn = fixed_connection(Role.RESPONDER)
    with pytest.raises(RemoteProtocolError) as ei:
        feed_connection(conn, bytes.fromhex(hexstr), split)
    assert ei.value.code is ErrorCode[code]
    _check_refusal(conn, ErrorCode[code])
    if when == "header":
        conn = fixed_connection(Role.RESPONDER)
        conn.receive_data(bytes.fromhex(hexstr)[:18])
        with pytest.raises(RemoteProtocolError):
            conn.next_event()


@pytest.mark.parametrize("name,hexstr,code", HELLO_ROWS, ids=[r[0] for r in HELLO_ROWS])
def test_invalid_hello_vector_encodes(name, hexstr, code):
    assert message3_with_hello(INVALID_HELLOS[name]).hex() == hexstr


@pytest.mark.parametrize("name,hexstr,code", HELLO_ROWS, ids=[r[0] for r in HELLO_ROWS])
@pytest.mark.parametrize("split", [None, 1, "trailing"])
def test_invalid_hello_rejected_by_a_responder(name, hexstr, code, split):
    conn = fixed_connection(Role.RESPONDER)
    assert feed_connection(conn, SESSION["message 1"], None) == []
    assert conn.data_to_send() == SESSION["message 2"]
    with pytest.raises(RemoteProtocolError) as ei:
        feed_connection(conn, bytes.fromhex(hexstr), split)
    assert ei.value.code is ErrorCode[code]
    _check_refusal(conn, ErrorCode[code])


def test_the_reachability_hello_vector_both_ways():
    """r8: PROTOCOL.md's hello with ``seen``, ``dial_back`` and ``dialed`` is what canonical
    msgpack makes of them, message 3 carrying it is what the fixed keys make, and a responder
    takes it with exactly that info."""
    import msgpack
    from blocktrain.protocol import HandshakeComplete
    (name, hexstr), = tables("Hello with the reachability keys")
    text = PROTOCOL_MD.read_text()
    assert msgpack.packb(REACH_HELLO, use_bin_type=True).hex() in text
    assert message3_with_hello(msgpack.packb(REACH_HELLO, use_bin_type=True)).hex() == hexstr
    conn = fixed_connection(Role.RESPONDER)
    assert feed_connection(conn, SESSION["message 1"], None) == []
    conn.data_to_send()
    evs = feed_connection(conn, bytes.fromhex(hexstr), None)
    assert len(evs) == 1 and isinstance(evs[0], HandshakeComplete) and evs[0].info == REACH_HELLO["info"]


def test_every_invalid_hello_has_a_vector():
    assert {r[0] for r in HELLO_ROWS} == set(INVALID_HELLOS)


@pytest.mark.parametrize("name", RANGE_HELLOS)
def test_the_out_of_range_block_hellos_are_canonical_so_the_range_check_refuses_them(name):
    """The u16 vector encoded -1 in a longer form than needed, so it was
    refused as non-canonical and never reached the range check."""
    from blocktrain.protocol import unpack_canonical
    assert unpack_canonical(INVALID_HELLOS[name])["info"]["blocks"][0] in (-1, 65536)


def test_sealed_session_vector_encodes():
    assert session_transcript() == {k: v for k, v in SESSION.items() if k != "hello"}
    hello = SESSION["hello"]
    assert hello == bytes.fromhex("83a17601a47365616cc3a4696e666f80")  # {"v": 1, "seal": true, "info": {}}


def test_sealed_session_vector_opens_with_the_handshake_keys():
    """Independently of Connection: AES-256-GCM with the Split() keys of the Handshake vectors,
    nonce = 4 zero bytes + the frame counter, the header as associated data."""
    hs = _hs_table()
    k1, k2 = AESGCM(hs["initiator-to-responder key"]), AESGCM(hs["responder-to-initiator key"])
    nonce = lambda n: n.to_bytes(12, "big")  # noqa: E731
    conf, ping, pong = SESSION["confirmation"], SESSION["initiator ping"], SESSION["responder pong"]
    assert conf[:18] == encode_header(0x01, 0x02, 0, 16) and k2.decrypt(nonce(0), conf[18:], conf[:18]) == b""
    plain = b"".join(encode_payload(Ping(nonce=7))[1])
    assert ping[:18] == encode_header(0x04, 0x02, 0, len(plain) + 16)
    assert k1.decrypt(nonce(0), ping[18:], ping[:18]) == plain
    assert k2.decrypt(nonce(1), pong[18:], pong[:18]) == b"".join(encode_payload(Pong(nonce=7))[1])
    # the Noise messages are framed as they are, in plain HANDSHAKE frames
    assert SESSION["message 1"][18:] == hs["message 1 (payload empty)"]


@pytest.mark.parametrize("split", [None, 1, "trailing"])
def test_sealed_session_vector_decodes_on_both_sides(split):
    i, r = fixed_connection(Role.INITIATOR), fixed_connection(Role.RESPONDER)
    i.initiate()
    assert feed_connection(r, SESSION["message 1"], split if split != "trailing" else None) == []
    assert feed_connection(i, SESSION["message 2"], split if split != "trailing" else None) == []
    # the session starts in the same read as the confirmation (and message 3): events in order
    tail = b"" if split != "trailing" else SESSION["responder pong"][:10]
    ev_i = feed_connection(i, SESSION["confirmation"] + SESSION["responder pong"] + tail, split if split == 1 else None)
    ev_r = feed_connection(r, SESSION["message 3"] + SESSION["initiator ping"] + tail, split if split == 1 else None)
    assert isinstance(ev_i[0], HandshakeComplete) and ev_i[1:] == [Pong(nonce=7)]
    assert isinstance(ev_r[0], HandshakeComplete) and ev_r[1:] == [Ping(nonce=7)]
    assert i.state is State.ESTABLISHED and r.state is State.ESTABLISHED


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


def test_stream_id_rules_are_the_spec_table_s():
    """Section 3's "stream id" column is what the code enforces, both for the message classes
    (sending) and for frame headers (receiving); STREAM_REQUEST included (finding 16)."""
    from blocktrain.protocol import MESSAGES, MessageType
    from blocktrain.protocol.frames import parse_header

    rows = {r[1]: r[2] for r in tables("3. Message types and flags")}
    assert set(rows) == {t.name for t in MESSAGES}
    for mtype, cls in MESSAGES.items():
        want_stream = rows[mtype.name] == "not 0"
        assert rows[mtype.name] in ("0", "not 0") and cls.ON_STREAM is want_stream, mtype.name
        for sid in (0, 7):
            head = encode_header(mtype, 0, sid, 0)
            if (sid != 0) is want_stream:
                parse_header(head)
            else:
                with pytest.raises(Exception) as ei:
                    parse_header(head)
                assert ei.value.code is ErrorCode.MALFORMED_METADATA
    assert rows["STREAM_REQUEST"] == "not 0" and MessageType.STREAM_RESET.name in rows


def test_the_serving_vector_holds_a_spec_that_a_hop_accepts_and_bad_ones_it_refuses():
    """Section 7.3: the vector's spec passes a hop's checks; each rule of the checks refuses."""
    from blocktrain.blocks.decode import BadSpec, check_spec
    spec = VALID["pipeline_forward_exact"].meta["spec"]
    assert check_spec(spec, 64) == {**spec, "width": 1}  # no width: one draft chain per node (r6.8)
    wide = VALID["pipeline_forward_wide"].meta["spec"]
    assert check_spec(wide, 64) == wide
    drawn = VALID["pipeline_forward_drawn"].meta["spec"]
    assert check_spec(drawn, 64) == drawn  # r10: drawn drafts
    for bad in ({**spec, "start": 5}, {**spec, "keep": [1, 0]}, {**spec, "positions": [4, 5, 64]},
                {**spec, "parents": [-1, 2, 1]}, {**spec, "ids": [104, 105, 257]}, {**spec, "draft": 33},
                {**spec, "invariant": 1}, {**spec, "logits": []}, {**spec, "slots": [[0], [], []]},
                {**wide, "width": 0}, {**wide, "width": 5}, {**wide, "width": True},
                {**drawn, "sample": [1, 800]}, {**drawn, "sample": [-1, 800, 8]},
                {**drawn, "sample": [1 << 62, 800, 8]},
                {**drawn, "sample": [1, 0, 8]}, {**drawn, "sample": [1, 100_001, 8]}, {**drawn, "sample": [1, 800, 0]},
                {**drawn, "sample": [1, 800, 17]}, {**drawn, "sample": [1, 800.0, 8]}, {**drawn, "sample": 5},
                {**wide, "ids": [104] * 33, "positions": [4] * 33, "parents": [-1] * 33, "logits": list(range(33)),
                 "draft": 16}):  # 33 x 4 x 16 drafting steps: past the bound of 65 x 32
        with pytest.raises(BadSpec):
            check_spec(bad, 64)


def test_the_busy_refusal_vector_both_ways():
    """Section 7.3 (r11): a saturated hop's refusal is written as the vector says and read back as
    fault "busy"; a fault a client does not know reads as "hop"."""
    from blocktrain.p2p.serving.api import PipelineError, refusal, refusal_meta
    want = VALID["pipeline_result_busy"]
    e = PipelineError.from_meta(want.meta)
    assert (e.fault, e.hop, e.block) == ("busy", 2, 2)
    made = PipelineError(want.meta["error"], 2, 2, fault="busy")
    assert refusal(13, refusal_meta(made, 2, 2)) == want
    assert PipelineError.from_meta({**want.meta, "fault": "later"}).fault == "hop"
