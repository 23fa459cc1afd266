"""What a wrapped decode adds to the transfer request it sends a prefill rank: one more
ZMQ frame after the ten SGLang 0.5.23's ``TransferInfo.from_zmq`` reads (a stock prefill
never looks at it), carrying the decode's incarnation, its go-ahead endpoint and the
token it gave that prefill rank (``shmhb.kv.fence``).  The frame is untrusted input on
the prefill: size-checked, parsed, validated, and ignored when it is anything else."""

from __future__ import annotations

import json

from ..kv.fence import Extra, parse_extra

MAGIC = b"shmhb1:"
#: a frame longer than this is not ours (the three fields take under 150 bytes)
MAX_FRAME = 512
#: the frames of a stock transfer request (room ... device indices)
STOCK_FRAMES = 10


def encode_extra(incarnation: int, fence: str, token: str) -> bytes:
    return MAGIC + json.dumps({"inc": incarnation, "fence": fence, "tok": token},
                              separators=(",", ":")).encode()


def decode_extra(msg: list[bytes]) -> Extra | None:
    """The shmhb frame of a transfer request, checked, or None (a stock decode's
    request, or anything malformed)."""
    if len(msg) <= STOCK_FRAMES:
        return None
    frame = msg[STOCK_FRAMES]
    if not isinstance(frame, bytes) or len(frame) > MAX_FRAME or not frame.startswith(MAGIC):
        return None
    try:
        v = json.loads(frame[len(MAGIC):])
    except (ValueError, UnicodeDecodeError):
        return None
    return parse_extra(v)
