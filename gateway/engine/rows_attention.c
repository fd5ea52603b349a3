/* Attention of a batch's decode rows whose KV lies in segments (gateway/engine/rows_kv.py).
 *
 * A row's keys are the concatenation of its segments, in order: a segment is a run of tokens held in
 * one array per layer, token t of KV head h at base + h * head_stride + t * head_dim (a prompt's own
 * cache buffer, a block of the decode's tail). Every segment but a row's last holds exactly `size`
 * tokens; the last may have room beyond the row's length. Rows own nothing here: the caller keeps the
 * arrays alive and lays out, per layer, one table of segments for all rows (row r's segments are
 * seg_first[r] .. seg_first[r + 1] - 1).
 *
 * Each call first writes the step's new keys and values of each row (L tokens, new_k / new_v:
 * (rows, kv_heads, L, head_dim), contiguous) at the row's positions length[r] .. length[r] + L - 1,
 * then attends: query j of the row sees keys [0, length[r] + j] (causal among the new tokens, as
 * drafts being verified need). q and out are (rows, heads, L, head_dim), contiguous. Each row's keys
 * and values are read once per query head of the group that shares them (grouped-query attention):
 * the scores of all its L x group queries come out of one pass over its keys. Softmax in base 2: q is
 * scaled by scale * log2(e).
 *
 * Built at first use with the machine's C compiler (decode_kernel.py's flags: AVX2 and FMA where this
 * CPU reports them). */
#include <math.h>
#include <stddef.h>
#include <string.h>

/* 2^x for x <= 0 (x below -126 gives 0, as does -inf), as in decode_attention.c: the nearest integer
 * goes into the float's exponent bits, 2^f for the rest through Cephes' exp2f polynomial. */
static inline float exp2_nonpositive(float x)
{
    float clamped = x < -126.0f ? -126.0f : x;
    float whole = floorf(clamped + 0.5f);
    float f = clamped - whole;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union { unsigned int bits; float value; } scale = { .bits = (unsigned int)((int)whole + 127) << 23 };
    return x < -126.0f ? 0.0f : p * scale.value;
}

/* The step's new tokens of one row, KV head `kv`, written into the segments that hold their positions. */
static void write_new(const float *new_k, const float *new_v, long L, long head_dim, long kv, long length, const long *k_base, const long *v_base, const long *k_stride,
                      const long *v_stride, const long *size, long first, long last)
{
    long start = 0; /* first token of segment s */
    long s = first;
    for (long j = 0; j < L; j++) {
        long position = length + j;
        while (s < last && position >= start + size[s]) {
            start += size[s];
            s++;
        }
        if (s == last)
            return; /* no room: the caller's make_room() broke its promise; nothing written past the table */
        float *k = (float *)k_base[s] + kv * k_stride[s] + (position - start) * head_dim;
        float *v = (float *)v_base[s] + kv * v_stride[s] + (position - start) * head_dim;
        memcpy(k, new_k + (kv * L + j) * head_dim, head_dim * sizeof(float));
        memcpy(v, new_v + (kv * L + j) * head_dim, head_dim * sizeof(float));
    }
}

/* One (row, KV head): its L x group queries (qg: query j of group head g at (g * L + j) * head_dim,
 * as (heads, L) lay out within the KV head's group) over the row's num_keys keys, with head_dim / 8
 * = `blocks` 8-float vectors (GCC's and clang's vector extensions: one AVX register where the CPU has
 * AVX; `blocks` a constant where inlined, so an output line stays in registers while the values
 * stream past). scores: scratch of L * group * num_keys floats. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define MAX_BLOCKS 32

static inline __attribute__((always_inline)) float sum8(v8 x)
{
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

static inline __attribute__((always_inline)) void attend_row(
    const float *restrict qg, long L, long group, const long blocks, long num_keys, long length,
    const long *k_base, const long *v_base, const long *k_stride, const long *v_stride, const long *size,
    long first, long last, long kv, float scale_log2e, float *restrict scores, float *restrict og)
{
    const long head_dim = blocks * 8, lines = group * L;
    long t = 0;
    for (long s = first; s < last && t < num_keys; s++) {
        const float *k = (const float *)k_base[s] + kv * k_stride[s];
        long count = size[s] < num_keys - t ? size[s] : num_keys - t;
        for (long i = 0; i < count; i++, t++) {
            const v8 *kt = (const v8 *)(k + i * head_dim);
            for (long line = 0; line < lines; line++) {
                /* line = g * L + j: query j sees keys up to its own position length + j (only the
                 * step's new keys past `length` are hidden from some) */
                if (t > length && t > length + line % L) {
                    scores[line * num_keys + t] = -INFINITY;
                    continue;
                }
                const v8 *qh = (const v8 *)(qg + line * head_dim);
                v8 acc = qh[0] * kt[0];
                for (long b = 1; b < blocks; b++)
                    acc += qh[b] * kt[b];
                scores[line * num_keys + t] = sum8(acc) * scale_log2e;
            }
        }
    }
    for (long line = 0; line < lines; line++) {
        float *sc = scores + line * num_keys;
        float top = -INFINITY;
        for (long i = 0; i < num_keys; i++)
            top = sc[i] > top ? sc[i] : top;
        float total = 0.0f;
        for (long i = 0; i < num_keys; i++) {
            sc[i] = exp2_nonpositive(sc[i] - top);
            total += sc[i];
        }
        v8 acc[MAX_BLOCKS];
        for (long b = 0; b < blocks; b++)
            acc[b] = (v8){0};
        long u = 0;
        for (long s = first; s < last && u < num_keys; s++) {
            const float *v = (const float *)v_base[s] + kv * v_stride[s];
            long count = size[s] < num_keys - u ? size[s] : num_keys - u;
            for (long i = 0; i < count; i++, u++) {
                const v8 *vt = (const v8 *)(v + i * head_dim);
                float weight = sc[u];
                for (long b = 0; b < blocks; b++)
                    acc[b] += weight * vt[b];
            }
        }
        v8 *o = (v8 *)(og + line * head_dim);
        float inverse = 1.0f / total;
        for (long b = 0; b < blocks; b++)
            o[b] = acc[b] * inverse;
    }
}

void rows_attention(const float *restrict q, const float *restrict new_k, const float *restrict new_v,
                    const long *restrict seg_first, const long *restrict k_base, const long *restrict v_base,
                    const long *restrict k_stride, const long *restrict v_stride, const long *restrict size,
                    const long *restrict lengths, long rows, long L, long heads, long kv_heads, long head_dim,
                    float scale_log2e, float *restrict scores, float *restrict out)
{
    long group = heads / kv_heads;
    for (long row = 0; row < rows; row++) {
        long length = lengths[row];
        long first = seg_first[row], last = seg_first[row + 1];
        const float *row_k = new_k + row * kv_heads * L * head_dim;
        const float *row_v = new_v + row * kv_heads * L * head_dim;
        for (long kv = 0; kv < kv_heads; kv++) {
            write_new(row_k, row_v, L, head_dim, kv, length, k_base, v_base, k_stride, v_stride, size,
                      first, last);
            /* (heads, L, head_dim) per row: the group of KV head kv is heads [kv * group, (kv + 1) * group) */
            const float *qg = q + ((row * heads + kv * group) * L) * head_dim;
            float *og = out + ((row * heads + kv * group) * L) * head_dim;
            if (head_dim == 64)
                attend_row(qg, L, group, 8, length + L, length, k_base, v_base, k_stride, v_stride, size, first, last,
                           kv, scale_log2e, scores, og);
            else if (head_dim == 128)
                attend_row(qg, L, group, 16, length + L, length, k_base, v_base, k_stride, v_stride, size, first,
                           last, kv, scale_log2e, scores, og);
            else
                attend_row(qg, L, group, head_dim / 8, length + L, length, k_base, v_base, k_stride, v_stride, size,
                           first, last, kv, scale_log2e, scores, og);
        }
    }
}
