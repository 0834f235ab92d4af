// Vectors of 16 floats and the few operations on them that the CPU kernels share
// (cpu_kernels.cpp includes this file; see its header for the vector extensions).

#pragma once

#include <stdint.h>
#include <string.h>

namespace {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

inline vf load(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return x - vf{}; }  // x - 0 is x (0 + x would turn -0 into +0): a plain broadcast

// A vector's lanes folded with op by halving shuffles: 4 steps where a lane loop takes 15.
template <typename Op>
inline float fold(vf v, Op op) {
    v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

inline float max_of(vf v) { return fold(v, [](vf a, vf b) { return a > b ? a : b; }); }
inline float sum_of(vf v) { return fold(v, [](vf a, vf b) { return a + b; }); }

// exp(x) as 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial: a relative error of
// about 2e-7, as good as torch's exp. x is clamped to [-87, 88], where exp stays a normal float.
inline vf exp_clamped(vf x) {
    x = x < splat(-87.0f) ? splat(-87.0f) : x;
    x = x > splat(88.0f) ? splat(88.0f) : x;
    vf t = x * 1.44269504088896341f;
    vf n = (t + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23 drops the fraction
    vf f = t - n;
    vf p = splat(1.5353362e-4f);
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022650e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// Sixteen vectors in, one out whose lane t is the sum of d[t]'s lanes: a transpose folded
// into the adds, 15 shuffle pairs instead of 16 horizontal sums.
inline vf transpose_sum(const vf* d) {
    vf e[8], f[4], g[2];
    for (int k = 0; k < 8; k++)  // lanes 0-7: d[2k], lanes 8-15: d[2k+1]
        e[k] = __builtin_shufflevector(d[2 * k], d[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(d[2 * k], d[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int k = 0; k < 4; k++)  // lane quads: d[4k], d[4k+2], d[4k+1], d[4k+3]
        f[k] = __builtin_shufflevector(e[2 * k], e[2 * k + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + __builtin_shufflevector(e[2 * k], e[2 * k + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int k = 0; k < 2; k++)  // lane pairs: d[8k + 0, 4, 2, 6, 1, 5, 3, 7]
        g[k] = __builtin_shufflevector(f[2 * k], f[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + __builtin_shufflevector(f[2 * k], f[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    // lanes: d0 d8 d4 d12 d2 d10 d6 d14 d1 d9 d5 d13 d3 d11 d7 d15
    vf h = __builtin_shufflevector(g[0], g[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
         + __builtin_shufflevector(g[0], g[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    return __builtin_shufflevector(h, h, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

}  // namespace
