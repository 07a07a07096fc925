"""What the portal says when it refuses an SSH public key.

Kept apart from the parser so the wording can be read (and reviewed) in one place.
Messages may name a character by its code point or a key type from a known list,
but never echo free text from the paste: what someone pasted can be a private key,
and these messages end up in pages, API responses and logs.
"""

from __future__ import annotations

import re
import unicodedata

NEW_KEY = (
    'Make a new key on your own computer with: ssh-keygen -t ed25519 -C "you@laptop" '
    "and paste the contents of the .pub file it creates (for example ~/.ssh/id_ed25519.pub)."
)
COPY_AGAIN = "Copy the whole line again, straight from your .pub file."

# Every option sshd reads before the key type in authorized_keys.
OPTION_NAMES = frozenset(
    {
        "agent-forwarding",
        "cert-authority",
        "command",
        "environment",
        "expiry-time",
        "from",
        "no-agent-forwarding",
        "no-port-forwarding",
        "no-pty",
        "no-touch-required",
        "no-user-rc",
        "no-x11-forwarding",
        "permitlisten",
        "permitopen",
        "port-forwarding",
        "principals",
        "pty",
        "restrict",
        "tunnel",
        "user-rc",
        "verify-required",
        "x11-forwarding",
    }
)

_SAFE_TOKEN = re.compile(r"[A-Za-z0-9@._+-]{1,64}")


def _safe(token: str | None) -> str | None:
    """A token fit to repeat back to the person, or None."""
    return token if token and _SAFE_TOKEN.fullmatch(token) else None


PRIVATE_KEY = (
    "This is a PRIVATE key. Never paste or upload it anywhere: only its public half "
    "(the .pub file) belongs here. The portal has not stored it. Because it has left "
    "your computer, treat it as compromised: delete it, remove its public half from "
    "every server and service that accepts it, and make a new key. " + NEW_KEY
)
EMPTY = "Paste your SSH public key: one line that starts with ssh-ed25519 or similar."
TOO_LONG = (
    "This is far longer than any SSH public key. Paste just the one line from your .pub file."
)
NOT_TEXT = (
    "This file is not a text file, so it is not an SSH public key. Choose the file "
    "that ends in .pub (never the one without .pub: that is your private key)."
)
PEM_PUBLIC_KEY = (
    "This is a public key in PEM format (BEGIN PUBLIC KEY), not the OpenSSH format "
    "the portal needs. Convert it with: ssh-keygen -i -m PKCS8 -f key.pem "
    "and paste the line it prints."
)
FINGERPRINT = (
    "This is a key fingerprint, not the key itself. Paste the contents of your .pub "
    "file instead: one line that starts with ssh-ed25519 or similar."
)
MULTIPLE_KEYS = "This contains more than one key. Add your keys one at a time."
MULTIPLE_LINES = (
    "A public key is exactly one line, and this has several. If your key was wrapped "
    "across lines by an email or a terminal, join it back into one line. " + COPY_AGAIN
)
AFTER_END = "There is text after the END SSH2 PUBLIC KEY line. Paste only the one key."
RFC4716_BEGIN_LINE = (
    "This looks like an SSH2 (RFC 4716) key, but its first line is not exactly "
    "---- BEGIN SSH2 PUBLIC KEY ----. " + COPY_AGAIN.replace("line", "file")
)
RFC4716_NO_END = (
    "This SSH2 (RFC 4716) key has no ---- END SSH2 PUBLIC KEY ---- line, so part of "
    "it is missing. Copy the whole file again."
)
RFC4716_COMMAND = (
    "This SSH2 key carries a forced command (x-command). The portal does not accept "
    "restrictions on keys: remove that header, or make a separate key for this use. " + NEW_KEY
)
MISSING_KEY_DATA = (
    "The key data is missing: after the key type there should be a long run of "
    "letters and digits. " + COPY_AGAIN
)
DSA = (
    "DSA (ssh-dss) keys are no longer safe, and current OpenSSH no longer accepts them. " + NEW_KEY
)
CERTIFICATE = (
    "This is an SSH certificate, not a plain public key. The portal grants access "
    "itself, so upload the plain public key the certificate was made from (the .pub "
    "file without -cert in its name). " + NEW_KEY
)
TRUNCATED = "The key data is incomplete: part of it was cut off. " + COPY_AGAIN
TRAILING_DATA = (
    "The key data has extra bytes after the end of the key, so it has been altered. " + COPY_AGAIN
)
BASE64_LENGTH = (
    "The key data has the wrong length: it was probably cut off while copying, or "
    "the '=' signs at its end were removed. " + COPY_AGAIN
)
BASE64_NOT_CANONICAL = (
    "The key data has been altered: its last characters are not what any key "
    "generator writes. " + COPY_AGAIN
)
RSA_BAD_EXPONENT = (
    "This RSA key has an unusual public exponent that no key generator produces, so "
    "it cannot be trusted. " + NEW_KEY
)
ADMIN_KEY = (
    "This is the portal's own administration key, not a personal key. Upload the "
    "public key from your own computer instead. " + NEW_KEY
)
IN_USE = (
    "This key is already on another account in the portal. A key belongs to one "
    "person, so whoever holds it is who logs in: make a key of your own. " + NEW_KEY
)


def duplicate(name: str) -> str:
    return f"You already added this key (“{name}”). Each key needs adding only once."


def too_many_keys(limit: int) -> str:
    return (
        f"You already have {limit} keys, the most one account can hold. Delete one you "
        "no longer use first."
    )


LABEL_TOO_LONG = "A label can be at most 100 characters."


def nbsp(code_point: str, position: int) -> str:
    return (
        f"This key contains a non-breaking space ({code_point}) at character "
        f"{position}. Chat apps, web pages and word processors put these in place of "
        "ordinary spaces; sshd would not read the key. " + COPY_AGAIN
    )


def control_character(char: str, position: int) -> str:
    return (
        f"This key contains an invisible or control character (U+{ord(char):04X}) at "
        f"character {position}. A public key is plain text on one line. " + COPY_AGAIN
    )


def non_ascii(char: str) -> str:
    name = unicodedata.name(char, "")
    named = f"{char} (U+{ord(char):04X} {name})" if name else f"U+{ord(char):04X}"
    return (
        f"This key contains the character {named}, which cannot appear in a key "
        "type or key data. Word processors and some chat apps replace characters "
        "like this. " + COPY_AGAIN
    )


def options(prefix: str, key_type: str | None) -> str:
    names = sorted(
        {
            part.split("=", 1)[0].lower()
            for part in prefix.replace(" ", ",").split(",")
            if part.split("=", 1)[0].lower() in OPTION_NAMES
        }
    )
    before = f"before {_safe(key_type)}" if _safe(key_type) else "before the key type"
    if names:
        listed = ", ".join(n + ("=" if n in _VALUED else "") for n in names)
        return (
            f"This line starts with authorized_keys options ({listed}). The portal "
            f"sets up access itself and does not accept options: remove everything "
            f"{before} and paste the key again."
        )
    return (
        f"Something comes {before}. A public key starts with its type, such as "
        "ssh-ed25519. If you copied this from a known_hosts file, that is a server's "
        "key, not yours. " + COPY_AGAIN
    )


_VALUED = {
    "command",
    "environment",
    "expiry-time",
    "from",
    "permitlisten",
    "permitopen",
    "principals",
    "tunnel",
}


def missing_type(inner: str | None) -> str:
    start = f"with {inner}" if inner else "with its type, such as ssh-ed25519"
    return (
        "The key type is missing: this starts with the key data. A public key line "
        f"starts {start}, then the key data. " + COPY_AGAIN
    )


def unsupported_type(key_type: str, allowed: tuple[str, ...]) -> str:
    listed = ", ".join(allowed)
    if key_type.lower() in allowed and key_type != key_type.lower():
        return f"Key types are lowercase: write {key_type.lower()}."
    shown = _safe(key_type)
    named = f"{shown} keys are" if shown else "This key type is"
    return f"{named} not accepted. The portal accepts {listed}. " + NEW_KEY


def not_a_key(allowed: tuple[str, ...]) -> str:
    return (
        "This does not look like an SSH public key. A public key is one line that "
        f"starts with its type ({', '.join(allowed)}), then the key data, then an "
        "optional comment. " + NEW_KEY
    )


def type_mismatch(stated: str, inner: str | None) -> str:
    holds = f"an {inner} key" if inner else "a different kind of key"
    return (
        f"The line says {stated}, but the key data holds {holds}. The type and the "
        "data were probably copied from different keys. " + COPY_AGAIN
    )


def bad_base64_char(char: str) -> str:
    if char == "=":
        where = "an '=' in the middle"
    elif " " < char <= "~":
        where = f"the character {char!r}"
    else:
        where = f"the character U+{ord(char):04X}"
    return (
        f"The key data contains {where}, which cannot appear in a key. It was "
        "probably changed while copying. " + COPY_AGAIN
    )


def invalid_key(detail: str) -> str:
    because = f" (it contains {detail})" if detail else ""
    return (
        f"This is not a valid public key{because}. It was probably damaged while "
        "copying. " + COPY_AGAIN
    )


def rsa_too_short(bits: int) -> str:
    return (
        f"This RSA key has only {bits} bits; the portal needs at least 2048, and 3072 "
        "is the current recommendation. An Ed25519 key is shorter and stronger still. " + NEW_KEY
    )


def rsa_too_long(bits: int) -> str:
    return f"This RSA key has {bits} bits, more than the 16384 that OpenSSH accepts. " + NEW_KEY
