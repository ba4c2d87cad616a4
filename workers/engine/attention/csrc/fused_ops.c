/* The decoder's elementwise ops for a bfloat16 model on the CPU, each in one pass over memory.
 *
 * The same ops as the model's plain PyTorch ones (model.TorchOps), with the same rounding steps:
 * math in float32 and a rounding to bfloat16 wherever PyTorch rounds (each bfloat16 op computes in
 * float32 and rounds its result). They differ from PyTorch only by the order of the RMS sum and
 * by the exp in SiLU. PyTorch runs each of these as three to six ops, each a pass over memory with
 * its own dispatch and type conversions: on a Zen 4 they took about 2.5 s of a 20 s benchmark.
 *
 * Plain C99 loops that the compiler vectorises; rows in parallel with OpenMP when there are
 * enough elements to pay for waking the threads (see paged_decode.c about PyTorch's threads).
 * All tensors contiguous except where a stride is passed.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"

#define PARALLEL_ELEMENTS 65536

static inline float widen(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* To nearest even, as PyTorch rounds; a NaN stays a (quiet) NaN. */
static inline uint16_t narrow(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return widen(narrow(f)); }

static inline float exp_clamped(float x) { return fast_exp(x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x); }

/* out = weight * RMSNorm(r) per row, where r = residual + x (rounded) is also written back to
 * residual; with residual NULL, r = x. Rows of `dim` elements. */
void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                       uint16_t *out, int rows, int dim, float eps) {
    _Pragma("omp parallel for if ((int64_t)rows * dim >= PARALLEL_ELEMENTS)")
    for (int row = 0; row < rows; row++) {
        const uint16_t *xr = x + (int64_t)row * dim;
        uint16_t *rr = residual ? residual + (int64_t)row * dim : NULL;
        uint16_t *o = out + (int64_t)row * dim;
        float squares = 0.0f;
        if (rr) {
            for (int i = 0; i < dim; i++) {
                const float r = round_bf16(widen(rr[i]) + widen(xr[i]));
                rr[i] = narrow(r);
                squares += r * r;
            }
        } else {
            for (int i = 0; i < dim; i++) squares += widen(xr[i]) * widen(xr[i]);
        }
        const uint16_t *src = rr ? rr : xr;
        const float inverse = 1.0f / sqrtf(squares / (float)dim + eps);
        for (int i = 0; i < dim; i++)
            o[i] = narrow(widen(weight[i]) * round_bf16(widen(src[i]) * inverse));
    }
}

/* Rotary embedding in place, "rotate half" layout: dimension i pairs with i + head_dim / 2.
 * qk: tokens x heads x head_dim, tokens token_stride elements apart, heads contiguous; cos and
 * sin: tokens x head_dim. */
void rope_bf16(uint16_t *qk, int64_t token_stride, int tokens, int heads, int head_dim,
               const uint16_t *cos, const uint16_t *sin) {
    const int half = head_dim / 2;
    _Pragma("omp parallel for if ((int64_t)tokens * heads * head_dim >= PARALLEL_ELEMENTS)")
    for (int t = 0; t < tokens; t++) {
        const uint16_t *c = cos + (int64_t)t * head_dim, *s = sin + (int64_t)t * head_dim;
        for (int h = 0; h < heads; h++) {
            uint16_t *v = qk + t * token_stride + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                const float a = widen(v[i]), b = widen(v[i + half]);
                /* x * cos + rotate_half(x) * sin, each product rounded, then the sum. */
                v[i] = narrow(round_bf16(a * widen(c[i])) + round_bf16(-b * widen(s[i])));
                v[i + half] = narrow(round_bf16(b * widen(c[i + half])) + round_bf16(a * widen(s[i + half])));
            }
        }
    }
}

/* out = silu(gate) * up per row of gate_up = [gate | up], each `inner` elements. */
void silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inner) {
    _Pragma("omp parallel for if ((int64_t)rows * inner >= PARALLEL_ELEMENTS)")
    for (int row = 0; row < rows; row++) {
        const uint16_t *g = gate_up + (int64_t)row * 2 * inner, *u = g + inner;
        uint16_t *o = out + (int64_t)row * inner;
        for (int i = 0; i < inner; i++) {
            const float x = widen(g[i]);
            o[i] = narrow(round_bf16(x / (1.0f + exp_clamped(-x))) * widen(u[i]));
        }
    }
}
