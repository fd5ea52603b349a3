/* Attention of a batch's decode rows: decode_attention() over a padded batch (one query per row and
 * head, each row over its own keys), rows_attention() over rows whose KV lies in segments (below);
 * and causal_softmax(), the softmax of a prompt chunk's scores (at the end).
 *
 * What it replaces: numpy's two batched products per layer, which run one OpenBLAS call per
 * (row, KV head) pair — 32 calls of 4 queries x 64 x 200 keys for 16 rows, ~19 us each of call
 * overhead — and a softmax over a temporary. Here each row's keys and values are read once, for
 * all the query heads that share them (grouped-query attention), in one pass.
 *
 * Layout: q and out are (rows, heads, head_dim), contiguous. keys and values are strided views
 * (row, KV head, key) with unit stride along head_dim, as MLX's batched cache holds them. allowed
 * is (rows, keys): 1 where the row may attend (its left padding is 0). A row with no allowed key
 * gets zeros. Softmax in base 2: q is scaled by scale * log2(e) before the dot products.
 *
 * Built at first use with the machine's C compiler, with AVX2 and FMA where this CPU reports them
 * (decode_kernel.py reads its flags), the compiler's baseline elsewhere. */
#include <math.h>
#include <stddef.h>
#include <string.h>


/* 2^x for x <= 0 (x below -126 gives 0, as does -inf): the nearest integer n goes into the float's
 * exponent bits, 2^f for the rest f in [-0.5, 0.5] through Cephes' exp2f polynomial (relative error
 * ~2e-7), so the loop over keys vectorises where libm's exp2f is one call per key. */
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

/* One (row, KV head): its `group` query heads against its keys. Inlined with head_dim a constant
 * (64, 128) so the compiler unrolls the dot products and keeps each output row in registers. */
static inline __attribute__((always_inline)) void attend(const float *restrict qg, const float *restrict k,
                                                         const float *restrict v, const unsigned char *restrict visible,
                                                         long group, long num_keys, const long head_dim,
                                                         long key_stride, long value_stride, float scale_log2e,
                                                         float *restrict scores, float *restrict og)
{
    for (long t = 0; t < num_keys; t++) {
        const float *kt = k + t * key_stride;
        for (long g = 0; g < group; g++) {
            const float *qh = qg + g * head_dim;
            float dot = 0.0f;
            for (long d = 0; d < head_dim; d++)
                dot += qh[d] * kt[d];
            scores[g * num_keys + t] = visible[t] ? dot * scale_log2e : -INFINITY;
        }
    }
    for (long g = 0; g < group; g++) {
        float *s = scores + g * num_keys;
        float top = -INFINITY;
        for (long t = 0; t < num_keys; t++)
            top = s[t] > top ? s[t] : top;
        float *o = og + g * head_dim;
        for (long d = 0; d < head_dim; d++)
            o[d] = 0.0f;
        if (top == -INFINITY)
            continue; /* no key visible: zeros */
        float total = 0.0f;
        for (long t = 0; t < num_keys; t++) {
            s[t] = exp2_nonpositive(s[t] - top);
            total += s[t];
        }
        for (long t = 0; t < num_keys; t++) {
            const float *vt = v + t * value_stride;
            for (long d = 0; d < head_dim; d++)
                o[d] += s[t] * vt[d];
        }
        float inverse = 1.0f / total;
        for (long d = 0; d < head_dim; d++)
            o[d] *= inverse;
    }
}

/* The same for head sizes that are a multiple of 8, with 8-float vectors (GCC's and clang's
 * vector extensions: one AVX register where the CPU has AVX, two SSE ones elsewhere). `blocks`
 * (head_dim / 8, at most MAX_BLOCKS) is a constant where inlined, so each output row stays in
 * registers while the keys stream past. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define MAX_BLOCKS 32

static inline __attribute__((always_inline)) float sum8(v8 x)
{
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

static inline __attribute__((always_inline)) void attend8(const float *restrict qg, const float *restrict k,
                                                          const float *restrict v, const unsigned char *restrict visible,
                                                          long group, long num_keys, const long blocks,
                                                          long key_stride, long value_stride, float scale_log2e,
                                                          float *restrict scores, float *restrict og)
{
    for (long t = 0; t < num_keys; t++) {
        const v8 *kt = (const v8 *)(k + t * key_stride);
        for (long g = 0; g < group; g++) {
            const v8 *qh = (const v8 *)(qg + g * blocks * 8);
            v8 acc = qh[0] * kt[0];
            for (long b = 1; b < blocks; b++)
                acc += qh[b] * kt[b];
            scores[g * num_keys + t] = visible[t] ? sum8(acc) * scale_log2e : -INFINITY;
        }
    }
    for (long g = 0; g < group; g++) {
        float *s = scores + g * num_keys;
        v8 *o = (v8 *)(og + g * blocks * 8);
        float top = -INFINITY;
        for (long t = 0; t < num_keys; t++)
            top = s[t] > top ? s[t] : top;
        if (top == -INFINITY) {
            for (long b = 0; b < blocks; b++)
                o[b] = (v8){0};
            continue; /* no key visible: zeros */
        }
        float total = 0.0f;
        for (long t = 0; t < num_keys; t++) {
            s[t] = exp2_nonpositive(s[t] - top);
            total += s[t];
        }
        v8 acc[MAX_BLOCKS];
        for (long b = 0; b < blocks; b++)
            acc[b] = (v8){0};
        for (long t = 0; t < num_keys; t++) {
            const v8 *vt = (const v8 *)(v + t * value_stride);
            for (long b = 0; b < blocks; b++)
                acc[b] += s[t] * vt[b];
        }
        float inverse = 1.0f / total;
        for (long b = 0; b < blocks; b++)
            o[b] = acc[b] * inverse;
    }
}

void decode_attention(const float *restrict q, const float *restrict keys, const float *restrict values,
                      const unsigned char *restrict allowed, long rows, long heads, long kv_heads, long num_keys,
                      long head_dim, long key_row_stride, long key_head_stride, long key_stride,
                      long value_row_stride, long value_head_stride, long value_stride, float scale_log2e,
                      float *restrict scores, float *restrict out)
{
    /* scores: scratch of (heads / kv_heads) * num_keys floats, one line of keys per query head */
    long group = heads / kv_heads;
    for (long row = 0; row < rows; row++) {
        const unsigned char *visible = allowed + row * num_keys;
        for (long kv = 0; kv < kv_heads; kv++) {
            const float *k = keys + row * key_row_stride + kv * key_head_stride;
            const float *v = values + row * value_row_stride + kv * value_head_stride;
            const float *qg = q + (row * heads + kv * group) * head_dim;
            float *og = out + (row * heads + kv * group) * head_dim;
            if (head_dim == 64)
                attend8(qg, k, v, visible, group, num_keys, 8, key_stride, value_stride, scale_log2e, scores, og);
            else if (head_dim == 128)
                attend8(qg, k, v, visible, group, num_keys, 16, key_stride, value_stride, scale_log2e, scores, og);
            else if (head_dim % 8 == 0 && head_dim / 8 <= MAX_BLOCKS)
                attend8(qg, k, v, visible, group, num_keys, head_dim / 8, key_stride, value_stride, scale_log2e,
                        scores, og);
            else
                attend(qg, k, v, visible, group, num_keys, head_dim, key_stride, value_stride, scale_log2e, scores, og);
        }
    }
}

/* Rows whose KV lies in segments (gateway/engine/rows_kv.py): rows_attention().
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
 */

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
 * = `blocks` 8-float vectors (attend8's v8: `blocks` a constant where inlined, so an output line
 * stays in registers while the values stream past). scores: scratch of L * group * num_keys floats. */
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

/* The largest of x[0 .. n), n >= 1: eight running maxima, which the compiler turns into one vector
 * instruction per eight floats (a single running maximum is a chain it cannot vectorise without
 * giving up NaN semantics). */
static inline float max_of(const float *restrict x, long n)
{
    float lanes[8];
    for (long j = 0; j < 8; j++)
        lanes[j] = x[0];
    long t = 0;
    for (; t + 8 <= n; t += 8)
        for (long j = 0; j < 8; j++)
            lanes[j] = x[t + j] > lanes[j] ? x[t + j] : lanes[j];
    float top = x[0];
    for (long j = 0; j < 8; j++)
        top = lanes[j] > top ? lanes[j] : top;
    for (; t < n; t++)
        top = x[t] > top ? x[t] : top;
    return top;
}

/* A prompt chunk's scores (attention.py): causal_softmax() turns a block of them into softmax weights
 * in place, in two passes over each line where numpy made five (the causal bias added, the maximum,
 * its subtraction, exp2, the sum), and skips the keys the causal mask and a sliding window hide.
 *
 * scores is (lines, num_keys), contiguous, already scaled by scale * log2(e): line i is query
 * i % block_queries of the block (the lines cycle through the block's queries once per query head),
 * and query j sees keys [max(0, first_visible + j - window), first_visible + j): its last `window`
 * keys (window >= num_keys: no window). Every line sees at least one key (first_visible >= 1,
 * window >= 1). sinks (NULL: none) holds gpt-oss's log2-scaled sink logit per query head, line i's
 * being sinks[i / block_queries]: one more term of the line's sum with no value behind it. The
 * hidden keys' weights become 0; inverse[i] is 1 / the sum of line i's weights and sink (the caller
 * divides the weighted values by it). */
void causal_softmax(float *restrict scores, long lines, long num_keys, long block_queries, long first_visible,
                    long window, const float *restrict sinks, float *restrict inverse)
{
    for (long i = 0; i < lines; i++) {
        float *s = scores + i * num_keys;
        long end = first_visible + i % block_queries;
        long start = end > window ? end - window : 0;
        float top = max_of(s + start, end - start);
        float sink = sinks ? sinks[i / block_queries] : -INFINITY;
        top = sink > top ? sink : top;
        float total = sinks ? exp2_nonpositive(sink - top) : 0.0f;
        for (long t = 0; t < start; t++)
            s[t] = 0.0f;
        for (long t = start; t < end; t++) {
            s[t] = exp2_nonpositive(s[t] - top);
            total += s[t];
        }
        for (long t = end; t < num_keys; t++)
            s[t] = 0.0f;
        inverse[i] = 1.0f / total;
    }
}
