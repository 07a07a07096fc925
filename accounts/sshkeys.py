"""SSH public keys from collaborators: a strict parser and the line the portal writes.

Every byte of an uploaded key is hostile: the portal writes keys into
``authorized_keys`` on machines where it is root. So the pipeline is deliberately
narrow, and every refusal says, in plain words, what went wrong and how to fix it:

1. refuse pasted *private* keys before anything else (the message never repeats them);
2. convert RFC 4716 (``---- BEGIN SSH2 PUBLIC KEY ----``) to one OpenSSH line;
3. exactly one line, no control characters, no non-breaking spaces;
4. nothing before the key type (no ``command=``, ``from=``, ``restrict`` …);
5. a type on the allowlist (DSA and certificates get their own explanations);
6. strict, canonical base64;
7. the blob's own structure (``accounts.sshwire``): inner type, nothing missing,
   nothing extra;
8. size policy, then ``cryptography`` loads it (FIDO ``sk-`` keys are checked
   structurally, because ``cryptography`` would silently turn them into plain keys).

The original blob is kept, so FIDO keys survive the round trip, and the
``authorized_keys`` line is always rebuilt from it: the user's text is never written
as-is. ``KeyRejected`` is the only exception ``parse_public_key`` raises.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography.hazmat.primitives.serialization import load_ssh_public_key

from accounts import sshmessages as msg
from accounts.sshwire import WireError, check_blob, read_inner_type
from tpus.remote import rules

# The hosts' list (best first): the portal accepts no type a worker would refuse.
ALLOWED_KEY_TYPES: tuple[str, ...] = rules.KEY_TYPES
SECURITY_KEY_TYPES = frozenset(t for t in ALLOWED_KEY_TYPES if t.startswith("sk-"))

RSA_MIN_BITS = 2048
RSA_MAX_BITS = 16384  # sshd's own ceiling (OpenSSL's OPENSSL_RSA_MAX_MODULUS_BITS)
COMMENT_MAX_LENGTH = 100
# A 16384-bit RSA key is under 3,000 characters; anything much longer is not a key.
MAX_INPUT_CHARS = 16 * 1024

RFC4716_BEGIN = "---- BEGIN SSH2 PUBLIC KEY ----"
RFC4716_END = "---- END SSH2 PUBLIC KEY ----"

# The bounded repeat keeps the search linear on hostile input such as "BEGIN" × 10⁶.
_PRIVATE_MARKERS = re.compile(
    r"BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY"  # OpenSSH, PEM RSA/EC/DSA, PKCS#8, SSH2, PGP
    r"|PuTTY-User-Key-File-"  # PuTTY .ppk, versions 2 and 3
    r"|Private-Lines:\s*\d"  # a .ppk pasted without its first line
    r"|b3BlbnNzaC1rZXktdjE",  # base64 of "openssh-key-v1", a body without its header
    re.IGNORECASE,
)
_PEM_PUBLIC = re.compile(r"-----BEGIN (RSA |EC )?PUBLIC KEY-----")
_FINGERPRINT = re.compile(r"(\d+ )?(SHA256|MD5):\S+( .*)?")
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_SAFE_TOKEN = re.compile(r"[A-Za-z0-9@._+-]{1,64}")
_PORTAL_COMMENT = re.compile(r"[A-Za-z0-9._@:+=/-]{0,100}")
# Characters that look like a space but make sshd read the line differently.
_NO_BREAK_SPACES = {"\u00a0": "U+00A0", "\u2007": "U+2007", "\u202f": "U+202F"}


class KeyRejected(ValueError):
    """A public key was refused. ``code`` is a stable slug for programs and tests;
    ``message`` is the explanation to show the person. Neither ever contains key
    material the person pasted."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"KeyRejected(code={self.code!r}, message={self.message!r})"


@dataclass(frozen=True)
class ParsedKey:
    """A public key that passed every check. ``blob_b64`` is the canonical base64 of
    the original blob; ``comment`` is the person's comment made safe for display
    (printable ASCII, at most ``COMMENT_MAX_LENGTH`` characters, possibly empty)."""

    key_type: str
    blob_b64: str
    bits: int
    comment: str
    fingerprint_sha256: str

    @property
    def blob(self) -> bytes:
        return base64.b64decode(self.blob_b64)

    @property
    def is_security_key(self) -> bool:
        return self.key_type in SECURITY_KEY_TYPES

    def authorized_keys_line(self, comment: str = "") -> str:
        """The ``authorized_keys`` line for this key: type, canonical base64 and a
        comment the *portal* chose (e.g. ``tpu-portal:42``). No options, no newline.
        The comment is a single token of safe characters, so the line always splits
        into at most three fields; anything else is a programming error."""
        if not _PORTAL_COMMENT.fullmatch(comment):
            raise ValueError("A portal comment is one token of letters, digits and ._@:+=/-")
        parts = [self.key_type, self.blob_b64] + ([comment] if comment else [])
        return " ".join(parts)


def fingerprint_sha256(blob: bytes) -> str:
    """The fingerprint exactly as ``ssh-keygen -lf`` prints it."""
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode("ascii")
    return "SHA256:" + digest.rstrip("=")


def _normalise_fingerprint(value: str) -> str:
    value = value.strip()
    value = value.removeprefix("SHA256:")
    return value.rstrip("=")


def ensure_not_admin_key(key: ParsedKey, admin_fingerprints: Iterable[str]) -> None:
    """Refuse the portal's own administration key(s), given by SHA256 fingerprint
    (with or without the ``SHA256:`` prefix and base64 padding). A collaborator who
    holds that key already holds root; uploading it is a mistake worth explaining."""
    own = _normalise_fingerprint(key.fingerprint_sha256)
    if any(_normalise_fingerprint(fp) == own for fp in admin_fingerprints):
        raise KeyRejected("admin_key", msg.ADMIN_KEY)


def clean_comment(raw: str) -> str:
    """A key comment made safe to show and store: accents folded to ASCII where
    possible, anything else dropped, whitespace collapsed, length capped."""
    folded = unicodedata.normalize("NFKD", raw).encode("ascii", "ignore").decode("ascii")
    printable = "".join(ch if 0x20 <= ord(ch) <= 0x7E else " " for ch in folded)
    return " ".join(printable.split())[:COMMENT_MAX_LENGTH].rstrip()


def decode_key_file(data: bytes) -> str:
    """Text of an uploaded key file. Handles UTF-8 (with or without a byte-order
    mark) and UTF-16 with a BOM, which Windows PowerShell writes with ``>``."""
    if len(data) > 4 * MAX_INPUT_CHARS:
        raise KeyRejected("too_long", msg.TOO_LONG)
    try:
        if data.startswith((b"\xff\xfe", b"\xfe\xff")):
            return data.decode("utf-16")
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise KeyRejected("not_text", msg.NOT_TEXT) from None


def parse_public_key(text: str) -> ParsedKey:
    """Parse one SSH public key as pasted or uploaded, or raise ``KeyRejected``."""
    # Private keys first, on the raw text, so no later step (or its message) ever
    # handles them.
    if _PRIVATE_MARKERS.search(text):
        raise KeyRejected("private_key", msg.PRIVATE_KEY)
    if len(text) > MAX_INPUT_CHARS:
        raise KeyRejected("too_long", msg.TOO_LONG)
    # Only harmless wrapping is forgiven: surrounding blank space, a final newline,
    # and the byte-order mark Windows editors put at the start of a file.
    text = text.removeprefix("\ufeff").strip(" \t\r\n")
    if not text:
        raise KeyRejected("empty", msg.EMPTY)
    if text.startswith("---- BEGIN SSH2"):
        text = _from_rfc4716(text)
    elif _PEM_PUBLIC.search(text):
        raise KeyRejected("pem_public_key", msg.PEM_PUBLIC_KEY)
    elif _FINGERPRINT.fullmatch(text):
        raise KeyRejected("fingerprint", msg.FINGERPRINT)
    _check_one_line(text)
    _check_characters(text)
    return _parse_line(text)


def _check_one_line(text: str) -> None:
    if "\n" not in text and "\r" not in text:
        return
    lines = [line.strip(" \t") for line in re.split(r"\r\n|\r|\n", text)]
    starts = sum(1 for line in lines if re.split(r"[ \t]+", line)[0] in _KNOWN_TYPE_NAMES)
    if starts > 1:
        raise KeyRejected("multiple_keys", msg.MULTIPLE_KEYS)
    raise KeyRejected("multiple_lines", msg.MULTIPLE_LINES)


def _check_characters(text: str) -> None:
    """Refuse control, format and no-break-space characters anywhere on the line.
    Other non-ASCII letters are judged per field later: fine in a comment, not in
    the key itself."""
    for position, char in enumerate(text, start=1):
        if char == "\t" or " " <= char <= "~":
            continue
        if char in _NO_BREAK_SPACES:
            raise KeyRejected("nbsp", msg.nbsp(_NO_BREAK_SPACES[char], position))
        if unicodedata.category(char)[0] == "C" or unicodedata.category(char) in {"Zl", "Zp"}:
            raise KeyRejected("control_character", msg.control_character(char, position))


def _from_rfc4716(text: str) -> str:
    """Convert an RFC 4716 public key to one OpenSSH line (``type base64 comment``),
    which then goes through the same checks as any pasted line."""
    lines = [line.rstrip(" \t") for line in re.split(r"\r\n|\r|\n", text)]
    for line in lines:
        _check_characters(line)
    if lines[0] != RFC4716_BEGIN:
        raise KeyRejected("bad_rfc4716", msg.RFC4716_BEGIN_LINE)
    try:
        end = lines.index(RFC4716_END)
    except ValueError:
        raise KeyRejected("bad_rfc4716", msg.RFC4716_NO_END) from None
    after = [line for line in lines[end + 1 :] if line]
    if after:
        code = "multiple_keys" if after[0].startswith("---- BEGIN") else "multiple_lines"
        raise KeyRejected(code, msg.MULTIPLE_KEYS if code == "multiple_keys" else msg.AFTER_END)

    comment, body, header, in_headers = "", [], "", True
    for line in lines[1:end]:
        if in_headers and (header or ":" in line):
            # A header ending in a backslash continues on the next line (RFC 4716 §3.3).
            header += line.removesuffix("\\")
            if line.endswith("\\"):
                continue
            tag, _, value = header.partition(":")
            header = ""
            tag = tag.strip().lower()
            if tag == "comment":
                comment = value.strip().removeprefix('"').removesuffix('"')
            elif tag == "x-command":
                # A forced command the portal would not honour: refuse rather than
                # grant more than the person meant to.
                raise KeyRejected("options", msg.RFC4716_COMMAND)
            continue
        in_headers = False
        if line:
            body.append(line)
    if header:
        raise KeyRejected("bad_rfc4716", msg.RFC4716_NO_END)
    b64 = "".join(body)
    if not b64:
        raise KeyRejected("missing_key_data", msg.MISSING_KEY_DATA)
    if not b64.isascii():
        raise KeyRejected("non_ascii", msg.non_ascii(_first_non_ascii(b64)))
    inner = read_inner_type(_decode_base64(b64))
    if inner is None:
        raise KeyRejected("invalid_key", msg.invalid_key(""))
    if not _looks_like_type(inner):
        raise KeyRejected("unsupported_type", msg.unsupported_type(inner, ALLOWED_KEY_TYPES))
    return f"{inner} {b64} {comment}".rstrip()


# Names worth recognising even though they are refused, so the message can say why.
_KNOWN_TYPE_NAMES = frozenset(
    ALLOWED_KEY_TYPES
    + ("ssh-dss", "ssh-xmss@openssh.com", "ssh-ed448", "x509v3-ssh-rsa", "x509v3-sign-rsa")
)


def _looks_like_type(token: str) -> bool:
    return (
        token in _KNOWN_TYPE_NAMES
        or token.endswith("-cert-v01@openssh.com")
        or (token.startswith(("ssh-", "ecdsa-sha2-", "sk-")) and bool(_SAFE_TOKEN.fullmatch(token)))
    )


def _parse_line(line: str) -> ParsedKey:
    fields = re.split(r"[ \t]+", line)
    if not _looks_like_type(fields[0]):
        _explain_first_field(fields)
    key_type = fields[0]
    _check_type(key_type)
    if len(fields) < 2:
        raise KeyRejected("missing_key_data", msg.MISSING_KEY_DATA)
    b64 = fields[1]
    if not b64.isascii():
        raise KeyRejected("non_ascii", msg.non_ascii(_first_non_ascii(b64)))
    _check_no_second_key(fields[2:])
    blob = _decode_base64(b64)
    try:
        facts = check_blob(key_type, blob)
    except WireError as error:
        if error.code == "type_mismatch":
            inner = read_inner_type(blob)
            inner = inner if inner in _KNOWN_TYPE_NAMES else None
            raise KeyRejected("type_mismatch", msg.type_mismatch(key_type, inner)) from None
        messages = {"truncated": msg.TRUNCATED, "trailing_data": msg.TRAILING_DATA}
        message = messages.get(error.code) or msg.invalid_key(error.detail)
        raise KeyRejected(error.code, message) from None

    if key_type == "ssh-rsa":
        _check_rsa(facts.bits, facts.rsa_e or 0, facts.rsa_n or 0)
    if key_type not in SECURITY_KEY_TYPES:
        try:
            load_ssh_public_key(f"{key_type} {b64}".encode("ascii"))
        except Exception:  # any failure in the loader means "not a key"
            raise KeyRejected("invalid_key", msg.invalid_key("")) from None

    return ParsedKey(
        key_type=key_type,
        blob_b64=b64,
        bits=facts.bits,
        comment=clean_comment(" ".join(fields[2:])),
        fingerprint_sha256=fingerprint_sha256(blob),
    )


def _explain_first_field(fields: list[str]) -> None:
    """The line does not start with a key type: say what it starts with instead."""
    type_at = next((i for i, f in enumerate(fields) if _looks_like_type(f)), None)
    if type_at is not None:
        prefix = " ".join(fields[:type_at])
        raise KeyRejected("options", msg.options(prefix, fields[type_at]))
    first = fields[0]
    if not first.isascii():
        raise KeyRejected("non_ascii", msg.non_ascii(_first_non_ascii(first)))
    if first.startswith("AAAA"):
        inner = read_inner_type(_decode_base64(first)) if _BASE64.fullmatch(first) else None
        inner = inner if inner in ALLOWED_KEY_TYPES else None
        raise KeyRejected("missing_type", msg.missing_type(inner))
    if "=" in first or first.split(",")[0].lower() in msg.OPTION_NAMES:
        raise KeyRejected("options", msg.options(first, None))
    if first.lower() in ALLOWED_KEY_TYPES:
        raise KeyRejected("unsupported_type", msg.unsupported_type(first, ALLOWED_KEY_TYPES))
    raise KeyRejected("not_a_key", msg.not_a_key(ALLOWED_KEY_TYPES))


def _check_type(key_type: str) -> None:
    if key_type == "ssh-dss":
        raise KeyRejected("dsa", msg.DSA)
    if key_type.endswith("-cert-v01@openssh.com"):
        raise KeyRejected("certificate", msg.CERTIFICATE)
    if key_type not in ALLOWED_KEY_TYPES:
        raise KeyRejected("unsupported_type", msg.unsupported_type(key_type, ALLOWED_KEY_TYPES))


def _check_no_second_key(comment_fields: list[str]) -> None:
    """Two keys joined onto one line (a textarea that lost its line break) would
    otherwise pass, with the second key silently read as a comment."""
    for this, following in zip(comment_fields, comment_fields[1:], strict=False):
        if _looks_like_type(this) and following.startswith("AAAA"):
            raise KeyRejected("multiple_keys", msg.MULTIPLE_KEYS)


def _decode_base64(b64: str) -> bytes:
    """Strict base64: only the standard alphabet, correct padding, and the canonical
    encoding of what it decodes to (so no stray '=' or '!' and no altered padding
    bits, which lenient decoders accept and silently ignore)."""
    if not _BASE64.fullmatch(b64):
        bad = next((c for c in b64 if not (c.isascii() and (c.isalnum() or c in "+/="))), "=")
        raise KeyRejected("bad_base64", msg.bad_base64_char(bad))
    if len(b64) % 4:
        raise KeyRejected("truncated", msg.BASE64_LENGTH)
    try:
        blob = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise KeyRejected("bad_base64", msg.BASE64_NOT_CANONICAL) from None
    if base64.b64encode(blob).decode("ascii") != b64:
        raise KeyRejected("bad_base64", msg.BASE64_NOT_CANONICAL)
    return blob


def _check_rsa(bits: int, e: int, n: int) -> None:
    if bits < RSA_MIN_BITS:
        raise KeyRejected("rsa_too_short", msg.rsa_too_short(bits))
    if bits > RSA_MAX_BITS:
        raise KeyRejected("rsa_too_long", msg.rsa_too_long(bits))
    # e = 65537 in every real key; tiny, even or enormous exponents mark a forged or
    # broken key (and OpenSSL refuses exponents over 64 bits for large moduli).
    if e < 3 or e % 2 == 0 or e.bit_length() > 64:
        raise KeyRejected("rsa_bad_exponent", msg.RSA_BAD_EXPONENT)
    if n % 2 == 0:
        raise KeyRejected("invalid_key", msg.invalid_key("an RSA modulus that is even"))


def _first_non_ascii(text: str) -> str:
    return next(c for c in text if not c.isascii())
