"""An authenticated TCP channel between two holders of the pipeline's key: the links between
ranks (sockets.py) and the rendezvous store's connections (store.py) both run on it.

Handshake, connector C to acceptor A, key K (both nonces fresh, 16 bytes):

    C -> A   HELLO(magic, purpose, rank C) + nonce C
    A -> C   nonce A + MAC_K("accept" | purpose | nonce C | nonce A | ranks)
    C -> A   MAC_K("connect" | purpose | nonce A | nonce C | ranks)

Each side then derives one key per direction, MAC_K("frames" | purpose | direction | nonces |
ranks), and every frame after the handshake carries MAC(direction key, sequence number | header |
body), 16 bytes, the sequence number counting that direction's frames from 0. So a frame that
was forged, altered, replayed, reordered or dropped fails the next check: a relay that learnt an
address by other means can pass frames along but cannot change, inject or withhold one unseen
(the handshake alone proved the key once and nothing after it, which let a stranger in the
middle negate the activations it relayed). `purpose` keeps a store connection from being taken
for a link and back. The MAC is HMAC-SHA256 (OpenSSL: about 1.5 GB/s on one core, so a decode
step's frames cost microseconds: docs/benchmarks.md §14).

With encryption (`--link-encryption`, links only), the body travels as AES-256-GCM ciphertext
under the same direction keys, the sequence number as its nonce and the header as associated
data; the 16-byte tag takes the MAC's place, so a frame has the same size either way. Both ends
must agree: the choice is part of the handshake's proofs, so it cannot be stripped on the way.

Reading a frame never allocates more than the caller's limit for its tag before the header is
checked, and the body is delivered only once its MAC (or tag) is checked.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time
from typing import Callable, Optional

HELLO = struct.Struct("<4sBi")  # magic, purpose, the connecting rank
MAGIC = b"SPP2"
LINK, STORE = 1, 2  # purposes
ENCRYPTED = 0x80  # or-ed into a link's purpose when its bodies are encrypted
NONCE_BYTES, PROOF_BYTES, MAC_BYTES = 16, 32, 16
SEQ = struct.Struct("<Q")
HANDSHAKE_S = 5.0  # a connecting peer that has not proved itself by then is dropped


class ChannelError(RuntimeError):
    """The peer closed the channel, a read ran past its deadline, or a handshake failed."""


class BadFrame(ChannelError):
    """The peer (or someone between us) sent what no SpecPipe rank sends: a frame that fails its
    MAC, an unknown tag, an impossible length. The channel cannot be trusted from here on."""


class Sealer:
    """One direction of a channel: the MAC of each frame, in order."""

    def __init__(self, key: bytes) -> None:
        self._keyed, self.seq = hmac.new(key, digestmod="sha256"), 0  # copied per frame: no re-keying

    def mac(self, header: bytes, body) -> bytes:
        h = self._keyed.copy()
        h.update(SEQ.pack(self.seq))
        h.update(header)
        h.update(body)
        self.seq += 1
        return h.digest()[:MAC_BYTES]


class Cipher:
    """One direction of an encrypted channel: AES-256-GCM, the frame's sequence number as nonce."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.aead, self.seq = AESGCM(key), 0

    def _nonce(self) -> bytes:
        nonce = self.seq.to_bytes(12, "little")
        self.seq += 1
        return nonce

    def seal(self, header: bytes, body) -> bytes:
        return self.aead.encrypt(self._nonce(), bytes(body), header)  # ciphertext + 16-byte tag

    def open(self, header: bytes, data) -> Optional[bytes]:
        from cryptography.exceptions import InvalidTag

        try:
            return self.aead.decrypt(self._nonce(), bytes(data), header)
        except InvalidTag:
            return None


class Channel:
    """A connected socket after a completed handshake, with the two directions' sealers (or
    ciphers, on an encrypted link)."""

    def __init__(self, sock: socket.socket, peer: int, out, inbound) -> None:
        self.sock, self.peer, self.out, self.inbound = sock, peer, out, inbound
        self.encrypted = isinstance(out, Cipher)
        try:
            self.where = "%s:%d" % sock.getpeername()[:2]
        except OSError:
            self.where = "?"
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)

    def send_frame(self, header: bytes, body=b"", timeout_s: Optional[float] = None) -> None:
        """Header, body and MAC; one write when small (one packet), else the body unjoined."""
        body = memoryview(body).cast("B")
        self.sock.settimeout(timeout_s)
        if self.encrypted:
            self.sock.sendall(header + self.out.seal(header, body))
            return
        mac = self.out.mac(header, body)
        if body.nbytes <= 1 << 16:
            self.sock.sendall(header + body + mac)
        else:
            self.sock.sendall(header)
            self.sock.sendall(body)
            self.sock.sendall(mac)

    def read_header(self, size: int, deadline: Optional[float]) -> bytearray:
        return read_exact(self.sock, size, deadline)

    def read_body(self, header: bytes, into: memoryview, deadline: Optional[float]) -> None:
        """The body of the frame whose header was just read, into `into` (its exact size), and its
        MAC checked (or its ciphertext decrypted and its tag checked). `into` holds unchecked bytes
        until this returns."""
        if self.encrypted:
            sealed = read_exact(self.sock, into.nbytes + MAC_BYTES, deadline)
            plain = self.inbound.open(header, sealed)
            if plain is None:
                raise BadFrame(f"a frame from rank {self.peer} ({self.where}) fails its tag: altered, forged, "
                               "replayed or out of order on the way")
            into[:] = plain
            return
        read_into(self.sock, into, deadline)
        theirs = bytes(read_exact(self.sock, MAC_BYTES, deadline))
        if not hmac.compare_digest(theirs, self.inbound.mac(header, into)):
            raise BadFrame(f"a frame from rank {self.peer} ({self.where}) fails its MAC: altered, forged, "
                           "replayed or out of order on the way")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# -- the handshake ------------------------------------------------------------------------------
def _proof(key: bytes, label: bytes, purpose: int, first: bytes, second: bytes, lower: int, higher: int) -> bytes:
    return hmac.new(key, label + bytes([purpose]) + first + second + struct.pack("<ii", lower, higher),
                    hashlib.sha256).digest()


def _sealers(key: bytes, purpose: int, nonce_c: bytes, nonce_a: bytes, connector: int, acceptor: int,
             i_connected: bool) -> tuple:
    """(out, in): the connector's outbound key is the acceptor's inbound one."""
    def derive(direction: bytes) -> bytes:
        return _proof(key, b"frames" + direction, purpose, nonce_c, nonce_a, connector, acceptor)

    kind = Cipher if purpose & ENCRYPTED else Sealer
    c_to_a, a_to_c = kind(derive(b">")), kind(derive(b"<"))
    return (c_to_a, a_to_c) if i_connected else (a_to_c, c_to_a)


def introduce(sock: socket.socket, key: bytes, purpose: int, me: int, peer: int,
              timeout_s: float = HANDSHAKE_S) -> Channel:
    """The connecting side: say who we are, check the acceptor's proof, give ours."""
    deadline = time.monotonic() + timeout_s
    mine = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(timeout_s)
    sock.sendall(HELLO.pack(MAGIC, purpose, me) + mine)
    reply = read_exact(sock, NONCE_BYTES + PROOF_BYTES, deadline)
    theirs, proof = bytes(reply[:NONCE_BYTES]), bytes(reply[NONCE_BYTES:])
    if not hmac.compare_digest(proof, _proof(key, b"accept", purpose, mine, theirs, me, peer)):
        raise ChannelError(f"rank {peer} does not hold the pipeline's key")
    sock.sendall(_proof(key, b"connect", purpose, theirs, mine, me, peer))
    out, inbound = _sealers(key, purpose, mine, theirs, me, peer, True)
    return Channel(sock, peer, out, inbound)


def admit(sock: socket.socket, key: bytes, purpose: int, me: int, allowed: Callable[[int], bool],
          timeout_s: float = HANDSHAKE_S) -> Channel:
    """The accepting side: the channel of a connecting rank that `allowed` and that proved the
    key; ChannelError (saying why) for anything else, within `timeout_s` whatever the peer does."""
    deadline = time.monotonic() + timeout_s
    magic, got_purpose, peer = HELLO.unpack(read_exact(sock, HELLO.size, deadline))
    if magic != MAGIC or got_purpose & ~ENCRYPTED != purpose & ~ENCRYPTED:
        raise ChannelError("not a SpecPipe rank of this version")
    if got_purpose != purpose:
        said = "with" if got_purpose & ENCRYPTED else "without"
        raise ChannelError(f"rank {peer} was started {said} --link-encryption and this one was not: "
                           "every rank must agree")
    if not allowed(peer):
        raise ChannelError(f"claims rank {peer}, which is not expected here")
    theirs = bytes(read_exact(sock, NONCE_BYTES, deadline))
    mine = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.sendall(mine + _proof(key, b"accept", purpose, theirs, mine, peer, me))
    proof = bytes(read_exact(sock, PROOF_BYTES, deadline))
    if not hmac.compare_digest(proof, _proof(key, b"connect", purpose, mine, theirs, peer, me)):
        raise ChannelError(f"claims rank {peer} but does not hold the pipeline's key")
    out, inbound = _sealers(key, purpose, theirs, mine, peer, me, False)
    return Channel(sock, peer, out, inbound)


# -- reading exactly n bytes by a deadline -------------------------------------------------------
def read_into(s: socket.socket, buf: memoryview, deadline: Optional[float] = None) -> None:
    got = 0
    while got < buf.nbytes:
        s.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
        n = s.recv_into(buf[got:])
        if n == 0:
            raise ChannelError("connection closed by the peer")
        got += n


def read_exact(s: socket.socket, n: int, deadline: Optional[float] = None) -> bytearray:
    buf = bytearray(n)
    read_into(s, memoryview(buf), deadline)
    return buf
