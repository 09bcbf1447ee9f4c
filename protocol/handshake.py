"""Noise_XXpsk3_25519_AESGCM_SHA256, from ``cryptography`` primitives.

Rules:
- Rule 1: this is the Noise Protocol Framework (revision 34) XX pattern with a ``psk`` token at
  the end of message 3, DH 25519, cipher AES-256-GCM, hash SHA-256, exactly: the three messages
  interoperate with any other implementation of that name (tests check ``noiseprotocol``).
- Rule 2: X25519, AES-GCM, HMAC and SHA-256 come from ``cryptography``; this module only
  composes them as the Noise specification says (no home-made primitives).
- Rule 3: after message 3 both sides hold two CipherStates: initiator->responder and back.
  Nonces are 64-bit counters; a counter never wraps.
- Rule 4: every failure raises ``HandshakeError`` with an ErrorCode; nothing decrypted from a
  failed handshake is returned.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding, PrivateFormat, PublicFormat, NoEncryption

from .errors import ErrorCode, LocalProtocolError

PROTOCOL_NAME = b"Noise_XXpsk3_25519_AESGCM_SHA256"
HASHLEN = 32
DHLEN = 32
TAGLEN = 16
MAX_MESSAGE_BYTES = 65535  # Noise's own limit on a handshake message
MAX_NONCE = 2**64 - 1  # reserved by Noise; reaching it means rekey-or-close


class HandshakeError(LocalProtocolError):
    """The handshake failed; ``code`` says why (AUTHENTICATION_FAILED, PEER_NOT_ALLOWED, ...)."""


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def hkdf(ck: bytes, ikm: bytes, n: int) -> tuple[bytes, ...]:
    """Noise's HKDF (section 4.3): 2 or 3 outputs of HASHLEN bytes."""
    temp = _hmac(ck, ikm)
    out, prev = [], b""
    for i in range(1, n + 1):
        prev = _hmac(temp, prev + bytes([i]))
        out.append(prev)
    return tuple(out)


def _nonce(n: int) -> bytes:
    return n.to_bytes(12, "big")  # 32 zero bits, then the 64-bit counter, big-endian (Noise 5.1)


class CipherState:
    """AES-256-GCM with a 64-bit counter nonce (Noise section 5.1)."""

    __slots__ = ("_aead", "n", "key")

    def __init__(self, key: bytes | None = None):
        self.key = key
        self._aead = AESGCM(key) if key is not None else None
        self.n = 0

    @property
    def has_key(self) -> bool:
        return self._aead is not None

    def encrypt(self, ad: bytes, plaintext) -> bytes:
        if self._aead is None:
            return plaintext
        if self.n >= MAX_NONCE:
            raise LocalProtocolError("nonce space exhausted; reconnect", ErrorCode.DECRYPT_FAILED)
        ct = self._aead.encrypt(_nonce(self.n), plaintext, ad)
        self.n += 1
        return ct

    def seal_into(self, ad: bytes, parts: list, out: memoryview) -> memoryview:
        """Seal the concatenation of ``parts`` into ``out`` (plaintext length + TAGLEN bytes)."""
        if self.n >= MAX_NONCE:
            raise LocalProtocolError("nonce space exhausted; reconnect", ErrorCode.DECRYPT_FAILED)
        assert self.key is not None  # only a session's keyed states seal
        enc = Cipher(algorithms.AES(self.key), modes.GCM(_nonce(self.n))).encryptor()
        enc.authenticate_additional_data(ad)
        pos = 0
        for p in parts:
            # update_into wants len(p) + 15 bytes of room; the tag's 16 bytes at the end give it
            pos += enc.update_into(p, out[pos:pos + len(p) + 15])
        enc.finalize()
        out[pos:pos + TAGLEN] = enc.tag
        self.n += 1
        return out[:pos + TAGLEN]

    def decrypt_into(self, ad: bytes, ciphertext, out: memoryview) -> memoryview:
        """Open ``ciphertext`` into ``out`` (len(ciphertext) - TAGLEN bytes, not overlapping
        ``ciphertext``); returns the view."""
        if self.n >= MAX_NONCE:
            raise LocalProtocolError("nonce space exhausted; reconnect", ErrorCode.DECRYPT_FAILED)
        assert self._aead is not None  # only a session's keyed states open into a buffer
        try:
            self._aead.decrypt_into(_nonce(self.n), ciphertext, ad, out)
        except InvalidTag:
            raise LocalProtocolError("AEAD tag mismatch: frame tampered, reordered or replayed",
                                     ErrorCode.DECRYPT_FAILED) from None
        self.n += 1
        return out

    def decrypt(self, ad: bytes, ciphertext) -> bytes:
        if self._aead is None:
            return ciphertext
        if self.n >= MAX_NONCE:
            raise LocalProtocolError("nonce space exhausted; reconnect", ErrorCode.DECRYPT_FAILED)
        try:
            pt = self._aead.decrypt(_nonce(self.n), ciphertext, ad)
        except InvalidTag:
            raise LocalProtocolError("AEAD tag mismatch: frame tampered, reordered or replayed",
                                     ErrorCode.DECRYPT_FAILED) from None
        self.n += 1
        return pt


class SymmetricState:
    def __init__(self):
        h = PROTOCOL_NAME.ljust(HASHLEN, b"\0") if len(PROTOCOL_NAME) <= HASHLEN else hashlib.sha256(PROTOCOL_NAME).digest()
        self.h = h
        self.ck = h
        self.cs = CipherState()

    def mix_hash(self, data: bytes | memoryview):
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key(self, ikm: bytes):
        self.ck, k = hkdf(self.ck, ikm, 2)
        self.cs = CipherState(k)

    def mix_key_and_hash(self, ikm: bytes):
        self.ck, th, k = hkdf(self.ck, ikm, 3)
        self.mix_hash(th)
        self.cs = CipherState(k)

    def encrypt_and_hash(self, pt: bytes) -> bytes:
        ct = self.cs.encrypt(self.h, pt)
        self.mix_hash(ct)
        return ct

    def decrypt_and_hash(self, ct: bytes | memoryview) -> bytes:
        pt = self.cs.decrypt(self.h, ct)
        self.mix_hash(ct)
        return pt

    def split(self) -> tuple[CipherState, CipherState]:
        k1, k2 = hkdf(self.ck, b"", 2)
        return CipherState(k1), CipherState(k2)


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def peer_id_of(static_public: bytes) -> str:
    """A peer's id: hex sha256 of its 32-byte X25519 static public key."""
    return hashlib.sha256(static_public).hexdigest()


# Message patterns of XXpsk3 (Noise section 7.5 and 9).
PATTERN = (("e",), ("e", "ee", "s", "es"), ("s", "se", "psk"))


class NoiseHandshake:
    """One side of an XXpsk3 handshake: ``write_message`` / ``read_message`` in turn.

    ``ephemeral`` may be given for test vectors; otherwise a fresh key is generated.
    """

    def __init__(self, initiator: bool, static: X25519PrivateKey, psk: bytes, prologue: bytes = b"",
                 ephemeral: X25519PrivateKey | None = None):
        if len(psk) != 32:
            raise LocalProtocolError(f"pre-shared key must be 32 bytes, got {len(psk)}", ErrorCode.HANDSHAKE_FAILED)
        self.initiator = initiator
        self.s = static
        self.e = ephemeral
        self.psk = bytes(psk)
        self.rs: bytes | None = None
        self.re: bytes | None = None
        self.ss = SymmetricState()
        self.ss.mix_hash(prologue)
        self.index = 0  # next message pattern
        self.result: tuple[CipherState, CipherState] | None = None  # (send, receive)

    @property
    def complete(self) -> bool:
        return self.result is not None

    @property
    def my_turn(self) -> bool:
        return not self.complete and (self.index % 2 == 0) == self.initiator

    def _dh(self, priv: X25519PrivateKey | None, pub: bytes | None) -> bytes:
        # the pattern's tokens come after the "e"/"s" tokens that set the keys they use
        assert priv is not None and pub is not None
        try:
            return priv.exchange(X25519PublicKey.from_public_bytes(pub))
        except ValueError:  # low-order point: cryptography refuses an all-zero shared secret
            raise HandshakeError("invalid public key in handshake", ErrorCode.HANDSHAKE_FAILED) from None

    def _dh_token(self, tok: str):
        ss = self.ss
        if tok == "ee":
            ss.mix_key(self._dh(self.e, self.re))
        elif tok == "es":
            ss.mix_key(self._dh(self.e, self.rs) if self.initiator else self._dh(self.s, self.re))
        elif tok == "se":
            ss.mix_key(self._dh(self.s, self.re) if self.initiator else self._dh(self.e, self.rs))
        elif tok == "psk":
            ss.mix_key_and_hash(self.psk)

    def write_message(self, payload: bytes = b"") -> bytes:
        if not self.my_turn:
            raise LocalProtocolError("not our turn to write a handshake message", ErrorCode.UNEXPECTED_MESSAGE)
        out = bytearray()
        for tok in PATTERN[self.index]:
            if tok == "e":
                if self.e is None:
                    self.e = X25519PrivateKey.generate()
                pub = public_bytes(self.e)
                out += pub
                self.ss.mix_hash(pub)
                self.ss.mix_key(pub)  # psk modifier: "e" also mixes the key
            elif tok == "s":
                out += self.ss.encrypt_and_hash(public_bytes(self.s))
            else:
                self._dh_token(tok)
        out += self.ss.encrypt_and_hash(payload)
        if len(out) > MAX_MESSAGE_BYTES:
            raise LocalProtocolError("handshake message over 65535 bytes", ErrorCode.HANDSHAKE_FAILED)
        self._advance()
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        if self.complete or self.my_turn:
            raise HandshakeError("unexpected handshake message", ErrorCode.UNEXPECTED_MESSAGE)
        if len(message) > MAX_MESSAGE_BYTES:
            raise HandshakeError("handshake message over 65535 bytes", ErrorCode.HANDSHAKE_FAILED)
        msg = memoryview(message)
        pos = 0
        try:
            for tok in PATTERN[self.index]:
                if tok == "e":
                    if len(msg) - pos < DHLEN:
                        raise HandshakeError("truncated handshake message", ErrorCode.HANDSHAKE_FAILED)
                    self.re = bytes(msg[pos:pos + DHLEN])
                    pos += DHLEN
                    self.ss.mix_hash(self.re)
                    self.ss.mix_key(self.re)
                elif tok == "s":
                    n = DHLEN + (TAGLEN if self.ss.cs.has_key else 0)
                    if len(msg) - pos < n:
                        raise HandshakeError("truncated handshake message", ErrorCode.HANDSHAKE_FAILED)
                    self.rs = self.ss.decrypt_and_hash(msg[pos:pos + n])
                    pos += n
                else:
                    self._dh_token(tok)
            if self.ss.cs.has_key and len(msg) - pos < TAGLEN:
                raise HandshakeError("truncated handshake message", ErrorCode.HANDSHAKE_FAILED)
            payload = self.ss.decrypt_and_hash(msg[pos:])
        except HandshakeError:
            raise
        except LocalProtocolError:  # AEAD failure inside the handshake
            raise HandshakeError("handshake authentication failed: wrong swarm key, or the handshake was "
                                 "tampered with", ErrorCode.AUTHENTICATION_FAILED) from None
        self._advance()
        return payload

    def _advance(self):
        self.index += 1
        if self.index == len(PATTERN):
            c1, c2 = self.ss.split()
            self.result = (c1, c2) if self.initiator else (c2, c1)

    @property
    def handshake_hash(self) -> bytes:
        return self.ss.h

    @property
    def remote_static(self) -> bytes | None:
        return self.rs
