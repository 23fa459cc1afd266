"""The deterministic stand-in for a model: what a token's KV holds, and which token a
request's KV makes it sample next.

The KV a token leaves in the cache is a function of the token and its position only,
so a prefill that computed a prompt and a decode instance that computes it locally write
the same bytes.  The next token is a digest of the request's whole KV so far: a load
that left any row wrong (zeros, another request's bytes, half a write) changes every
token after it.  So "the same output tokens as an undisturbed run" checks what matters,
whichever way the KV got there.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

BLOCK_SIZE = 32  # the CPU attention backend's multiple
NUM_KV_HEADS = 2
HEAD_SIZE = 32
#: blocks per prompt: 3 (96 tokens of 16 KiB each block) unless the bench asks for
#: larger transfers (``SHMHB_VLLM_PROMPT_BLOCKS``: 64 is 1 MiB, 1024 is 16 MiB)
PROMPT_BLOCKS = int(os.environ.get("SHMHB_VLLM_PROMPT_BLOCKS", "3"))
NUM_BLOCKS = max(24, 2 * PROMPT_BLOCKS + 8)
VOCAB = 256
FIRST_TOKEN = 3  # sampled tokens avoid the special ids 0-2 (EOS is 2)


def kv_rows(tokens: list[int], start: int) -> np.ndarray:
    """The KV rows (one per token: K and V, heads, head size) of ``tokens`` at
    positions ``start``, ``start + 1``, ..."""
    n = len(tokens)
    width = 2 * NUM_KV_HEADS * HEAD_SIZE
    tok = np.asarray(tokens, np.int64)[:, None]
    pos = np.arange(start, start + n, dtype=np.int64)[:, None]
    k = np.arange(width, dtype=np.int64)[None, :]
    v = ((tok * 131 + pos * 7 + k * 3) % 997).astype(np.float32) / np.float32(997) + np.float32(1)
    return v.reshape(n, 2, NUM_KV_HEADS, HEAD_SIZE)


def next_token(kv: np.ndarray) -> int:
    """The token a request whose KV so far is ``kv`` (rows, as ``kv_rows``) samples."""
    h = hashlib.sha256(np.ascontiguousarray(kv, np.float32).tobytes()).digest()
    return FIRST_TOKEN + int.from_bytes(h[:4], "little") % (VOCAB - FIRST_TOKEN)


def generate(prompt: list[int], n: int) -> list[int]:
    """The output of an undisturbed run: ``n`` tokens after ``prompt``."""
    kv = kv_rows(prompt, 0)
    out: list[int] = []
    for _ in range(n):
        t = next_token(kv)
        out.append(t)
        kv = np.concatenate([kv, kv_rows([t], len(kv))])
    return out


def prompt_for(seed: int) -> list[int]:
    """A prompt of PROMPT_BLOCKS full blocks, different per seed."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(FIRST_TOKEN, VOCAB, PROMPT_BLOCKS * BLOCK_SIZE)]
