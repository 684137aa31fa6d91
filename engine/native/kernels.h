/* The interface between engine/native/kernels.c and Python, declared once: kernels.c includes
 * this file (the compiler holds its definitions to these prototypes) and engine/native/abi.py
 * reads it to make the ctypes structures and argument types, so the two cannot drift apart.
 *
 * abi.py reads a plain subset of C: typedef'd structs of scalars, pointers and nested structs,
 * and one prototype per function, each starting on its own line with "int adaspec_".
 */
#ifndef ADASPEC_KERNELS_H
#define ADASPEC_KERNELS_H

#include <stdint.h>

#define PANEL 64 /* output columns per weight panel: four vectors */

enum { F32, BF16, INT8, UINT4 }; /* how a Linear's panels are stored */

/* A weight [n, k] stored as panels of PANEL output columns, each [k][PANEL] (the last one
 * zero-padded), so that a product streams it from memory exactly once in order. UINT4 packs a
 * panel row's 64 values into 32 bytes: byte j holds column j in its low nibble, j + 32 in its high.
 *
 * Grouped (group > 0; INT8 or UINT4): each output's inputs come in groups of `group` consecutive
 * ones (the last may be shorter), each group with a scale and min (float32, or float16 where
 * every one is exact in it), and a weight is
 * q * scale + min computed in float32 before it multiplies (GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q6_K
 * are all this after unpacking). Scales and mins are [panels][groups][PANEL]. */
typedef struct {
    const void *panels; /* in `format`: bfloat16, int8 and uint4 are widened to float32 as they are read */
    const float *bias;  /* [n] or NULL */
    const float *scale; /* INT8 with group 0: [n], each output column's scale (its products are summed,
                         * then scaled); grouped: each group's scale (float16 where half_scales) */
    const float *min;   /* grouped: each group's min, or NULL (0) (float16 where half_scales) */
    int32_t n, k;
    int32_t format;
    int32_t group;      /* inputs per group of a grouped layout; 0: not grouped */
    int32_t half_scales; /* grouped: scale and min are float16 (where every one is exact so: GGUF's Q8_0,
                          * Q4_0 and Q4_1 store them so), half float32's bytes */
} Linear;

typedef struct {
    const float *input_norm;
    Linear qkv;
    const float *q_norm, *k_norm; /* [head_dim] each, or NULL */
    Linear o_proj;
    const float *post_norm;
    Linear gate_up;
    Linear down;
} Layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab;
    int32_t sliding_window; /* 0: none */
    float eps;
    const void *embed;               /* [vocab, hidden], bfloat16 where `embed_bf16` */
    int32_t embed_bf16;
    const Linear *embed_rows;        /* or NULL: each token's embedding is this weight's row, read from
                                      * its panels (a quantized embedding kept only there, or the grouped
                                      * lm head it is tied to); `embed` is then unused */
    const float *norm;               /* [hidden] */
    const float *rope_cos, *rope_sin; /* [positions, head_dim]; sin with rotate-half's sign */
    Linear lm_head;
    const Layer *layers;
} Model;

typedef struct {
    float *k;                  /* [layers, slots, kv_heads, head_dim, positions]: keys position-minor */
    float *v;                  /* [layers, slots, positions, kv_heads, head_dim] */
    int64_t k_layer, k_slot, positions;
    int64_t v_layer, v_slot;
} Cache;

typedef struct {
    int32_t rows, width;     /* tokens is [rows, width], right-padded */
    const int64_t *tokens;
    const int32_t *slot, *start, *count; /* per row: cache slot, tokens cached before, new tokens */
    int32_t last_only;       /* logits of each row's last token only ([rows, vocab]) */
    float *logits;           /* [rows, width, vocab], or [rows, vocab] with last_only */
    int32_t num_captured;    /* layers whose outputs are copied to captured[i], [rows, width, hidden] */
    const int32_t *captured_layers;
    float *const *captured;
    int32_t threads;
    int32_t block;           /* a row's new tokens all see each other (DFlash's block), not causally */
    int32_t out_first, out_count; /* out_count > 0: logits of each row's tokens out_first.. only
                                   * ([rows, out_count, vocab]; every row has that many) */
    int64_t captured_stride; /* floats from one token's captured row to the next (0: hidden), so that
                              * the captured layers can sit side by side in one tensor */
    int64_t *argmax;         /* NULL, or per row of logits written its argmax (laid out as they are) */
} Batch;

/* DFlash's context: the target's tapped hidden states of `tokens` newly kept tokens ([tokens,
 * taps * hidden], concatenated) are fused (fc, then its norm) and become every draft layer's keys
 * (k-norm, RoPE at position[t]) and values in the drafter's cache, at slot[t]. */
typedef struct {
    Linear fc;
    const float *fc_norm;
    const Linear *kv; /* per draft layer: its key and value projections, [k; v] */
} Context;

int adaspec_forward(const Model *m, const Cache *cache, const Batch *b);

int adaspec_dflash_context(const Model *m, const Context *c, const Cache *cache, int tokens, const float *taps,
                           const int32_t *slot, const int32_t *position, int threads);

int adaspec_eagle3_step(const Model *m, const float *hidden_norm, int norm_before_residual, const Linear *fc,
                        const Cache *cache, int tokens, const int64_t *token_ids, const float *inputs,
                        const int32_t *slot, const int32_t *position, int outputs, const int32_t *selected,
                        float *out_features, float *logits, int threads);

int adaspec_eagle3_chain(const Model *m, const float *hidden_norm, int norm_before_residual, const Cache *cache,
                         int rows, const int32_t *slot, const int32_t *start, const int32_t *steps,
                         const int64_t *draft_to_target, float *features, int64_t *tokens, int width,
                         const float *inv_temperature, const float *top_p, const double *uniforms, float *probs,
                         float floor, int32_t *drafted, int threads);

int adaspec_eagle3_round(const Model *m, const float *hidden_norm, int norm_before_residual, const Linear *fc,
                         const Cache *cache, int count, const int64_t *token_ids, const float *taps,
                         const int32_t *slot, const int32_t *position, int rows, const int32_t *selected,
                         const int32_t *steps, const int64_t *draft_to_target, float *next_features,
                         float *next_logits, int64_t *tokens, int width, float floor, int32_t *drafted,
                         int threads);

int adaspec_greedy_chain(const Model *m, const Cache *cache, int rows, int width, const int64_t *tokens,
                         const int32_t *slot, const int32_t *start, const int32_t *count, const int32_t *drafts,
                         int64_t *out, int out_width, int threads);

int adaspec_nucleus(const float *probs, int rows, int n, float top_p, float *out);

#endif
