"""The SSH wire format of public key blobs (RFC 4251 §5), read strictly.

``accounts.sshkeys`` is the public door; this module only knows how to take a decoded
blob apart and check that its structure is exactly what OpenSSH would write for the
stated type: every field present, nothing left over, integers in canonical form, EC
points uncompressed. Failures raise ``WireError`` carrying a stable code; the caller
turns it into a friendly message.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric import ec


class WireError(ValueError):
    """A blob is not a well-formed key of its stated type. ``code`` is one of
    ``truncated``, ``trailing_data``, ``type_mismatch`` or ``invalid_key``."""

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(code)
        self.code = code
        # Only ever built from constants or from values this module validated.
        self.detail = detail


@dataclass(frozen=True)
class KeyFacts:
    """What the structural check learned about a blob."""

    inner_type: str
    bits: int
    rsa_e: int | None = None
    rsa_n: int | None = None


class _Reader:
    """Reads RFC 4251 ``string`` and ``mpint`` fields from a byte buffer."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def string(self) -> bytes:
        if len(self.data) - self.pos < 4:
            raise WireError("truncated")
        length = int.from_bytes(self.data[self.pos : self.pos + 4], "big")
        self.pos += 4
        if length > len(self.data) - self.pos:
            raise WireError("truncated")
        value = self.data[self.pos : self.pos + length]
        self.pos += length
        return value

    def mpint(self) -> int:
        raw = self.string()
        if not raw:
            return 0
        # Canonical mpints are positive and carry a leading zero byte only when the
        # high bit would otherwise make them look negative; anything else is a blob
        # that no key generator writes.
        if raw[0] & 0x80:
            raise WireError("invalid_key", "a negative number")
        if raw[0] == 0 and (len(raw) == 1 or not raw[1] & 0x80):
            raise WireError("invalid_key", "a number with a needless leading zero")
        return int.from_bytes(raw, "big")

    def done(self) -> None:
        if self.pos != len(self.data):
            raise WireError("trailing_data")


_EC_CURVES: dict[str, tuple[ec.EllipticCurve, int]] = {
    # curve name in the blob: (curve, bits)
    "nistp256": (ec.SECP256R1(), 256),
    "nistp384": (ec.SECP384R1(), 384),
    "nistp521": (ec.SECP521R1(), 521),
}

# The longest FIDO application string we keep; OpenSSH writes "ssh:" plus a short
# user-chosen suffix, so this is generous.
MAX_SK_APPLICATION = 256


def read_inner_type(blob: bytes) -> str | None:
    """The key type named inside a blob, when it is short printable ASCII; else None.
    Used to say *which* type a mismatched blob holds, and to convert RFC 4716 keys."""
    try:
        raw = _Reader(blob).string()
    except WireError:
        return None
    if not 0 < len(raw) <= 64 or not all(0x21 <= b <= 0x7E for b in raw):
        return None
    return raw.decode("ascii")


def check_blob(stated_type: str, blob: bytes) -> KeyFacts:
    """Check that ``blob`` is exactly a ``stated_type`` key (a type on the allowlist)
    and return its size. Does not call into OpenSSL; the caller loads the key with
    ``cryptography`` afterwards for the types it understands."""
    reader = _Reader(blob)
    inner = reader.string()
    if inner != stated_type.encode("ascii"):
        raise WireError("type_mismatch")
    if stated_type == "ssh-ed25519":
        facts = _ed25519(reader, stated_type)
    elif stated_type == "sk-ssh-ed25519@openssh.com":
        facts = _ed25519(reader, stated_type)
        _sk_application(reader)
    elif stated_type.startswith("ecdsa-sha2-"):
        facts = _ecdsa(reader, stated_type, stated_type.removeprefix("ecdsa-sha2-"))
    elif stated_type == "sk-ecdsa-sha2-nistp256@openssh.com":
        facts = _ecdsa(reader, stated_type, "nistp256")
        _sk_application(reader)
    elif stated_type == "ssh-rsa":
        e = reader.mpint()
        n = reader.mpint()
        facts = KeyFacts(stated_type, n.bit_length(), rsa_e=e, rsa_n=n)
    else:  # pragma: no cover - the caller checks the allowlist first
        raise WireError("invalid_key", "an unknown type")
    reader.done()
    return facts


def _ed25519(reader: _Reader, key_type: str) -> KeyFacts:
    if len(reader.string()) != 32:
        raise WireError("invalid_key", "an Ed25519 key that is not 32 bytes long")
    return KeyFacts(key_type, 256)


def _ecdsa(reader: _Reader, key_type: str, expected_curve: str) -> KeyFacts:
    curve_name = reader.string()
    if curve_name != expected_curve.encode("ascii"):
        raise WireError("invalid_key", "a curve name that does not match the key type")
    curve, bits = _EC_CURVES[expected_curve]
    point = reader.string()
    # OpenSSH only reads uncompressed points (0x04 || X || Y).
    if len(point) != 1 + 2 * ((bits + 7) // 8) or point[0] != 0x04:
        raise WireError("invalid_key", "an elliptic-curve point in the wrong format")
    try:
        ec.EllipticCurvePublicKey.from_encoded_point(curve, point)
    except ValueError:
        raise WireError("invalid_key", "a point that is not on the curve") from None
    return KeyFacts(key_type, bits)


def _sk_application(reader: _Reader) -> None:
    """FIDO keys end with the application (relying party) string, e.g. ``ssh:``."""
    app = reader.string()
    if not 0 < len(app) <= MAX_SK_APPLICATION or not all(0x20 <= b <= 0x7E for b in app):
        raise WireError("invalid_key", "a security-key application name that is not plain text")
