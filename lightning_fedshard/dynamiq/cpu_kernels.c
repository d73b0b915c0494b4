/* DynamiQ-L on CPU: the whole encode and decode(-and-add) of a chunk in two passes over its coordinates.
 *
 * The message and every rule that derives it are those of dynamiq_format.py (read it first); the torch
 * functions there and in dynamiq_codec.py are the reference, and these kernels give their bytes exactly
 * (tests/dynamiq/test_cpu_kernels.py). Why C: a chunk of 2^22 coordinates has 131,072 groups, and the
 * per-group rules (scales, water-filling, headers) cost one torch dispatch per operation, each a pass over
 * the groups: 15 ms eager and 5 ms compiled, against a 2 ms copy_ of the chunk. Here they are one loop.
 *
 * Bit-exactness: every float operation is the reference's, in its order, in fp32, built with
 * -ffp-contract=off so that no multiply-add is fused. Built by setup.py at install (cpu_kernels_build.py) and
 * loaded through ctypes by cpu_kernels.py. Portable C11 with the GCC/Clang vector extensions of GCC 8 on.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    GROUP = 32,
    GROUPS_PER_SG = 8,
    MAX_WIDTH = 8,
    SIDE_BYTES_PER_SG = 15,
    KEYS = 2048,
    LEVEL_OFFSET = 8 * (MAX_WIDTH - 2),
    LEVELS = KEYS + LEVEL_OFFSET + 1,
};

static const int32_t WIDTHS[8] = {0, 2, 3, 4, 5, 6, 7, 8};

static inline uint32_t float_bits(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    return b;
}

static inline float bits_float(uint32_t b) {
    float v;
    memcpy(&v, &b, 4);
    return v;
}

/* Max |v| of 32 floats. The absolute values' bits compare as integers in the order of the floats, and a NaN
 * (bits above +Inf) wins as it does in torch.amax, so check_finite sees it in the group's max. */
static inline float group_max_abs(const float *v) {
    uint32_t m = 0;
    for (int j = 0; j < GROUP; j++) {
        uint32_t b = float_bits(v[j]) & 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    return bits_float(m);
}

void dq_group_max(const float *x, int64_t groups, float *out) {
    for (int64_t g = 0; g < groups; g++) out[g] = group_max_abs(x + g * GROUP);
}

/* log2_eighths: floor(8·log2 v) + 1016 from the exponent and mantissa bits. */
static inline int64_t log2_eighths(float v, const float *mantissa_steps) {
    uint32_t b = float_bits(v);
    int64_t exponent = (b >> 23) & 0xFF;
    float mantissa = bits_float((b & 0x7FFFFFu) | 0x3F800000u);
    int64_t eighths = 0;
    for (int k = 0; k < 7; k++) eighths += mantissa >= mantissa_steps[k];
    return 8 * exponent + eighths;
}

/* group_log_scales of a super-group's 8 groups: for each, the largest c with sg · table[c] ≥ its max. The
 * predicate falls with c and holds at c = 0 (table[0] = 1, sg ≥ every max), so a binary search finds it exactly;
 * an all-zero group gets 255, as in the reference. The 8 searches run side by side (one vector step each). */
static inline void log_scales(const float *maxima, float sg, const float *table, int32_t c[GROUPS_PER_SG]) {
    for (int k = 0; k < GROUPS_PER_SG; k++) c[k] = 0;
    for (int step = 128; step > 0; step >>= 1)  /* c + step ≤ 128 + 64 + ... + 1 = 255 */
        for (int k = 0; k < GROUPS_PER_SG; k++) c[k] = sg * table[c[k] + step] >= maxima[k] ? c[k] + step : c[k];
}

static inline int32_t width_at(int64_t key, int64_t level) {
    int64_t above = key - level, w = 2 + (above >> 3);  /* key -1 (an all-zero group) is below every level */
    return (key >= 0 && above >= 0) ? (int32_t)(w < MAX_WIDTH ? w : MAX_WIDTH) : 0;
}

/* allocate_widths: reverse water-filling of `budget` width units over the groups' keys. */
static void allocate_widths(const int64_t *keys, int64_t groups, int64_t budget, int32_t *widths) {
    int64_t at_least[KEYS + 1] = {0};  /* on the stack: ranks simulated in threads call this at once */
    for (int64_t g = 0; g < groups; g++)
        if (keys[g] >= 0) at_least[keys[g]]++;
    for (int k = KEYS - 1; k >= 0; k--) at_least[k] += at_least[k + 1];
    /* counts[i] = #keys ≥ i - LEVEL_OFFSET, with every key counted below the smallest and none above 2047 */
#define COUNTS(i) ((i) < LEVEL_OFFSET ? at_least[0] : (i) - LEVEL_OFFSET < KEYS ? at_least[(i) - LEVEL_OFFSET] : 0)
    int64_t first_fit = 0;  /* argmax of an all-false mask is 0, as in the reference */
    for (int64_t i = 0; i < LEVELS; i++) {
        int64_t used = 2 * COUNTS(i);
        for (int j = 1; j < MAX_WIDTH - 1; j++) used += COUNTS(8 * j + i);
        if (used <= budget) {
            first_fit = i;
            break;
        }
    }
#undef COUNTS
    int64_t level = first_fit - LEVEL_OFFSET, total = 0;
    for (int64_t g = 0; g < groups; g++) total += widths[g] = width_at(keys[g], level);
    /* the units left over go, in group order and while they fit, to the groups one level lower */
    int64_t remaining = budget - total, running = 0;
    for (int64_t g = 0; g < groups; g++) {
        int32_t lower = width_at(keys[g], level - 1), extra = lower - widths[g];
        running += extra;
        if (extra > 0 && running <= remaining) widths[g] = lower;
    }
}

/* hash_uniform: the dither of coordinate `index` in (0, 1). */
static inline float hash_uniform(int64_t index, int64_t key) {
    uint64_t x = (uint64_t)(index ^ key);
    for (int r = 0; r < 2; r++) x = ((x ^ (x >> 16)) * 0x45D9F3Bu) & 0xFFFFFFFFu;
    x ^= x >> 16;
    return ((float)(x >> 9) + 0.5f) * 0x1p-23f;
}

/* A group's 32 codes of 8 bits as 4 blocks of 8 (block b = lanes 8b..8b+7, code j of a block in byte j), and
 * its 8 planes as 32 bytes (byte 4m + b = lanes 8b..8b+7 of plane m). GCC and Clang vector types: SIMD
 * registers where the target has them, plain integers elsewhere. */
typedef uint64_t blocks_t __attribute__((vector_size(32)));
typedef uint8_t bytes_t __attribute__((vector_size(32)));

/* Each block's 8×8 bit matrix (row i = byte i) transposed: bit j of byte i goes to bit i of byte j, so eight
 * codes become their eight bit planes (byte m = bit m of each code) and back. */
static inline blocks_t transpose8(blocks_t x) {
    blocks_t t;
    t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAull, x ^= t ^ (t << 7);
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCull, x ^= t ^ (t << 14);
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ull, x ^= t ^ (t << 28);
    return x;
}

/* A byte shuffle by a constant pattern: Clang's __builtin_shufflevector, or GCC's __builtin_shuffle, which every
 * GCC from 4.7 has (GCC has __builtin_shufflevector only from 12 on, and Ubuntu 22.04 and RHEL 8/9 ship 8 to 11).
 * Both give the same instruction (one byte permute where the target has it). */
#if defined(__clang__)
#define SHUFFLE_BYTES(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE_BYTES(v, ...) __builtin_shuffle(v, (bytes_t){__VA_ARGS__})
#endif

/* Byte 8b + m of the blocks' planes to byte 4m + b of the plane words: codes to planes. */
static inline bytes_t blocks_to_planes(bytes_t v) {
    return SHUFFLE_BYTES(v, 0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27, 4, 12, 20, 28, 5, 13, 21, 29, 6,
                         14, 22, 30, 7, 15, 23, 31);
}

/* The inverse: byte 4m + b to byte 8b + m. */
static inline bytes_t planes_to_blocks(bytes_t v) {
    return SHUFFLE_BYTES(v, 0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29, 2, 6, 10, 14, 18, 22, 26, 30, 3,
                         7, 11, 15, 19, 23, 27, 31);
}

/* torch.minimum(torch.maximum(floor(s), -L), L - 1) + L for finite s (fminf/fmaxf would not vectorise) */
static inline uint8_t midrise_code(float scaled, float levels) {
    float q = floorf(scaled);
    q = q > -levels ? q : -levels;
    q = q < levels - 1.0f ? q : levels - 1.0f;
    return (uint8_t)(int32_t)(q + levels);
}

/* One group's codes in [0, 2^w) (quantize) and its 8 bit planes (bit_planes), of which the first w are sent. */
static inline void quantize_group(const float *v, int64_t first_index, int32_t w, float group_scale,
                                  int stochastic, int64_t key, int antithetic, uint8_t planes[GROUP]) {
    const float levels = (float)(1 << (w - 1)), steps = stochastic ? levels - 0.5f : levels;
    const float inverse_step = steps / group_scale;
    uint8_t codes[GROUP];
    if (!stochastic) {
        for (int j = 0; j < GROUP; j++) codes[j] = midrise_code(v[j] * inverse_step, levels);
    } else {
        const float sign = antithetic ? -1.0f : 1.0f;  /* ½ - u = -(u - ½) exactly */
        for (int j = 0; j < GROUP; j++)
            codes[j] = midrise_code(v[j] * inverse_step + sign * (hash_uniform(first_index + j, key) - 0.5f), levels);
    }
    blocks_t blocks;
    memcpy(&blocks, codes, GROUP);  /* little-endian: code j of block b is byte j of blocks[b] */
    blocks = transpose8(blocks);
    bytes_t bytes;
    memcpy(&bytes, &blocks, GROUP);
    bytes = blocks_to_planes(bytes);
    memcpy(planes, &bytes, GROUP);
}

/* The message of x (n = 32·groups coordinates) whose group maxima are `group_max`, into `msg`
 * (15·n/256 + 4·budget bytes). `widths` is scratch of `groups` int32, `keys` of `groups` int64. */
void dq_encode(const float *x, const float *group_max, int64_t groups, int64_t budget, const float *table,
               const float *mantissa_steps, int stochastic, int64_t key, int antithetic, uint8_t *msg,
               int32_t *widths, int64_t *keys) {
    const int64_t sgs = groups / GROUPS_PER_SG;
    uint8_t *sg_field = msg, *log_field = msg + 4 * sgs, *width_field = log_field + groups;
    uint8_t *payload = width_field + 3 * groups / 8;
    for (int64_t g = 0; g < groups; g++) keys[g] = group_max[g] > 0 ? log2_eighths(group_max[g], mantissa_steps) : -1;
    allocate_widths(keys, groups, budget, widths);
    int64_t offset = 0;
    for (int64_t s = 0; s < sgs; s++) {
        const float *maxima = group_max + s * GROUPS_PER_SG;
        float sg = maxima[0];
        for (int k = 1; k < GROUPS_PER_SG; k++) sg = maxima[k] > sg ? maxima[k] : sg;
        memcpy(sg_field + 4 * s, &sg, 4);
        int32_t c[GROUPS_PER_SG];
        log_scales(maxima, sg, table, c);
        uint32_t width_codes = 0;  /* 8 codes of 3 bits: 3 bytes, little-endian */
        for (int k = 0; k < GROUPS_PER_SG; k++) {
            const int64_t g = s * GROUPS_PER_SG + k;
            const int32_t w = widths[g];
            log_field[g] = (uint8_t)c[k];
            width_codes |= (uint32_t)(w == 0 ? 0 : w - 1) << (3 * k);
            if (w == 0) continue;
            uint8_t planes[GROUP];
            quantize_group(x + g * GROUP, g * GROUP, w, sg * table[c[k]], stochastic, key, antithetic, planes);
            /* all 8 planes where they fit (the next group overwrites the extra ones): one fixed-size store */
            if (offset + MAX_WIDTH <= budget)
                memcpy(payload + 4 * offset, planes, GROUP);
            else
                memcpy(payload + 4 * offset, planes, 4 * (size_t)w);
            offset += w;
        }
        memcpy(width_field + 3 * s, &width_codes, 3);
    }
    memset(payload + 4 * offset, 0, 4 * (size_t)(budget - offset));  /* the units no group could take */
}

/* PLANE_MASKS[w]: the bytes of the first w plane words. */
static bytes_t PLANE_MASKS[MAX_WIDTH + 1];

__attribute__((constructor)) static void fill_plane_masks(void) {
    for (int w = 0; w <= MAX_WIDTH; w++)
        for (int i = 0; i < GROUP; i++) PLANE_MASKS[w][i] = i < 4 * w ? 0xFF : 0;
}

/* decode_add: every coordinate's cell centre (code - L + ½) · step, plus `local` when not NULL, into `out`;
 * each group's max |value| into `group_max`. Returns 0, or -1 when the widths need more than `budget` payload
 * words (a corrupt message: nothing past the payload is read). */
int dq_decode(const uint8_t *msg, int64_t groups, int64_t budget, const float *table, int stochastic,
              const float *local, float *out, float *group_max) {
    const int64_t sgs = groups / GROUPS_PER_SG;
    const uint8_t *sg_field = msg, *log_field = msg + 4 * sgs, *width_field = log_field + groups;
    const uint8_t *payload = width_field + 3 * groups / 8;
    int64_t offset = 0;
    for (int64_t s = 0; s < sgs; s++) {
        float sg;
        memcpy(&sg, sg_field + 4 * s, 4);
        uint32_t width_codes = 0;
        memcpy(&width_codes, width_field + 3 * s, 3);
        for (int k = 0; k < GROUPS_PER_SG; k++) {
            const int64_t g = s * GROUPS_PER_SG + k;
            const int32_t w = WIDTHS[(width_codes >> (3 * k)) & 7];
            if (offset + w > budget) return -1;
            const float levels = w > 0 ? (float)(1 << (w - 1)) : 0.0f;
            const float steps = stochastic ? levels - 0.5f : levels;
            const float step = w > 0 ? sg * table[log_field[g]] / steps : 0.0f;
            bytes_t bytes = {0};
            if (offset + MAX_WIDTH <= budget) {  /* one fixed-size load, the planes past w masked off */
                memcpy(&bytes, payload + 4 * offset, GROUP);
                bytes &= PLANE_MASKS[w];
            } else {
                memcpy(&bytes, payload + 4 * offset, 4 * (size_t)w);
            }
            offset += w;
            bytes = planes_to_blocks(bytes);
            blocks_t blocks;
            memcpy(&blocks, &bytes, GROUP);
            blocks = transpose8(blocks);
            uint8_t codes[GROUP];
            memcpy(codes, &blocks, GROUP);
            float *values = out + g * GROUP;
            for (int j = 0; j < GROUP; j++) {
                float value = (((float)codes[j] - levels) + 0.5f) * step;
                values[j] = local ? value + local[g * GROUP + j] : value;
            }
            group_max[g] = group_max_abs(values);
        }
    }
    return 0;
}

/* The x86-64 level this CPU and its OS run: 4 (AVX-512 F, BW, CD, DQ, VL), 3 (AVX2, FMA, BMI1/2), 2 (SSSE3,
 * SSE4.1/4.2, POPCNT), else 0, as elsewhere than x86. The features are exactly those of each level's flags in
 * cpu_kernels_build.py: the loader asks the baseline library and loads the highest level built up to this. */
int dq_cpu_level(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("ssse3") && __builtin_cpu_supports("sse4.1") && __builtin_cpu_supports("sse4.2") &&
          __builtin_cpu_supports("popcnt")))
        return 0;
    if (!(__builtin_cpu_supports("avx") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2")))
        return 2;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")))
        return 3;
    return 4;
#else
    return 0;
#endif
}

/* The SHA-256 of the source this library was built from (cpu_kernels_build.py passes it): the loader refuses
 * a library built from other source, as an editable install's is after the source changes. */
#ifndef DQ_SOURCE_SHA256
#define DQ_SOURCE_SHA256 ""
#endif
const char *dq_source_sha256(void) { return DQ_SOURCE_SHA256; }
