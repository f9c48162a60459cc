"""What this machine's CPU computes natively, for choices made at load.

Matrix products in bfloat16 run on dedicated instructions only where the CPU has them
(x86: AVX512-BF16 or AMX-BF16; ARM: the BF16 extension). Elsewhere torch emulates them in
float32 through conversions, and a bfloat16 product takes about two to three times as long
as the same product in float32: on a 2-core AVX-512 Xeon without BF16, a 200-token prompt
of SmolLM2-135M took 930 ms to prefill in bfloat16 and 370 ms in float32.
"""

from __future__ import annotations

import functools
from pathlib import Path

_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@functools.cache
def native_bfloat16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU multiplies bfloat16 natively (its flags, from /proc/cpuinfo). Where
    the file cannot be read, True: bfloat16 is then the usual choice, as before."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return True
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return bool(_BF16_FLAGS.intersection(value.split()))
    return True
