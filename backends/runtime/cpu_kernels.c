/* CPU kernels of the lean runtime (built and called by cpu_kernels.py): batch-invariant
 * attention; RMSNorm, RoPE with the KV write and SiLU * up for bf16 steps; bf16 linear layers
 * on packed weights (at the end of the file, where the CPU has AVX-512 BF16 or AVX2 + FMA).
 *
 * Attention: each query token attends over an explicit list of pool slots, in list order, and
 * its result is computed by the same arithmetic whatever else is in the call: the queries of a
 * row share each load of a key (runs of up to MAX_RUN tokens, 16 keys a tile), but no reduction
 * order depends on the number of queries, the other queries' key lengths or the thread count,
 * only on the query's own key list. So a token verified among k+1 drafts, or in a prompt chunk,
 * gets bit for bit what a 1-token step would give.
 *
 * A list longer than KEY_CHUNK keys is attended in chunks of it (by position in the list), each
 * chunk's maximum, total and weighted sums combined in order. Within a chunk, two schemes:
 *
 * float32 (and bf16 where the CPU lacks AVX-512 BF16): math in float32 on GCC vectors of 16
 * floats, bf16 inputs widened. Each key's score is the head dim's products accumulated in 16
 * lanes (each product added with one rounding: FMA), summed across the lanes in one pairwise
 * order (hsum; hsum16 does 16 keys at once with the same order); softmax and the weighted sum
 * of values run over the keys in list order.
 *
 * bf16 on AVX-512 BF16 (BF16_DOTS): vdpbf16ps, which adds to a float32 lane the products of a
 * pair of bf16 values (exact in float32). A key's score is one lane's sum over the head dim's
 * pairs in order (keys transposed so a tile's 16 keys fill the lanes; a dot product's operands
 * commute, so the query's side of the tile is free), times the scale; its probability
 * exp(score - max) rounded to bf16 (0 past the query's keys or at hidden ones); the total the
 * 16 lanes' sums over the tiles in order, then hsum; the weighted values each output dim's
 * lane summed over the key pairs (2i, 2i + 1) in order, values interleaved by pairs. A key past
 * a query's own keys in a tile or pair has weight 0: adding it changes no sum (keys and values
 * are finite), so a query alone gets the bits it gets beside longer ones.
 *
 * The bf16 output is rounded to nearest even. Keys and values are read in tiles of 16 keys so
 * the sums stay in registers. Built without -ffast-math, so no sum is ever reordered.
 */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_HEAD_DIM 256
#define MAX_GROUP 32
#define MAX_RUN 64 /* query tokens sharing one pass over their keys, at most */
/* A step's runs: at most STEP_RUN tokens (a prompt chunk's through split_layers: MAX_RUN, half
 * the key transposes and value interleaves of 32-token runs: 128 queries over 8000 keys in
 * 0.95x the time; a decode step's scratch stays the smaller one, which its calls allocate) */
#define STEP_RUN 32
#define ROW_PAD 8  /* scratch rows past a run's query heads (attend_run_bf16 works in blocks) */
/* A query with more keys attends over them in chunks of this many (by position in its own key
 * list, so the same chunks whatever else is in the call), combined in order. In a step of few
 * rows each chunk is a task of its own, so a few long queries keep every thread busy (one token
 * over 3 kv heads left one of 2 threads idle a third of the time). */
#define KEY_CHUNK 256
#define PART(d) ((d) + 2) /* a chunk's partial result: its maximum, its total, its weighted sums */
#define MAX_SPREAD_FLOATS (2 << 20) /* the most partial results a call keeps for all (8 MB) */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

/* Lane-wise work (conversions, RoPE, SiLU, softmax's exp, argmax) runs on the CPU's own
 * vector width: GCC splits 16-float arithmetic over two AVX2 registers well, but it turns
 * comparisons of 16 floats into 16 scalar ones (SiLU took twice its time), and a lane-wise
 * result is the same whatever the width. Sums across lanes keep LANES (their order is fixed). */
#ifdef __AVX512F__
#define ELEMS 16
#else
#define ELEMS 8
#endif
typedef float evec __attribute__((vector_size(ELEMS * sizeof(float))));
typedef int32_t eivec __attribute__((vector_size(ELEMS * sizeof(int32_t))));
typedef uint16_t ehvec __attribute__((vector_size(ELEMS * sizeof(uint16_t))));
typedef uint32_t euvec __attribute__((vector_size(ELEMS * sizeof(uint32_t))));

/* Keys are read one slot at a time with a stride the hardware prefetcher may not follow
 * (pool blocks, kv heads interleaved): ask for the rows PREFETCH keys ahead. */
#define PREFETCH 8
#define REG_BLOCKS 8 /* value sums kept in registers at once: a head dim of up to 128 */

static void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}

/* n floats (a multiple of ELEMS) from float32 or bf16 (the high half of a float32) */
static void load_row(const char *src, int64_t n, float *dst, int bf16) {
    if (!bf16) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    /* one widening load a vector: GCC makes four instructions of __builtin_convertvector
     * here, at both widths (vpmovzxwd of each half, an extract and an insert) */
    for (int64_t i = 0; i < n; i += ELEMS) {
#if defined(__AVX512F__)
        __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(src + 2 * i))), 16);
        _mm512_storeu_si512(dst + i, u);
#elif defined(__AVX2__)
        __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(src + 2 * i))), 16);
        _mm256_storeu_si256((void *)(dst + i), u);
#else
        ehvec h;
        memcpy(&h, src + i * sizeof(uint16_t), sizeof h);
        euvec u = __builtin_convertvector(h, euvec) << 16;
        memcpy(dst + i, &u, sizeof u);
#endif
    }
}

/* n floats to float32 or bf16 (nearest even; a NaN stays a quiet NaN), ELEMS at a time: a
 * lane at a time, the NaN test kept GCC from vectorizing it, and SiLU, RMSNorm and RoPE spent
 * most of their time here */
static void store_row(const float *src, int64_t n, char *dst, int bf16) {
    if (!bf16) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)dst;
    int64_t i = 0;
    for (; i + ELEMS <= n; i += ELEMS) {
        euvec u;
        memcpy(&u, src + i, sizeof u);
        euvec nan = (euvec)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
        euvec r = (((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan) | (((u >> 16) | 0x40) & nan);
        ehvec b = __builtin_convertvector(r, ehvec);
        memcpy(h + i, &b, sizeof b);
    }
    for (; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u)
            h[i] = (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
        else
            h[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* v rounded to bf16 (nearest even) and widened back: what a bf16 tensor op's result holds */
static evec round_bf16(evec v) {
    euvec u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* where mask: a, else b (masks as vector comparisons give them: all ones or zero per lane) */
static evec select(eivec mask, evec a, evec b) {
    eivec ai, bi;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    ai = (ai & mask) | (bi & ~mask);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* exp(x) for x <= 0 (a score minus its row's max): Cephes' polynomial after a ln2 range
 * reduction, on whole vectors, so every key gets the same code. */
static evec exp_nonpositive(evec x) {
    x = select(x < -87.0f, (evec){0} - 87.0f, x);
    evec y = x * 1.44269504088896341f + 0.5f;
    eivec t = __builtin_convertvector(y, eivec); /* truncates towards zero */
    evec n = __builtin_convertvector(t, evec);
    n = select(n > y, n - 1.0f, n); /* floor */
    evec r = x - n * 0.693359375f + n * 2.12194440e-4f;
    evec p = (evec){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    eivec e = (__builtin_convertvector(n, eivec) + 127) << 23;
    evec scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* The lanes of v added in one fixed pairwise order (halves, quarters, ...). */
static float hsum(vec v) {
    v += __builtin_shuffle(v, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (ivec){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (ivec){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    v += __builtin_shuffle(v, (ivec){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return v[0];
}

/* hsum of each of 16 vectors at once, lane l the sum of p[l]: the same pairwise order (lanes
 * e and e + 8, then e + 4, e + 2, e + 1), so the same bits, in 30 vector operations. */
static vec hsum16(const vec p[LANES]) {
    vec a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: p[2i], 8-15: p[2i+1], each e + (e + 8) */
        a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], (ivec){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
               __builtin_shuffle(p[2 * i], p[2 * i + 1], (ivec){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int i = 0; i < 4; i++) /* 4 lanes per vector: keys 4i .. 4i + 3 */
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], (ivec){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
               __builtin_shuffle(a[2 * i], a[2 * i + 1], (ivec){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    for (int i = 0; i < 2; i++) /* 2 lanes per vector: keys 8i .. 8i + 7 */
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], (ivec){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
               __builtin_shuffle(b[2 * i], b[2 * i + 1], (ivec){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
    return __builtin_shuffle(c[0], c[1], (ivec){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
           __builtin_shuffle(c[0], c[1], (ivec){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

/* Per-thread scratch for the largest run of a call. */
typedef struct {
    float *qf;     /* [run][group][d]: scaled queries */
    float *scores; /* [run][group][stride]: scores, then probabilities */
    float *total;  /* [run][group]: softmax denominators */
    float *max;    /* [run][group]: the scores' maxima */
    vec *acc;      /* [run][group][d / LANES]: weighted sums of values */
    float *keys;   /* [LANES][d]: one tile of keys, then of values */
    /* bf16 on dot products (attend_run_bf16) */
    uint32_t *qpairs; /* [run][group][d / 2]: queries as bf16 pairs */
    uint16_t *probs;  /* [run][group][KEY_CHUNK]: bf16 probabilities */
    uint16_t *vpairs; /* [KEY_CHUNK / 2][d][2]: values of key pairs interleaved */
    void *tile;       /* [d / 2][LANES] 32-bit pairs: a tile of keys transposed */
} scratch;

/* The keys a run's queries may not see (a draft tree's other branches): query r of the run sees
 * key j >= from[r] of its list only where visible[r * width + j - from[r]] is set. Tree nodes
 * verified in one row share one list (the cached tokens, then the nodes in order), each a
 * longer prefix as in a chain, so their keys are loaded once. A hidden key's weight is an
 * exact 0: it changes no maximum, and adding 0 (or 0 * value) changes no sum, so a node gets
 * the bits it gets over a list of its ancestors alone (given the same chunks: lean_lm shares a
 * list only where the nodes all fall in one chunk). `base`: where the run's keys begin in
 * its lists (a chunk's offset). */
typedef struct {
    const int64_t *from;
    const uint8_t *visible;
    int64_t width, base;
} key_mask;

/* Query r's scores s[0:len] (keys base.. of its list) at hidden keys set to `value`. */
static void hide_keys(const key_mask *mask, int64_t r, float *s, int64_t len, float value) {
    int64_t first = mask->from[r] - mask->base;
    for (int64_t j = first > 0 ? first : 0; j < len; j++)
        if (!mask->visible[r * mask->width + mask->base + j - mask->from[r]]) s[j] = value;
}

/* attend_run's two inner loops, most of its time:
 * - score_tile: out[l] = the score of query q against key l of a tile of LANES keys ([LANES][d]),
 *   its lane products summed over d's blocks, then its lanes as hsum adds them;
 * - add_weighted: sum[0:d] += p[l] * values[l][0:d] for each of `own` keys in order.
 * Each product is added to its sum with one rounding (a fused multiply-add: one instruction
 * where the CPU has FMA, half the work of a product and a sum), in the 16-wide versions and in
 * the 8-wide ones below alike, so both give the same bits. */
#if defined(__AVX512F__) || !defined(__AVX2__) || !defined(__FMA__)
#ifdef __AVX512F__
static inline vec fma_vec(vec a, vec b, vec c) { return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#else
static inline vec fma_vec(vec a, vec b, vec c) {
    for (int i = 0; i < LANES; i++) c[i] = fmaf(a[i], b[i], c[i]);
    return c;
}
#endif

static void score_tile(const float *q, const float *keys, int64_t d, float *out) {
    vec partial[LANES] = {{0}};
    for (int64_t b = 0; b < d / LANES; b++) { /* 16 independent sums: no add waits on another */
        vec qv;
        memcpy(&qv, q + b * LANES, sizeof qv);
        for (int l = 0; l < LANES; l++) {
            vec kv_;
            memcpy(&kv_, keys + l * d + b * LANES, sizeof kv_);
            partial[l] = fma_vec(qv, kv_, partial[l]);
        }
    }
    vec sums = hsum16(partial);
    memcpy(out, &sums, sizeof sums);
}

static void add_weighted(float *sum, const float *p, const float *values, int64_t own, int64_t d) {
    vec *s = (vec *)sum;
    for (int64_t b0 = 0; b0 < d / LANES; b0 += REG_BLOCKS) {
        /* REG_BLOCKS running sums in registers (a constant-bound loop GCC unrolls) */
        vec acc[REG_BLOCKS];
        for (int b = 0; b < REG_BLOCKS; b++)
            if (b0 + b < d / LANES) acc[b] = s[b0 + b];
        for (int64_t l = 0; l < own; l++)
            for (int b = 0; b < REG_BLOCKS; b++)
                if (b0 + b < d / LANES) {
                    vec v;
                    memcpy(&v, values + l * d + (b0 + b) * LANES, sizeof v);
                    acc[b] = fma_vec((vec){0} + p[l], v, acc[b]);
                }
        for (int b = 0; b < REG_BLOCKS; b++)
            if (b0 + b < d / LANES) s[b0 + b] = acc[b];
    }
}
#else
/* AVX2's 8-wide registers: GCC compiles the 16-wide sums above into stack spills at every key
 * (a 5-token step over 1000 keys spent ~2.5 ms a layer there; these take ~0.4). */
static inline __attribute__((always_inline)) void add_weighted8(float *sum, const float *p, const float *values,
                                                                 int64_t own, int64_t d, int vecs) {
    __m256 acc[8];
    for (int j = 0; j < vecs; j++) acc[j] = _mm256_loadu_ps(sum + 8 * j);
    for (int64_t l = 0; l < own; l++) {
        __m256 pl = _mm256_set1_ps(p[l]);
        for (int j = 0; j < vecs; j++)
            acc[j] = _mm256_fmadd_ps(pl, _mm256_loadu_ps(values + l * d + 8 * j), acc[j]);
    }
    for (int j = 0; j < vecs; j++) _mm256_storeu_ps(sum + 8 * j, acc[j]);
}

/* score_tile on 8-wide registers, the same sums in the same order: a key's 16 lanes are two
 * halves (lanes e and e + 8 added first, as hsum does), and 8 keys' halves are folded together
 * (e + 4, e + 2, e + 1) by shuffles instead of one key at a time. */
static inline __m256 key_lanes(const float *q, const float *k, int64_t d) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t b = 0; b < d; b += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + b), _mm256_loadu_ps(k + b), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + b + 8), _mm256_loadu_ps(k + b + 8), hi);
    }
    return _mm256_add_ps(lo, hi);
}

static inline __m256 fold4(__m256 a, __m256 b) { /* lanes e + (e + 4): a's in the low half, b's in the high */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline __attribute__((always_inline)) void score_tile_d(const float *q, const float *keys, int64_t d,
                                                                float *out) {
    for (int half = 0; half < LANES; half += 8) {
        const float *k = keys + half * d;
        __m256 a01 = fold4(key_lanes(q, k, d), key_lanes(q, k + d, d));
        __m256 a23 = fold4(key_lanes(q, k + 2 * d, d), key_lanes(q, k + 3 * d, d));
        __m256 a45 = fold4(key_lanes(q, k + 4 * d, d), key_lanes(q, k + 5 * d, d));
        __m256 a67 = fold4(key_lanes(q, k + 6 * d, d), key_lanes(q, k + 7 * d, d));
        /* e + (e + 2): per 128-bit half, keys 0 and 2 (low) / 1 and 3 (high), two lanes each */
        __m256 b03 = _mm256_add_ps(_mm256_shuffle_ps(a01, a23, 0x44), _mm256_shuffle_ps(a01, a23, 0xee));
        __m256 b47 = _mm256_add_ps(_mm256_shuffle_ps(a45, a67, 0x44), _mm256_shuffle_ps(a45, a67, 0xee));
        /* e + (e + 1): keys 0, 2, 4, 6 | 1, 3, 5, 7, put back in order */
        __m256 c = _mm256_add_ps(_mm256_shuffle_ps(b03, b47, 0x88), _mm256_shuffle_ps(b03, b47, 0xdd));
        _mm256_storeu_ps(out + half, _mm256_permutevar8x32_ps(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
}

static void score_tile(const float *q, const float *keys, int64_t d, float *out) {
    switch (d) { /* the common head dims unrolled */
        case 64: score_tile_d(q, keys, 64, out); break;
        case 128: score_tile_d(q, keys, 128, out); break;
        default: score_tile_d(q, keys, d, out);
    }
}

static void add_weighted(float *sum, const float *p, const float *values, int64_t own, int64_t d) {
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) add_weighted8(sum + c, p, values + c, own, d, 8);
    for (; c < d; c += 16) add_weighted8(sum + c, p, values + c, own, d, 2);
}
#endif

/* The largest of s[0 : len] as a scan from s[0] with `>` finds it (the same value: a NaN among
 * the scores makes the softmax NaN whatever the maximum), ELEMS lanes at a time. */
static float row_max(const float *s, int64_t len) {
    float m = s[0];
    int64_t j = 1;
    if (len >= 2 * ELEMS) {
        evec best;
        memcpy(&best, s, sizeof best);
        for (j = ELEMS; j + ELEMS <= len; j += ELEMS) {
            evec v;
            memcpy(&v, s + j, sizeof v);
            best = select(v > best, v, best);
        }
        m = best[0];
        for (int l = 1; l < ELEMS; l++) m = best[l] > m ? best[l] : m;
    }
    for (; j < len; j++) m = s[j] > m ? s[j] : m;
    return m;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_DOTS
/* bf16 attention on AVX-512 BF16's dot products (vdpbf16ps: a lane adds the products of two
 * pairs of bf16 values to its float32 sum), the arithmetic the header comment gives. */
#define SCORE_ROWS 8 /* query heads scored side by side against a tile of keys */
#define PV_REGS 24   /* sums of weighted values kept in registers */

/* r[i] lane j -> out[j] lane i, for 16 vectors of 16 32-bit lanes: pairs of rows interleaved,
 * then pairs of pairs, then the 128-bit quarters moved (64 shuffles, a quarter of the time the
 * 16 gathers of a tile's transpose took) */
static inline void transpose16(const __m512i r[LANES], __m512i out[LANES]) {
    __m512i t[LANES], u[LANES];
    for (int i = 0; i < LANES; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < LANES; i += 4) { /* u[i + c] quarter L: rows i .. i + 3 of column 4L + c */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
        __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        out[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        out[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        out[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        out[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

/* The tile of keys j0 .. j0 + 15 of `slots` (zeros past `len`) transposed for the dot
 * products: kt[p] lane l = key l's pair p of dims (2p, 2p + 1). The next tile's keys are
 * prefetched (the values too, as the float32 pass does, stalled on the CPU's miss buffers). */
static void key_tile_pairs(const char *kv, const int64_t *slots, int64_t j0, int64_t len, int64_t slot_bytes,
                           int64_t k_off, int64_t d, __m512i *kt) {
    for (int64_t j = j0 + LANES; j < j0 + 2 * LANES && j < len; j++) prefetch_row(kv + slots[j] * slot_bytes + k_off, d * 2);
    for (int64_t b = 0; b < d / 2; b += LANES) {
        __mmask16 m = d / 2 - b >= LANES ? 0xffff : (__mmask16)((1u << (d / 2 - b)) - 1);
        __m512i rows[LANES], cols[LANES];
        for (int l = 0; l < LANES; l++)
            rows[l] = j0 + l < len ? _mm512_maskz_loadu_epi32(m, kv + slots[j0 + l] * slot_bytes + k_off + 4 * b)
                                   : _mm512_setzero_si512();
        transpose16(rows, cols);
        for (int64_t p = b; p < b + LANES && p < d / 2; p++) kt[p] = cols[p - b];
    }
}

/* Scores of query heads h0 .. h0 + rows - 1 (qp: [heads][d / 2] bf16 pairs) against one
 * transposed tile: each a sum over the dim pairs in order, times `scale`. */
static inline __attribute__((always_inline)) void score_rows(const uint32_t *qp, int64_t h0, int rows,
                                                             const __m512i *kt, int64_t pairs, float scale,
                                                             float *out, int64_t stride) {
    __m512 acc[SCORE_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh k = (__m512bh)kt[p];
        for (int i = 0; i < rows; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], k, (__m512bh)_mm512_set1_epi32((int)qp[(h0 + i) * pairs + p]));
    }
    for (int i = 0; i < rows; i++) _mm512_storeu_ps(out + (h0 + i) * stride, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
}

/* Values of keys 2i and 2i + 1 (zeros past `len`) interleaved, for i < n: vp[i][c] = (v_2i[c],
 * v_2i+1[c]), the pairs the weighted sums' dot products take. */
static void value_pairs(const char *kv, const int64_t *slots, int64_t len, int64_t n, int64_t slot_bytes,
                        int64_t v_off, int64_t d, uint16_t *vp) {
    typedef int16_t words __attribute__((vector_size(64)));
    const __m512i lo = (__m512i)(words){0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                        8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t i = 0; i < n; i++) {
        for (int64_t j = 2 * i + PREFETCH; j < 2 * i + PREFETCH + 2 && j < len; j++)
            prefetch_row(kv + slots[j] * slot_bytes + v_off, d * 2);
        const uint16_t *a = 2 * i < len ? (const uint16_t *)(kv + slots[2 * i] * slot_bytes + v_off) : NULL;
        const uint16_t *b = 2 * i + 1 < len ? (const uint16_t *)(kv + slots[2 * i + 1] * slot_bytes + v_off) : NULL;
        for (int64_t c = 0; c < d; c += 32) {
            __mmask32 m = d - c >= 32 ? 0xffffffffu : (1u << (d - c)) - 1;
            __m512i va = a ? _mm512_maskz_loadu_epi16(m, a + c) : _mm512_setzero_si512();
            __m512i vb = b ? _mm512_maskz_loadu_epi16(m, b + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + i * 2 * d + 2 * c, _mm512_permutex2var_epi16(va, lo, vb));
            if (d - c > 16) _mm512_storeu_si512(vp + i * 2 * d + 2 * c + 32, _mm512_permutex2var_epi16(va, hi, vb));
        }
    }
}

/* Weighted values of query heads h0 .. h0 + rows - 1 (probs: their bf16 probabilities, rows
 * KEY_CHUNK apart) over the first n key pairs, pair after pair: acc[h][0 : d] (nb = d / 16). */
static inline __attribute__((always_inline)) void weigh_rows(const uint16_t *vp, const uint16_t *probs, int64_t h0,
                                                             int rows, int nb, int64_t n, float *acc) {
    __m512 sum[PV_REGS];
    for (int i = 0; i < rows * nb; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *v = vp + i * 32 * nb;
        for (int r = 0; r < rows; r++) {
            uint32_t pair;
            memcpy(&pair, probs + (h0 + r) * KEY_CHUNK + 2 * i, sizeof pair);
            __m512bh p = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int b = 0; b < nb; b++)
                sum[r * nb + b] = _mm512_dpbf16_ps(sum[r * nb + b], (__m512bh)_mm512_loadu_si512(v + 32 * b), p);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) _mm512_storeu_ps(acc + (h0 + r) * 16 * nb + 16 * b, sum[r * nb + b]);
}

/* exp(x - m) as 2^n * 2^f (x log2 e - m log2 e = n + f, |f| <= 1/2, 2^f to 1e-7 by its Taylor
 * series): half of exp_nonpositive's work, and a probability keeps 8 bits of it. A score far
 * below m gives an exact 0. */
static inline __m512 exp_from(__m512 x, __m512 m_log2e) {
    __m512 t = _mm512_fmsub_ps(x, _mm512_set1_ps(1.44269504088896341f), m_log2e);
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n), p = _mm512_set1_ps(1.5403530e-4f);
    static const float c[] = {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f};
    for (int i = 0; i < 6; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

/* Query head h's scores s[0 : stride] -> its bf16 probabilities (0 past its len keys and at
 * hidden ones: a hidden key's score is set to -inf, which no key's own score is), their maximum
 * and total (the 16 lanes' sums over the tiles, then hsum), in one pass after the maximum. */
static void softmax_row(float *s, int64_t len, int64_t stride, const key_mask *mask, int64_t r, uint16_t *probs,
                        float *max, float *total) {
    if (mask) hide_keys(mask, r, s, len, -INFINITY);
    float m = len > 0 ? row_max(s, len) : -INFINITY;
    __m512 m_log2e = _mm512_set1_ps(m * 1.44269504088896341f);
    vec sum = {0};
    for (int64_t j0 = 0; j0 < stride; j0 += LANES) {
        __m512 x = _mm512_loadu_ps(s + j0);
        __mmask16 live = j0 >= len ? 0 : len - j0 >= LANES ? 0xffff : (__mmask16)((1u << (len - j0)) - 1);
        live &= _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ); /* a NaN stays */
        evec p = round_bf16((evec)_mm512_maskz_mov_ps(live, exp_from(x, m_log2e)));
        sum += (vec)p;
        _mm256_storeu_si256((__m256i *)(probs + j0), (__m256i)_mm512_cvtneps_pbh((__m512)p));
    }
    *max = m;
    *total = hsum(sum);
}

/* The most keys of query heads h0 .. h0 + rows - 1 (those past `heads`: none) */
static int64_t block_len(const int64_t *lens, int64_t group, int64_t heads, int64_t h0, int64_t rows) {
    int64_t most = 0;
    for (int64_t h = h0; h < h0 + rows && h < heads; h++) most = lens[h / group] > most ? lens[h / group] : most;
    return most;
}

/* attend_run for bf16 on the dot products: the same runs, chunks and partial results, each
 * query head's arithmetic the header comment's. */
static void attend_run_bf16(const char *q, int64_t q_bytes, const char *kv, const int64_t *slots, const int64_t *lens,
                            int64_t nq, char *out, int64_t out_bytes, int64_t kvh, int64_t kv_heads, int64_t group,
                            int64_t d, float scale, const key_mask *mask, scratch w, float *part, int64_t part_row,
                            int64_t part_g) {
    int64_t slot_bytes = 4 * kv_heads * d, k_off = kvh * d * 2, v_off = (kv_heads + kvh) * d * 2, max_len = 0;
    int64_t heads = nq * group, padded = (heads + SCORE_ROWS - 1) / SCORE_ROWS * SCORE_ROWS, pairs = d / 2;
    for (int64_t r = 0; r < nq; r++) max_len = lens[r] > max_len ? lens[r] : max_len;
    int64_t stride = (max_len + LANES - 1) / LANES * LANES;
    /* query head h = r * group + g: token r's head g * kv_heads + kvh, as bf16 pairs */
    for (int64_t h = 0; h < padded; h++) {
        if (h < heads)
            memcpy(w.qpairs + h * pairs, q + (h / group) * q_bytes + ((h % group) * kv_heads + kvh) * d * 2, (size_t)d * 2);
        else
            memset(w.qpairs + h * pairs, 0, (size_t)d * 2);
    }
    __m512i *kt = (__m512i *)w.tile;
    for (int64_t j0 = 0; j0 < max_len; j0 += LANES) {
        key_tile_pairs(kv, slots, j0, max_len, slot_bytes, k_off, d, kt);
        for (int64_t h0 = 0; h0 < heads; h0 += SCORE_ROWS) { /* past a block's own keys: not read */
            if (block_len(lens, group, heads, h0, SCORE_ROWS) <= j0) continue;
            if (heads - h0 <= SCORE_ROWS / 2) /* a step's last few heads (a 1-token step's all) */
                score_rows(w.qpairs, h0, SCORE_ROWS / 2, kt, pairs, scale, w.scores + j0, stride);
            else
                score_rows(w.qpairs, h0, SCORE_ROWS, kt, pairs, scale, w.scores + j0, stride);
        }
    }
    for (int64_t j = 0; j < PREFETCH && j < max_len; j++) prefetch_row(kv + slots[j] * slot_bytes + v_off, d * 2);
    for (int64_t h = 0; h < heads; h++)
        softmax_row(w.scores + h * stride, lens[h / group], stride, mask, h / group, w.probs + h * KEY_CHUNK,
                    w.max + h, w.total + h);
    value_pairs(kv, slots, max_len, stride / 2, slot_bytes, v_off, d, w.vpairs);
    float *acc = (float *)w.acc;
    int rows = d == 64 ? 6 : d == 128 ? 3 : 1, nb = (int)(d / LANES);
    for (int64_t h0 = 0; h0 < heads; h0 += rows) {
        int64_t longest = block_len(lens, group, heads, h0, rows); /* past a head's own keys its weights are 0 */
        if (d == 64 && heads - h0 <= 3)
            weigh_rows(w.vpairs, w.probs, h0, 3, 4, (longest + 1) / 2, acc);
        else if (d == 64)
            weigh_rows(w.vpairs, w.probs, h0, 6, 4, (longest + 1) / 2, acc);
        else if (d == 128)
            weigh_rows(w.vpairs, w.probs, h0, 3, 8, (longest + 1) / 2, acc);
        else
            weigh_rows(w.vpairs, w.probs, h0, 1, nb, (longest + 1) / 2, acc);
    }
    float row[MAX_HEAD_DIM];
    for (int64_t h = 0; h < heads; h++) {
        int64_t r = h / group, g = h % group;
        if (part) {
            float *entry = part + r * part_row + g * part_g;
            entry[0] = w.max[h];
            entry[1] = w.total[h];
            memcpy(entry + 2, acc + h * d, sizeof(float) * (size_t)d);
            continue;
        }
        for (int64_t b = 0; b < d / LANES; b++) {
            vec o;
            memcpy(&o, acc + h * d + b * LANES, sizeof o);
            o /= w.total[h];
            memcpy(row + b * LANES, &o, sizeof o);
        }
        store_row(row, d, out + r * out_bytes + (g * kv_heads + kvh) * d * 2, 1);
    }
}
#endif

/* One task: the `group` query heads sharing kv head `kvh`, for a run of `nq` consecutive query
 * tokens that read prefixes of one key list (the tokens of a row, causal: each a longer prefix).
 * Each key row is loaded once for the whole run, but what a query computes is the same as alone:
 * its scores over its own keys, its own max, sum and weighted sum, each over its keys in order.
 * With `part` set, the keys are one chunk of longer lists (a query may have none of them) and
 * the partial result of query r's g-th head of the group goes to part + r * part_row + g * part_g
 * instead. */
static void attend_run(const char *q, int64_t q_bytes, const char *kv, const int64_t *slots,
                       const int64_t *lens, int64_t nq, char *out, int64_t out_bytes, int64_t kvh,
                       int64_t kv_heads, int64_t group, int64_t d, float scale, int bf16,
                       const key_mask *mask, scratch w, float *part, int64_t part_row, int64_t part_g) {
    int64_t esz = bf16 ? 2 : 4, blocks = d / LANES, max_len = 0;
    int64_t slot_bytes = 2 * kv_heads * d * esz, k_off = kvh * d * esz, v_off = (kv_heads + kvh) * d * esz;
    float row[MAX_HEAD_DIM];
#ifdef BF16_DOTS
    if (bf16) {
        attend_run_bf16(q, q_bytes, kv, slots, lens, nq, out, out_bytes, kvh, kv_heads, group, d, scale, mask, w, part,
                        part_row, part_g);
        return;
    }
#endif
    for (int64_t r = 0; r < nq; r++) max_len = lens[r] > max_len ? lens[r] : max_len;
    int64_t stride = (max_len + LANES - 1) / LANES * LANES;

    for (int64_t r = 0; r < nq; r++)
        for (int64_t g = 0; g < group; g++) {
            float *qg = w.qf + (r * group + g) * d;
            load_row(q + r * q_bytes + (g * kv_heads + kvh) * d * esz, d, qg, bf16);
            for (int64_t i = 0; i < d; i++) qg[i] *= scale;
        }
    /* Scores LANES keys at a time: each key's lane products summed as hsum sums them, for 16
     * keys in one pass (a key past a query's own keys gets a score its softmax never reads). */
    for (int64_t j0 = 0; j0 < max_len; j0 += LANES) {
        for (int64_t l = 0; l < LANES; l++) {
            int64_t j = j0 + l;
            if (j + PREFETCH < max_len) { /* the values too: they are read right after this pass */
                prefetch_row(kv + slots[j + PREFETCH] * slot_bytes + k_off, d * esz);
                prefetch_row(kv + slots[j + PREFETCH] * slot_bytes + v_off, d * esz);
            }
            if (j < max_len)
                load_row(kv + slots[j] * slot_bytes + k_off, d, w.keys + l * d, bf16);
            else
                memset(w.keys + l * d, 0, sizeof(float) * (size_t)d);
        }
        for (int64_t r = 0; r < nq; r++) {
            if (j0 >= lens[r]) continue;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = w.qf + (r * group + g) * d;
                score_tile(qg, w.keys, d, w.scores + (r * group + g) * stride + j0);
            }
        }
    }
    for (int64_t r = 0; r < nq; r++) {
        int64_t len = lens[r], padded = (len + LANES - 1) / LANES * LANES;
        float *rs = w.scores + r * group * stride;
        for (int64_t g = 0; g < group; g++) {
            float *s = rs + g * stride;
            if (mask) hide_keys(mask, r, s, len, -INFINITY);
            float m = len > 0 ? row_max(s, len) : -INFINITY;
            w.max[r * group + g] = m;
            for (int64_t j = len; j < padded; j++) s[j] = m; /* lanes past the keys: never read */
            for (int64_t j0 = 0; j0 < padded; j0 += ELEMS) {
                evec x;
                memcpy(&x, s + j0, sizeof x);
                x = exp_nonpositive(x - m);
                memcpy(s + j0, &x, sizeof x);
            }
            if (mask) hide_keys(mask, r, s, len, 0.0f); /* an exact 0, whatever exp makes of -inf */
            for (int64_t b = 0; b < blocks; b++) w.acc[(r * group + g) * blocks + b] = (vec){0};
        }
        /* each head's total over its keys in order, four heads side by side so that their
         * chains of additions overlap (a spare lane repeats the first head) */
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            const float *p[4];
            float total[4] = {0};
            for (int i = 0; i < 4; i++) p[i] = rs + (g0 + i < group ? g0 + i : g0) * stride;
            for (int64_t j = 0; j < len; j++)
                for (int i = 0; i < 4; i++) total[i] += p[i][j];
            for (int i = 0; i < 4 && g0 + i < group; i++) w.total[r * group + g0 + i] = total[i];
        }
    }
    /* Weighted values, a tile of LANES keys at a time with each query's sums in registers; each
     * query still adds its keys' values one key after the other, in order. */
    for (int64_t j0 = 0; j0 < max_len; j0 += LANES) {
        int64_t tile = max_len - j0 < LANES ? max_len - j0 : LANES;
        for (int64_t l = 0; l < tile; l++) {
            int64_t j = j0 + l;
            if (j + PREFETCH < max_len) prefetch_row(kv + slots[j + PREFETCH] * slot_bytes + v_off, d * esz);
            load_row(kv + slots[j] * slot_bytes + v_off, d, w.keys + l * d, bf16);
        }
        for (int64_t r = 0; r < nq; r++) {
            int64_t own = lens[r] - j0 < tile ? lens[r] - j0 : tile;
            for (int64_t g = 0; g < group && own > 0; g++) {
                vec *sum = w.acc + (r * group + g) * blocks;
                const float *p = w.scores + (r * group + g) * stride + j0;
                add_weighted((float *)sum, p, w.keys, own, d);
            }
        }
    }
    for (int64_t r = 0; r < nq; r++)
        for (int64_t g = 0; g < group; g++) {
            if (part) {
                float *entry = part + r * part_row + g * part_g;
                entry[0] = w.max[r * group + g];
                entry[1] = w.total[r * group + g];
                memcpy(entry + 2, w.acc + (r * group + g) * blocks, sizeof(float) * (size_t)d);
                continue;
            }
            for (int64_t b = 0; b < blocks; b++) {
                vec o = w.acc[(r * group + g) * blocks + b] / w.total[r * group + g];
                memcpy(row + b * LANES, &o, sizeof o);
            }
            store_row(row, d, out + r * out_bytes + (g * kv_heads + kvh) * d * esz, bf16);
        }
}

/* Chunk c of a run's key list for a task: its slots and each query's keys in it (maybe none),
 * then attend_run's partial results at part (see there). */
static void attend_chunk(const char *q, int64_t q_bytes, const char *kv, const int64_t *slots,
                         const int64_t *key_len, int64_t nq, int64_t c, int64_t kvh, int64_t kv_heads,
                         int64_t group, int64_t d, float scale, int bf16, const key_mask *mask, scratch w,
                         float *part, int64_t part_row, int64_t part_g) {
    int64_t lens[MAX_RUN];
    key_mask chunk_mask;
    if (mask) chunk_mask = *mask, chunk_mask.base = c * KEY_CHUNK, mask = &chunk_mask;
    for (int64_t r = 0; r < nq; r++) {
        int64_t own = key_len[r] - c * KEY_CHUNK;
        lens[r] = own < 0 ? 0 : own > KEY_CHUNK ? KEY_CHUNK : own;
    }
    attend_run(q, q_bytes, kv, slots + c * KEY_CHUNK, lens, nq, NULL, 0, kvh, kv_heads, group, d, scale, bf16, mask, w,
               part, part_row, part_g);
}

/* One query head's `chunks` partial results (PART(d) apart) combined in order: each chunk's
 * sums rescaled from its own maximum to the query's, as one pass over the whole list makes
 * them; the output row written as attend_run writes it. */
static void combine_chunks(const float *e, int64_t chunks, int64_t d, char *out, int bf16) {
    float m = e[0], total = 0.0f, acc[MAX_HEAD_DIM] = {0};
    for (int64_t c = 1; c < chunks; c++) m = e[c * PART(d)] > m ? e[c * PART(d)] : m;
    for (int64_t c = 0; c < chunks; c++) {
        const float *ec = e + c * PART(d);
        float f = exp_nonpositive((evec){0} + (ec[0] - m))[0];
        total += ec[1] * f;
        for (int64_t j = 0; j < d; j++) acc[j] += ec[2 + j] * f;
    }
    for (int64_t j = 0; j < d; j++) acc[j] /= total;
    store_row(acc, d, out, bf16);
}

/* Whether bf16 attention runs on the dot products here (else as float32 does) */
int attend_bf16_dots(void) {
#ifdef BF16_DOTS
    return 1;
#else
    return 0;
#endif
}

/* Runs: consecutive query tokens of one key list (one sequence), at most `cap` each, which
 * share each pass over their keys. first[r]: run r's first token (first[runs] = tokens);
 * chunks[r]: the KEY_CHUNKs of its longest query. Returns the number of runs. */
static int64_t form_runs(const int64_t *key_start, const int64_t *key_len, int64_t tokens, int64_t cap,
                         int64_t *first, int64_t *chunks) {
    int64_t runs = 0;
    for (int64_t t = 0; t < tokens; t++) {
        if (t == 0 || key_start[t] != key_start[t - 1] || t - first[runs - 1] == cap) chunks[runs] = 0, first[runs++] = t;
        int64_t c = (key_len[t] + KEY_CHUNK - 1) / KEY_CHUNK;
        chunks[runs - 1] = c > chunks[runs - 1] ? c : chunks[runs - 1];
    }
    first[runs] = tokens;
    return runs;
}

/* One attention call's arguments (see attend). */
typedef struct {
    const void *q, *kv;
    const int64_t *key_slots, *key_start, *key_len, *mask_from;
    const uint8_t *mask;
    void *out;
    int64_t q_stride, mask_width, tokens, heads, kv_heads, d;
    float scale;
    int bf16;
} attend_call;

/* How a call's work is cut into tasks; it depends on the key lists and the thread count only, so
 * a step's layers share one. first[r]: run r's first token; chunks[r]: its longest query's
 * KEY_CHUNKs; task[3i ..]: (run, kv head, chunk) of task i; part: the spread chunks' partial
 * results, [tokens][heads][max_chunks] (spread only). */
typedef struct {
    int64_t cap, runs, tasks, max_chunks, part_head; /* cap: a run's most tokens */
    int spread;
    int64_t *first, *chunks, *task;
    float *part;
} attend_plan;

static void free_plan(attend_plan *p) {
    free(p->first), free(p->chunks), free(p->task), free(p->part);
}

/* The runs (of at most cap <= MAX_RUN tokens) and tasks of call c on `threads` threads; 0, or
 * -2 when out of memory. */
static int plan_attend(const attend_call *c, int64_t cap, int threads, attend_plan *p) {
    int64_t tokens = c->tokens, kv_heads = c->kv_heads;
    *p = (attend_plan){cap, 0, 0, 1, 0, 0, NULL, NULL, NULL, NULL};
    p->first = malloc(sizeof(int64_t) * (size_t)(tokens + 1)), p->chunks = malloc(sizeof(int64_t) * (size_t)tokens);
    if (!p->first || !p->chunks) return free_plan(p), -2;
    int64_t runs = form_runs(c->key_start, c->key_len, tokens, cap, p->first, p->chunks);
    for (int64_t r = 0; r < runs; r++) p->max_chunks = p->chunks[r] > p->max_chunks ? p->chunks[r] : p->max_chunks;
    if (runs * kv_heads < 2 * threads && runs < tokens && p->max_chunks == 1) {
        /* Too few tasks to share (a 5-token verification's 3 kv heads on 2 threads: one
         * thread did two, the other waited), and no chunks of keys to spread instead: runs of
         * half the length. A query's result does not depend on the run it is in; only the
         * keys' widening is done once more. */
        int64_t longest = 0, *first = p->first;
        for (int64_t r = 0; r < runs; r++) longest = first[r + 1] - first[r] > longest ? first[r + 1] - first[r] : longest;
        runs = form_runs(c->key_start, c->key_len, tokens, (longest + 1) / 2, p->first, p->chunks);
    }
    /* Few tasks (a step of a row or two): each chunk of a run is a task of its own, its partial
     * results [tokens][heads][max_chunks] kept in `part` for all; otherwise (or where those
     * would take too much memory) a task attends its run's chunks one after the other in its
     * own scratch. The arithmetic is the same: only who computes a chunk differs. */
    p->runs = runs, p->part_head = p->max_chunks * PART(c->d);
    p->spread = p->max_chunks > 1 && runs * kv_heads < 4 * threads &&
                tokens * c->heads * p->part_head <= MAX_SPREAD_FLOATS;
    for (int64_t r = 0; r < runs; r++) p->tasks += kv_heads * (p->spread ? p->chunks[r] : 1);
    p->task = malloc(sizeof(int64_t) * 3 * (size_t)p->tasks);
    p->part = p->spread ? malloc(sizeof(float) * (size_t)(tokens * c->heads * p->part_head)) : NULL;
    if (!p->task || (p->spread && !p->part)) return free_plan(p), -2;
    /* chunk-major: the kv heads of one chunk run at about the same time (on 2 threads, 2 of
     * them at once), while the pool rows they share, all heads' keys and values side by side,
     * are in cache */
    for (int64_t r = 0, i = 0; r < runs; r++)
        for (int64_t ch = 0; ch < (p->spread ? p->chunks[r] : 1); ch++)
            for (int64_t kvh = 0; kvh < kv_heads; kvh++, i++)
                p->task[3 * i] = r, p->task[3 * i + 1] = kvh, p->task[3 * i + 2] = ch;
    return 0;
}

/* A thread's scratch for the tasks of plan p (and where a task combines its own chunks:
 * local_part); returns whether an allocation failed (free_scratch frees what was had). */
static int new_scratch(const attend_call *c, const attend_plan *p, scratch *w, float **local_part) {
    size_t cells = (size_t)(p->cap * (c->heads / c->kv_heads) + ROW_PAD), d = (size_t)c->d;
    *w = (scratch){malloc(sizeof(float) * cells * d), malloc(sizeof(float) * cells * KEY_CHUNK),
                   malloc(sizeof(float) * cells), malloc(sizeof(float) * cells),
                   aligned_alloc(sizeof(vec), sizeof(vec) * cells * (d / LANES)), malloc(sizeof(float) * LANES * d),
                   NULL, NULL, NULL, NULL};
    int local = p->max_chunks > 1 && !p->spread;
    *local_part = local ? malloc(sizeof(float) * cells * (size_t)p->part_head) : NULL;
    int failed = !w->qf || !w->scores || !w->total || !w->max || !w->acc || !w->keys || (local && !*local_part);
#ifdef BF16_DOTS
    if (c->bf16) {
        w->qpairs = malloc(sizeof(uint32_t) * cells * d / 2);
        w->probs = calloc(cells * KEY_CHUNK, sizeof(uint16_t)); /* rows past a run's heads: read, unused */
        w->vpairs = malloc(sizeof(uint16_t) * KEY_CHUNK * d);
        w->tile = aligned_alloc(64, 32 * d);
        failed |= !w->qpairs || !w->probs || !w->vpairs || !w->tile;
    }
#endif
    return failed;
}

static void free_scratch(scratch *w, float *local_part) {
    free(w->qf), free(w->scores), free(w->total), free(w->max), free(w->acc), free(w->keys);
    free(w->qpairs), free(w->probs), free(w->vpairs), free(w->tile), free(local_part);
}

/* Task i of plan p: a run's kv head, all its chunks or (spread) one. */
static void attend_task(const attend_call *c, const attend_plan *p, int64_t i, scratch w, float *local_part) {
    int64_t group = c->heads / c->kv_heads, kv_heads = c->kv_heads, d = c->d, heads = c->heads, esz = c->bf16 ? 2 : 4;
    int64_t run = p->task[3 * i], kvh = p->task[3 * i + 1], ch = p->task[3 * i + 2], t = p->first[run];
    int64_t nq = p->first[run + 1] - t, q_bytes = c->q_stride * esz, part_head = p->part_head;
    const char *qt = (const char *)c->q + t * q_bytes, *kv = c->kv;
    const int64_t *slots = c->key_slots + c->key_start[t], *key_len = c->key_len;
    key_mask run_mask = {0};
    if (c->mask_from) run_mask = (key_mask){c->mask_from + t, c->mask + t * c->mask_width, c->mask_width, 0};
    const key_mask *hides = c->mask_from ? &run_mask : NULL;
    if (p->chunks[run] == 1)
        attend_run(qt, q_bytes, kv, slots, key_len + t, nq, (char *)c->out + t * heads * d * esz, heads * d * esz, kvh,
                   kv_heads, group, d, c->scale, c->bf16, hides, w, NULL, 0, 0);
    else if (p->spread)
        attend_chunk(qt, q_bytes, kv, slots, key_len + t, nq, ch, kvh, kv_heads, group, d, c->scale, c->bf16, hides, w,
                     p->part + (t * heads + kvh) * part_head + ch * PART(d), heads * part_head, kv_heads * part_head);
    else {
        for (ch = 0; ch < p->chunks[run]; ch++)
            attend_chunk(qt, q_bytes, kv, slots, key_len + t, nq, ch, kvh, kv_heads, group, d, c->scale, c->bf16, hides,
                         w, local_part + ch * PART(d), group * part_head, part_head);
        for (int64_t r = 0; r < nq; r++)
            for (int64_t g = 0; g < group; g++)
                combine_chunks(local_part + (r * group + g) * part_head, (key_len[t + r] + KEY_CHUNK - 1) / KEY_CHUNK,
                               d, (char *)c->out + ((t + r) * heads + g * kv_heads + kvh) * d * esz, c->bf16);
    }
}

/* Plan p's tasks shared by the threads of the enclosing parallel region (every thread calls
 * this; `failed`: this thread's scratch is missing, so it takes no task), each output written
 * when the last worksharing loop's barrier is passed. */
static void attend_tasks(const attend_call *c, const attend_plan *p, scratch w, float *local_part, int failed) {
    /* dynamic: chunks and runs differ in size; what each computes does not depend on who runs it */
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < p->tasks; i++)
        if (!failed) attend_task(c, p, i, w, local_part);
    if (!p->spread) return;
    int64_t heads = c->heads, d = c->d, esz = c->bf16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < c->tokens * heads; i++) {
        int64_t t = i / heads, run = 0;
        while (p->first[run + 1] <= t) run++;
        if (!failed && p->chunks[run] > 1)
            combine_chunks(p->part + i * p->part_head, (c->key_len[t] + KEY_CHUNK - 1) / KEY_CHUNK, d,
                           (char *)c->out + i * d * esz, c->bf16);
    }
}

static int attend_sizes_ok(int64_t heads, int64_t kv_heads, int64_t d) {
    return d % LANES == 0 && d <= MAX_HEAD_DIM && heads % kv_heads == 0 && heads / kv_heads <= MAX_GROUP;
}

/* q: [tokens, q_stride elements] with head h at h*d (query heads group-major: head
 * g*kv_heads + kvh uses kv head kvh); kv: one layer of the pool, [slots, 2, kv_heads, d];
 * query t attends over key_slots[key_start[t] : key_start[t] + key_len[t]] (key_len >= 1),
 * less the keys j >= mask_from[t] of that list where mask[t * mask_width + j - mask_from[t]]
 * is 0 (mask_from NULL: none hidden; see key_mask); out: [tokens, heads*d]. Consecutive
 * tokens with the same key_start form runs (of at most STEP_RUN) that share key loads. Returns
 * 0, -1 for a head dim or group it does not take, -2 when out of memory. */
int attend(const void *q, int64_t q_stride, const void *kv, const int64_t *key_slots,
           const int64_t *key_start, const int64_t *key_len, const int64_t *mask_from, const uint8_t *mask,
           int64_t mask_width, void *out, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d, float scale,
           int bf16, int threads) {
    if (!attend_sizes_ok(heads, kv_heads, d)) return -1;
    if (tokens == 0) return 0;
    attend_call c = {q,       kv,   key_slots,  key_start, key_len, mask_from, mask, out, q_stride,
                     mask_width, tokens, heads, kv_heads,  d,       scale,     bf16};
    attend_plan p;
    if (plan_attend(&c, STEP_RUN, threads, &p)) return -2;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        scratch w;
        float *local_part;
        failed = new_scratch(&c, &p, &w, &local_part);
        attend_tasks(&c, &p, w, local_part, failed);
        free_scratch(&w, local_part);
    }
    free_plan(&p);
    return failed ? -2 : 0;
}

/* RMSNorm of `rows` rows of n values (n a multiple of LANES, at most MAX_NORM), rounded as
 * transformers' RMSNorm rounds: the mean of squares in float32, the normalized row rounded to
 * the input dtype, then times the weight (rounded again). One row's arithmetic never depends
 * on the other rows, so this is batch invariant too; it is here for speed: one call instead of
 * the ~8 tensor ops (each a few microseconds) of F.rms_norm, twice per layer per step. */
#define MAX_NORM 16384
static void norm_row(const char *x, const void *weight, char *out, int64_t n, float eps, int bf16) {
    int64_t esz = bf16 ? 2 : 4;
    float row[MAX_NORM], w[ELEMS];
    load_row(x, n, row, bf16);
    vec squares = {0};
    for (int64_t i = 0; i < n; i += LANES) {
        vec v;
        memcpy(&v, row + i, sizeof v);
        squares += v * v;
    }
    float inv = 1.0f / sqrtf(hsum(squares) / (float)n + eps);
    for (int64_t i = 0; i < n; i += ELEMS) {
        evec v;
        memcpy(&v, row + i, sizeof v);
        v *= inv;
        if (bf16) v = round_bf16(v);
        load_row((const char *)weight + i * esz, ELEMS, w, bf16);
        evec wv;
        memcpy(&wv, w, sizeof wv);
        v *= wv;
        memcpy(row + i, &v, sizeof v);
    }
    store_row(row, n, out, bf16);
}

int rms_norm(const void *x, int64_t x_stride, const void *weight, void *out, int64_t out_stride, int64_t rows,
             int64_t n, float eps, int bf16, int threads) {
    if (n % LANES != 0 || n > MAX_NORM) return -1;
    int64_t esz = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 4 * threads)
    for (int64_t r = 0; r < rows; r++)
        norm_row((const char *)x + r * x_stride * esz, weight, (char *)out + r * out_stride * esz, n, eps, bf16);
    return 0;
}

/* RoPE on the query and key heads of each token's fused q|k|v row, in place, then the token's
 * key and value heads into its pool slot (kv: [slots][2][kv_heads][d]). x' = x * cos +
 * swap_halves(x) * sin, sin with its first half negated (rotate_half folded into it), rounded
 * as the bf16 tensor ops round: the product x * cos, then the sum. */
static void rope_row(char *row, const void *cos, const void *sin, char *slot, int64_t t, int64_t heads,
                     int64_t kv_heads, int64_t d, int bf16) {
    int64_t esz = bf16 ? 2 : 4, half = d / 2;
    float c[MAX_HEAD_DIM], s[MAX_HEAD_DIM], x[MAX_HEAD_DIM];
    load_row((const char *)cos + t * d * esz, d, c, bf16);
    load_row((const char *)sin + t * d * esz, d, s, bf16);
    for (int64_t h = 0; h < heads + kv_heads; h++) {
        float y[MAX_HEAD_DIM], swapped[MAX_HEAD_DIM];
        load_row(row + h * d * esz, d, x, bf16);
        memcpy(swapped, x + half, sizeof(float) * (size_t)half);
        memcpy(swapped + half, x, sizeof(float) * (size_t)half);
        for (int64_t i = 0; i < d; i += ELEMS) {
            evec xv, sw, cv, sv;
            memcpy(&xv, x + i, sizeof xv);
            memcpy(&sw, swapped + i, sizeof sw);
            memcpy(&cv, c + i, sizeof cv);
            memcpy(&sv, s + i, sizeof sv);
            evec a = xv * cv;
            if (bf16) a = round_bf16(a);
            evec out = a + sw * sv;
            memcpy(y + i, &out, sizeof out);
        }
        store_row(y, d, row + h * d * esz, bf16);
    }
    memcpy(slot, row + heads * d * esz, (size_t)(2 * kv_heads * d * esz)); /* k heads, then v heads */
}

int rope_store(void *qkv, int64_t qkv_stride, const void *cos, const void *sin, void *kv, const int64_t *slots,
               int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d, int bf16, int threads) {
    if (d > MAX_HEAD_DIM || d % LANES != 0) return -1;
    int64_t esz = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens >= 4 * threads)
    for (int64_t t = 0; t < tokens; t++)
        rope_row((char *)qkv + t * qkv_stride * esz, cos, sin, (char *)kv + slots[t] * 2 * kv_heads * d * esz, t, heads,
                 kv_heads, d, bf16);
    return 0;
}

/* out = silu(gate) * up per row of gate|up (each n values, n a multiple of LANES), rounded as
 * the bf16 tensor ops round: silu, then the product. silu(x) = x * sigmoid(x), the sigmoid
 * from exp(-|x|) so every lane takes the same vector code. */
static void silu_row(const char *gate, char *out, int64_t n, int bf16) {
    int64_t esz = bf16 ? 2 : 4;
    const char *up_row = gate + n * esz;
    for (int64_t i = 0; i < n; i += ELEMS) {
        evec x, up;
        load_row(gate + i * esz, ELEMS, (float *)&x, bf16);
        load_row(up_row + i * esz, ELEMS, (float *)&up, bf16);
        evec e = exp_nonpositive(select(x < 0, x, -x));
        evec sig = select(x < 0, e, (evec){0} + 1.0f) / (1.0f + e); /* e / (1 + e) or 1 / (1 + e) */
        evec act = x * sig;
        if (bf16) act = round_bf16(act);
        act *= up;
        store_row((const float *)&act, ELEMS, out + i * esz, bf16);
    }
}

int silu_mul(const void *gate_up, int64_t in_stride, void *out, int64_t out_stride, int64_t rows, int64_t n, int bf16,
             int threads) {
    if (n % LANES != 0 || n > MAX_NORM) return -1;
    int64_t esz = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 4 * threads)
    for (int64_t r = 0; r < rows; r++)
        silu_row((const char *)gate_up + r * in_stride * esz, (char *)out + r * out_stride * esz, n, bf16);
    return 0;
}

/* Greedy verification's argmax: per row of n values, the index of the largest (the first of
 * equal ones, as torch.argmax), or -1 for a row holding a NaN (the caller then asks torch,
 * whose argmax picks the NaN). One pass: each lane keeps its largest value and where it first
 * was; the row's answer is the first index among the lanes holding the largest. */
static float row_value(const char *row, int64_t i, int bf16) {
    float f;
    if (bf16) {
        uint32_t u = (uint32_t)((const uint16_t *)row)[i] << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, row + i * sizeof(float), sizeof f);
    }
    return f;
}

#define ARGMAX_WAYS 4 /* independent (value, index) pairs a lane keeps: no chain of selects */
static int64_t argmax_row(const char *row, int64_t n, int bf16) {
    const int64_t step = ELEMS * ARGMAX_WAYS;
    int64_t esz = bf16 ? 2 : 4, whole = n - n % step, at = -1;
    float m = -INFINITY;
    if (whole) {
        evec best[ARGMAX_WAYS];
        eivec lane, best_at[ARGMAX_WAYS], nan = {0};
        for (int l = 0; l < ELEMS; l++) lane[l] = l;
        for (int w = 0; w < ARGMAX_WAYS; w++) {
            load_row(row + w * ELEMS * esz, ELEMS, (float *)&best[w], bf16);
            nan |= best[w] != best[w];
            best_at[w] = lane + w * ELEMS;
        }
        for (int64_t i = step; i < whole; i += step)
            for (int w = 0; w < ARGMAX_WAYS; w++) {
                evec v;
                load_row(row + (i + w * ELEMS) * esz, ELEMS, (float *)&v, bf16);
                nan |= v != v;
                eivec above = v > best[w]; /* strictly: a lane keeps its first of equal values */
                best[w] = select(above, v, best[w]);
                best_at[w] = (above & (lane + (int32_t)(i + w * ELEMS))) | (~above & best_at[w]);
            }
        for (int l = 0; l < ELEMS; l++) {
            if (nan[l]) return -1;
            for (int w = 0; w < ARGMAX_WAYS; w++)
                if (at < 0 || best[w][l] > m || (best[w][l] == m && best_at[w][l] < at))
                    m = best[w][l], at = best_at[w][l];
        }
    }
    for (int64_t i = whole; i < n; i++) {
        float f = row_value(row, i, bf16);
        if (f != f) return -1;
        if (f > m || at < 0) m = f, at = i;
    }
    return at; /* -1 for an empty row */
}

void argmax_rows(const void *x, int64_t stride, int64_t rows, int64_t n, int bf16, int64_t *out) {
    int64_t esz = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row((const char *)x + r * stride * esz, n, bf16);
}

/* The linear layers' shared parts: both run TILE_ROWS rows of x per pass over the weights of
 * GROUP outputs (4 vectors of 16), packed by pack_linear. */
#define GROUP 64
#define TILE_ROWS 6
/* How far ahead of the weights being summed the bf16, int8 and int4 kernels prefetch: 2 KB left
 * DRAM idle while 5 or more rows computed. Kernels alone on cold weights, 8 KB against 2 KB:
 * Qwen2.5-1.5B's bf16 linears 0.90x the time for 5 rows, 0.97x for 1; its int4 drafter's 0.93x
 * for 5 to 8 rows, the same for 1 and 2 (AVX2: 0.97-0.98x); int8 the same. */
#define PREFETCH_BYTES 8192
/* The AVX2 kernels' tiling (bf16 and int8 alike; see the AVX2 packed_linear): 8 sums in
 * registers a pass over 1-4 rows, K in chunks of CHUNK_WORDS words of a group (8 KB, kept in L1)
 * that every tile of a block of BLOCK_ROWS rows reads before the next chunk. */
#define AVX2_ROWS 4
#define PREFETCH_WORDS 16 /* ahead of the word being summed: 4 KB, ~2 us of weights */
#define CHUNK_WORDS 32
#define BLOCK_ROWS 16 /* rows whose sums of a group stay in L1 (4 KB) */

/* A linear layer's weight [n][words] (a word: the 2 bf16 or 4 int8 weights of one output that
 * one dot-product instruction takes) in the kernels' layout [groups][words][GROUP]: per group
 * of GROUP outputs, each word of every output side by side, so the weights stream in order.
 * Padding outputs are zero, and never stored. */
void pack_linear(const uint32_t *w, int64_t n, int64_t words, uint32_t *out) {
    int64_t groups = (n + GROUP - 1) / GROUP;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t p = 0; p < words; p++)
            for (int64_t j = 0; j < GROUP; j++) {
                int64_t row = g * GROUP + j;
                out[(g * words + p) * GROUP + j] = row < n ? w[row * words + p] : 0;
            }
}
#if defined(__AVX512F__) && defined(__AVX512BW__)
static __m512 widen_bf16(__mmask16 mask, const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

static __m256i narrow_bf16(__m512 v) { /* round_bf16's rounding (no NaN reaches here), high halves */
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512((__m512)round_bf16((evec)v)), 16));
}

#endif

/* bf16 linear layers: y = x W^T (+ bias) (+ residual), float32 accumulation, bf16 out.
 *
 * W is packed once at load as [groups][K/2][GROUP][2]: per group of GROUP outputs, each pair of
 * K positions for every output side by side, so one AVX-512 BF16 dot-product instruction adds a
 * broadcast pair of x to 16 outputs' sums and the weights stream in order. Each output's sum
 * runs over K in the same order whatever the row count, tile or thread: every row gets the same
 * bits alone as among others (batch invariant by construction). Measured against oneDNN's
 * prepacked kernel on SmolLM2's 30 layers of weights (2-core EPYC, cold caches): 0.63-0.77x
 * its time for 1 to 17 rows, 0.91x for 40, equal from 128 to 512.
 *
 * More rows than one tile take: the tiles of a block of rows (split evenly) each sum a chunk of
 * K before the next chunk, their sums kept in memory between chunks, so a group's weights come
 * from memory once and from L1 for the other tiles (Qwen2.5-1.5B's down_proj group is 1.1 MB,
 * past L2), and the rows split evenly over the tiles (7: 4 + 3, not 6 + 1). The sums still run
 * over K in order: the same bits. Kernels alone on cold weights, against unchunked tiles of 6
 * and 2 KB of prefetch: Qwen2.5-Coder-1.5B's linears 0.72-0.80x the time for 7 to 17 rows,
 * 0.90x for 5, 0.97x for 1; SmolLM2's 0.81x for 8 to 40 rows, 0.88-0.99x for 5. */
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define CHUNK_PAIRS 64 /* K pairs of a group's weights (16 KB) every tile of a block sums in turn */
#define TILE_BLOCK 48  /* rows whose sums of a group wait in memory between chunks (12 KB) */
int packed_linear_available(void) { return 1; }

/* Adds K pairs [p0, p1) of the group's weights wg to the sums of R rows (xr) x GROUP outputs.
 * R is a constant wherever this is inlined (tile_pass), so the sums stay in registers and the
 * loop is loads and dot products only: with R read at run time GCC tested it after every row
 * and stored 24 flag bytes a pair, and a 2k-token prefill's GEMMs ran at ~1/2 the dot products'
 * rate. Each sum still adds its pairs one by one in K order: the same bits. */
static inline __attribute__((always_inline)) void sum_pairs(const uint32_t *wg, const uint32_t *const *xr, const int R,
                                                            int64_t p0, int64_t p1, const int prefetch,
                                                            __m512 acc[TILE_ROWS][4]) {
    for (int64_t p = p0; p < p1; p++) {
        const uint32_t *wp = wg + p * GROUP;
        if (prefetch)
            for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(wp + 16 * j) + PREFETCH_BYTES, _MM_HINT_T0);
        __m512bh w[4];
        for (int j = 0; j < 4; j++) w[j] = (__m512bh)_mm512_loadu_si512(wp + 16 * j);
        for (int i = 0; i < R; i++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[i][p]);
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, w[j]);
        }
    }
}

/* One tile's pass over K pairs [p0, p1): its sums from `sums` (or zero at p0 = 0) and back
 * there if K goes on, else y (+ bias, + residual) for its rows m0 .. m0 + R - 1. Only the tile
 * that first reads a chunk of weights (from memory) prefetches; the others find it in cache. */
static inline __attribute__((always_inline)) void tile_rows(const uint32_t *wg, const uint16_t *x, int64_t x_stride,
                                                            const int R, int64_t m0, int64_t p0, int64_t p1,
                                                            int64_t pairs, int prefetch, __m512 sums[][4],
                                                            const uint16_t *bias, const uint16_t *residual,
                                                            int64_t residual_stride, uint16_t *y, int64_t y_stride,
                                                            int64_t n0, int64_t n) {
    __m512 acc[TILE_ROWS][4];
    const uint32_t *xr[TILE_ROWS];
    for (int i = 0; i < R; i++) {
        xr[i] = (const uint32_t *)(x + (m0 + i) * x_stride);
        for (int j = 0; j < 4; j++) acc[i][j] = p0 ? sums[i][j] : _mm512_setzero_ps();
    }
    if (prefetch)
        sum_pairs(wg, xr, R, p0, p1, 1, acc);
    else
        sum_pairs(wg, xr, R, p0, p1, 0, acc);
    if (p1 < pairs) { /* more of K to come */
        for (int i = 0; i < R; i++)
            for (int j = 0; j < 4; j++) sums[i][j] = acc[i][j];
        return;
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 4; j++) {
            int64_t o = n0 + j * 16;
            if (o >= n) break;
            __mmask16 mask = n - o >= 16 ? 0xffff : (__mmask16)((1u << (n - o)) - 1);
            __m512 v = acc[i][j];
            if (bias) v = _mm512_add_ps(v, widen_bf16(mask, bias + o));
            if (residual) v = _mm512_add_ps(v, widen_bf16(mask, residual + (m0 + i) * residual_stride + o));
            _mm256_mask_storeu_epi16(y + (m0 + i) * y_stride + o, mask, narrow_bf16(v));
        }
}

static void tile_pass(const uint32_t *wg, const uint16_t *x, int64_t x_stride, int rows, int64_t m0, int64_t p0,
                      int64_t p1, int64_t pairs, int prefetch, __m512 sums[][4], const uint16_t *bias,
                      const uint16_t *residual, int64_t residual_stride, uint16_t *y, int64_t y_stride, int64_t n0,
                      int64_t n) {
#define TILE(R)                                                                                                        \
    case R:                                                                                                            \
        tile_rows(wg, x, x_stride, R, m0, p0, p1, pairs, prefetch, sums, bias, residual, residual_stride, y, y_stride, \
                  n0, n);                                                                                              \
        break;
    switch (rows) {
        TILE(1)
        TILE(2)
        TILE(3)
        TILE(4)
        TILE(5)
        TILE(6)
    }
#undef TILE
}

int packed_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                  const uint16_t *residual, int64_t residual_stride, uint16_t *y, int64_t y_stride, int64_t m,
                  int64_t n, int64_t k, int threads) {
    if (k % 2 != 0) return -1;
    int64_t groups = (n + GROUP - 1) / GROUP, pairs = k / 2, blocks = (m + TILE_BLOCK - 1) / TILE_BLOCK;
    /* Tasks: a group of outputs for a block of rows, so a prefill's few groups (SmolLM2's
     * o_proj: 9) still split evenly over the threads. */
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = 0; b < blocks; b++) {
            const uint32_t *wg = (const uint32_t *)packed + g * pairs * GROUP;
            int64_t b0 = b * TILE_BLOCK, b1 = m - b0 < TILE_BLOCK ? m : b0 + TILE_BLOCK;
            /* tiles of sizes at most one apart (32 rows: 6 + 6 + 5 + 5 + 5 + 5, not 6 x 5 + 2) */
            int64_t tiles = (b1 - b0 + TILE_ROWS - 1) / TILE_ROWS, small = (b1 - b0) / tiles, big = (b1 - b0) % tiles;
            int64_t chunk = tiles == 1 ? pairs : CHUNK_PAIRS; /* one tile keeps its sums in registers */
            __m512 sums[TILE_BLOCK][4];
            for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
                int64_t p1 = pairs - p0 < chunk ? pairs : p0 + chunk;
                for (int64_t t = 0, m0 = b0; t < tiles; m0 += small + (t < big), t++)
                    tile_pass(wg, x, x_stride, (int)(small + (t < big)), m0, p0, p1, pairs, t == 0, sums + (m0 - b0),
                              bias, residual, residual_stride, y, y_stride, g * GROUP, n);
            }
        }
    }
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 + FMA (no bf16 instructions): the same packed weights, widened in registers. A word holds
 * the bf16 weights of K positions 2p (low half) and 2p+1 (high half), so the float32 of the
 * first is the word shifted up 16 bits and of the second the word's high half: two FMAs per
 * pair, 8 outputs a vector. Each output's sum runs over K in the same order whatever the row
 * count, tile or thread (batch invariant by construction). x is widened to float32 once per
 * call. A pass keeps 8 sums in registers whatever its rows (1 row x 64 outputs, 2 x 32, 3-4 x
 * 16): fewer leave the FMA units waiting on each sum's chain (1 row x 16 outputs summed at half
 * the memory's speed). K runs in chunks of CHUNK_WORDS pairs (8 KB of weights, kept in L1) that
 * every pass of every tile of up to BLOCK_ROWS rows reads before the next chunk, so the weights
 * stream from memory once and in order (a tile at a time over the whole group: 15-20% slower
 * for 5-16 rows); a prompt's further blocks of rows read the group again from L2. */

int packed_linear_available(void) { return 1; }

static __m256 pair_low(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static __m256 pair_high(__m256i w) { return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u))); }

/* Adds pairs [p0, p1) of K to the sums of `vecs` x 8 outputs (from output h of the group) of
 * `rows` rows, x already widened to float32 ([rows][k], row stride k); inlined per constant
 * (rows, vecs), so the sums stay in registers. The sums live in `sums` between calls: float32
 * stored and loaded back exactly, so each output's chain of FMAs is the same however K is cut. */
static inline __attribute__((always_inline)) void pass(const uint32_t *wg, int h, int64_t p0, int64_t p1,
                                                        const float *xf, int64_t k, int rows, int vecs,
                                                        float (*sums)[GROUP]) {
    __m256 acc[AVX2_ROWS][GROUP / 8];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < vecs; j++) acc[i][j] = _mm256_loadu_ps(sums[i] + h + 8 * j);
    for (int64_t p = p0; p < p1; p++) {
        const uint32_t *wp = wg + p * GROUP + h;
        if (h == 0) /* the first pass over these pairs fetches all the group's outputs ahead */
            for (int j = 0; j < GROUP; j += 16) _mm_prefetch((const char *)(wp + PREFETCH_WORDS * GROUP + j), _MM_HINT_T0);
        /* 16 ymm registers: widen the weights once and stream x, or the reverse when there are
         * more weight vectors than rows (the same sums either way) */
        if (vecs <= 2) {
            __m256 lo[2], hi[2];
            for (int j = 0; j < vecs; j++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(wp + 8 * j));
                lo[j] = pair_low(w), hi[j] = pair_high(w);
            }
            for (int i = 0; i < rows; i++) {
                __m256 xa = _mm256_broadcast_ss(xf + i * k + 2 * p), xb = _mm256_broadcast_ss(xf + i * k + 2 * p + 1);
                for (int j = 0; j < vecs; j++) acc[i][j] = _mm256_fmadd_ps(xb, hi[j], _mm256_fmadd_ps(xa, lo[j], acc[i][j]));
            }
        } else {
            __m256 xa[2], xb[2];
            for (int i = 0; i < rows; i++) {
                xa[i] = _mm256_broadcast_ss(xf + i * k + 2 * p);
                xb[i] = _mm256_broadcast_ss(xf + i * k + 2 * p + 1);
            }
            for (int j = 0; j < vecs; j++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(wp + 8 * j));
                __m256 lo = pair_low(w), hi = pair_high(w);
                for (int i = 0; i < rows; i++) acc[i][j] = _mm256_fmadd_ps(xb[i], hi, _mm256_fmadd_ps(xa[i], lo, acc[i][j]));
            }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < vecs; j++) _mm256_storeu_ps(sums[i] + h + 8 * j, acc[i][j]);
}

int packed_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                  const uint16_t *residual, int64_t residual_stride, uint16_t *y, int64_t y_stride, int64_t m,
                  int64_t n, int64_t k, int threads) {
    if (k % 2 != 0) return -1;
    int64_t groups = (n + GROUP - 1) / GROUP, pairs = k / 2;
    float *xf = malloc((size_t)(m * k) * sizeof(float)); /* x widened once, not per group */
    if (!xf) return -3;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < k; j++) xf[i * k + j] = row_value((const char *)(x + i * x_stride), j, 1);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint32_t *wg = (const uint32_t *)packed + g * pairs * GROUP;
        int outputs = n - g * GROUP < GROUP ? (int)(n - g * GROUP) : GROUP;
        for (int64_t b0 = 0; b0 < m; b0 += BLOCK_ROWS) {
            int64_t b1 = m - b0 < BLOCK_ROWS ? m : b0 + BLOCK_ROWS;
            float sums[BLOCK_ROWS][GROUP] = {{0}};
            for (int64_t p0 = 0; p0 < pairs; p0 += CHUNK_WORDS) {
                int64_t p1 = pairs - p0 < CHUNK_WORDS ? pairs : p0 + CHUNK_WORDS;
                for (int64_t m0 = b0; m0 < b1; m0 += AVX2_ROWS) {
                    int rows = b1 - m0 < AVX2_ROWS ? (int)(b1 - m0) : AVX2_ROWS, width = rows == 1 ? 64 : rows == 2 ? 32 : 16;
                    const float *xr = xf + m0 * k;
                    float(*tile)[GROUP] = sums + (m0 - b0);
                    for (int h = 0; h < outputs; h += width) switch (rows) {
                            case 1: pass(wg, h, p0, p1, xr, k, 1, 8, tile); break;
                            case 2: pass(wg, h, p0, p1, xr, k, 2, 4, tile); break;
                            case 3: pass(wg, h, p0, p1, xr, k, 3, 2, tile); break;
                            default: pass(wg, h, p0, p1, xr, k, AVX2_ROWS, 2, tile); break;
                        }
                }
            }
            for (int64_t i = b0; i < b1; i++) {
                const uint16_t *res = residual ? residual + i * residual_stride : NULL;
                float *row = sums[i - b0];
                for (int j = 0; j < outputs; j++) {
                    if (bias) row[j] += row_value((const char *)bias, g * GROUP + j, 1);
                    if (res) row[j] += row_value((const char *)res, g * GROUP + j, 1);
                }
                store_row(row, outputs, (char *)(y + i * y_stride + g * GROUP), 1);
            }
        }
    }
    free(xf);
    return 0;
}

#else
int packed_linear_available(void) { return 0; }
int packed_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                  const uint16_t *residual, int64_t residual_stride, uint16_t *y, int64_t y_stride, int64_t m,
                  int64_t n, int64_t k, int threads) {
    return -2;
}
#endif

/* int8 linear layers (a quantized drafter's): y = x W^T (+ bias) (+ residual), bf16 in and out.
 *
 * W is quantized once at load, symmetric per output (w = scale[n] * q, q in [-127, 127]), and
 * packed as [groups][K/4][GROUP][4]: per group, each 4 K positions of every output side by
 * side, so one AVX-512 VNNI instruction adds a broadcast 4 bytes of x to 16 outputs' int32
 * sums. x is quantized per row when the call comes (dynamic, as torch's dynamic int8): u8 with
 * zero point 128, so x W^T = xs * scale * (sum(xq * q) - 128 * sum(q)); wsum[n] = sum(q) is
 * kept with the weights. Half the bytes of the bf16 kernel stream per token: a drafter's
 * step is bound by them. Not exact (the target never runs this); every row is quantized and
 * summed alone, so each row still gets the same result whatever shares its call. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
int int8_linear_available(void) { return 1; }

/* one row of k bf16 values -> u8 (round to nearest even, + 128); returns its scale */
static float quantize_row(const uint16_t *x, int64_t k, uint8_t *q) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        __mmask16 mask = k - i >= 16 ? 0xffff : (__mmask16)((1u << (k - i)) - 1);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(widen_bf16(mask, x + i)));
    }
    float top = _mm512_reduce_max_ps(amax), scale = top > 0 ? top / 127.0f : 1.0f;
    __m512 inv = _mm512_set1_ps(1.0f / scale);
    __m512i zero_point = _mm512_set1_epi32(128);
    for (int64_t i = 0; i < k; i += 16) {
        __mmask16 mask = k - i >= 16 ? 0xffff : (__mmask16)((1u << (k - i)) - 1);
        __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(widen_bf16(mask, x + i), inv)), zero_point);
        _mm_mask_storeu_epi8(q + i, mask, _mm512_cvtusepi32_epi8(v));
    }
    return scale;
}

int int8_linear(const uint16_t *x, int64_t x_stride, const int8_t *packed, const float *scale, const int32_t *wsum,
                const uint16_t *bias, const uint16_t *residual, int64_t residual_stride, uint16_t *y,
                int64_t y_stride, int64_t m, int64_t n, int64_t k, int threads) {
    if (k % 4 != 0) return -1;
    uint8_t *xq = malloc((size_t)(m * k));
    float *xs = malloc((size_t)m * sizeof(float));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -3;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < m; r++) xs[r] = quantize_row(x + r * x_stride, k, xq + r * k);
    int64_t groups = (n + GROUP - 1) / GROUP, quads = k / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int32_t *wg = (const int32_t *)packed + g * quads * GROUP;
        for (int64_t m0 = 0; m0 < m; m0 += TILE_ROWS) {
            int rows = m - m0 < TILE_ROWS ? (int)(m - m0) : TILE_ROWS;
            __m512i acc[TILE_ROWS][4];
            const int32_t *xr[TILE_ROWS];
            for (int i = 0; i < rows; i++) {
                xr[i] = (const int32_t *)(xq + (m0 + i) * k);
                for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
            }
            for (int64_t p = 0; p < quads; p++) {
                const int32_t *wp = wg + p * GROUP;
                for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(wp + 16 * j) + PREFETCH_BYTES, _MM_HINT_T0);
                __m512i w[4];
                for (int j = 0; j < 4; j++) w[j] = _mm512_loadu_si512(wp + 16 * j);
                for (int i = 0; i < rows; i++) {
                    __m512i xb = _mm512_set1_epi32(xr[i][p]);
                    for (int j = 0; j < 4; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xb, w[j]);
                }
            }
            for (int j = 0; j < 4; j++) {
                int64_t n0 = g * GROUP + j * 16;
                if (n0 >= n) break;
                __mmask16 mask = n - n0 >= 16 ? 0xffff : (__mmask16)((1u << (n - n0)) - 1);
                __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, wsum + n0), 7);
                __m512 wscale = _mm512_maskz_loadu_ps(mask, scale + n0);
                __m512 b = bias ? widen_bf16(mask, bias + n0) : _mm512_setzero_ps();
                for (int i = 0; i < rows; i++) {
                    __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], offset));
                    v = _mm512_fmadd_ps(v, _mm512_mul_ps(wscale, _mm512_set1_ps(xs[m0 + i])), b);
                    if (residual) v = _mm512_add_ps(v, widen_bf16(mask, residual + (m0 + i) * residual_stride + n0));
                    _mm256_mask_storeu_epi16(y + (m0 + i) * y_stride + n0, mask, narrow_bf16(v));
                }
            }
        }
    }
    free(xq);
    free(xs);
    return 0;
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same int8 arithmetic on AVX2 (no VNNI): each weight word's 4 int8 are sign-extended to
 * two int16 pairs ((w0, w2), (w1, w3)) and multiplied with x's matching u8 pairs by vpmaddwd,
 * whose int32 sums of two products (each at most 255 * 127) never saturate: the integer sums,
 * and so every output bit, are those of the VNNI kernel. Half the bytes of the bf16 kernel and
 * fewer instructions per weight: a drafter's step streams half the memory. Tiled as the AVX2 bf16
 * kernel (AVX2_ROWS, CHUNK_WORDS, BLOCK_ROWS), int32 sums in place of float32. */

int int8_linear_available(void) { return 1; }

/* one row of k bf16 values -> u8 (round to nearest even, + 128) as int16 pairs per quad of K:
 * pairs[2p] = (x[4p], x[4p+2]), pairs[2p+1] = (x[4p+1], x[4p+3]); returns its scale */
static float quantize_row(const uint16_t *x, int64_t k, uint32_t *pairs) {
    float top = 0.0f;
    for (int64_t i = 0; i < k; i++) top = fmaxf(top, fabsf(row_value((const char *)x, i, 1)));
    float scale = top > 0 ? top / 127.0f : 1.0f, inv = 1.0f / scale;
    for (int64_t p = 0; p < k / 4; p++) {
        uint32_t q[4];
        for (int j = 0; j < 4; j++) q[j] = (uint32_t)(lrintf(row_value((const char *)x, 4 * p + j, 1) * inv) + 128);
        pairs[2 * p] = q[0] | q[2] << 16;
        pairs[2 * p + 1] = q[1] | q[3] << 16;
    }
    return scale;
}

/* Adds quads [p0, p1) of K to the int32 sums of `vecs` x 8 outputs (from output h of the
 * group) of `rows` rows; inlined per constant (rows, vecs) so the sums stay in registers. */
static inline __attribute__((always_inline)) void quad_pass(const int32_t *wg, int h, int64_t p0, int64_t p1,
                                                             const uint32_t *xp, int64_t k2, int rows, int vecs,
                                                             int32_t (*sums)[GROUP]) {
    __m256i acc[AVX2_ROWS][GROUP / 8];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < vecs; j++) acc[i][j] = _mm256_loadu_si256((const __m256i *)(sums[i] + h + 8 * j));
    for (int64_t p = p0; p < p1; p++) {
        const int32_t *wp = wg + p * GROUP + h;
        if (h == 0)
            for (int j = 0; j < GROUP; j += 16) _mm_prefetch((const char *)(wp + PREFETCH_WORDS * GROUP + j), _MM_HINT_T0);
        if (vecs <= 2) { /* few weight vectors: widen them once, stream the rows */
            __m256i even[2], odd[2];
            for (int j = 0; j < vecs; j++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(wp + 8 * j));
                even[j] = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), odd[j] = _mm256_srai_epi16(w, 8);
            }
            for (int i = 0; i < rows; i++) {
                __m256i xe = _mm256_set1_epi32((int)xp[i * k2 + 2 * p]), xo = _mm256_set1_epi32((int)xp[i * k2 + 2 * p + 1]);
                for (int j = 0; j < vecs; j++)
                    acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_add_epi32(_mm256_madd_epi16(even[j], xe),
                                                                             _mm256_madd_epi16(odd[j], xo)));
            }
        } else {
            __m256i xe[2], xo[2];
            for (int i = 0; i < rows; i++) {
                xe[i] = _mm256_set1_epi32((int)xp[i * k2 + 2 * p]);
                xo[i] = _mm256_set1_epi32((int)xp[i * k2 + 2 * p + 1]);
            }
            for (int j = 0; j < vecs; j++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(wp + 8 * j));
                __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), odd = _mm256_srai_epi16(w, 8);
                for (int i = 0; i < rows; i++)
                    acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_add_epi32(_mm256_madd_epi16(even, xe[i]),
                                                                             _mm256_madd_epi16(odd, xo[i])));
            }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < vecs; j++) _mm256_storeu_si256((__m256i *)(sums[i] + h + 8 * j), acc[i][j]);
}

int int8_linear(const uint16_t *x, int64_t x_stride, const int8_t *packed, const float *scale, const int32_t *wsum,
                const uint16_t *bias, const uint16_t *residual, int64_t residual_stride, uint16_t *y,
                int64_t y_stride, int64_t m, int64_t n, int64_t k, int threads) {
    if (k % 4 != 0) return -1;
    int64_t k2 = k / 2, quads = k / 4, groups = (n + GROUP - 1) / GROUP;
    uint32_t *xp = malloc((size_t)(m * k2) * sizeof(uint32_t));
    float *xs = malloc((size_t)m * sizeof(float));
    if (!xp || !xs) {
        free(xp);
        free(xs);
        return -3;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < m; r++) xs[r] = quantize_row(x + r * x_stride, k, xp + r * k2);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int32_t *wg = (const int32_t *)packed + g * quads * GROUP;
        int outputs = n - g * GROUP < GROUP ? (int)(n - g * GROUP) : GROUP;
        for (int64_t b0 = 0; b0 < m; b0 += BLOCK_ROWS) {
            int64_t b1 = m - b0 < BLOCK_ROWS ? m : b0 + BLOCK_ROWS;
            int32_t sums[BLOCK_ROWS][GROUP] = {{0}};
            for (int64_t p0 = 0; p0 < quads; p0 += CHUNK_WORDS) {
                int64_t p1 = quads - p0 < CHUNK_WORDS ? quads : p0 + CHUNK_WORDS;
                for (int64_t m0 = b0; m0 < b1; m0 += AVX2_ROWS) {
                    int rows = b1 - m0 < AVX2_ROWS ? (int)(b1 - m0) : AVX2_ROWS, width = rows == 1 ? 64 : rows == 2 ? 32 : 16;
                    const uint32_t *xr = xp + m0 * k2;
                    int32_t(*tile)[GROUP] = sums + (m0 - b0);
                    for (int h = 0; h < outputs; h += width) switch (rows) {
                            case 1: quad_pass(wg, h, p0, p1, xr, k2, 1, 8, tile); break;
                            case 2: quad_pass(wg, h, p0, p1, xr, k2, 2, 4, tile); break;
                            case 3: quad_pass(wg, h, p0, p1, xr, k2, 3, 2, tile); break;
                            default: quad_pass(wg, h, p0, p1, xr, k2, AVX2_ROWS, 2, tile); break;
                        }
                }
            }
            for (int64_t i = b0; i < b1; i++) { /* the VNNI kernel's float steps, one output at a time */
                float row[GROUP];
                for (int j = 0; j < outputs; j++) {
                    int64_t o = g * GROUP + j;
                    float b = bias ? row_value((const char *)bias, o, 1) : 0.0f;
                    row[j] = fmaf((float)(sums[i - b0][j] - (wsum[o] << 7)), scale[o] * xs[i], b);
                    if (residual) row[j] += row_value((const char *)(residual + i * residual_stride), o, 1);
                }
                store_row(row, outputs, (char *)(y + i * y_stride + g * GROUP), 1);
            }
        }
    }
    free(xp);
    free(xs);
    return 0;
}
#else
int int8_linear_available(void) { return 0; }
int int8_linear(const uint16_t *x, int64_t x_stride, const int8_t *packed, const float *scale, const int32_t *wsum,
                const uint16_t *bias, const uint16_t *residual, int64_t residual_stride, uint16_t *y,
                int64_t y_stride, int64_t m, int64_t n, int64_t k, int threads) {
    return -2;
}
#endif

/* int4 linear layers (a quantized drafter's, `quantization: int4`): y = x W^T (+ bias)
 * (+ residual), bf16 in and out. Half the bytes of int8 per weight: a drafter's token is bound
 * by the bytes it streams.
 *
 * W is quantized once at load, symmetric per output and per Q4_GROUP positions of K
 * (w = scale[n][c] * q, q in [-7, 7]), stored as nibbles q + 8 and packed as
 * [groups][K/8][4][16][4]: per group of GROUP outputs and 8 positions of K, for each 16 outputs
 * 4 bytes each, whose low nibbles are K positions 0-3 and high nibbles 4-7. So one 64-byte load
 * unpacks (and, shift) into two vectors of u8 that VNNI adds, 4 products at a time, to 16
 * outputs' int32 sums against a broadcast 4 bytes of x. x is quantized per row when the call
 * comes, symmetric to s8 (scale xs), with the sum of its values per Q4_GROUP (xsum), so a
 * group's sum of (q + 8) * xq less 8 * xsum is sum(q * xq), exact in int32. Each group's sum
 * then goes into a float32 sum in K order (fma with its scale), and y = that * xs + bias: the
 * same float steps in the AVX-512 VNNI and the AVX2 kernel (vpmaddubsw + vpmaddwd give VNNI's
 * int32 sums, no pair of products saturating: 2 * 15 * 127 < 32767), so the same bits. Not
 * exact (the target never runs this); each row is quantized and summed alone, so a row gets
 * the same result whatever shares its call. */
#define Q4_GROUP 64
#define Q4_ROWS 4

typedef int8_t ecvec __attribute__((vector_size(ELEMS)));

/* one row of k bf16 values -> s8 (round to nearest even) and its sum per Q4_GROUP; its scale */
static float quantize_row_s8(const uint16_t *x, int64_t k, int8_t *q, int32_t *sums) {
    float part[Q4_GROUP];
    evec top = {0};
    for (int64_t i = 0; i < k; i += Q4_GROUP) {
        load_row((const char *)(x + i), Q4_GROUP, part, 1);
        for (int j = 0; j < Q4_GROUP; j += ELEMS) {
            evec v;
            memcpy(&v, part + j, sizeof v);
            v = select(v < 0, -v, v);
            top = select(v > top, v, top); /* a NaN is passed over, as fmaxf does */
        }
    }
    float most = 0.0f;
    for (int l = 0; l < ELEMS; l++) most = fmaxf(most, top[l]);
    float scale = most > 0 ? most / 127.0f : 1.0f, inv = 1.0f / scale;
    for (int64_t c = 0; c < k / Q4_GROUP; c++) {
        load_row((const char *)(x + c * Q4_GROUP), Q4_GROUP, part, 1);
        eivec sum = {0};
        for (int j = 0; j < Q4_GROUP; j += ELEMS) {
            evec v;
            memcpy(&v, part + j, sizeof v);
            v = v * inv;
            v = v + 12582912.0f; /* 1.5 * 2^23: rounds |v| < 2^22 to an integer, nearest even (lrintf) */
            eivec r = __builtin_convertvector(v - 12582912.0f, eivec);
            ecvec b = __builtin_convertvector(r, ecvec);
            memcpy(q + c * Q4_GROUP + j, &b, sizeof b);
            sum += r;
        }
        int32_t total = 0;
        for (int l = 0; l < ELEMS; l++) total += sum[l];
        sums[c] = total;
    }
    return scale;
}

typedef struct {
    int8_t *xq;
    int32_t *xsum;
    float *xs;
} q4_rows;

static int quantize_rows(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int threads, q4_rows *r) {
    int64_t groups = k / Q4_GROUP;
    r->xq = malloc((size_t)(m * k));
    r->xsum = malloc((size_t)(m * groups) * sizeof(int32_t));
    r->xs = malloc((size_t)m * sizeof(float));
    if (!r->xq || !r->xsum || !r->xs) return -3;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < m; i++) r->xs[i] = quantize_row_s8(x + i * x_stride, k, r->xq + i * k, r->xsum + i * groups);
    return 0;
}

static void free_rows(q4_rows *r) {
    free(r->xq);
    free(r->xsum);
    free(r->xs);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT4_KERNEL

/* y for the rows quantized in r: the kernel proper (int4_linear quantizes, then calls it) */
static void int4_rows(const q4_rows *r, const uint8_t *packed, const float *scale, const uint16_t *bias,
                      const uint16_t *residual, int64_t residual_stride, uint16_t *y, int64_t y_stride, int64_t m,
                      int64_t n, int64_t k, int threads) {
    int64_t groups = (n + GROUP - 1) / GROUP, kg = k / Q4_GROUP;
    const __m512i low = _mm512_set1_epi8(0x0f);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = packed + g * GROUP * (k / 2);
        const float *sg = scale + g * kg * GROUP;
        for (int64_t m0 = 0; m0 < m; m0 += Q4_ROWS) {
            int rows = m - m0 < Q4_ROWS ? (int)(m - m0) : Q4_ROWS;
            __m512 sum[Q4_ROWS][4];
            for (int i = 0; i < rows; i++)
                for (int j = 0; j < 4; j++) sum[i][j] = _mm512_setzero_ps();
            for (int64_t c = 0; c < kg; c++) {
                __m512i acc[Q4_ROWS][4];
                for (int i = 0; i < rows; i++)
                    for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
                for (int64_t o = c * (Q4_GROUP / 8); o < (c + 1) * (Q4_GROUP / 8); o++) {
                    const uint8_t *wp = wg + o * 4 * 64;
                    for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(wp + 64 * j) + PREFETCH_BYTES, _MM_HINT_T0);
                    __m512i lo[4], hi[4];
                    for (int j = 0; j < 4; j++) {
                        __m512i v = _mm512_loadu_si512(wp + 64 * j);
                        lo[j] = _mm512_and_si512(v, low);
                        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    }
                    for (int i = 0; i < rows; i++) {
                        const int32_t *xr = (const int32_t *)(r->xq + (m0 + i) * k);
                        __m512i x0 = _mm512_set1_epi32(xr[2 * o]), x1 = _mm512_set1_epi32(xr[2 * o + 1]);
                        for (int j = 0; j < 4; j++)
                            acc[i][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[i][j], lo[j], x0), hi[j], x1);
                    }
                }
                for (int i = 0; i < rows; i++) {
                    __m512i offset = _mm512_set1_epi32(r->xsum[(m0 + i) * kg + c] * 8);
                    for (int j = 0; j < 4; j++)
                        sum[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], offset)),
                                                    _mm512_loadu_ps(sg + c * GROUP + 16 * j), sum[i][j]);
                }
            }
            for (int j = 0; j < 4; j++) {
                int64_t n0 = g * GROUP + j * 16;
                if (n0 >= n) break;
                __mmask16 mask = n - n0 >= 16 ? 0xffff : (__mmask16)((1u << (n - n0)) - 1);
                __m512 b = bias ? widen_bf16(mask, bias + n0) : _mm512_setzero_ps();
                for (int i = 0; i < rows; i++) {
                    __m512 v = _mm512_fmadd_ps(sum[i][j], _mm512_set1_ps(r->xs[m0 + i]), b);
                    if (residual) v = _mm512_add_ps(v, widen_bf16(mask, residual + (m0 + i) * residual_stride + n0));
                    _mm256_mask_storeu_epi16(y + (m0 + i) * y_stride + n0, mask, narrow_bf16(v));
                }
            }
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define INT4_KERNEL

/* VNNI's vpdpbusd on AVX2: 4 products of u8 w and s8 x per int32 lane, added to acc */
static inline __m256i dpbusd8(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

/* y for the rows quantized in r: the kernel proper (int4_linear quantizes, then calls it) */
static void int4_rows(const q4_rows *r, const uint8_t *packed, const float *scale, const uint16_t *bias,
                      const uint16_t *residual, int64_t residual_stride, uint16_t *y, int64_t y_stride, int64_t m,
                      int64_t n, int64_t k, int threads) {
    int64_t groups = (n + GROUP - 1) / GROUP, kg = k / Q4_GROUP;
    const __m256i low = _mm256_set1_epi8(0x0f);
    /* one row at a time over a group's 64 outputs (8 vectors of sums in registers); the other
     * rows read the group's weights again from cache */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = packed + g * GROUP * (k / 2);
        const float *sg = scale + g * kg * GROUP;
        int outputs = n - g * GROUP < GROUP ? (int)(n - g * GROUP) : GROUP;
        for (int64_t i = 0; i < m; i++) {
            const int32_t *xr = (const int32_t *)(r->xq + i * k);
            __m256 sum[8];
            for (int j = 0; j < 8; j++) sum[j] = _mm256_setzero_ps();
            for (int64_t c = 0; c < kg; c++) {
                __m256i acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_si256();
                for (int64_t o = c * (Q4_GROUP / 8); o < (c + 1) * (Q4_GROUP / 8); o++) {
                    const uint8_t *wp = wg + o * 4 * 64;
                    for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(wp + 64 * j) + PREFETCH_BYTES, _MM_HINT_T0);
                    __m256i x0 = _mm256_set1_epi32(xr[2 * o]), x1 = _mm256_set1_epi32(xr[2 * o + 1]);
                    for (int j = 0; j < 8; j++) {
                        __m256i v = _mm256_loadu_si256((const __m256i *)(wp + 32 * j));
                        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                        acc[j] = dpbusd8(dpbusd8(acc[j], lo, x0), hi, x1);
                    }
                }
                __m256i offset = _mm256_set1_epi32(r->xsum[i * kg + c] * 8);
                for (int j = 0; j < 8; j++)
                    sum[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[j], offset)),
                                             _mm256_loadu_ps(sg + c * GROUP + 8 * j), sum[j]);
            }
            float out[GROUP], total[GROUP]; /* the VNNI kernel's float steps, one output at a time */
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(total + 8 * j, sum[j]);
            for (int j = 0; j < outputs; j++) {
                int64_t o = g * GROUP + j;
                float b = bias ? row_value((const char *)bias, o, 1) : 0.0f;
                out[j] = fmaf(total[j], r->xs[i], b);
                if (residual) out[j] += row_value((const char *)(residual + i * residual_stride), o, 1);
            }
            store_row(out, outputs, (char *)(y + i * y_stride + g * GROUP), 1);
        }
    }
}
#endif

#ifdef INT4_KERNEL
int int4_linear_available(void) { return 1; }

int int4_linear(const uint16_t *x, int64_t x_stride, const uint8_t *packed, const float *scale, const uint16_t *bias,
                const uint16_t *residual, int64_t residual_stride, uint16_t *y, int64_t y_stride, int64_t m,
                int64_t n, int64_t k, int threads) {
    if (k % Q4_GROUP != 0) return -1;
    q4_rows r;
    int rc = quantize_rows(x, x_stride, m, k, threads, &r);
    if (!rc) int4_rows(&r, packed, scale, bias, residual, residual_stride, y, y_stride, m, n, k, threads);
    free_rows(&r);
    return rc;
}
#else
int int4_linear_available(void) { return 0; }
int int4_linear(const uint16_t *x, int64_t x_stride, const uint8_t *packed, const float *scale, const uint16_t *bias,
                const uint16_t *residual, int64_t residual_stride, uint16_t *y, int64_t y_stride, int64_t m,
                int64_t n, int64_t k, int threads) {
    return -2;
}
#endif

/* One bf16 decoder layer of a step, the calls lean_lm makes one by one, made here in one: the
 * same kernels in the same order on the same buffers, so the bits are those of the calls one
 * by one; what goes is ~8 Python -> C transitions a layer (~7 us each here, 1.5-2 ms of a
 * 10 ms SmolLM2 step) and the tensor ops around them. h [tokens][hidden] is the residual
 * stream, updated in place (o_proj and down_proj add into it); the attention runs over
 * explicit key lists (batch-invariant mode); `scratch` holds
 * tokens * (hidden + qkv + heads*d + 2*inter + inter) values. Each linear layer runs the kernel
 * its weights name: bf16 (packed_linear, no `scale`), int8 (int8_linear, `scale` and `wsum`) or
 * int4 (int4_linear, `scale` only); an int4 model's layer may mix int4 and int8 (a K int4 cannot
 * take stays int8). */
typedef struct {
    const void *packed;
    const uint16_t *bias;   /* or NULL */
    const float *scale;     /* int8: per output; int4: per output and Q4_GROUP of K; NULL: bf16 */
    const int32_t *wsum;    /* int8: per output; NULL: int4 */
} linear_weights;

typedef struct {
    const uint16_t *attn_norm, *mlp_norm;
    linear_weights qkv, o, gate_up, down;
} layer_weights;

static int linear(const linear_weights *w, const uint16_t *x, int64_t x_stride, const uint16_t *residual,
                  int64_t residual_stride, uint16_t *y, int64_t y_stride, int64_t m, int64_t n, int64_t k,
                  int threads) {
    if (w->scale && !w->wsum)
        return int4_linear(x, x_stride, w->packed, w->scale, w->bias, residual, residual_stride, y, y_stride, m, n, k,
                           threads);
    if (w->scale)
        return int8_linear(x, x_stride, w->packed, w->scale, w->wsum, w->bias, residual, residual_stride, y, y_stride,
                           m, n, k, threads);
    return packed_linear(x, x_stride, w->packed, w->bias, residual, residual_stride, y, y_stride, m, n, k, threads);
}

static int layer_step(uint16_t *h, const uint16_t *attn_in, int64_t attn_width, int64_t tokens, int64_t hidden,
                      int64_t inter, int64_t heads, int64_t kv_heads,
                      int64_t d, float eps, float scale, const layer_weights *w, void *kv, const int64_t *slots,
                      const uint16_t *cos, const uint16_t *sin, const int64_t *key_slots, const int64_t *key_start,
                      const int64_t *key_len, const int64_t *mask_from, const uint8_t *mask, int64_t mask_width,
                      uint16_t *scratch, int threads) {
    int64_t qkv_n = (heads + 2 * kv_heads) * d, att_n = heads * d;
    uint16_t *x = scratch, *qkv = x + tokens * hidden, *att = qkv + tokens * qkv_n, *gu = att + tokens * att_n,
             *act = gu + tokens * 2 * inter;
    int rc = 0;
    if (!attn_in) { /* the layer's own input norm of the residual stream */
        if (!w->attn_norm) return -2;
        rc = rms_norm(h, hidden, w->attn_norm, x, hidden, tokens, hidden, eps, 1, threads);
        attn_in = x, attn_width = hidden;
    }
    if (!rc) rc = linear(&w->qkv, attn_in, attn_width, NULL, 0, qkv, qkv_n, tokens, qkv_n, attn_width, threads);
    if (!rc) rc = rope_store(qkv, qkv_n, cos, sin, kv, slots, tokens, heads, kv_heads, d, 1, threads);
    if (!rc)
        rc = attend(qkv, qkv_n, kv, key_slots, key_start, key_len, mask_from, mask, mask_width, att, tokens, heads,
                    kv_heads, d, scale, 1, threads);
    if (!rc) rc = linear(&w->o, att, att_n, h, hidden, h, hidden, tokens, hidden, att_n, threads);
    if (!rc) rc = rms_norm(h, hidden, w->mlp_norm, x, hidden, tokens, hidden, eps, 1, threads);
    if (!rc) rc = linear(&w->gate_up, x, hidden, NULL, 0, gu, 2 * inter, tokens, 2 * inter, hidden, threads);
    if (!rc) rc = silu_mul(gu, 2 * inter, act, inter, tokens, inter, 1, threads);
    if (!rc) rc = linear(&w->down, act, inter, h, hidden, h, hidden, tokens, hidden, inter, threads);
    return rc;
}

/* A prompt chunk's layers (SPLIT_ROWS or more rows a thread) in one parallel region. Each
 * thread takes a fixed share of the rows through everything a row does alone (RMSNorm, the
 * linears, RoPE and the KV write, SiLU * up), and the threads meet only where rows need each
 * other: before a layer's attention (its keys are every row's) and after it (its tasks are
 * (run, kv head), shared dynamically). Two barriers a layer, where the kernels called one by one
 * had nine parallel regions, and at each a thread waits as long as the other is descheduled: a
 * 2k-token prefill on 2 threads beside a busy process took 0.70x the time (the same on a quiet
 * host). Every row goes through the same kernels as in layer_step (each row's linears sum K in
 * the same order whatever the tile or thread count), so the same bits. */
#define SPLIT_ROWS 32

typedef struct {
    uint16_t *h, *x, *qkv, *att, *gu, *act; /* the residual stream and the scratch, [tokens][..] */
    int64_t hidden, inter, heads, kv_heads, d;
    float eps;
    const int64_t *slots;
    const uint16_t *cos, *sin;
} layer_rows;

/* Rows [r0, r1) of layer w up to its attention, on this thread: RMSNorm, q|k|v, RoPE and the
 * rows' keys and values into kv. */
static int before_attention(const layer_rows *s, const layer_weights *w, char *kv, int64_t r0, int64_t r1) {
    int64_t hidden = s->hidden, qkv_n = (s->heads + 2 * s->kv_heads) * s->d, slot_bytes = 4 * s->kv_heads * s->d;
    for (int64_t r = r0; r < r1; r++)
        norm_row((const char *)(s->h + r * hidden), w->attn_norm, (char *)(s->x + r * hidden), hidden, s->eps, 1);
    int rc = linear(&w->qkv, s->x + r0 * hidden, hidden, NULL, 0, s->qkv + r0 * qkv_n, qkv_n, r1 - r0, qkv_n, hidden, 1);
    for (int64_t r = r0; r < r1 && !rc; r++)
        rope_row((char *)(s->qkv + r * qkv_n), s->cos, s->sin, kv + s->slots[r] * slot_bytes, r, s->heads, s->kv_heads,
                 s->d, 1);
    return rc;
}

/* Rows [r0, r1) of layer w after its attention, on this thread: o_proj into the residual,
 * RMSNorm, gate|up, SiLU * up, down_proj into the residual. */
static int after_attention(const layer_rows *s, const layer_weights *w, int64_t r0, int64_t r1) {
    int64_t hidden = s->hidden, inter = s->inter, att_n = s->heads * s->d, m = r1 - r0;
    uint16_t *h = s->h + r0 * hidden;
    int rc = linear(&w->o, s->att + r0 * att_n, att_n, h, hidden, h, hidden, m, hidden, att_n, 1);
    for (int64_t r = r0; r < r1; r++)
        norm_row((const char *)(s->h + r * hidden), w->mlp_norm, (char *)(s->x + r * hidden), hidden, s->eps, 1);
    if (!rc)
        rc = linear(&w->gate_up, s->x + r0 * hidden, hidden, NULL, 0, s->gu + r0 * 2 * inter, 2 * inter, m, 2 * inter,
                    hidden, 1);
    for (int64_t r = r0; r < r1; r++)
        silu_row((const char *)(s->gu + r * 2 * inter), (char *)(s->act + r * inter), inter, 1);
    if (!rc) rc = linear(&w->down, s->act + r0 * inter, inter, h, hidden, h, hidden, m, hidden, inter, 1);
    return rc;
}

/* run_layers for SPLIT_ROWS or more rows a thread (see there); c: the attention call of layer
 * 0 (each layer's differs in its KV only). */
static int split_layers(const layer_rows *s, const layer_weights *w, int64_t layers, char *kv, int64_t kv_stride,
                        attend_call c, int64_t tokens, int threads) {
    attend_plan p;
    if (plan_attend(&c, MAX_RUN, threads, &p)) return -2;
    int rc = 0;
#pragma omp parallel num_threads(threads) reduction(| : rc)
    {
        int64_t n = omp_get_num_threads(), i = omp_get_thread_num(), r0 = tokens * i / n, r1 = tokens * (i + 1) / n;
        scratch sw;
        float *local_part;
        rc = new_scratch(&c, &p, &sw, &local_part) ? -2 : 0;
        for (int64_t l = 0; l < layers; l++) { /* every thread meets every barrier, failed or not */
            attend_call layer = c;
            layer.kv = kv + l * kv_stride;
            if (!rc) rc = before_attention(s, w + l, kv + l * kv_stride, r0, r1);
#pragma omp barrier
            attend_tasks(&layer, &p, sw, local_part, rc != 0); /* ends in a barrier */
            if (!rc) rc = after_attention(s, w + l, r0, r1);
        }
        free_scratch(&sw, local_part);
    }
    free_plan(&p);
    return rc;
}

/* `layers` consecutive decoder layers (w[0..layers), layer l's KV at kv + l * kv_stride bytes)
 * in one call: a step's whole stack, where ~30 calls from Python cost ~10 us each. A step of
 * few rows runs layer_step's kernels one by one, each shared by the threads over outputs (a
 * decode step's rows are too few to share out); a prompt chunk runs split_layers. */
int run_layers(uint16_t *h, int64_t tokens, int64_t hidden, int64_t inter, int64_t heads, int64_t kv_heads, int64_t d,
               float eps, float scale, const layer_weights *w, int64_t layers, char *kv, int64_t kv_stride,
               const int64_t *slots, const uint16_t *cos, const uint16_t *sin, const int64_t *key_slots,
               const int64_t *key_start, const int64_t *key_len, const int64_t *mask_from, const uint8_t *mask,
               int64_t mask_width, uint16_t *scratch, int threads) {
    if (tokens >= SPLIT_ROWS * threads) {
        if (!attend_sizes_ok(heads, kv_heads, d) || d > MAX_HEAD_DIM || hidden % LANES || hidden > MAX_NORM ||
            inter % LANES || inter > MAX_NORM)
            return -1;
        int64_t qkv_n = (heads + 2 * kv_heads) * d;
        uint16_t *qkv = scratch + tokens * hidden, *att = qkv + tokens * qkv_n, *gu = att + tokens * heads * d;
        layer_rows s = {h, scratch, qkv, att, gu, gu + tokens * 2 * inter, hidden, inter, heads, kv_heads, d, eps,
                        slots, cos, sin};
        attend_call c = {qkv,        kv,     key_slots, key_start, key_len, mask_from, mask, att, qkv_n,
                         mask_width, tokens, heads,     kv_heads,  d,       scale,     1};
        return split_layers(&s, w, layers, kv, kv_stride, c, tokens, threads);
    }
    int rc = 0;
    for (int64_t l = 0; l < layers && !rc; l++)
        rc = layer_step(h, NULL, 0, tokens, hidden, inter, heads, kv_heads, d, eps, scale, w + l, kv + l * kv_stride,
                        slots, cos, sin, key_slots, key_start, key_len, mask_from, mask, mask_width, scratch, threads);
    return rc;
}

/* DSpark's vanilla Markov chain drafted greedily (backends/methods/dspark.py), every step of
 * every row in one call: step i of row r drafts the argmax of base[r][i] + w2 . w1[prev] (the
 * bias as packed_linear gives it, bf16, widened and added in float32 as torch adds it) and
 * feeds its target id (to_target[draft], or the draft) on as prev, the row's anchor first.
 * out[r][i] = that id. Returns -1 where a step's logits hold a NaN (the caller drafts in
 * torch then), -2 out of memory, or packed_linear's error. */
int markov_greedy(const float *base, int64_t rows, int64_t steps, int64_t vocab, const uint16_t *w1, int64_t rank,
                  const uint16_t *w2, const int64_t *to_target, const int64_t *anchors, int64_t *out, int threads) {
    float *logits = malloc(vocab * sizeof(float));
    uint16_t *bias = malloc(vocab * sizeof(uint16_t));
    int rc = logits && bias ? 0 : -2;
    for (int64_t r = 0; r < rows && !rc; r++) {
        int64_t prev = anchors[r];
        for (int64_t i = 0; i < steps && !rc; i++) {
            const float *b = base + (r * steps + i) * vocab;
            rc = packed_linear(w1 + prev * rank, rank, w2, NULL, NULL, 0, bias, vocab, 1, vocab, rank, threads);
            if (rc) break;
            for (int64_t j = 0; j < vocab; j++) logits[j] = b[j] + row_value((const char *)bias, j, 1);
            int64_t draft = argmax_row((const char *)logits, vocab, 0);
            if (draft < 0) {
                rc = -1;
                break;
            }
            out[r * steps + i] = prev = to_target ? to_target[draft] : draft;
        }
    }
    free(logits);
    free(bias);
    return rc;
}

/* One decoder layer whose attention reads `attn_in` [tokens][attn_width] as given instead of
 * its input norm of h: a drafter head's layer (EAGLE-3's [embedding | hidden] 2H-wide q/k/v
 * input, EAGLE's first layer without an input norm). The same kernels as run_layers. */
int run_layer_attn_in(uint16_t *h, const uint16_t *attn_in, int64_t attn_width, int64_t tokens, int64_t hidden,
                      int64_t inter, int64_t heads, int64_t kv_heads, int64_t d, float eps, float scale,
                      const layer_weights *w, char *kv, const int64_t *slots, const uint16_t *cos, const uint16_t *sin,
                      const int64_t *key_slots, const int64_t *key_start, const int64_t *key_len,
                      const int64_t *mask_from, const uint8_t *mask, int64_t mask_width, uint16_t *scratch,
                      int threads) {
    return layer_step(h, attn_in, attn_width, tokens, hidden, inter, heads, kv_heads, d, eps, scale, w, kv, slots, cos,
                      sin, key_slots, key_start, key_len, mask_from, mask, mask_width, scratch, threads);
}

/* A head's layer inputs for n pairs (token ids[t], state x[t]), in its layout:
 * - EAGLE-3 (pair_norms, no fc): attn_in[t] = the embedding's pair_norms[0] | the state's
 *   pair_norms[1], 2 hidden wide; the residual x[t] stays the state or, with
 *   norm_before_residual, becomes its normed half;
 * - EAGLE-1 (fc, no norms): x[t] = fc over the embedding | the state (its bias added), and the
 *   attention input is x[t] itself (its layer 0 has no input_layernorm);
 * - MTP, DeepSeek's (pair_norms, fc, attn_norm): x[t] = fc (eh_proj) over enorm(embedding) |
 *   hnorm(state), the attention input its input_layernorm.
 * `cat` holds n x 2 hidden where there is an fc. */
static int eagle_pairs(const uint16_t *embed, const int64_t *ids, uint16_t *x, int64_t n, int64_t hidden,
                       const uint16_t *const pair_norms[2], const linear_weights *fc, const uint16_t *attn_norm,
                       int norm_before_residual, float eps, uint16_t *cat, uint16_t *attn_in, int threads) {
    uint16_t *pairs = fc ? cat : attn_in;
    for (int64_t t = 0; t < n; t++) {
        uint16_t *in = pairs + t * 2 * hidden;
        const uint16_t *e = embed + ids[t] * hidden, *h = x + t * hidden;
        if (pair_norms[0]) {
            norm_row((const char *)e, pair_norms[0], (char *)in, hidden, eps, 1);
            norm_row((const char *)h, pair_norms[1], (char *)(in + hidden), hidden, eps, 1);
        } else {
            memcpy(in, e, hidden * sizeof(uint16_t));
            memcpy(in + hidden, h, hidden * sizeof(uint16_t));
        }
        if (!fc && norm_before_residual) memcpy(x + t * hidden, in + hidden, hidden * sizeof(uint16_t));
    }
    if (!fc) return 0;
    int rc = linear(fc, cat, 2 * hidden, NULL, 0, x, hidden, n, hidden, 2 * hidden, threads);
    if (rc) return rc;
    if (attn_norm) return rms_norm(x, hidden, attn_norm, attn_in, hidden, n, hidden, eps, 1, threads);
    memcpy(attn_in, x, n * hidden * sizeof(uint16_t));
    return 0;
}

/* An EAGLE-family head's propose call for a greedy chain (backends/methods/eagle.py), every
 * row's in one call: the calls the proposer makes one by one, here in the same order on the same
 * kernels, so the same bits. The layer's inputs are the head's layout's (eagle_pairs; the
 * layer reads 2 hidden without an fc, else hidden); its logits the LM head's over the state or,
 * with `final_norm`, over the state's final norm. First the context: the `ctx` new pairs
 * (ctx_ids[t], h[t]: EAGLE-3's fc features, the others' target states, rows' pairs one after
 * another) through the decoder layer; a row's state is its last pair's output (h[last[r]]). Then
 * step s of each row: the LM head over the draft vocabulary, the first-max argmax and the draft's
 * target id (to_target[draft], or the draft), out[r][s]; then, but after the last step, the pair
 * (draft, state) through the layer, whose output is the row's next state. Queries: the context's
 * ctx, then fed step s's `rows` at ctx + s * rows, each with its slot, RoPE row and key list.
 * `h` is overwritten; `logits` holds rows x vocab, `attn_in` max(ctx, rows) x 2 hidden, `cat`
 * (with an fc) as many, `scratch` layer_step's for max(ctx, rows) tokens, `state` rows x hidden,
 * `ids` rows. Returns -1 where logits hold a NaN (the caller then drafts in torch), or a kernel's
 * error. */
int eagle_chain(uint16_t *h, const int64_t *ctx_ids, int64_t ctx, const int64_t *last, int64_t rows, int64_t steps,
                int64_t hidden, int64_t inter, int64_t heads, int64_t kv_heads, int64_t d, float eps, float scale,
                const layer_weights *w, char *kv, const uint16_t *embed, const linear_weights *fc,
                const uint16_t *input_norm, const uint16_t *hidden_norm, const uint16_t *attn_norm,
                const uint16_t *final_norm, int norm_before_residual, const linear_weights *lm_head, int64_t vocab,
                const int64_t *to_target, const int64_t *slots, const uint16_t *cos, const uint16_t *sin,
                const int64_t *key_slots, const int64_t *key_start, const int64_t *key_len, uint16_t *state,
                int64_t *ids, uint16_t *logits, uint16_t *attn_in, uint16_t *cat, uint16_t *scratch, int64_t *out,
                int threads) {
    const uint16_t *const pair_norms[2] = {input_norm, hidden_norm};
    int64_t width = fc ? hidden : 2 * hidden; /* the layer's attention input */
    int rc = eagle_pairs(embed, ctx_ids, h, ctx, hidden, pair_norms, fc, attn_norm, norm_before_residual, eps, cat,
                         attn_in, threads);
    if (!rc)
        rc = layer_step(h, attn_in, width, ctx, hidden, inter, heads, kv_heads, d, eps, scale, w, kv, slots, cos, sin,
                        key_slots, key_start, key_len, NULL, NULL, 0, scratch, threads);
    for (int64_t r = 0; r < rows; r++) memcpy(state + r * hidden, h + last[r] * hidden, hidden * sizeof(uint16_t));
    for (int64_t s = 0; s < steps && !rc; s++) {
        const uint16_t *head_in = state;
        if (final_norm) { /* the final norm's rows, before attn_in is needed */
            rc = rms_norm(state, hidden, final_norm, attn_in, hidden, rows, hidden, eps, 1, threads);
            head_in = attn_in;
        }
        if (!rc) rc = linear(lm_head, head_in, hidden, NULL, 0, logits, vocab, rows, vocab, hidden, threads);
        for (int64_t r = 0; r < rows && !rc; r++) {
            int64_t draft = argmax_row((const char *)(logits + r * vocab), vocab, 1);
            if (draft < 0) return -1;
            out[r * steps + s] = ids[r] = to_target ? to_target[draft] : draft;
        }
        if (rc || s + 1 == steps) break;
        int64_t at = ctx + s * rows; /* this fed step's first query */
        rc = eagle_pairs(embed, ids, state, rows, hidden, pair_norms, fc, attn_norm, norm_before_residual, eps, cat,
                         attn_in, threads);
        if (!rc)
            rc = layer_step(state, attn_in, width, rows, hidden, inter, heads, kv_heads, d, eps, scale, w, kv,
                            slots + at, cos + at * d, sin + at * d, key_slots, key_start + at, key_len + at, NULL, NULL,
                            0, scratch, threads);
    }
    return rc;
}
