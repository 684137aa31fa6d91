/* The decoder forward on a CPU in one call: every layer, in float32, for a batch of rows that each
 * append some new tokens to their own KV cache slot (a prompt, one decode token, or a verify of
 * k+1 tokens). engine/native/build.py compiles this file once per machine and calls it through ctypes.
 *
 * Why not PyTorch operators: on the small models adaspec drafts with, a decode token costs about
 * as much in per-operator dispatch as in arithmetic, and the matrix-vector products of its
 * library kernels stream weights at half the memory bandwidth. Here one call runs the whole
 * forward on one OpenMP team (the same libgomp PyTorch uses, so the two share their threads).
 *
 * Every output element is computed by the same sequence of operations whatever the batch: a
 * token's logits do not depend on which other tokens, rows or threads share its forward. A
 * verify of k+1 tokens therefore gives bit for bit the logits k+1 decode steps would, which
 * keeps greedy speculation token-for-token equal to target-only decoding.
 *
 * The same forward drafts DFlash's block (Batch.block: the block's tokens attend to each other
 * whole, not causally), and adaspec_dflash_context turns the target's tapped hidden states into
 * the DFlash drafter's context keys and values.
 */
#include <math.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* 16 floats: one AVX-512 register where the CPU has them; GCC splits it where it has not. */
typedef float vf __attribute__((vector_size(64)));
typedef float vf_unaligned __attribute__((vector_size(64), aligned(4), may_alias));

#define TILE_ROWS 6 /* input rows per register tile: 24 accumulators */
/* Input rows per tile of a bfloat16 or integer panel, widened as it is read: eight rows spill a few
 * of their 32 accumulators, yet a verify of up to 8 tokens then reads each weight once. */
#define NARROW_TILE_ROWS 8

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

/* The sum of a vector's lanes, as a tree: a chain of 15 dependent adds would cost more than the
 * products it sums. */
static inline float hsum(vf v) {
    const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

typedef int32_t vi __attribute__((vector_size(64)));

/* Per lane: a where mask is set (all ones), else b. */
static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* e^x on 16 lanes (within 2 ulp): 2^n * e^r with |r| <= ln 2 / 2, a degree-6 polynomial for e^r.
 * Softmax and SiLU run through it on whole vectors only, so an element's value never depends on
 * which lane or loop it fell in. */
static inline vf vexp(vf x) {
    const vf high = (vf){0} + 88.3762626647949f, low = (vf){0} - 87.3365447505531f;
    x = pick(x > high, high, x);
    x = pick(x < low, low, x);
    const vf shifter = (vf){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const vf n = (x * 1.44269504088896341f + shifter) - shifter;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

typedef uint16_t vh __attribute__((vector_size(32), aligned(2), may_alias));

/* 16 bfloat16 values as float32: a bfloat16 is the top half of a float32's bits. */
static inline vf widen(const uint16_t *p) { return (vf)(__builtin_convertvector(*(const vh *)p, vi) << 16); }

typedef int8_t vb __attribute__((vector_size(16), aligned(1), may_alias));

/* 16 int8 values as float32 (exactly). GCC scalarizes the generic conversion, hence the intrinsics. */
static inline vf widen8(const int8_t *p) {
#ifdef __AVX512F__
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return __builtin_convertvector(__builtin_convertvector(*(const vb *)p, vi), vf);
#endif
}

typedef uint8_t vub __attribute__((vector_size(16), aligned(1), may_alias));

/* A UINT4 panel row (32 bytes) as its PANEL values in float32, in column order (exactly). */
static inline void widen4(const uint8_t *p, vf *out) {
#ifdef __AVX512F__
    const __m512i low = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i high = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
    const __m512i nibble = _mm512_set1_epi32(15);
    out[0] = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(low, nibble));
    out[1] = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(high, nibble));
    out[2] = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(low, 4));
    out[3] = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(high, 4));
#else
    const vi low = __builtin_convertvector(*(const vub *)p, vi);
    const vi high = __builtin_convertvector(*(const vub *)(p + 16), vi);
    out[0] = __builtin_convertvector(low & 15, vf), out[1] = __builtin_convertvector(high & 15, vf);
    out[2] = __builtin_convertvector(low >> 4, vf), out[3] = __builtin_convertvector(high >> 4, vf);
#endif
}

/* tile's name for an INT8 panel with a scale per group rather than per output. */
#define INT8_GROUPED 16

/* A grouped Linear's scales and mins for one panel (size 0: not grouped). */
typedef struct {
    int size, half; /* half: scales and mins are float16 */
    const void *scale, *min;
} Groups;

static Groups groups_at(const Linear *w, int p) {
    Groups g = {0, 0, NULL, NULL};
    if (w->group > 0) {
        const int64_t at = (int64_t)p * ((w->k + w->group - 1) / w->group) * PANEL * (w->half_scales ? 2 : 4);
        const char *scale = (const char *)w->scale, *min = (const char *)w->min;
        g = (Groups){w->group, w->half_scales, scale + at, min ? min + at : NULL};
    }
    return g;
}

/* Group `group`'s PANEL scales (returned) and mins (`*min`, NULL for none) in float32: in place
 * where they are stored so, else widened into `wide` ([2][PANEL]) once for the group's rows
 * (float16 ones widen exactly, by the CPU's conversion instructions where it has them). */
static inline __attribute__((always_inline)) const float *group_scales(const Groups *g, int64_t group, float *wide,
                                                                       const float **min) {
    const int64_t at = group * PANEL;
    if (!g->half) {
        *min = g->min ? (const float *)g->min + at : NULL;
        return (const float *)g->scale + at;
    }
    const void *from[2] = {g->scale, g->min};
    for (int t = 0; t < 2; t++) {
        if (!from[t]) continue;
        const uint16_t *h = (const uint16_t *)from[t] + at;
        float *out = wide + t * PANEL;
        for (int v = 0; v < PANEL; v += 8) {
#if defined(__F16C__)
            _mm256_storeu_ps(out + v, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + v))));
#else
            for (int j = 0; j < 8; j++) out[v + j] = (float)((const _Float16 *)h)[v + j];
#endif
        }
    }
    *min = g->min ? wide + PANEL : NULL;
    return wide;
}

/* Row i of w in `format` (rows ldw values apart) as PANEL float32 values, integers not yet scaled. */
static inline __attribute__((always_inline)) void load_row(int format, const void *w, int64_t i, int64_t ldw,
                                                            vf *out) {
    if (format == BF16) {
        const uint16_t *wi = (const uint16_t *)w + i * ldw;
        out[0] = widen(wi), out[1] = widen(wi + 16), out[2] = widen(wi + 32), out[3] = widen(wi + 48);
    } else if (format == INT8 || format == INT8_GROUPED) {
        const int8_t *wi = (const int8_t *)w + i * ldw;
        out[0] = widen8(wi), out[1] = widen8(wi + 16), out[2] = widen8(wi + 32), out[3] = widen8(wi + 48);
    } else if (format == UINT4) {
        widen4((const uint8_t *)w + i * (ldw / 2), out);
    } else {
        const float *wi = (const float *)w + i * ldw;
        out[0] = *(const vf_unaligned *)wi, out[1] = *(const vf_unaligned *)(wi + 16);
        out[2] = *(const vf_unaligned *)(wi + 32), out[3] = *(const vf_unaligned *)(wi + 48);
    }
}

/* A grouped row's weights, q * scale + min in float32: one place, so that a tile and a widened
 * panel compute the same values (every product q * scale of GGUF's formats and of
 * engine/model/quantize.py's is exact, so fused or not, this is PyTorch's q * scale + min). */
static inline __attribute__((always_inline)) void dequantize(vf *row, const float *scale, const float *min) {
    for (int v = 0; v < 4; v++) {
        vf min_v = (vf){0};
        if (min) min_v = *(const vf_unaligned *)(min + 16 * v);
        row[v] = row[v] * *(const vf_unaligned *)(scale + 16 * v) + min_v;
    }
}

/* rows x PANEL outputs: y[m][j] = sum_i x[m][i] * w[i][j] for i < k (times scale[j]), where row i
 * of w starts at w + i * ldw values (dequantized by `g`'s groups first where `format` is grouped);
 * one multiply-add chain per output in i order, the same whatever `rows` is. */
static inline __attribute__((always_inline)) void tile(
    const int rows, const int format, int k, const float *x, int64_t ldx, const void *w, int64_t ldw,
    const Groups *g, const float *scale, const float *bias, int columns, float *const *y, int accumulate) {
    const int grouped = format == INT8_GROUPED || format == UINT4;
    const int span = grouped ? g->size : k;
    vf acc[NARROW_TILE_ROWS][4];
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = (vf){0};
    for (int i0 = 0; i0 < k; i0 += span) {
        const int end = k - i0 < span ? k : i0 + span;
        float wide[2 * PANEL];
        const float *group_scale = NULL, *group_min = NULL;
        if (grouped) group_scale = group_scales(g, i0 / span, wide, &group_min);
        for (int i = i0; i < end; i++) {
            vf wv[4];
            load_row(format, w, i, ldw, wv);
            if (grouped) dequantize(wv, group_scale, group_min);
#pragma GCC unroll 8
            for (int m = 0; m < rows; m++) {
                const float xs = x[m * ldx + i];
                acc[m][0] += wv[0] * xs;
                acc[m][1] += wv[1] * xs;
                acc[m][2] += wv[2] * xs;
                acc[m][3] += wv[3] * xs;
            }
        }
    }
    /* Whole vectors where nothing could be fused: a scaled sum that is then added to might become
     * one multiply-add in some of tile's instances and not in others, and differ in its last bit. */
    if (columns == PANEL && !(scale && (bias || accumulate))) {
        vf scales[4], biases[4];
        for (int v = 0; v < 4; v++) {
            if (scale) scales[v] = *(const vf_unaligned *)(scale + 16 * v);
            if (bias) biases[v] = *(const vf_unaligned *)(bias + 16 * v);
        }
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) {
            for (int v = 0; v < 4; v++) {
                vf value = acc[m][v];
                if (scale) value *= scales[v];
                if (bias) value += biases[v];
                vf_unaligned *out = (vf_unaligned *)(y[m] + 16 * v);
                if (accumulate) value = *out + value;
                *out = value;
            }
        }
        return;
    }
    for (int m = 0; m < rows; m++) {
        float *out = y[m];
        for (int j = 0; j < columns; j++) {
            float value = acc[m][j >> 4][j & 15];
            if (scale) value *= scale[j];
            if (bias) value += bias[j];
            out[j] = accumulate ? out[j] + value : value;
        }
    }
}

#define TILE_CASES(FORMAT)                                                                               \
    switch (rows) {                                                                                      \
        case 1: tile(1, FORMAT, k, x, ldx, w, ldw, g, scale, bias, columns, y, accumulate); break;            \
        case 2: tile(2, FORMAT, k, x, ldx, w, ldw, g, scale, bias, columns, y, accumulate); break;            \
        case 3: tile(3, FORMAT, k, x, ldx, w, ldw, g, scale, bias, columns, y, accumulate); break;            \
        case 4: tile(4, FORMAT, k, x, ldx, w, ldw, g, scale, bias, columns, y, accumulate); break;            \
        case 5: tile(5, FORMAT, k, x, ldx, w, ldw, g, scale, bias, columns, y, accumulate); break;            \
        case 6: tile(6, FORMAT, k, x, ldx, w, ldw, g, scale, bias, columns, y, accumulate); break;            \
        case 7: tile(7, FORMAT, k, x, ldx, w, ldw, g, scale, bias, columns, y, accumulate); break;            \
        default: tile(8, FORMAT, k, x, ldx, w, ldw, g, scale, bias, columns, y, accumulate); break;           \
    }

/* Input rows per tile for a panel in `format`. */
static inline int tile_depth(int format) { return format == F32 ? TILE_ROWS : NARROW_TILE_ROWS; }

/* `tile` for 1 to NARROW_TILE_ROWS rows, each count compiled with its accumulators in registers. */
static void tile_rows(int rows, int format, int k, const float *x, int64_t ldx, const void *w, int64_t ldw,
                      const Groups *g, const float *scale, const float *bias, int columns, float *const *y, int accumulate) {
    if (format == BF16) {
        TILE_CASES(BF16)
    } else if (format == INT8 && g->size) {
        TILE_CASES(INT8_GROUPED)
    } else if (format == INT8) {
        TILE_CASES(INT8)
    } else if (format == UINT4) {
        TILE_CASES(UINT4)
    } else {
        TILE_CASES(F32)
    }
}

/* Where panel p of w starts. */
static const void *panel_at(const Linear *w, int p) {
    const int row_bytes = w->format == F32 ? 4 * PANEL : w->format == BF16 ? 2 * PANEL : w->format == INT8 ? PANEL : PANEL / 2;
    return (const char *)w->panels + (int64_t)p * w->k * row_bytes;
}

/* The panel to multiply by, and its format: a narrow panel that serves more than five tiles (a
 * prompt's, not a verify's) is widened once into `widened` ([k][PANEL] float32, the thread's own),
 * the same values a tile would widen: a grouped panel's dequantized, an int8 panel's with a scale
 * per output still unscaled (the tile scales its sums either way). */
static inline int panel_format(const Linear *w, int rows) { return rows <= 5 * NARROW_TILE_ROWS ? w->format : F32; }

static const void *panel_for(const Linear *w, int p, int rows, float *widened, int *format) {
    const void *panel = panel_at(w, p);
    *format = panel_format(w, rows);
    if (w->format == F32 || *format != F32) return panel;
    const Groups g = groups_at(w, p);
    float wide[2 * PANEL];
    const float *scale = NULL, *min = NULL;
    for (int64_t i = 0; i < w->k; i++) {
        vf row[4];
        load_row(w->format, panel, i, PANEL, row);
        if (g.size && i % g.size == 0) scale = group_scales(&g, i / g.size, wide, &min);
        if (g.size) dequantize(row, scale, min);
        for (int v = 0; v < 4; v++) *(vf_unaligned *)(widened + i * PANEL + 16 * v) = row[v];
    }
    return widened;
}

/* Token `token`'s embedding in float32: its row of m->embed (bfloat16 widened), or column `token`
 * of the panels of m->embed_rows, each panel row widened and dequantized as a tile widens it, so
 * that the values are the very ones the lm head they may be tied to multiplies by. */
static void embed_row(const Model *m, int64_t token, float *out) {
    const int hidden = m->hidden;
    const Linear *w = m->embed_rows;
    if (w) {
        const int p = (int)(token / PANEL), column = (int)(token % PANEL);
        const void *panel = panel_at(w, p);
        const Groups g = groups_at(w, p);
        const float scale = w->scale && !w->group ? w->scale[token] : 1.0f; /* int8 with a scale per output */
        float wide[2 * PANEL];
        const float *group_scale = NULL, *group_min = NULL;
        for (int i = 0; i < hidden; i++) {
            vf row[4];
            load_row(w->format, panel, i, PANEL, row);
            if (g.size && i % g.size == 0) group_scale = group_scales(&g, i / g.size, wide, &group_min);
            if (g.size) dequantize(row, group_scale, group_min);
            out[i] = row[column / 16][column % 16] * scale;
        }
    } else if (m->embed_bf16) {
        const uint16_t *in = (const uint16_t *)m->embed + token * hidden;
        for (int i = 0; i < hidden; i++) {
            const uint32_t bits = (uint32_t)in[i] << 16;
            memcpy(out + i, &bits, sizeof(float));
        }
    } else {
        memcpy(out, (const float *)m->embed + token * hidden, sizeof(float) * (size_t)hidden);
    }
}

/* y[m] (+)= x[m] @ w.T (+ bias) for m < rows; y_row(m) = y + (index ? index[m] : m) * ldy.
 * Called by every thread of the team, which waits at the end. The work is shared out as (panel,
 * tile of rows) pairs in panel order: a prompt's 9 panels (a 576-wide output) go 4.5 and 4.5 to
 * two threads rather than 5 and 4, and a thread widens each panel it touches once. Every output
 * is still one tile's, with the rows tiled as before, so the values do not change. */
static void linear(const float *x, int rows, const Linear *w, float *y, int64_t ldy, const int64_t *index,
                   int accumulate, float *widened) {
    const int panels = (w->n + PANEL - 1) / PANEL;
    const int step = tile_depth(panel_format(w, rows));
    const int tiles = (rows + step - 1) / step;
    int held = -1, format = w->format; /* the panel this thread has at hand */
    const void *panel = NULL;
#pragma omp for schedule(static)
    for (int item = 0; item < panels * tiles; item++) {
        const int p = item / tiles, m0 = (item % tiles) * step;
        if (p != held) panel = panel_for(w, p, rows, widened, &format), held = p;
        const Groups g = groups_at(w, p);
        const int n0 = p * PANEL;
        const int columns = w->n - n0 < PANEL ? w->n - n0 : PANEL;
        const float *bias = w->bias ? w->bias + n0 : NULL;
        const float *scale = w->scale && !w->group ? w->scale + n0 : NULL; /* a scale per output */
        const int mr = rows - m0 < step ? rows - m0 : step;
        float *out[NARROW_TILE_ROWS];
        for (int m = 0; m < mr; m++) out[m] = y + (index ? index[m0 + m] : m0 + m) * ldy + n0;
        tile_rows(mr, format, w->k, x + (int64_t)m0 * w->k, w->k, panel, PANEL, &g, scale, bias, columns, out,
                  accumulate);
    }
}

/* out = silu(gate) * up = gate / (1 + e^-gate) * up, on whole vectors (the tail through a copy). */
static void silu_times(const float *gate, const float *up, int n, float *out) {
    for (int i = 0; i < n; i += 16) {
        vf g = (vf){0}, u = (vf){0};
        const int lanes = n - i < 16 ? n - i : 16;
        memcpy(&g, gate + i, sizeof(float) * (size_t)lanes);
        memcpy(&u, up + i, sizeof(float) * (size_t)lanes);
        const vf y = g / (1.0f + vexp(-g)) * u;
        memcpy(out + i, &y, sizeof(float) * (size_t)lanes);
    }
}

/* act[m] = silu(gate) * up for m < rows, where w's panels hold gate and up rows alternately
 * (PANEL / 2 of each, engine/native/weights.py `gate_up_panels`): each thread finishes its panels' share
 * of act without a pass of its own over the product. */
static void linear_glu(const float *x, int rows, const Linear *w, float *act, int inter, float *widened) {
    const int panels = (w->n + PANEL - 1) / PANEL, half = PANEL / 2;
#pragma omp for schedule(static)
    for (int p = 0; p < panels; p++) {
        int format;
        const void *panel = panel_for(w, p, rows, widened, &format);
        const Groups g = groups_at(w, p);
        const int n0 = p * half, columns = inter - n0 < half ? inter - n0 : half;
        const float *bias = w->bias ? w->bias + (int64_t)p * PANEL : NULL;
        const float *scale = w->scale && !w->group ? w->scale + (int64_t)p * PANEL : NULL;
        const int step = tile_depth(format);
        for (int m0 = 0; m0 < rows; m0 += step) {
            const int mr = rows - m0 < step ? rows - m0 : step;
            float products[NARROW_TILE_ROWS][PANEL], *out[NARROW_TILE_ROWS];
            for (int m = 0; m < mr; m++) out[m] = products[m];
            tile_rows(mr, format, w->k, x + (int64_t)m0 * w->k, w->k, panel, PANEL, &g, scale, bias, PANEL, out, 0);
            for (int m = 0; m < mr; m++) {
                float glu[half];
                silu_times(products[m], products[m] + half, half, glu);
                memcpy(act + (int64_t)(m0 + m) * inter + n0, glu, sizeof(float) * (size_t)columns);
            }
        }
    }
}

static void rms_norm(const float *x, const float *weight, int n, float eps, float *out) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

/* Every thread normalizes all `rows` of x into its own `out`: cheaper than a pass and a wait. */
static void rms_norm_rows(const float *x, int rows, const float *weight, int n, float eps, float *out) {
    for (int r = 0; r < rows; r++) rms_norm(x + (int64_t)r * n, weight, n, eps, out + (int64_t)r * n);
}

/* x * cos + rotate_half(x) * sin, in place on one head. */
static void rope(float *x, const float *cos, const float *sin, int dim) {
    const int half = dim / 2;
    float rotated[dim];
    for (int i = 0; i < dim; i++) rotated[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
    memcpy(x, rotated, sizeof(float) * (size_t)dim);
}

/* p[j] = softmax(scale * p[first..pos])[j], and 0 for every other j from `from` (a multiple of
 * 16 at or before `first`) up to `last`; on whole vectors (p has room up to a multiple of 16 past
 * `last`), hidden places counting 0. */
static void softmax(float *p, int from, int first, int pos, int last, float scale) {
    const int end = pos / 16 * 16 + 16;
    vf top = (vf){0} - INFINITY;
    for (int j = from; j < end; j += 16) {
        vf v = *(vf_unaligned *)(p + j) * scale;
        const vi at = (vi){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + j;
        v = pick((at >= first) & (at <= pos), v, top);
        top = pick(v > top, v, top);
    }
    float most = top[0];
    for (int i = 1; i < 16; i++) most = top[i] > most ? top[i] : most;
    vf total = (vf){0};
    for (int j = from; j < end; j += 16) {
        const vi at = (vi){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + j;
        vf e = vexp(*(vf_unaligned *)(p + j) * scale - most);
        e = pick((at >= first) & (at <= pos), e, (vf){0});
        *(vf_unaligned *)(p + j) = e;
        total += e;
    }
    const float inverse = 1.0f / hsum(total);
    for (int j = from; j < end; j += 16) *(vf_unaligned *)(p + j) *= inverse;
    for (int j = end; j <= last; j++) p[j] = 0.0f;
}

/* Scratch one thread needs to attend: a tile of queries and their probabilities. */
typedef struct {
    float *queries, *probs;
} AttendScratch;

/* The first position a query at `pos` sees: 0, or the start of the model's sliding window. */
static inline int window_start(const Model *m, int pos) {
    return m->sliding_window > 0 && pos - m->sliding_window + 1 > 0 ? pos - m->sliding_window + 1 : 0;
}

/* One row's new tokens, for the query heads that share kv head `kv`: scores and weighted values
 * as tiles of products (queries x keys, probabilities x values), so that a query's result does
 * not depend on which other queries share its tile (causally hidden keys get a probability of
 * exactly 0). keys: [head_dim, positions] of this slot and head; values: [positions] rows. */
static void attend(const Model *m, int kv, const float *qkv, int64_t qkv_size, int count, int start, int block,
                   const float *keys, int64_t positions, const float *values, int64_t value_stride, float *out,
                   int64_t out_stride, const AttendScratch *s) {
    const int dim = m->head_dim, group = m->num_heads / m->num_kv_heads, length = start + count;
    const int64_t ldp = (int64_t)(length + PANEL - 1) / PANEL * PANEL;
    const float scale = 1.0f / sqrtf((float)dim);
    const int queries = count * group;
    for (int q0 = 0; q0 < queries; q0 += TILE_ROWS) {
        const int rows = queries - q0 < TILE_ROWS ? queries - q0 : TILE_ROWS;
        float *score_rows[TILE_ROWS], *out_rows[TILE_ROWS];
        int last = 0, earliest = length; /* the last position any query of the tile sees, and the first */
        for (int r = 0; r < rows; r++) {
            const int t = (q0 + r) / group, head = kv * group + (q0 + r) % group;
            memcpy(s->queries + r * dim, qkv + t * qkv_size + head * dim, sizeof(float) * (size_t)dim);
            out_rows[r] = out + t * out_stride + head * dim;
            const int sees = block ? length - 1 : start + t;
            if (sees > last) last = sees;
            if (window_start(m, sees) < earliest) earliest = window_start(m, sees);
        }
        /* Keys before the window of every query of the tile are skipped whole panels at a time: a
         * probability of exactly 0 adds nothing to a sum that starts at 0, so each result is the
         * same bits whichever queries share the tile. */
        const int from = earliest / PANEL * PANEL;
        for (int b = from / PANEL; b <= last / PANEL; b++) {
            for (int r = 0; r < rows; r++) score_rows[r] = s->probs + r * ldp + b * PANEL;
            tile_rows(rows, F32, dim, s->queries, dim, keys + b * PANEL, positions, NULL, NULL, NULL, PANEL,
                      score_rows, 0);
        }
        for (int r = 0; r < rows; r++) {
            const int pos = block ? length - 1 : start + (q0 + r) / group;
            softmax(s->probs + r * ldp, from, window_start(m, pos), pos, last, scale);
        }
        for (int d = 0; d < dim; d += PANEL) {
            float *rows_at[TILE_ROWS];
            for (int r = 0; r < rows; r++) rows_at[r] = out_rows[r] + d;
            const int columns = dim - d < PANEL ? dim - d : PANEL; /* reads past them land in the padding */
            tile_rows(rows, F32, last + 1 - from, s->probs + from, ldp, values + (int64_t)from * value_stride + d,
                      value_stride, NULL, NULL, NULL, columns, rows_at, 0);
        }
    }
}

static float *take(float **arena, int64_t n) {
    float *p = *arena;
    *arena += (n + 15) & ~(int64_t)15;
    return p;
}

/* The first index of the largest value, as torch.argmax (a NaN counts as the largest). Each lane
 * keeps its own first largest and where it was; the lanes are merged at the end. */
static int argmax(const float *row, int n) {
    int best = 0, v = 0;
    if (n >= 16) {
        vf top = *(const vf_unaligned *)row;
        vi at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, here = at, nan = top != top;
        for (v = 16; v + 16 <= n; v += 16) {
            const vf x = *(const vf_unaligned *)(row + v);
            here += 16;
            const vi larger = x > top;
            top = pick(larger, x, top);
            at = (here & larger) | (at & ~larger);
            nan |= x != x;
        }
        int any_nan = 0;
        for (int lane = 0; lane < 16; lane++) any_nan |= nan[lane];
        if (any_nan) {
            for (int i = 0; i < n; i++)
                if (row[i] != row[i]) return i;
        }
        best = at[0];
        for (int lane = 1; lane < 16; lane++)
            if (top[lane] > row[best] || (top[lane] == row[best] && at[lane] < best)) best = at[lane];
    }
    for (; v < n; v++) {
        if (row[v] != row[v]) return v;
        if (row[v] > row[best]) best = v;
    }
    return best;
}

/* The softmax probability of row[best], the row's largest value: 1 over the sum of e^(x - row[best]). */
static float top_probability(const float *row, int n, int best) {
    const float most = row[best];
    vf total = (vf){0};
    int v = 0;
    for (; v + 16 <= n; v += 16) total += vexp(*(const vf_unaligned *)(row + v) - most);
    float sum = hsum(total);
    for (; v < n; v++) sum += expf(row[v] - most);
    return 1.0f / sum;
}

/* Runs the forward; returns 0, or -1 when memory for the activations could not be had. */
int adaspec_forward(const Model *m, const Cache *cache, const Batch *b) {
    const int hidden = m->hidden, dim = m->head_dim, heads = m->num_heads, kv_heads = m->num_kv_heads;
    const int q_size = heads * dim, qkv_size = (heads + 2 * kv_heads) * dim, inter = m->intermediate;
    const int64_t key_stride = (int64_t)kv_heads * dim;

    int tokens = 0, longest = 0;
    for (int r = 0; r < b->rows; r++) {
        tokens += b->count[r];
        if (b->start[r] + b->count[r] > longest) longest = b->start[r] + b->count[r];
    }
    const int outputs = b->last_only ? b->rows : b->out_count > 0 ? b->rows * b->out_count : tokens;
    const int threads = b->threads > 0 ? b->threads : 1;
    const int64_t keys_padded = (int64_t)(longest + PANEL - 1) / PANEL * PANEL;
    const int64_t per_thread = TILE_ROWS * dim + TILE_ROWS * keys_padded + 2 * 16;
    const int64_t normed = (int64_t)(tokens > outputs ? tokens : outputs) * hidden + 16; /* per thread */
    const int64_t longest_k = hidden > inter ? (hidden > q_size ? hidden : q_size) : (inter > q_size ? inter : q_size);
    const int64_t widest = longest_k * PANEL + 16; /* per thread: one widened panel */
    int64_t floats = (int64_t)tokens * (hidden + qkv_size + q_size + inter) + threads * (per_thread + normed + widest) + 16 * 8;
    float *arena = malloc(sizeof(float) * (size_t)floats);
    int64_t *where = malloc(sizeof(int64_t) * (size_t)(3 * tokens + 2 * outputs + 2 * b->rows + 2));
    if (!arena || !where) {
        free(arena);
        free(where);
        return -1;
    }
    float *next = arena;
    float *x = take(&next, (int64_t)tokens * hidden), *qkv = take(&next, (int64_t)tokens * qkv_size);
    float *attn = take(&next, (int64_t)tokens * q_size), *act = take(&next, (int64_t)tokens * inter);
    float *normed_arena = take(&next, threads * normed), *widened_arena = take(&next, threads * widest);
    float *attend_arena = next;

    /* Per packed token: its place in the padded [rows, width] layout, its cache row, its position;
     * per output: the token whose logits it is, and its row of `logits`. */
    int64_t *padded = where, *cache_row = where + tokens, *position = where + 2 * tokens;
    int64_t *selected = where + 3 * tokens, *out_row = selected + outputs, *row_first = out_row + outputs;
    /* Per row: its first output (row r's outputs are row_out[r] .. row_out[r + 1] - 1). */
    int64_t *row_out = row_first + b->rows;
    for (int r = 0, t = 0, o = 0; r < b->rows; r++) {
        row_first[r] = t, row_out[r] = o;
        for (int j = 0; j < b->count[r]; j++, t++) {
            padded[t] = (int64_t)r * b->width + j;
            cache_row[t] = b->slot[r];
            position[t] = b->start[r] + j;
            if (b->last_only) {
                if (j == b->count[r] - 1) selected[o] = t, out_row[o] = r, o++;
            } else if (b->out_count > 0) {
                if (j >= b->out_first && j < b->out_first + b->out_count)
                    selected[o] = t, out_row[o] = (int64_t)r * b->out_count + j - b->out_first, o++;
            } else {
                selected[o] = t, out_row[o] = padded[t], o++;
            }
        }
    }
    row_out[b->rows] = outputs;
    /* The last layer only needs to finish the rows whose logits are wanted (one row of a prefill's
     * hundreds): every other token's keys and values are all that later positions read. Not where
     * the last layer's outputs are captured, nor in a block whose tokens see each other. A row's
     * result does not depend on which rows share its tiles, so the wanted rows are unchanged. */
    int finish_outputs_only = outputs < tokens && !b->block;
    for (int c = 0; c < b->num_captured; c++) finish_outputs_only &= b->captured_layers[c] != m->num_layers - 1;

#pragma omp parallel num_threads(threads)
    {
        float *mine = attend_arena + omp_get_thread_num() * per_thread;
        const AttendScratch my_scratch = {mine, mine + TILE_ROWS * dim + 16};
        float *h = normed_arena + omp_get_thread_num() * normed;
        float *widened = widened_arena + omp_get_thread_num() * widest;
#pragma omp for schedule(static)
        for (int t = 0; t < tokens; t++) {
            embed_row(m, b->tokens[padded[t]], x + (int64_t)t * hidden);
        }

        for (int l = 0; l < m->num_layers; l++) {
            const Layer *layer = &m->layers[l];
            float *k_cache = cache->k + l * cache->k_layer, *v_cache = cache->v + l * cache->v_layer;
            const int outputs_only = finish_outputs_only && l == m->num_layers - 1;
            rms_norm_rows(x, tokens, layer->input_norm, hidden, m->eps, h);
            linear(h, tokens, &layer->qkv, qkv, qkv_size, NULL, 0, widened);

            /* Queries and keys: norm (Qwen3) and rotate; keys and values go to the cache. */
#pragma omp for schedule(static)
            for (int t = 0; t < tokens; t++) {
                float *row = qkv + (int64_t)t * qkv_size;
                const float *cos = m->rope_cos + position[t] * dim, *sin = m->rope_sin + position[t] * dim;
                for (int head = 0; head < heads + kv_heads; head++) {
                    float *vec = row + head * dim;
                    const float *norm = head < heads ? layer->q_norm : layer->k_norm;
                    if (norm) rms_norm(vec, norm, dim, m->eps, vec);
                    rope(vec, cos, sin, dim);
                }
                float *keys = k_cache + cache_row[t] * cache->k_slot + position[t];
                for (int i = 0; i < key_stride; i++) keys[i * cache->positions] = row[q_size + i];
                memcpy(v_cache + cache_row[t] * cache->v_slot + position[t] * key_stride, row + q_size + key_stride,
                       sizeof(float) * (size_t)key_stride);
            }
#pragma omp for schedule(static) collapse(2)
            for (int r = 0; r < b->rows; r++) {
                for (int kv = 0; kv < kv_heads; kv++) {
                    /* All of the row's tokens, or (outputs_only) its outputs, written in output order:
                     * a row's outputs are consecutive tokens, from its first selected one. */
                    const int count = outputs_only ? (int)(row_out[r + 1] - row_out[r]) : b->count[r];
                    if (count == 0) continue;
                    const int64_t from = outputs_only ? selected[row_out[r]] - row_first[r] : 0, first = row_first[r] + from;
                    attend(m, kv, qkv + first * qkv_size, qkv_size, count, b->start[r] + (int)from, b->block,
                           k_cache + b->slot[r] * cache->k_slot + (int64_t)kv * dim * cache->positions, cache->positions,
                           v_cache + b->slot[r] * cache->v_slot + (int64_t)kv * dim, key_stride,
                           attn + (outputs_only ? row_out[r] : row_first[r]) * q_size, q_size, &my_scratch);
                }
            }
            int finishing = tokens;
            if (outputs_only) {
                /* The outputs' residuals move to the front, in order (selected[s] >= s). */
#pragma omp single
                for (int s = 0; s < outputs; s++)
                    if (selected[s] != s)
                        memcpy(x + (int64_t)s * hidden, x + selected[s] * hidden, sizeof(float) * (size_t)hidden);
                finishing = outputs;
            }
            linear(attn, finishing, &layer->o_proj, x, hidden, NULL, 1, widened);

            rms_norm_rows(x, finishing, layer->post_norm, hidden, m->eps, h);
            linear_glu(h, finishing, &layer->gate_up, act, inter, widened);
            linear(act, finishing, &layer->down, x, hidden, NULL, 1, widened);

            const int64_t captured_stride = b->captured_stride > 0 ? b->captured_stride : hidden;
            for (int c = 0; c < b->num_captured; c++) {
                if (b->captured_layers[c] != l) continue;
#pragma omp for schedule(static)
                for (int t = 0; t < tokens; t++)
                    memcpy(b->captured[c] + padded[t] * captured_stride, x + (int64_t)t * hidden,
                           sizeof(float) * (size_t)hidden);
            }
        }

        for (int s = 0; s < outputs; s++)
            rms_norm(x + (finish_outputs_only ? s : selected[s]) * hidden, m->norm, hidden, m->eps, h + (int64_t)s * hidden);
        linear(h, outputs, &m->lm_head, b->logits, m->vocab, out_row, 0, widened);
        /* Greedy verification reads the argmax: here, while the logits are in the caches, instead
         * of a reduction from Python after the call returns. */
        if (b->argmax) {
#pragma omp for schedule(static)
            for (int s = 0; s < outputs; s++) b->argmax[out_row[s]] = argmax(b->logits + out_row[s] * m->vocab, m->vocab);
        }
    }
    free(arena);
    free(where);
    return 0;
}


int adaspec_dflash_context(const Model *m, const Context *c, const Cache *cache, int tokens, const float *taps,
                           const int32_t *slot, const int32_t *position, int threads) {
    const int hidden = m->hidden, dim = m->head_dim, kv_heads = m->num_kv_heads;
    const int64_t key_stride = (int64_t)kv_heads * dim;
    threads = threads > 0 ? threads : 1;
    const int64_t widest = (int64_t)(c->fc.k > hidden ? c->fc.k : hidden) * PANEL + 16;
    const int64_t normed = (int64_t)tokens * hidden + 16;
    float *arena = malloc(sizeof(float) * (size_t)(tokens * (hidden + 2 * key_stride) + threads * (widest + normed) + 48));
    if (!arena) return -1;
    float *next = arena;
    float *fused = take(&next, (int64_t)tokens * hidden), *kv = take(&next, tokens * 2 * key_stride);
    float *normed_arena = take(&next, threads * normed), *widened_arena = next;
#pragma omp parallel num_threads(threads)
    {
        float *h = normed_arena + omp_get_thread_num() * normed;
        float *widened = widened_arena + omp_get_thread_num() * widest;
        linear(taps, tokens, &c->fc, fused, hidden, NULL, 0, widened);
        rms_norm_rows(fused, tokens, c->fc_norm, hidden, m->eps, h);
        for (int l = 0; l < m->num_layers; l++) {
            float *k_cache = cache->k + l * cache->k_layer, *v_cache = cache->v + l * cache->v_layer;
            linear(h, tokens, &c->kv[l], kv, 2 * key_stride, NULL, 0, widened);
#pragma omp for schedule(static)
            for (int t = 0; t < tokens; t++) {
                float *row = kv + (int64_t)t * 2 * key_stride;
                const float *cos = m->rope_cos + position[t] * dim, *sin = m->rope_sin + position[t] * dim;
                for (int head = 0; head < kv_heads; head++) {
                    float *vec = row + head * dim;
                    if (m->layers[l].k_norm) rms_norm(vec, m->layers[l].k_norm, dim, m->eps, vec);
                    rope(vec, cos, sin, dim);
                }
                float *keys = k_cache + slot[t] * cache->k_slot + position[t];
                for (int i = 0; i < key_stride; i++) keys[i * cache->positions] = row[i];
                memcpy(v_cache + slot[t] * cache->v_slot + position[t] * key_stride, row + key_stride,
                       sizeof(float) * (size_t)key_stride);
            }
        }
    }
    free(arena);
    return 0;
}

/* One step of an EAGLE-3 head (a one-layer model, `m`, whose q, k and v read [input_norm(embedding
 * of token t), hidden_norm(feature t)], width 2 * hidden, and whose residual stream is the feature).
 * With `fc`, `features` are the target's tapped hidden states side by side ([tokens, fc->k]) and
 * the features are fc of them; without, they are the features ([tokens, hidden]).
 * Every token's keys and values go to the head's cache at slot[t], position[t]; the `outputs`
 * tokens `selected` then attend to their slot up to their position and finish the layer: their
 * output features ([outputs, hidden]) and their logits ([outputs, vocab]). The draft-extend
 * passes a round's kept tokens and selects each sequence's last; a chain step passes one token a
 * sequence and selects them all. */
int adaspec_eagle3_step(const Model *m, const float *hidden_norm, int norm_before_residual, const Linear *fc,
                        const Cache *cache, int tokens,
                        const int64_t *token_ids, const float *inputs, const int32_t *slot,
                        const int32_t *position, int outputs, const int32_t *selected, float *out_features,
                        float *logits, int threads) {
    const int hidden = m->hidden, dim = m->head_dim, heads = m->num_heads, kv_heads = m->num_kv_heads;
    const int q_size = heads * dim, qkv_size = (heads + 2 * kv_heads) * dim, inter = m->intermediate;
    const int64_t key_stride = (int64_t)kv_heads * dim;
    const Layer *layer = &m->layers[0];
    threads = threads > 0 ? threads : 1;
    int longest = 0;
    for (int s = 0; s < outputs; s++)
        if (position[selected[s]] + 1 > longest) longest = position[selected[s]] + 1;
    const int64_t keys_padded = (int64_t)(longest + PANEL - 1) / PANEL * PANEL;
    const int64_t per_thread = TILE_ROWS * dim + TILE_ROWS * keys_padded + 2 * 16;
    const int64_t normed = (int64_t)outputs * hidden + 16;
    int64_t widest_k = 2 * hidden > inter ? 2 * hidden : inter;
    if (fc && fc->k > widest_k) widest_k = fc->k;
    const int64_t widest = (widest_k > q_size ? widest_k : q_size) * PANEL + 16;
    const int64_t floats = (int64_t)tokens * (3 * hidden + qkv_size) + (int64_t)outputs * (q_size + inter) +
                           threads * (per_thread + normed + widest) + 16 * 7;
    float *arena = malloc(sizeof(float) * (size_t)floats);
    if (!arena) return -1;
    float *next = arena;
    float *joined = take(&next, (int64_t)tokens * 2 * hidden), *qkv = take(&next, (int64_t)tokens * qkv_size);
    float *attn = take(&next, (int64_t)outputs * q_size), *act = take(&next, (int64_t)outputs * inter);
    float *normed_arena = take(&next, threads * normed), *widened_arena = take(&next, threads * widest);
    float *fused = take(&next, (int64_t)tokens * hidden), *attend_arena = next;
    float *x = out_features; /* the residual stream of the selected tokens, finished in place */
    const float *features = fc ? fused : inputs;

#pragma omp parallel num_threads(threads)
    {
        float *mine = attend_arena + omp_get_thread_num() * per_thread;
        const AttendScratch my_scratch = {mine, mine + TILE_ROWS * dim + 16};
        float *h = normed_arena + omp_get_thread_num() * normed;
        float *widened = widened_arena + omp_get_thread_num() * widest;
        if (fc) linear(inputs, tokens, fc, fused, hidden, NULL, 0, widened);
#pragma omp for schedule(static)
        for (int t = 0; t < tokens; t++) {
            float embedded[hidden];
            embed_row(m, token_ids[t], embedded);
            float *out = joined + (int64_t)t * 2 * hidden;
            rms_norm(embedded, layer->input_norm, hidden, m->eps, out);
            rms_norm(features + (int64_t)t * hidden, hidden_norm, hidden, m->eps, out + hidden);
        }
        linear(joined, tokens, &layer->qkv, qkv, qkv_size, NULL, 0, widened);
#pragma omp for schedule(static)
        for (int t = 0; t < tokens; t++) {
            float *row = qkv + (int64_t)t * qkv_size;
            const float *cos = m->rope_cos + (int64_t)position[t] * dim, *sin = m->rope_sin + (int64_t)position[t] * dim;
            for (int head = 0; head < heads + kv_heads; head++) rope(row + head * dim, cos, sin, dim);
            float *keys = cache->k + slot[t] * cache->k_slot + position[t];
            for (int i = 0; i < key_stride; i++) keys[i * cache->positions] = row[q_size + i];
            memcpy(cache->v + slot[t] * cache->v_slot + position[t] * key_stride, row + q_size + key_stride,
                   sizeof(float) * (size_t)key_stride);
        }
#pragma omp for schedule(static) collapse(2)
        for (int s = 0; s < outputs; s++) {
            for (int kv = 0; kv < kv_heads; kv++) {
                const int t = selected[s];
                attend(m, kv, qkv + (int64_t)t * qkv_size, qkv_size, 1, position[t], 0,
                       cache->k + slot[t] * cache->k_slot + (int64_t)kv * dim * cache->positions, cache->positions,
                       cache->v + slot[t] * cache->v_slot + (int64_t)kv * dim, key_stride, attn + (int64_t)s * q_size,
                       q_size, &my_scratch);
            }
        }
#pragma omp for schedule(static)
        for (int s = 0; s < outputs; s++) {
            /* The residual stream starts from the feature, or from its norm (speculators' heads). */
            const float *residual = norm_before_residual ? joined + (int64_t)selected[s] * 2 * hidden + hidden
                                                         : features + (int64_t)selected[s] * hidden;
            memcpy(x + (int64_t)s * hidden, residual, sizeof(float) * (size_t)hidden);
        }
        linear(attn, outputs, &layer->o_proj, x, hidden, NULL, 1, widened);
        rms_norm_rows(x, outputs, layer->post_norm, hidden, m->eps, h);
        linear_glu(h, outputs, &layer->gate_up, act, inter, widened);
        linear(act, outputs, &layer->down, x, hidden, NULL, 1, widened);
        rms_norm_rows(x, outputs, m->norm, hidden, m->eps, h);
        linear(h, outputs, &m->lm_head, logits, m->vocab, NULL, 0, widened);
    }
    free(arena);
    return 0;
}

/* A sampled draft (engine/sampling.py `target_probs` without top-k, then `sample`): `probs`
 * becomes softmax(logits * inv_temperature) kept on its top_p nucleus, and the draft is the first
 * index whose cumulative probability exceeds u times the total (a zero-probability one never
 * does). `scratch` holds n floats rounded up to a multiple of 16, plus 16. Returns the index, or
 * -1 when memory could not be had. */
static int draw(const float *logits, int n, float inv_temperature, float top_p, double u, float *probs,
                float *scratch) {
    memcpy(scratch, logits, sizeof(float) * (size_t)n);
    softmax(scratch, 0, 0, n - 1, n - 1, inv_temperature);
    if (top_p < 1.0f) {
        if (adaspec_nucleus(scratch, 1, n, top_p, probs)) return -1;
    } else {
        memcpy(probs, scratch, sizeof(float) * (size_t)n);
    }
    double total = 0.0, seen = 0.0;
    for (int i = 0; i < n; i++) total += probs[i];
    const double threshold = u * total;
    int last = 0;
    for (int i = 0; i < n; i++) {
        if (probs[i] > 0.0f) last = i;
        seen += probs[i];
        if (seen > threshold) return i;
    }
    return last; /* the draw rounded up to the total */
}

/* EAGLE-3 chains for `rows` sequences in one call: what a chain step by step from Python would
 * draft, without a return to Python between steps. Row r's chain starts from its first draft,
 * tokens[r * width], and its last verified output feature, features[r] ([rows, hidden],
 * overwritten); step j writes its entry at start[r] + j and drafts tokens[r * width + j + 1], for
 * j < steps[r]: the argmax of its logits (the first of equals, as torch.argmax), or with
 * `uniforms` ([rows, width]) a draw at uniforms[r * width + j + 1] from the row's
 * inv_temperature[r] and top_p[r] (`draw`), its probabilities written to probs[(r * width + j +
 * 1) * vocab ..]; mapped by draft_to_target. Rows that are done drop out of the later steps.
 * drafted[r] counts row r's drafts (in: 1, or 0 for a row that drafts no more). A greedy row stops
 * at the first draft whose probability under the head is below floor (0: never); that draft
 * is not kept. */
int adaspec_eagle3_chain(const Model *m, const float *hidden_norm, int norm_before_residual, const Cache *cache,
                         int rows, const int32_t *slot, const int32_t *start, const int32_t *steps,
                         const int64_t *draft_to_target, float *features, int64_t *tokens, int width,
                         const float *inv_temperature, const float *top_p, const double *uniforms, float *probs,
                         float floor, int32_t *drafted, int threads) {
    const int hidden = m->hidden, vocab = m->vocab;
    int longest = 0;
    for (int r = 0; r < rows; r++)
        if (steps[r] > longest) longest = steps[r];
    float *arena = malloc(sizeof(float) * ((size_t)rows * (2 * hidden + vocab) + (size_t)vocab + 32));
    int32_t *meta = malloc(sizeof(int32_t) * (size_t)rows * 4);
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)rows);
    if (!arena || !meta || !ids) {
        free(arena), free(meta), free(ids);
        return -1;
    }
    float *scratch = arena + (int64_t)rows * (2 * hidden + vocab);
    float *in = arena, *out = arena + (int64_t)rows * hidden, *logits = out + (int64_t)rows * hidden;
    int32_t *row_of = meta, *slots = meta + rows, *positions = meta + 2 * rows, *selected = meta + 3 * rows;
    int failed = 0;
    for (int j = 0; j < longest && !failed; j++) {
        int n = 0;
        for (int r = 0; r < rows; r++) {
            if (steps[r] <= j || drafted[r] != j + 1) continue;
            row_of[n] = r, slots[n] = slot[r], positions[n] = start[r] + j, selected[n] = n;
            ids[n] = tokens[(int64_t)r * width + j];
            memcpy(in + (int64_t)n * hidden, features + (int64_t)r * hidden, sizeof(float) * (size_t)hidden);
            n++;
        }
        if (n == 0) break; /* every row has stopped: a row never steps again once it has not */
        failed = adaspec_eagle3_step(m, hidden_norm, norm_before_residual, NULL, cache, n, ids, in, slots, positions,
                                     n, selected, out, logits, threads);
        for (int s = 0; s < n && !failed; s++) {
            const int r = row_of[s];
            const int64_t at = (int64_t)r * width + j + 1;
            int pick = uniforms ? draw(logits + (int64_t)s * vocab, vocab, inv_temperature[r], top_p[r], uniforms[at],
                                       probs + at * vocab, scratch)
                                : argmax(logits + (int64_t)s * vocab, vocab);
            if (pick < 0) {
                failed = -1;
                break;
            }
            if (!uniforms && floor > 0 && top_probability(logits + (int64_t)s * vocab, vocab, pick) < floor)
                continue;
            drafted[r] = j + 2;
            tokens[at] = draft_to_target[pick];
            memcpy(features + (int64_t)r * hidden, out + (int64_t)s * hidden, sizeof(float) * (size_t)hidden);
        }
    }
    free(arena), free(meta), free(ids);
    return failed;
}

/* A round's drafting for greedy EAGLE-3 rows in one call: the draft-extend of their kept tokens
 * (adaspec_eagle3_step with fc over the target's taps; `selected[r]` is row r's last token),
 * whose output feature and draft-vocabulary logits become slot[selected[r]]'s next ones
 * (next_features [slots, hidden], next_logits [slots, vocab]), then each row's greedy chain from
 * there (adaspec_eagle3_chain): its first draft the argmax of those logits, then steps[r] more,
 * written to tokens[r * width ..], and how many there are to drafted[r]: fewer where a draft's
 * probability under the head is below floor (as adaspec_eagle3_chain stops). */
int adaspec_eagle3_round(const Model *m, const float *hidden_norm, int norm_before_residual, const Linear *fc,
                         const Cache *cache, int count, const int64_t *token_ids, const float *taps,
                         const int32_t *slot, const int32_t *position, int rows, const int32_t *selected,
                         const int32_t *steps, const int64_t *draft_to_target, float *next_features,
                         float *next_logits, int64_t *tokens, int width, float floor, int32_t *drafted,
                         int threads) {
    const int hidden = m->hidden, vocab = m->vocab;
    float *arena = malloc(sizeof(float) * (size_t)rows * (hidden + vocab));
    int32_t *meta = malloc(sizeof(int32_t) * (size_t)rows * 2);
    if (!arena || !meta) {
        free(arena), free(meta);
        return -1;
    }
    float *features = arena, *logits = arena + (int64_t)rows * hidden;
    int32_t *row_slot = meta, *start = meta + rows;
    int failed = adaspec_eagle3_step(m, hidden_norm, norm_before_residual, fc, cache, count, token_ids, taps, slot,
                                     position, rows, selected, features, logits, threads);
    for (int r = 0; r < rows && !failed; r++) {
        const int t = selected[r];
        row_slot[r] = slot[t], start[r] = position[t] + 1;
        memcpy(next_features + (int64_t)slot[t] * hidden, features + (int64_t)r * hidden, sizeof(float) * (size_t)hidden);
        memcpy(next_logits + (int64_t)slot[t] * vocab, logits + (int64_t)r * vocab, sizeof(float) * (size_t)vocab);
        const float *row = logits + (int64_t)r * vocab;
        const int first = argmax(row, vocab);
        tokens[(int64_t)r * width] = draft_to_target[first];
        drafted[r] = floor > 0 && top_probability(row, vocab, first) < floor ? 0 : 1;
    }
    if (!failed)
        failed = adaspec_eagle3_chain(m, hidden_norm, norm_before_residual, cache, rows, row_slot, start, steps,
                                      draft_to_target, features, tokens, width, NULL, NULL, NULL, NULL, floor,
                                      drafted, threads);
    free(arena), free(meta);
    return failed;
}

/* Greedy chains of a draft model for `rows` sequences in one call: what its forward step by step
 * from Python would draft. Row r first feeds count[r] tokens (tokens[r * width ..], what its cache
 * at slot[r] lacks after its start[r] cached ones), whose last logits give its first draft; then
 * each draft but the last is fed in turn, until row r has drafts[r] drafts, written to
 * out[r * out_width ..]. Rows that are done drop out of the later forwards. Returns -2 unless
 * every row feeds at least one token and drafts at least one. */
int adaspec_greedy_chain(const Model *m, const Cache *cache, int rows, int width, const int64_t *tokens,
                         const int32_t *slot, const int32_t *start, const int32_t *count, const int32_t *drafts,
                         int64_t *out, int out_width, int threads) {
    int longest = 0;
    for (int r = 0; r < rows; r++) {
        if (drafts[r] < 1 || count[r] < 1) return -2; /* every row feeds something and drafts */
        if (drafts[r] > longest) longest = drafts[r];
    }
    float *logits = malloc(sizeof(float) * (size_t)rows * m->vocab);
    int32_t *meta = malloc(sizeof(int32_t) * (size_t)rows * 5);
    int64_t *fed = malloc(sizeof(int64_t) * (size_t)rows);
    if (!logits || !meta || !fed) {
        free(logits), free(meta), free(fed);
        return -1;
    }
    int32_t *row_of = meta, *slots = meta + rows, *starts = meta + 2 * rows, *counts = meta + 3 * rows;
    int32_t *next = meta + 4 * rows; /* per row: where its next token goes in its cache */
    int failed = 0;
    for (int j = 0; j < longest && !failed; j++) {
        int n = 0;
        for (int r = 0; r < rows; r++) {
            if (drafts[r] <= j) continue;
            if (j == 0) next[r] = start[r];
            row_of[n] = r, slots[n] = slot[r], starts[n] = next[r], counts[n] = j == 0 ? count[r] : 1;
            if (j > 0) fed[n] = out[(int64_t)r * out_width + j - 1];
            n++;
        }
        const Batch b = {n, j == 0 ? width : 1, j == 0 ? tokens : fed, slots, starts, counts, 1, logits,
                         0, NULL, NULL, threads, 0, 0, 0};
        failed = adaspec_forward(m, cache, &b);
        for (int s = 0; s < n && !failed; s++) {
            out[(int64_t)row_of[s] * out_width + j] = argmax(logits + (int64_t)s * m->vocab, m->vocab);
            next[row_of[s]] += counts[s];
        }
    }
    free(logits), free(meta), free(fed);
    return failed;
}


/* Top-p filtering (engine/sampling.py `nucleus`): each row of `probs` ([rows, n], a distribution)
 * kept on the smallest set of most likely tokens whose mass reaches top_p (the most likely always
 * stays), renormalized, into `out`. No sort of the vocabulary: tokens go to buckets by how far
 * their bits lie below the row's largest (a positive float's bits order as its value does: 128
 * buckets an octave), whole buckets above the one where the mass reaches top_p are kept, and only
 * that bucket's tokens are ranked. Returns 0, or -1 when memory could not be had. */
#define NUCLEUS_SHIFT 16 /* 2^(23 - 16) = 128 buckets an octave */
#define NUCLEUS_BUCKETS 4096 /* 32 octaves: the last bucket holds every token further below (and zeros) */

typedef struct {
    float value;
    int32_t index;
} Member;

static int more_likely(const void *a, const void *b) {
    const Member *x = a, *y = b;
    if (x->value != y->value) return x->value < y->value ? 1 : -1;
    return x->index < y->index ? -1 : x->index > y->index;
}

int adaspec_nucleus(const float *probs, int rows, int n, float top_p, float *out) {
    Member *members = malloc(sizeof(Member) * (size_t)n);
    int32_t *bucket = malloc(sizeof(int32_t) * ((size_t)n + 16));
    float *mass = malloc(sizeof(float) * NUCLEUS_BUCKETS);
    if (!members || !bucket || !mass) {
        free(members), free(bucket), free(mass);
        return -1;
    }
    const int whole = n / 16 * 16;
    for (int r = 0; r < rows; r++) {
        const float *p = probs + (int64_t)r * n;
        float *o = out + (int64_t)r * n;
        float largest = p[0];
        if (whole) {
            vf top_lanes = *(const vf_unaligned *)p;
            for (int i = 16; i < whole; i += 16) {
                const vf x = *(const vf_unaligned *)(p + i);
                top_lanes = pick(x > top_lanes, x, top_lanes);
            }
            for (int lane = 0; lane < 16; lane++) largest = top_lanes[lane] > largest ? top_lanes[lane] : largest;
        }
        for (int i = whole; i < n; i++) largest = p[i] > largest ? p[i] : largest;
        int32_t top;
        memcpy(&top, &largest, sizeof top);
        /* Each token's bucket: vectors, then the tail one by one, the same arithmetic. */
        const vi last = (vi){0} + (NUCLEUS_BUCKETS - 1);
        for (int i = 0; i < whole; i += 16) {
            const vf x = *(const vf_unaligned *)(p + i);
            const vi depth = ((vi){0} + top - (vi)x) >> NUCLEUS_SHIFT;
            vi b = (vi)pick(depth < last, (vf)depth, (vf)last);
            b = (vi)pick(x > 0.0f, (vf)b, (vf)last);
            memcpy(bucket + i, &b, sizeof b);
        }
        for (int i = whole; i < n; i++) {
            int32_t bits;
            memcpy(&bits, p + i, sizeof bits);
            const int32_t depth = (top - bits) >> NUCLEUS_SHIFT;
            bucket[i] = !(p[i] > 0.0f) || depth >= NUCLEUS_BUCKETS - 1 ? NUCLEUS_BUCKETS - 1 : depth;
        }
        memset(mass, 0, sizeof(float) * NUCLEUS_BUCKETS);
        for (int i = 0; i < n; i++) mass[bucket[i]] += p[i];
        /* The crossing bucket: whole runs of 16 buckets skipped while the mass stays under top_p. */
        int crossing = NUCLEUS_BUCKETS - 1;
        double above = 0.0; /* the mass of the buckets above `crossing` */
        int b = 0;
        for (; b + 16 <= NUCLEUS_BUCKETS; b += 16) {
            const double run = hsum(*(const vf_unaligned *)(mass + b));
            if (above + run >= top_p) break;
            above += run;
        }
        for (; b < NUCLEUS_BUCKETS; b++) {
            if (above + mass[b] >= top_p) {
                crossing = b;
                break;
            }
            above += mass[b];
        }
        int count = 0;
        double total = above;
        const vi cut = (vi){0} + crossing;
        for (int i = 0; i < whole; i += 16) {
            vi at;
            memcpy(&at, bucket + i, sizeof at);
            const vf x = *(const vf_unaligned *)(p + i);
            *(vf_unaligned *)(o + i) = pick(at < cut, x, (vf){0});
            const vi in_crossing = (at == cut) & (x > 0.0f);
            for (int lane = 0; lane < 16; lane++)
                if (in_crossing[lane]) members[count++] = (Member){x[lane], i + lane};
        }
        for (int i = whole; i < n; i++) {
            o[i] = bucket[i] < crossing ? p[i] : 0.0f;
            if (bucket[i] == crossing && p[i] > 0.0f) members[count++] = (Member){p[i], i};
        }
        qsort(members, (size_t)count, sizeof(Member), more_likely);
        for (int j = 0; j < count && above < top_p; j++) {
            o[members[j].index] = members[j].value;
            total += members[j].value;
            above += members[j].value;
        }
        const float scale = (float)(1.0 / total);
        for (int i = 0; i < n; i++) o[i] *= scale;
    }
    free(members), free(bucket), free(mass);
    return 0;
}
