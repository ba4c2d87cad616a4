/* e^x in plain float arithmetic, so that the loops around it vectorise (libm's expf stops the
 * compiler): Cody-Waite range reduction and Cephes' polynomial, within 2 ulp for x in
 * [-87, 88], which callers clamp to (e^-87 is 1.6e-38, as good as 0 next to a softmax's peak). */
#ifndef FAST_EXP_H
#define FAST_EXP_H

#include <math.h>
#include <stdint.h>

static inline float fast_exp(float x) {
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    /* Fused multiply-adds: written as plain arithmetic, -fassociative-math may reorder the two
     * steps and lose the reduction's extra precision. */
    const float r = fmaf(n, 2.12194440e-4f, fmaf(-n, 0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const union { int32_t bits; float value; } two_to_n = { .bits = ((int32_t)n + 127) << 23 };
    return p * two_to_n.value;
}

#endif
