"""``bt-bench codec``: in-process encode+decode throughput of the wire protocol.

Every ratio compares figures measured in the same run, interleaved, so a noisy machine moves
both sides alike. Each figure is the median of ``repeats`` timed runs.
"""

from __future__ import annotations

import os
import statistics
import time

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from blocktrain.p2p.transport import make_connection
from blocktrain.protocol import NEED_DATA, Ping, Role, StreamChunk

from .report import verdict


def _pair(seal: bool):
    psk = os.urandom(32)
    a = make_connection(Role.INITIATOR, X25519PrivateKey.generate(), psk, seal=seal)
    b = make_connection(Role.RESPONDER, X25519PrivateKey.generate(), psk, seal=seal)
    b.receive_data(a.initiate())
    b.next_event()
    a.receive_data(b.data_to_send())
    a.next_event()
    b.receive_data(a.data_to_send())
    b.next_event()
    a.receive_data(b.data_to_send())
    assert a.next_event() is not NEED_DATA
    return a, b


def _median_time(fn, repeats: int, inner: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _large_payload_arms(data: bytes, pairs: dict) -> dict:
    """The four arms on one large payload, each a function moving it once: memcpy, plaintext and
    sealed encode+decode through ``pairs``' two Connections, raw AES-256-GCM encrypt+decrypt."""
    chunk_bytes = len(data)
    dst_view = memoryview(bytearray(chunk_bytes))

    def memcpy():
        dst_view[:] = data

    key = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    ct_buf = memoryview(bytearray(chunk_bytes + 16))
    pt_buf = memoryview(bytearray(chunk_bytes))

    def raw_aes():  # the best raw AES-GCM can do here: one-shot, into reused buffers
        key.encrypt_into(nonce, data, b"h" * 18, ct_buf)
        key.decrypt_into(nonce, ct_buf, b"h" * 18, pt_buf)

    def codec(kind):
        a, b = pairs[kind]

        def go():
            for buf in a.send_buffers(StreamChunk(offset=0, data=data, stream_id=1)):
                b.receive_data(buf)
            m = b.next_event()  # parsed, verified (and opened): m.data is the decoded payload
            assert len(m.data) == chunk_bytes
        return go

    return {"memcpy": memcpy, "plain": codec("plain"), "raw_aes": raw_aes, "sealed": codec("sealed")}


def _interleaved_medians(fns: dict, repeats: int, inner: int, progress=None) -> dict:
    """Each arm's median seconds, the arms measured in turn every repeat, so that load on the
    machine hits all of them alike."""
    results: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm up
    for r in range(repeats):
        for k, fn in fns.items():
            results[k].append(_median_time(fn, 1, inner))
        if progress:
            progress(r + 1, repeats)
    return {k: statistics.median(v) for k, v in results.items()}


def _small_frames_per_s(a, b, repeats: int, small_frames: int) -> float:
    """Median rate of Ping frames encoded by ``a`` and decoded by ``b``."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        wire = b"".join(a.send(Ping(nonce=i)) for i in range(small_frames))
        b.receive_data(wire)
        n = 0
        while b.next_event() is not NEED_DATA:
            n += 1
        rates.append(small_frames / (time.perf_counter() - t0))
        assert n == small_frames
    return statistics.median(rates)


def run(chunk_bytes: int = 4 * 1024 * 1024, repeats: int = 7, inner: int = 10, small_frames: int = 20000,
        progress=None) -> dict:
    data = os.urandom(chunk_bytes)
    pairs = {"plain": _pair(False), "sealed": _pair(True)}
    med = _interleaved_medians(_large_payload_arms(data, pairs), repeats, inner, progress)
    gbps = {k: chunk_bytes / v / 1e9 for k, v in med.items()}
    small = {kind: _small_frames_per_s(*pairs[kind], repeats, small_frames) for kind in ("plain", "sealed")}
    return {
        "benchmark": "codec",
        "what": ("encode+decode of one StreamChunk message of chunk_bytes random bytes through two in-process "
                 "Connections (encode: frame + optional seal; decode: parse, verify, open; the payload crosses "
                 "as separate buffers, so decode copies it once into the frame assembly buffer), against memcpy of the same bytes and raw AES-256-GCM "
                 "encrypt+decrypt of them; small frames: Ping encoded and decoded, per second"),
        "chunk_bytes": chunk_bytes, "repeats": repeats, "inner": inner,
        "median_seconds": med,
        "throughput_gbps": gbps,
        "ratios": {
            "plain_vs_memcpy": gbps["plain"] / gbps["memcpy"],
            "sealed_vs_raw_aes_gcm": gbps["sealed"] / gbps["raw_aes"],
        },
        "small_frames_per_s": small,
        "targets": {
            "plain_vs_memcpy": 0.5, "sealed_vs_raw_aes_gcm": 0.6, "small_frames_per_s": 100_000,
        },
        "met": {
            "plain_vs_memcpy": gbps["plain"] / gbps["memcpy"] >= 0.5,
            "sealed_vs_raw_aes_gcm": gbps["sealed"] / gbps["raw_aes"] >= 0.6,
            "small_frames_plain": small["plain"] >= 100_000,
            "small_frames_sealed": small["sealed"] >= 100_000,
        },
    }


def rows(r: dict) -> list[tuple[str, str]]:
    """``bt-bench codec``'s report of ``run``'s result: (figure, value) rows."""
    g, q, s, met = r["throughput_gbps"], r["ratios"], r["small_frames_per_s"], r["met"]
    return [
        ("memcpy", f"{g['memcpy']:.2f} GB/s"),
        ("plaintext encode+decode", f"{g['plain']:.2f} GB/s  ({q['plain_vs_memcpy']:.0%} of memcpy, target 50%: "
                                    f"{verdict(met['plain_vs_memcpy'])})"),
        ("raw AES-256-GCM enc+dec", f"{g['raw_aes']:.2f} GB/s"),
        ("sealed encode+decode", f"{g['sealed']:.2f} GB/s  ({q['sealed_vs_raw_aes_gcm']:.0%} of raw AES-GCM, "
                                 f"target 60%: {verdict(met['sealed_vs_raw_aes_gcm'])})"),
        ("small frames, plaintext", f"{s['plain']:,.0f} /s  (target 100,000: {verdict(met['small_frames_plain'])})"),
        ("small frames, sealed", f"{s['sealed']:,.0f} /s  (target 100,000: {verdict(met['small_frames_sealed'])})"),
    ]
