// GGUF types whose blocks are decoded a weight row at a time before their dot products: Q5_0
// and Q5_1 (32-element blocks, a fifth bit per weight in a 32-bit mask) and the K-quants Q4_K,
// Q5_K and Q6_K (256-element super-blocks of sub-blocks with their own scales). Included by
// kernels/gguf_linear.cpp inside its namespace, after QuantizedRows.
//
// A row is decoded into what the Q4/Q8 kernel reads from the file directly: unsigned bytes u
// (0-15, 0-31 or 0-63) and, for every 4 consecutive weights (one vpdpbusd lane), a scale D and
// an offset C with w = D * u + C. A K-quant's sub-blocks are 32 (Q4_K, Q5_K) or 16 (Q6_K)
// weights, so D and C are constant over a lane; a lane's offset term multiplies the lane's own
// sum of x's int8 values (QuantizedRows::lane_offset16), exact for sub-blocks of 16.
// Layouts (ggml-common.h, ggml-quants.c's dequantize_row_*):
//   Q5_0 (22 bytes): fp16 d, 32-bit qh, 16 bytes of nibbles;  w = d * (q - 16)
//   Q5_1 (24 bytes): fp16 d, fp16 m, 32-bit qh, 16 bytes;      w = d * q + m
//     element i < 16: low nibble of byte i, bit i of qh; element 16 + i: high nibble, bit 16 + i
//   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) x 8, 128 bytes of nibbles
//   Q5_K (176 bytes): Q4_K's, plus 32 bytes qh of fifth bits before the nibbles
//     64-weight chunk j: 32 low nibbles of bytes 32j.. (sub-block 2j), then their high nibbles
//     (sub-block 2j + 1); w = d * scale - dmin * min per sub-block of 32; Q5_K's fifth bit of
//     element l of chunk j is bit 2j of qh[l] (low half) or 2j + 1 (high half)
//   Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales (one
//     per 16 weights), fp16 d; w = d * scale * (q - 32)

//   troupe's own type 200, U8x16 (24 bytes): 16 bytes u, float32 D, float32 C; w = D * u + C.
//     Any of the types above, decoded (gguf_decode_rows), without loss: a fused projection whose
//     tensors mix them (llama.cpp's Q4_K_M: Q4_K q/k, Q6_K v) runs as one weight in this type.

enum { kQ5_0 = 6, kQ5_1 = 7, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kU8x16 = 200 };  // ggml's type ids, and troupe's

inline bool is_decoded_type(int type) {
    return type == kQ5_0 || type == kQ5_1 || type == kQ4_K || type == kQ5_K || type == kQ6_K || type == kU8x16;
}

inline int decoded_block_elements(int type) { return type == kQ5_0 || type == kQ5_1 ? 32 : type == kU8x16 ? 16 : 256; }

inline int decoded_block_bytes(int type) {
    switch (type) {
        case kQ5_0: return 22;
        case kQ5_1: return 24;
        case kQ4_K: return 144;
        case kQ5_K: return 176;
        case kQ6_K: return 210;
        case kU8x16: return 24;
        default: return 0;
    }
}

// bytes of a row of in_features weights, 0 where they are not whole blocks (K-quants: of 256)
inline int64_t decoded_row_bytes(int type, int64_t in_features) {
    const int elements = decoded_block_elements(type);
    return in_features % elements ? 0 : in_features / elements * decoded_block_bytes(type);
}

// a K-quant sub-block's 6-bit scale and min (ggml's get_scale_min_k4)
inline void scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// one block's u[elements], d4/c4[elements / 4]
inline void decode_block(int type, const uint8_t* b, uint8_t* u, float* d4, float* c4) {
    if (type == kU8x16) {
        float d, c;
        memcpy(u, b, 16);
        memcpy(&d, b + 16, 4);
        memcpy(&c, b + 20, 4);
        for (int i = 0; i < 4; i++) d4[i] = d, c4[i] = c;
    } else if (type == kQ5_0 || type == kQ5_1) {
        const float d = half_to_float(b), c = type == kQ5_1 ? half_to_float(b + 2) : -16.0f * d;
        const uint8_t* h = b + (type == kQ5_1 ? 4 : 2);
        const uint32_t qh = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
        const uint8_t* q = h + 4;
        for (int i = 0; i < 16; i++) {
            u[i] = (uint8_t)((q[i] & 0xf) | ((qh >> i) & 1) << 4);
            u[16 + i] = (uint8_t)((q[i] >> 4) | ((qh >> (16 + i)) & 1) << 4);
        }
        for (int i = 0; i < 8; i++) d4[i] = d, c4[i] = c;
    } else if (type == kQ4_K || type == kQ5_K) {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t* scales = b + 4;
        const uint8_t* qh = b + 16;
        const uint8_t* q = b + (type == kQ5_K ? 48 : 16);
        for (int j = 0; j < 4; j++) {
            for (int half = 0; half < 2; half++) {
                int scale, min;
                scale_min_k4(2 * j + half, scales, &scale, &min);
                float* lane_d = d4 + 16 * j + 8 * half;  // the sub-block's 8 lanes
                float* lane_c = c4 + 16 * j + 8 * half;
                for (int i = 0; i < 8; i++) lane_d[i] = d * (float)scale, lane_c[i] = -dmin * (float)min;
                for (int l = 0; l < 32; l++) {
                    int value = half ? q[32 * j + l] >> 4 : q[32 * j + l] & 0xf;
                    if (type == kQ5_K) value |= ((qh[l] >> (2 * j + half)) & 1) << 4;
                    u[64 * j + 32 * half + l] = (uint8_t)value;
                }
            }
        }
    } else {  // Q6_K
        const float d = half_to_float(b + 208);
        for (int n = 0; n < 2; n++) {
            const uint8_t* ql = b + 64 * n;
            const uint8_t* qh = b + 128 + 32 * n;
            const int8_t* scales = (const int8_t*)(b + 192 + 8 * n);
            uint8_t* out = u + 128 * n;
            for (int l = 0; l < 32; l++) {
                out[l] = (uint8_t)((ql[l] & 0xf) | ((qh[l] >> 0) & 3) << 4);
                out[l + 32] = (uint8_t)((ql[l + 32] & 0xf) | ((qh[l] >> 2) & 3) << 4);
                out[l + 64] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
                out[l + 96] = (uint8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
            }
            for (int s = 0; s < 8; s++)  // 16 weights a scale: 4 lanes
                for (int i = 0; i < 4; i++) {
                    d4[32 * n + 4 * s + i] = d * (float)scales[s];
                    c4[32 * n + 4 * s + i] = -32.0f * d * (float)scales[s];
                }
        }
    }
}

// A row of in_features weights decoded; u, d4 and c4 padded with zeros to `padded` weights.
inline void decode_row(int type, const uint8_t* row, int64_t in_features, int64_t padded, uint8_t* u, float* d4,
                       float* c4) {
    const int elements = decoded_block_elements(type), bytes = decoded_block_bytes(type);
    for (int64_t b = 0; b < in_features / elements; b++)
        decode_block(type, row + b * bytes, u + b * elements, d4 + b * elements / 4, c4 + b * elements / 4);
    memset(u + in_features, 0, padded - in_features);
    for (int64_t i = in_features / 4; i < padded / 4; i++) d4[i] = c4[i] = 0.0f;
}

inline void dequantize_decoded_row(int type, const uint8_t* row, int64_t in_features, float* out) {
    static thread_local std::vector<uint8_t> u;
    static thread_local std::vector<float> d4, c4;
    u.resize(in_features), d4.resize(in_features / 4), c4.resize(in_features / 4);
    decode_row(type, row, in_features, in_features, u.data(), d4.data(), c4.data());
    for (int64_t i = 0; i < in_features; i++) out[i] = d4[i / 4] * (float)u[i] + c4[i / 4];
}

#ifdef GGUF_VNNI
// A decoded row against R rows of x from first_row: per pair of x blocks, one vpdpbusd a row,
// its lanes scaled by x's dx and the weights' D, plus C times the lanes' x sums.
template <int R>
void dot_decoded_rows(const uint8_t* u, const float* d4, const float* c4, const QuantizedRows& x,
                      int64_t first_row, float* out) {
    const int64_t blocks = x.padded / kBlock, pairs = blocks / 2;
    __m512 acc[2][R];
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512i w = _mm512_loadu_si512(u + 64 * p);
        const __m512 wd = _mm512_loadu_ps(d4 + 16 * p), wc = _mm512_loadu_ps(c4 + 16 * p);
        for (int r = 0; r < R; r++) {
            const int64_t lane = ((first_row + r) * blocks + 2 * p) * 8;
            const __m512i sums = _mm512_dpbusd_epi32(
                _mm512_setzero_si512(), w, _mm512_loadu_si512(x.q.data() + (first_row + r) * x.padded + p * 64));
            const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_loadu_ps(x.scale16.data() + lane));
            acc[p & 1][r] = _mm512_fmadd_ps(wc, _mm512_loadu_ps(x.lane_offset16.data() + lane),
                                            _mm512_fmadd_ps(scaled, wd, acc[p & 1][r]));
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]));
}

// y = x @ W^T (+ bias) for a decoded type: threads split the weight rows, each decoded once for
// all of x's rows.
inline void decoded_linear_vnni(int type, const QuantizedRows& qx, int64_t rows, const uint8_t* weight,
                                int64_t row_bytes, int64_t in_features, int64_t out_features, const float* bias,
                                float* y, int64_t y_stride, int num_threads) {
    const int64_t padded = qx.padded;
#pragma omp parallel num_threads(num_threads) if (out_features >= 64)
    {
        std::vector<uint8_t> u(padded);
        std::vector<float> d4(padded / 4), c4(padded / 4);
        float out[kTileRows];
#pragma omp for schedule(static)
        for (int64_t j = 0; j < out_features; j++) {
            decode_row(type, weight + j * row_bytes, in_features, padded, u.data(), d4.data(), c4.data());
            for (int64_t r = 0; r < rows; r += kTileRows) {
                const int tile = rows - r < kTileRows ? (int)(rows - r) : kTileRows;
                if (tile == kTileRows) {
                    dot_decoded_rows<kTileRows>(u.data(), d4.data(), c4.data(), qx, r, out);
                } else {
                    for (int i = 0; i < tile; i++)
                        dot_decoded_rows<1>(u.data(), d4.data(), c4.data(), qx, r + i, out + i);
                }
                for (int i = 0; i < tile; i++) y[(r + i) * y_stride + j] = out[i] + (bias != nullptr ? bias[j] : 0.0f);
            }
        }
    }
}
#endif
