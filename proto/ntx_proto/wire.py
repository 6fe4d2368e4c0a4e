"""What the API's messages mean beyond their fields: the daemon writes by these rules and every
client reads by them.

Thread rule: constants and pure functions.
"""

from __future__ import annotations

# The trailing metadata key in which the daemon names the request field an INVALID_ARGUMENT is
# about ("max_tokens", "constraint.json_schema", "sampling.temperature").
FIELD_METADATA = "ntx-field"


def piece_text(piece: bytes) -> str:
    """A token's bytes as text, as OpenAI shows a token: its UTF-8 text, or where it is not whole
    UTF-8 (part of a character) "bytes:" and each byte escaped, "bytes:\\xe6\\x97"."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)
