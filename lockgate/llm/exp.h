/* e^x for x <= 0, shared by the runtime's attention kernels (`native.py` builds each source
   with this header beside it, and hashes it into the library's name). */

#ifndef LOCKGATE_EXP_H
#define LOCKGATE_EXP_H

#include <stdint.h>
#include <string.h>

/* e^x for the softmax, x <= 0 (a score less the largest): Cephes' expf, range-reduced by
   ln 2 and a degree-6 polynomial, within 2 ulp; no call, so the loop over it vectorises.
   Below -87 (under 1.7e-38, the least normal float) it gives e^-87, nothing against the
   largest score's 1. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
