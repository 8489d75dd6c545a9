/* lrq-bench's CPU kernels (lrq.native compiles this file on the machine that runs it: cc -O3 -march=native
 * -fopenmp; the vector code is AVX-512 (with AVX512-BF16/VNNI/VBMI where the compiler's target has them) or AVX2
 * intrinsics chosen by the target's macros, plain C elsewhere). What it holds: the 4-bit, W8A8 and dense
 * matrix-vector products of a decode step, the 4-bit prefill operand (int4_unpack_t), the lean runtime's norms,
 * RoPE with the cache write and attention, and a whole decoder layer's one-token step in one call
 * (lrq_decoder_layer_step, at the end).
 *
 * int4_gemv: y[m, n_pad] (float32) = x[m, k_pad] (float32) times the weight held in torch's int4 CPU packing
 * (`_convert_weight_to_int4pack_for_cpu`, lrq.cpu_kernels): output features in blocks of B (64 where torch runs
 * its AVX-512 kernels, 32 with its AVX2 ones), each block k rows of B / 2 bytes, byte j holding feature j (low
 * nibble) and feature j + B / 2 (high nibble); then one block of the remaining n mod B features, k rows of
 * rem / 2 bytes, byte j holding features 2j (low) and 2j + 1 (high). The weight is q * s + zc per group of
 * `group` input features (s, zc per group and feature, held block by block, compactly where they fit: block_scales;
 * the quantizer's own groups, the last one shorter where group does not divide k_pad: a 576-wide layer at g128 reads
 * 5 scale rows, not torch's kernel group 64's 9), so per group
 *     y += s * sum_k q[k] x[k] + zc * sum_k x[k]
 * with the levels' products summed in float32 vectors of 16 features (exact: q < 16), or, for bf16 activations
 * (and float32 ones where the layer's x16 asks: float32_decode "i16") where the CPU has AVX512-VNNI and VBMI, or
 * AVX2 without AVX-512 on torch's AVX2 packing, as int32 sums of 16-bit integer products (block64_i16, block32_i16:
 * the activations scaled per chunk of 256 rows, each rounded to within 2^-15 of its chunk's largest). Output blocks
 * are split among `nthreads` OpenMP threads (the runtime torch itself uses, where torch's libgomp is the one loaded). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__)
/* acc += p in place, in int32 or int16 lanes: written as one instruction because GCC, given the intrinsic, adds into a
 * temporary and moves it back (a third more instructions in the AVX2 integer loops, 10-19 % of their time) */
#define ADD_I32_IN_PLACE(acc, p) __asm__("vpaddd %1, %0, %0" : "+x"(acc) : "x"(p))
#define ADD_I16_IN_PLACE(acc, p) __asm__("vpaddw %1, %0, %0" : "+x"(acc) : "x"(p))
#endif
#if defined(__AVX512VNNI__)
/* acc += the VNNI dot products of a and b in place (vpdpwssd: int16 pairs; vpdpbusd: u8 quadruples of a times s8 ones
 * of b), written as one instruction for the same reason: GCC 12, given the intrinsics, copies each accumulator into
 * a new register and back around every product and spills some to the stack, so that block64_i16's accumulators
 * each waited on a store and a reload a step (53 instructions a step instead of 24; a 1536 x 576 layer in L2 at 27
 * GB/s of packed weight on an AMD Zen 4, about a core's stream from memory, so the two never overlapped) */
#define DPWSSD_IN_PLACE(acc, a, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#define DPBUSD_IN_PLACE(acc, u8, s8) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8))
#endif

/* v16: 16 float32 lanes (one AVX-512 register, two AVX2 ones, or a plain array) and the few operations used */
#if defined(__AVX512F__)
typedef __m512 v16;
static inline v16 vzero(void) { return _mm512_setzero_ps(); }
static inline v16 vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 vfma(v16 a, float b, v16 c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
static inline v16 vfmav(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline __m256i bf16_round16(__m512 v) {   /* round to nearest even, NaN kept quiet (f32_to_bf16) */
  __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)))),
      16);
  r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), hi, _mm512_set1_epi32(64));
  return _mm512_cvtepi32_epi16(r);
}
/* bf16_round16 in fewer operations where the CPU has AVX512-BF16: vcvtneps2bf16 gives the same bits for every value
 * but a float32 denormal, which it reads as 0 (a vector holding one takes bf16_round16) */
static inline __m256i bf16_round16_fast(__m512 v) {
#if defined(__AVX512BF16__)
  return _mm512_fpclass_ps_mask(v, 0x30) ? bf16_round16(v) : (__m256i)_mm512_cvtneps_pbh(v);
#else
  return bf16_round16(v);
#endif
}
static inline void vstore_bf16(uint16_t *p, v16 v) { _mm256_storeu_si256((__m256i *)p, bf16_round16(v)); }
static inline v16 vwiden(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
static inline v16 vload_bf16(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline float vsum(v16 v) { return _mm512_reduce_add_ps(v); }
/* the first `left` of 16 lanes (all 16 from 16 on) */
static inline __mmask16 tail16(int left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }
#define NIBBLES 1
#elif defined(__AVX2__) && defined(__FMA__)
typedef struct { __m256 a, b; } v16;
static inline v16 vzero(void) { v16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
static inline v16 vload(const float *p) { v16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline void vstore(float *p, v16 v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
static inline v16 vfma(v16 a, float b, v16 c) {
  __m256 bb = _mm256_set1_ps(b);
  v16 r = {_mm256_fmadd_ps(a.a, bb, c.a), _mm256_fmadd_ps(a.b, bb, c.b)};
  return r;
}
static inline v16 vfmav(v16 a, v16 b, v16 c) {
  v16 r = {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)};
  return r;
}
static inline __m128i bf16_round8(__m256 v) {   /* round to nearest even, NaN kept quiet (f32_to_bf16) */
  __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)))),
      16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(64)), nan);
  r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);   /* values < 65536: exact */
  return _mm256_castsi256_si128(r);
}
static inline void vstore_bf16(uint16_t *p, v16 v) {
  _mm_storeu_si128((__m128i *)p, bf16_round8(v.a));
  _mm_storeu_si128((__m128i *)(p + 8), bf16_round8(v.b));
}
static inline v16 vwiden(__m128i v) {
  v16 r = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))};
  return r;
}
static inline __m256 bf16x8(const uint16_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline v16 vload_bf16(const uint16_t *p) { v16 r = {bf16x8(p), bf16x8(p + 8)}; return r; }
static inline float vsum(v16 v) {
  __m256 a = _mm256_add_ps(v.a, v.b);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#define NIBBLES 1
#endif

#if defined(NIBBLES) && defined(__AVX512F__)
typedef __m128i b16;
static inline b16 bload(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
static inline v16 lo_f(b16 v) { return vwiden(_mm_and_si128(v, _mm_set1_epi8(15))); }
static inline v16 hi_f(b16 v) { return vwiden(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15))); }
#elif defined(NIBBLES)
/* AVX2: the 16 bytes in both halves of a register (a broadcast load), each byte spread into an int32 lane by one
 * vpshufb per 8 bytes (bytes 0-3 | 4-7, or 8-11 | 12-15), the low nibble masked, the high one shifted down: 2
 * shuffles for 32 levels where vpmovzxbd (and the shifts that bring bytes 8-15 down to it) took 6, all on the one
 * port Intel cores shuffle on: the float32 4-bit matrix-vector product 13-15 % faster on an Intel Xeon held to AVX2,
 * the same values */
typedef __m256i b16;
static inline b16 bload(const uint8_t *p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256i spread_lo8(b16 v) {
  return _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                                 4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1));
}
static inline __m256i spread_hi8(b16 v) {
  return _mm256_shuffle_epi8(v, _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                                 12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1));
}
static inline v16 lo_f(b16 v) {
  const __m256i m = _mm256_set1_epi32(15);
  v16 r = {_mm256_cvtepi32_ps(_mm256_and_si256(spread_lo8(v), m)), _mm256_cvtepi32_ps(_mm256_and_si256(spread_hi8(v), m))};
  return r;
}
static inline v16 hi_f(b16 v) {
  v16 r = {_mm256_cvtepi32_ps(_mm256_srli_epi32(spread_lo8(v), 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(spread_hi8(v), 4))};
  return r;
}
#else   /* portable C: the compiler vectorizes what it can */
typedef struct { float f[16]; } v16;
typedef struct { uint8_t b[16]; } b16;
static inline v16 vzero(void) { v16 r; memset(&r, 0, sizeof r); return r; }
static inline v16 vload(const float *p) { v16 r; memcpy(r.f, p, 64); return r; }
static inline void vstore(float *p, v16 v) { memcpy(p, v.f, 64); }
static inline v16 vfma(v16 a, float b, v16 c) { for (int i = 0; i < 16; i++) c.f[i] += a.f[i] * b; return c; }
static inline v16 vfmav(v16 a, v16 b, v16 c) { for (int i = 0; i < 16; i++) c.f[i] = fmaf(a.f[i], b.f[i], c.f[i]); return c; }
static uint16_t f32_to_bf16(float f);
static inline void vstore_bf16(uint16_t *p, v16 v) { for (int i = 0; i < 16; i++) p[i] = f32_to_bf16(v.f[i]); }
static inline b16 bload(const uint8_t *p) { b16 r; memcpy(r.b, p, 16); return r; }
static inline v16 lo_f(b16 v) { v16 r; for (int i = 0; i < 16; i++) r.f[i] = (float)(v.b[i] & 15); return r; }
static inline v16 hi_f(b16 v) { v16 r; for (int i = 0; i < 16; i++) r.f[i] = (float)(v.b[i] >> 4); return r; }
static inline v16 vload_bf16(const uint16_t *p) {
  v16 r;
  for (int i = 0; i < 16; i++) { uint32_t u = (uint32_t)p[i] << 16; memcpy(&r.f[i], &u, 4); }
  return r;
}
static inline float vsum(v16 v) { float t = 0; for (int i = 0; i < 16; i++) t += v.f[i]; return t; }
#endif

#ifndef FLOAT_AHEAD
#define FLOAT_AHEAD 4096   /* bytes of a block's levels fetched ahead by the float32 kernels */
#endif
/* a later group's scales and zero terms of this block (`bytes` of each, `gstride` floats apart from group to group:
 * block_scales) */
#define SCALES_AHEAD(s, zc, gi, gstride, bytes)                                                             \
  do {                                                                                                      \
    const char *ps_ = (const char *)((s) + (size_t)(gi) * (gstride));                                       \
    const char *pz_ = (const char *)((zc) + (size_t)(gi) * (gstride));                                      \
    for (int l_ = 0; l_ < (bytes); l_ += 64) { __builtin_prefetch(ps_ + l_, 0, 3); __builtin_prefetch(pz_ + l_, 0, 3); } \
  } while (0)
#if defined(__AVX512F__)
/* 16 features' s and zc = 0 - z s from a compact group's fp16 scales h and uint8 zero points z (exact: the float32
 * values the float32 form holds) */
static inline void compact16(const uint8_t *h, const uint8_t *z, __m512 *s, __m512 *zc) {
  *s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
  *zc = _mm512_sub_ps(_mm512_setzero_ps(),
                      _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)z))), *s));
}
#endif
/* one block of 64 features (torch's AVX-512 packing), one token */
static void block64(const uint8_t *blk, const float *s, const float *zc, const float *x, const float *xs,
                    float *y, int k_pad, int group, int gstride) {
  v16 o0 = vzero(), o1 = o0, o2 = o0, o3 = o0;
  for (int g0 = 0, gi = 0; g0 < k_pad; g0 += group, gi++) {
    if (g0 + 2 * group < k_pad) SCALES_AHEAD(s, zc, gi + 2, gstride, 256);
    v16 a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
    for (int k = g0, ke = g0 + group < k_pad ? g0 + group : k_pad; k < ke; k++) {
      const uint8_t *r = blk + (size_t)k * 32;
      if (k % 2 == 0) __builtin_prefetch(r + FLOAT_AHEAD, 0, 3);
      b16 v0 = bload(r), v1 = bload(r + 16);
      float xk = x[k];
      a0 = vfma(lo_f(v0), xk, a0); a1 = vfma(lo_f(v1), xk, a1);
      a2 = vfma(hi_f(v0), xk, a2); a3 = vfma(hi_f(v1), xk, a3);
    }
    const float *sg = s + (size_t)gi * gstride, *zg = zc + (size_t)gi * gstride;
    float xsum = xs[gi];
    o0 = vfmav(a0, vload(sg), vfma(vload(zg), xsum, o0));
    o1 = vfmav(a1, vload(sg + 16), vfma(vload(zg + 16), xsum, o1));
    o2 = vfmav(a2, vload(sg + 32), vfma(vload(zg + 32), xsum, o2));
    o3 = vfmav(a3, vload(sg + 48), vfma(vload(zg + 48), xsum, o3));
  }
  vstore(y, o0); vstore(y + 16, o1); vstore(y + 32, o2); vstore(y + 48, o3);
}

/* one block of 32 features (torch's AVX2 packing), one token */
static void block32(const uint8_t *blk, const float *s, const float *zc, const float *x, const float *xs,
                    float *y, int k_pad, int group, int gstride) {
  v16 o0 = vzero(), o1 = o0;
  for (int g0 = 0, gi = 0; g0 < k_pad; g0 += group, gi++) {
    if (g0 + 2 * group < k_pad) SCALES_AHEAD(s, zc, gi + 2, gstride, 128);
    v16 a0 = vzero(), a1 = a0;
    for (int k = g0, ke = g0 + group < k_pad ? g0 + group : k_pad; k < ke; k++) {
      if (k % 4 == 0) __builtin_prefetch(blk + (size_t)k * 16 + FLOAT_AHEAD, 0, 3);
      b16 v = bload(blk + (size_t)k * 16);
      float xk = x[k];
      a0 = vfma(lo_f(v), xk, a0); a1 = vfma(hi_f(v), xk, a1);
    }
    const float *sg = s + (size_t)gi * gstride, *zg = zc + (size_t)gi * gstride;
    float xsum = xs[gi];
    o0 = vfmav(a0, vload(sg), vfma(vload(zg), xsum, o0));
    o1 = vfmav(a1, vload(sg + 16), vfma(vload(zg + 16), xsum, o1));
  }
  vstore(y, o0); vstore(y + 16, o1);
}

#if defined(__AVX512BF16__)
#define BF16_DOT 1   /* vdpbf16ps: the dense bf16 rows (dense_rows) */
#endif

/* the integer decode kernels' stream fetched ahead (bytes, into L2: a line-fill buffer per miss would bound one core at
 * 12-14 GB/s), and the rows of activations one 16-bit scale covers */
#ifndef INT4_AHEAD
#define INT4_AHEAD 8192
#endif
#ifndef INT4_HINT
#define INT4_HINT _MM_HINT_T1
#endif
#define I16_CHUNK 256

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && !defined(NO_I16_DOT)
/* one block of 64 features, bf16 activations, integer dot products (AVX512-VNNI vpdpwssd: pairs of 16-bit integers
 * multiplied and summed into int32 lanes). Two rows k, k+1 of levels are read at once (one 64-byte load, row k's 32
 * bytes then row k+1's; byte j of a row holds feature j in its low nibble and feature j + 32 in its high one) and
 * their bytes placed (one vpermb) so that 32-bit lane i holds
 *     byte 0: row k byte i,  byte 1: row k byte i + 16,  byte 2: row k+1 byte i,  byte 3: row k+1 byte i + 16.
 * Masked with 0x000F000F, a lane (or the lane shifted right 8 bits) holds in its two 16-bit halves the levels q of
 * feature i (i + 16) for rows k and k+1; masked with 0x00F000F0, 16 q of feature i + 32 (i + 48): one shift per two
 * rows, no table lookups. The activations enter as 16-bit integers x * 2^e per chunk of at most I16_CHUNK rows (e the
 * largest that keeps |x| * 2^e below 2^15: a bf16 value, 8 significant bits, is held exactly unless it is more than
 * 2^7 below the chunk's largest, the others are rounded to 2^-16 of it, far below the bf16 output's rounding);
 * vpdpwssd sums each pair of products with (x[k], x[k+1]) into int32 lanes, already in feature order and exact
 * (16 q x < 2^8 * 2^15 * 256 rows < 2^31), turned to float32 per chunk; per group
 *     y += s * sum_c(acc_c * 2^-e_c) + zc * sum_k x[k].
 * This replaced vdpbf16ps on the levels as bf16 values 128 + q: on a 2-core Intel Xeon with AMX a vdpbf16ps costs
 * three times a vpdpwssd (1.48 against 0.49 TSC cycles a zmm instruction, measured alone), and a 1536 x 576 g128
 * layer in cache took 26.5-28.3 us that way against 13.9-15.3 now (medians of interleaved rounds); Zen 4/5 run both
 * instructions at one a cycle. Four rows a step into two sets of accumulators, the stream INT4_AHEAD bytes ahead
 * prefetched into L2 (on that Intel 8 KB T1 was 2-13 % faster than 4 KB T0 over a model's layers from memory, and
 * layer-sized streams read at 8-12 GB/s against 20-23 GB/s for one 14 MB layer: every call starts its stream cold). */
#define I16_DOT 1
/* a group's 64 scales and 64 zero terms of this block (4 + 4 cache lines, the next group's 128 floats on) */
#define SCALE_PREFETCH(s, zc, gi, gstride) SCALES_AHEAD(s, zc, gi, gstride, 256)
/* rows k0..k1 - 1 (k1 - k0 a multiple of 4) of a block of 64 features against their 16-bit activations: the four
 * int32 sums of block64_i16's chunk (features 0-15, 16-31, then 16 times those of 32-47, 48-63). A function of its own
 * so that its eight accumulators stay in registers (inlined, GCC spilled some around every product) */
static __attribute__((noinline)) void i16_rows64(const uint8_t *blk, int k0, int k1, const int16_t *xi,
                                                  __m512i out[4]) {
  const __m512i place = _mm512_set_epi8(
      63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11, 58, 42, 26, 10, 57, 41, 25,
      9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49,
      33, 17, 1, 48, 32, 16, 0);
  const __m512i lo = _mm512_set1_epi32(0x000F000F), hi = _mm512_set1_epi32(0x00F000F0);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int k = k0; k < k1; k += 4) {
    _mm_prefetch((const char *)(blk + (size_t)k * 32 + INT4_AHEAD), INT4_HINT);
    _mm_prefetch((const char *)(blk + (size_t)k * 32 + INT4_AHEAD + 64), INT4_HINT);
    __m512i d = _mm512_permutexvar_epi8(place, _mm512_loadu_si512(blk + (size_t)k * 32));
    __m512i e = _mm512_permutexvar_epi8(place, _mm512_loadu_si512(blk + (size_t)k * 32 + 64));
    __m512i d8 = _mm512_srli_epi32(d, 8), e8 = _mm512_srli_epi32(e, 8);
    uint32_t pair, pair2;
    memcpy(&pair, xi + k, 4);
    memcpy(&pair2, xi + k + 2, 4);
    __m512i xp = _mm512_set1_epi32((int)pair), xq = _mm512_set1_epi32((int)pair2);
    DPWSSD_IN_PLACE(a0, _mm512_and_si512(d, lo), xp);
    DPWSSD_IN_PLACE(a1, _mm512_and_si512(d8, lo), xp);
    DPWSSD_IN_PLACE(a2, _mm512_and_si512(d, hi), xp);
    DPWSSD_IN_PLACE(a3, _mm512_and_si512(d8, hi), xp);
    DPWSSD_IN_PLACE(b0, _mm512_and_si512(e, lo), xq);
    DPWSSD_IN_PLACE(b1, _mm512_and_si512(e8, lo), xq);
    DPWSSD_IN_PLACE(b2, _mm512_and_si512(e, hi), xq);
    DPWSSD_IN_PLACE(b3, _mm512_and_si512(e8, hi), xq);
  }
  out[0] = _mm512_add_epi32(a0, b0); out[1] = _mm512_add_epi32(a1, b1);
  out[2] = _mm512_add_epi32(a2, b2); out[3] = _mm512_add_epi32(a3, b3);
}
/* c8: the block's scales in their compact form (block_scales'; 192 bytes a group: 64 fp16 s, 64 uint8 z), read here
 * as they are, or NULL: s and zc float32. Read in place, the compact form saves block_scales' decoding pass (a 576 x
 * 1536 g128 layer in L2 on an AMD Zen 4 took 14.4 us decoded against 13.1 with float32 scales) */
static void block64_i16(const uint8_t *blk, const float *s, const float *zc, const uint8_t *c8, const int16_t *xi,
                        const float *xinv, const float *xs, float *y, int k_pad, int group, int gstride) {
  __m512 o0 = _mm512_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
  int ci = 0;
#ifndef NO_SCALE_PREFETCH
  for (int gi = 0; gi < 2 && gi * group < k_pad; gi++)
    if (c8) SCALES_AHEAD(c8, c8 + 128, gi, 192, 128);
    else SCALE_PREFETCH(s, zc, gi, gstride);
#endif
  for (int g0 = 0, gi = 0; g0 < k_pad; g0 += group, gi++) {
    int ge = g0 + group < k_pad ? g0 + group : k_pad;
#ifndef NO_SCALE_PREFETCH
    if (g0 + 2 * group < k_pad) {
      if (c8) SCALES_AHEAD(c8, c8 + 128, gi + 2, 192, 128);
      else SCALE_PREFETCH(s, zc, gi + 2, gstride);
    }
#endif
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;   /* features 0-15, 16-31, 32-47, 48-63 */
    for (int c0 = g0; c0 < ge; c0 += I16_CHUNK, ci++) {
      __m512i acc[4];
      i16_rows64(blk, c0, c0 + I16_CHUNK < ge ? c0 + I16_CHUNK : ge, xi, acc);
      __m512 inv = _mm512_set1_ps(xinv[ci]), inv16 = _mm512_set1_ps(xinv[ci] * 0.0625f);
      f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[0]), inv, f0);
      f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[1]), inv, f1);
      f2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[2]), inv16, f2);
      f3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[3]), inv16, f3);
    }
    __m512 xsum = _mm512_set1_ps(xs[gi]);
    if (c8) {   /* s and zc = 0 - z s as block_scales decodes them, the same float32 values */
      const uint8_t *h = c8 + (size_t)gi * 192, *zb = h + 128;
#define COMPACT_GROUP(o, f, i)                                                                                  \
  do {                                                                                                        \
    __m512 s_, zc_;                                                                                           \
    compact16(h + 32 * (i), zb + 16 * (i), &s_, &zc_);                                                        \
    o = _mm512_fmadd_ps(f, s_, _mm512_fmadd_ps(zc_, xsum, o));                                                \
  } while (0)
      COMPACT_GROUP(o0, f0, 0); COMPACT_GROUP(o1, f1, 1); COMPACT_GROUP(o2, f2, 2); COMPACT_GROUP(o3, f3, 3);
#undef COMPACT_GROUP
      continue;
    }
    const float *sg = s + (size_t)gi * gstride, *zg = zc + (size_t)gi * gstride;
    o0 = _mm512_fmadd_ps(f0, _mm512_loadu_ps(sg), _mm512_fmadd_ps(_mm512_loadu_ps(zg), xsum, o0));
    o1 = _mm512_fmadd_ps(f1, _mm512_loadu_ps(sg + 16), _mm512_fmadd_ps(_mm512_loadu_ps(zg + 16), xsum, o1));
    o2 = _mm512_fmadd_ps(f2, _mm512_loadu_ps(sg + 32), _mm512_fmadd_ps(_mm512_loadu_ps(zg + 32), xsum, o2));
    o3 = _mm512_fmadd_ps(f3, _mm512_loadu_ps(sg + 48), _mm512_fmadd_ps(_mm512_loadu_ps(zg + 48), xsum, o3));
  }
  _mm512_storeu_ps(y, o0); _mm512_storeu_ps(y + 16, o1); _mm512_storeu_ps(y + 32, o2); _mm512_storeu_ps(y + 48, o3);
}

/* a token's activations as 16-bit integers per chunk (block64_i16): returns 0 where one is not finite (the token then
 * runs block64 on its float32 values, whose NaN/inf propagate as torch's do) */
static int i16_chunks(const float *x, int k_pad, int group, int16_t *xi, float *xinv) {
  int ci = 0;
  for (int g0 = 0; g0 < k_pad; g0 += group) {
    int ge = g0 + group < k_pad ? g0 + group : k_pad;
    for (int c0 = g0; c0 < ge; c0 += I16_CHUNK, ci++) {
      int ce = c0 + I16_CHUNK < ge ? c0 + I16_CHUNK : ge;
      __m512 m = _mm512_setzero_ps();
      for (int i = c0; i < ce; i += 16) {
        __mmask16 k = tail16(ce - i);
        m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_maskz_loadu_ps(k, x + i)));   /* a NaN lane: max keeps m */
      }
      float mx = _mm512_reduce_max_ps(m);
      if (!(mx <= 3.0e38f)) return 0;   /* inf */
      int ex = 0;
      if (mx > 0) frexpf(mx, &ex);        /* mx < 2^ex */
      __m512 up = _mm512_set1_ps(ldexpf(1.0f, 15 - ex));   /* |x| * up < 2^15 */
      xinv[ci] = ldexpf(1.0f, ex - 15);
      for (int i = c0; i < ce; i += 16) {
        __mmask16 k = tail16(ce - i);
        __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return 0;   /* NaN */
        /* nearest even (the default rounding), saturated to int16 (a float32 input can round to 2^15) */
        _mm256_mask_storeu_epi16(xi + i, k, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v, up))));
      }
    }
  }
  return 1;
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(NO_I16_DOT)
/* block64_i16 for AVX2 (a Zen 3, an Intel before Ice Lake): one block of 32 features (torch's AVX2 packing), the
 * activations as the same 16-bit integers per chunk (i16_chunks below), AVX2 vpmaddwd (pairs of 16-bit integers
 * multiplied and summed into int32 lanes) and an add where VNNI fuses the two. Rows k..k+3 are two 32-byte loads d, e
 * (row k's 16 bytes then row k+1's, row k+2's then row k+3's; byte j of a row holds feature j in its low nibble and
 * feature j + 16 in its high one). In-lane unpacks of 16-bit words pair them without a cross-lane permute: the low
 * half of u = unpacklo16(d, e) holds row k's bytes 2i, 2i+1 and row k+2's in 32-bit lane i, its high half row k+1's
 * and row k+3's, so a madd by (x[k], x[k+2]) in the low half and (x[k+1], x[k+3]) in the high one (xp: one 8-byte
 * broadcast and a vpshufb) sums two rows of one feature per lane: masked 0x000F, feature 2i; its odd bytes shifted
 * down (u8), feature 2i + 1 once masked and f + 16 f' whole (the high nibble's 16 q, the low nibble's sum taken off
 * once a chunk); the 0x00FF-masked even bytes likewise for feature 2i + 16; v = unpackhi16 the features 8-15, 24-31.
 * Eight accumulators then, two lanes of one feature added and the features put in order once a chunk (pair_sum8).
 * Every sum is an exact int32 (16 q x < 2^8 * 2^15 a product, 256 rows < 2^31 a chunk), so the output is the same bit
 * for bit as the previous kernel's (a vpermd and a vpshufb per two rows, four masks per row pair), 14 % less time a
 * feature in L2 (a 1536 x 576 layer: 13.0 -> 11.2 ns a feature, 22.2 -> 19.3 us a call) and 7 % less over
 * SmolLM2-135M's 210 g128 layers from memory (3.36 -> 3.12 ms; an AMD Zen 4 held to AVX2, one thread, interleaved
 * rounds); vpmaddwd runs on two of the core's four vector pipes, so about 25 vector operations per four rows and
 * 32 features are the floor. (The previous form: on an Intel Xeon held to AVX2, the 210 layers took 4.1 ms against
 * 5.1 with the float32 kernel.) */
#define I16_AVX2 1
static inline __m256i pair_sum8(__m256i a, __m256i b) {   /* lanes 0-3 of a, b: features 2j, 2j+1, rows' halves */
  __m256i lo = _mm256_unpacklo_epi32(a, b), hi = _mm256_unpackhi_epi32(a, b);
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}
static void block32_i16(const uint8_t *blk, const float *s, const float *zc, const int16_t *xi, const float *xinv,
                        const float *xs, float *y, int k_pad, int group, int gstride) {
  const __m256i xsel = _mm256_setr_epi8(0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5,
                                        2, 3, 6, 7, 2, 3, 6, 7, 2, 3, 6, 7, 2, 3, 6, 7);
  const __m256i lo = _mm256_set1_epi32(0x000F000F), byte = _mm256_set1_epi32(0x00FF00FF);
  __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
  int ci = 0;
  for (int g0 = 0, gi = 0; g0 < k_pad; g0 += group, gi++) {
    int ge = g0 + group < k_pad ? g0 + group : k_pad;
    if (g0 + 2 * group < k_pad) SCALES_AHEAD(s, zc, gi + 2, gstride, 128);
    __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;   /* features 0-7, 8-15, 16-23, 24-31 */
    for (int c0 = g0; c0 < ge; c0 += I16_CHUNK, ci++) {
      __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int k = c0, ke = c0 + I16_CHUNK < ge ? c0 + I16_CHUNK : ge; k < ke; k += 4) {   /* group % 4 == 0 */
        _mm_prefetch((const char *)(blk + (size_t)k * 16 + INT4_AHEAD), INT4_HINT);
        __m256i d = _mm256_loadu_si256((const __m256i *)(blk + (size_t)k * 16));
        __m256i e = _mm256_loadu_si256((const __m256i *)(blk + (size_t)k * 16 + 32));
        long long q4;
        memcpy(&q4, xi + k, 8);
        __m256i xp = _mm256_shuffle_epi8(_mm256_set1_epi64x(q4), xsel);
        __m256i u = _mm256_unpacklo_epi16(d, e), v = _mm256_unpackhi_epi16(d, e);
        __m256i u8 = _mm256_srli_epi16(u, 8), v8 = _mm256_srli_epi16(v, 8);   /* odd bytes whole: f + 16 f' */
        ADD_I32_IN_PLACE(a0, _mm256_madd_epi16(_mm256_and_si256(u, lo), xp));
        ADD_I32_IN_PLACE(a1, _mm256_madd_epi16(_mm256_and_si256(u8, lo), xp));
        ADD_I32_IN_PLACE(a2, _mm256_madd_epi16(_mm256_and_si256(u, byte), xp));
        ADD_I32_IN_PLACE(a3, _mm256_madd_epi16(u8, xp));
        ADD_I32_IN_PLACE(b0, _mm256_madd_epi16(_mm256_and_si256(v, lo), xp));
        ADD_I32_IN_PLACE(b1, _mm256_madd_epi16(_mm256_and_si256(v8, lo), xp));
        ADD_I32_IN_PLACE(b2, _mm256_madd_epi16(_mm256_and_si256(v, byte), xp));
        ADD_I32_IN_PLACE(b3, _mm256_madd_epi16(v8, xp));
      }
      a2 = _mm256_sub_epi32(a2, a0), a3 = _mm256_sub_epi32(a3, a1);   /* 16 f' alone */
      b2 = _mm256_sub_epi32(b2, b0), b3 = _mm256_sub_epi32(b3, b1);
      __m256 inv = _mm256_set1_ps(xinv[ci]), inv16 = _mm256_set1_ps(xinv[ci] * 0.0625f);
      f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_sum8(a0, a1)), inv, f0);
      f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_sum8(b0, b1)), inv, f1);
      f2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_sum8(a2, a3)), inv16, f2);
      f3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_sum8(b2, b3)), inv16, f3);
    }
    const float *sg = s + (size_t)gi * gstride, *zg = zc + (size_t)gi * gstride;
    __m256 xsum = _mm256_set1_ps(xs[gi]);
    o0 = _mm256_fmadd_ps(f0, _mm256_loadu_ps(sg), _mm256_fmadd_ps(_mm256_loadu_ps(zg), xsum, o0));
    o1 = _mm256_fmadd_ps(f1, _mm256_loadu_ps(sg + 8), _mm256_fmadd_ps(_mm256_loadu_ps(zg + 8), xsum, o1));
    o2 = _mm256_fmadd_ps(f2, _mm256_loadu_ps(sg + 16), _mm256_fmadd_ps(_mm256_loadu_ps(zg + 16), xsum, o2));
    o3 = _mm256_fmadd_ps(f3, _mm256_loadu_ps(sg + 24), _mm256_fmadd_ps(_mm256_loadu_ps(zg + 24), xsum, o3));
  }
  _mm256_storeu_ps(y, o0); _mm256_storeu_ps(y + 8, o1); _mm256_storeu_ps(y + 16, o2); _mm256_storeu_ps(y + 24, o3);
}

/* i16_chunks (block64_i16's) in AVX2: the same values (each chunk's largest magnitude, the scale 2^(15 - e), nearest
 * even, saturated to int16); chunks are multiples of 4 rows, so at most 4 of each go through the plain-C tail */
static inline int16_t i16_level(float v) {   /* rintf: nearest even, as cvtps_epi32 in the default rounding mode */
  float r = rintf(v);
  return (int16_t)(r > 32767.0f ? 32767.0f : r);
}
static int i16_chunks(const float *x, int k_pad, int group, int16_t *xi, float *xinv) {
  const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int ci = 0;
  for (int g0 = 0; g0 < k_pad; g0 += group) {
    int ge = g0 + group < k_pad ? g0 + group : k_pad;
    for (int c0 = g0; c0 < ge; c0 += I16_CHUNK, ci++) {
      int ce = c0 + I16_CHUNK < ge ? c0 + I16_CHUNK : ge, i = c0, nan = 0;
      __m256 m = _mm256_setzero_ps();
      for (; i + 8 <= ce; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, _mm256_and_ps(v, mag));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      float mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      for (; i < ce; i++) {
        float a = fabsf(x[i]);
        nan |= a != a;
        if (a > mx) mx = a;
      }
      if (nan || !(mx <= 3.0e38f)) return 0;   /* NaN or inf: the token runs the float32 kernel */
      int ex = 0;
      if (mx > 0) frexpf(mx, &ex);              /* mx < 2^ex */
      float upf = ldexpf(1.0f, 15 - ex);          /* |x| * up < 2^15 */
      __m256 up = _mm256_set1_ps(upf);
      xinv[ci] = ldexpf(1.0f, ex - 15);
      for (i = c0; i + 8 <= ce; i += 8) {   /* a product that rounds to 2^15 saturates (packs) */
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), up));
        _mm_storeu_si128((__m128i *)(xi + i), _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
      }
      for (; i < ce; i++) xi[i] = i16_level(x[i] * upf);
    }
  }
  return 1;
}
#endif

/* the last n mod B features: k rows of rem / 2 bytes, features 2j (low nibble) and 2j + 1 (high), one token */
static void block_rest(const uint8_t *blk, int rem, const float *s, const float *zc, const float *x,
                       const float *xs, float *y, int k_pad, int group, int gstride) {
  for (int j = 0; j < rem; j++) {
    float out = 0;
    for (int g0 = 0, gi = 0; g0 < k_pad; g0 += group, gi++) {
      float a = 0;
      for (int k = g0, ke = g0 + group < k_pad ? g0 + group : k_pad; k < ke; k++) {
        uint8_t b = blk[(size_t)k * (rem / 2) + j / 2];
        a += (float)((j & 1) ? b >> 4 : b & 15) * x[k];
      }
      out += a * s[(size_t)gi * gstride + j] + zc[(size_t)gi * gstride + j] * xs[gi];
    }
    y[j] = out;
  }
}

/* weights (times tokens) from which a call is split over threads: below it a fork/join costs more than it saves
 * (a 192 x 576 projection is 110,592) */
#define PARALLEL_FROM (1u << 18)

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch's cast; NaN stays NaN */
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* x: [m, k] (bf16 when x_bf16, else float32), rows `x_stride` elements apart; y: [m, n] (bf16 when y_bf16, else
 * float32), contiguous. k <= k_pad (the padding columns count as zero inputs), n <= n_pad (the padding features are
 * computed and dropped). Returns 0, or 1 for arguments this kernel does not take, 2 when memory runs out. */
/* a layer's constant arguments, made once per layer by lrq.cpu_kernels (one pointer per call instead of a dozen
 * converted arguments: at one token a call's fixed cost is what is left to save) */
typedef struct {
  const uint8_t *packed;
  const void *sz;   /* the scales and zero terms block by block (block_scales): float32, or compact */
  int32_t n, n_pad, k, k_pad, group, block;
  int32_t x16;   /* 1: float32 activations run the 16-bit integer kernel too (float32_decode "i16"), where built */
  int32_t compact;   /* 1: sz holds fp16 scales and uint8 zero points (block_scales decodes them) */
} int4_layer;

/* A layer's s and zc per group (`group` input features) and feature, held block by block in the packing's blocks of
 * `block` output features (the last one the n_pad mod block features left): block b's groups one after the other,
 * so that a decode step reads each block's scales as one stream beside its levels (held [groups][n_pad], two arrays,
 * a block read 2 x groups pieces of 256 bytes n_pad floats apart: SmolLM2-135M's 210 g128 layers from huge pages on an
 * AMD Zen 4 took 0.97x the time this way, per channel 0.95x). Two forms of a group:
 *   float32 (compact 0): its `width` scales s then its `width` zero terms zc (weight = q * s + zc), 8 bytes a feature;
 *   compact (1): its `width` scales as fp16 then its `width` zero points z as uint8, 3 bytes a feature, where the
 *     layer's scales are fp16 values (a packed model's own: its deployment format) and its zero points integers of
 *     0..255; zc = -z * s, exact in float32 (an 11-bit significand times 8 bits), so both forms give the same values
 *     bit for bit. A g128 layer's groups are 128 rows of 32 bytes a block of 64 features, so its float32 scales added
 *     12.5 % to the bytes a step reads, the compact ones 4.7 %.
 * Returns block b's s, its zc in *zc, and in *gstride the floats from one group's s (or zc) to the next's; a compact
 * layer's block decoded into the calling thread's buffer (scales_ready must have made it), the next block's bytes
 * fetched ahead into L2. */
static __thread float *scales_buf;
static __thread size_t scales_cap;
/* L's groups of scales a feature, and the width of its block b (the last block the n_pad mod block features) */
static inline int scale_groups(const int4_layer *L) { return (L->k_pad + L->group - 1) / L->group; }
static inline int block_width(const int4_layer *L, int b) {
  int nb = L->n_pad / L->block;
  return b < nb ? L->block : L->n_pad - nb * L->block;
}
/* whether the calling thread can decode a block of L's scales (its buffer grown as needed and kept; 0: no memory) */
static int scales_ready(const int4_layer *L) {
  if (!L->compact) return 1;
  size_t need = (size_t)2 * L->block * scale_groups(L);
  if (need <= scales_cap) return 1;
  float *p = realloc(scales_buf, need * sizeof(float));
  if (!p) return 0;
  scales_buf = p;
  scales_cap = need;
  return 1;
}
#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__F16C__))
static float f16_to_f32(uint16_t h) {   /* exact: every fp16 value is a float32 one */
  int e = (h >> 10) & 31, f = h & 1023;
  float v = e == 0 ? ldexpf((float)f, -24) : e == 31 ? (f ? NAN : INFINITY) : ldexpf((float)(f | 1024), e - 25);
  return h >> 15 ? -v : v;
}
#endif
/* block b's scales in their compact form as held (a compact layer's), the next block's fetched ahead into L2 */
static inline const uint8_t *compact_block(const int4_layer *L, int b) {
  int ng = scale_groups(L);
  const uint8_t *src = (const uint8_t *)L->sz + (size_t)b * L->block * ng * 3;
  size_t bytes = (size_t)block_width(L, b) * ng * 3;
  if ((size_t)(b + 1) * L->block < (size_t)L->n_pad)   /* a next block */
    for (size_t l = 0; l < bytes; l += 64) __builtin_prefetch(src + bytes + l, 0, 2);
  return src;
}
static inline const float *block_scales(const int4_layer *L, int b, const float **zc, int *gstride) {
  int ng = scale_groups(L), width = block_width(L, b);
  *gstride = 2 * width;
  if (!L->compact) {
    const float *s = (const float *)L->sz + (size_t)b * L->block * ng * 2;
    *zc = s + width;
    return s;
  }
  const uint8_t *src = compact_block(L, b);
  float *s = scales_buf;
  for (int g = 0; g < ng; g++) {
    const uint8_t *h = src + (size_t)g * 3 * width, *z = h + 2 * (size_t)width;
    float *sg = s + (size_t)g * 2 * width, *zg = sg + width;
    for (int i = 0; i < width; i += 16) {   /* width: a multiple of 16 (n_pad is) */
#if defined(__AVX512F__)
      __m512 sv, zcv;
      compact16(h + 2 * i, z + i, &sv, &zcv);
      _mm512_storeu_ps(sg + i, sv);
      _mm512_storeu_ps(zg + i, zcv);
#elif defined(__AVX2__) && defined(__F16C__)
      for (int j = i; j < i + 16; j += 8) {
        __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 2 * j)));
        __m256 zv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(z + j))));
        _mm256_storeu_ps(sg + j, sv);
        _mm256_storeu_ps(zg + j, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(zv, sv)));
      }
#else
      for (int j = i; j < i + 16; j++) {
        uint16_t hj;
        memcpy(&hj, h + 2 * j, 2);
        sg[j] = f16_to_f32(hj);
        zg[j] = 0.0f - (float)z[j] * sg[j];
      }
#endif
    }
  }
  *zc = s + width;
  return s;
}

/* a block of contiguous weight rows read a column step at a time (four rows side by side) is one stream
 * of memory: each step fetches `lines` cache lines STREAM_AHEAD bytes past position `pos` of the block (its byte
 * offset times the rows read a step), the next block's lines when the step is at the end of this one. Fetching each
 * row's line some rows ahead instead (the same lines, in another order) streamed the bf16 head at 13-16 GB/s on an
 * AMD Zen 4, about what no prefetch at all gives, and the stream's order at 28-36 (one core's plain read: 26-28 GB/s
 * with the other core busy); 8 KB ahead into L1 was the best of 2-32 KB and T0/T1 there. (On a Zen 5 fetching
 * ahead at all took the head from 24 GB/s to 30-34.) */
#ifndef STREAM_AHEAD
#define STREAM_AHEAD 8192
#endif
#define PREFETCH_STREAM(base, pos, lines) PREFETCH_STREAM_AT(base, pos, lines, STREAM_AHEAD, 3)
/* W8A8's 16-row kernel reads its block a row at a time (one stream in memory order), 4 KB ahead into L2: SmolLM2-135M's
 * 210 W8A8 layers from huge pages on an AMD Zen 4, 4.95 ms against 5.38 into L1 (21 interleaved rounds; 2 and 3 KB
 * into L2 4.89 and 4.95, 6 KB 5.73; into L1 8 KB 5.8, and 7.2 for the 16 rows read side by side, 16 lines a step),
 * the dense bf16 layers 8.2 ms (26 GB/s) beside them */
#define ROW16_AHEAD 4096
#define ROW16_HINT 2   /* __builtin_prefetch's locality: prefetcht1 */
#define PREFETCH_STREAM_AT(base, pos, lines, ahead, locality)                                                  \
  do {                                                                                                      \
    const char *p_ = (const char *)(base) + (pos) + (ahead);                                                \
    for (int l_ = 0; l_ < (lines); l_++) __builtin_prefetch(p_ + 64 * l_, 0, locality);                     \
  } while (0)

/* scratch memory of the calling thread, grown as needed and kept (no allocation per call) */
static __thread void *scratch;
static __thread size_t scratch_size;
static void *scratch_get(size_t bytes) {
  if (bytes > scratch_size) {
    void *p = realloc(scratch, bytes);
    if (!p) return NULL;
    scratch = p;
    scratch_size = bytes;
  }
  return scratch;
}

int lrq_int4_gemv(const int4_layer *L, const void *x, int x_bf16, long x_stride, void *y, int m, int nthreads) {
  const uint8_t *packed = L->packed;
  int n = L->n, n_pad = L->n_pad, k = L->k, k_pad = L->k_pad, group = L->group, block = L->block, y_bf16 = x_bf16;
  if ((block != 64 && block != 32) || group <= 0 || k_pad % 2 || n_pad % 16 || k > k_pad || n > n_pad || m < 1)
    return 1;
  int ng = (k_pad + group - 1) / group, nb = n_pad / block, rem = n_pad - nb * block;
  size_t floats = (size_t)m * (k_pad + ng) + (size_t)m * n_pad;
  /* the 16-bit path (bf16 activations, and float32 ones where the layer asks: every group the quantizer makes); its
   * chunks a token */
  int nc = 0, i16 = 0;
#if defined(I16_DOT)
  i16 = (x_bf16 || L->x16) && block == 64 && group % 4 == 0 && k_pad % 4 == 0;
#elif defined(I16_AVX2)
  i16 = (x_bf16 || L->x16) && block == 32 && group % 4 == 0 && k_pad % 4 == 0;
#endif
  if (i16)
    for (int g0 = 0; g0 < k_pad; g0 += group)
      nc += ((group < k_pad - g0 ? group : k_pad - g0) + I16_CHUNK - 1) / I16_CHUNK;
  /* xf [m, k_pad] float32 activations, xs [m, ng] their group sums, yf [m, n_pad]; then per token its chunks' inverse
   * scales and a flag (1: all finite), xinv [m, nc + 1]; then xi [m, k_pad] int16 */
  float *xf = scratch_get(sizeof(float) * (floats + (size_t)m * (nc + 1)) + sizeof(int16_t) * (size_t)m * k_pad);
  if (!xf) return 2;
  float *xs = xf + (size_t)m * k_pad, *yf = xs + (size_t)m * ng, *xinv = xf + floats;
  int16_t *xi = (int16_t *)(xinv + (size_t)m * (nc + 1));
  (void)xi;
  for (int t = 0; t < m; t++) {
    float *xt = xf + (size_t)t * k_pad;
    if (x_bf16) {
      const uint16_t *src = (const uint16_t *)x + (size_t)t * x_stride;
      for (int i = 0; i < k; i++) xt[i] = bf16_to_f32(src[i]);
    } else {
      memcpy(xt, (const float *)x + (size_t)t * x_stride, sizeof(float) * k);
    }
    for (int i = k; i < k_pad; i++) xt[i] = 0;
    for (int g = 0; g < ng; g++) {
      int i = g * group, e = (g + 1) * group < k_pad ? (g + 1) * group : k_pad;
#if defined(__AVX512F__)
      /* in 16 lanes: a scalar sum waits on each addition (576 in a row, about 0.7 us a call, 0.2 ms a token of a
       * 4-bit SmolLM2-135M) */
      __m512 a16 = _mm512_setzero_ps();
      for (; i < e; i += 16) a16 = _mm512_add_ps(a16, _mm512_maskz_loadu_ps(tail16(e - i), xt + i));
      xs[(size_t)t * ng + g] = _mm512_reduce_add_ps(a16);
#else
      float a = 0;
      for (; i < e; i++) a += xt[i];
      xs[(size_t)t * ng + g] = a;
#endif
    }
  }
#if defined(I16_DOT) || defined(I16_AVX2)
  if (i16)
    for (int t = 0; t < m; t++)
      xinv[(size_t)t * (nc + 1) + nc] = (float)i16_chunks(xf + (size_t)t * k_pad, k_pad, group, xi + (size_t)t * k_pad,
                                                          xinv + (size_t)t * (nc + 1));
#endif
  int units = nb + (rem > 0), failed = 0;
  #pragma omp parallel for num_threads(nthreads) schedule(static) \
      if (nthreads > 1 && units > 1 && (size_t)m * n_pad * k_pad >= PARALLEL_FROM)
  for (int b = 0; b < units; b++) {
    if (!scales_ready(L)) {
      #pragma omp atomic write
      failed = 1;
      continue;
    }
    const float *zc = NULL, *s = NULL;
    int gs = 0;   /* the block's scales: group after group gs floats apart (block_scales, made where a kernel needs them) */
    const uint8_t *blk = packed + (size_t)b * block * k_pad / 2;
#if defined(I16_DOT)
    const uint8_t *c8 = L->compact && i16 && b < nb ? compact_block(L, b) : NULL;   /* block64_i16 reads them so */
#endif
    for (int t = 0; t < m; t++) {
      const float *xt = xf + (size_t)t * k_pad, *xst = xs + (size_t)t * ng;
      float *yt = yf + (size_t)t * n_pad + (size_t)b * block;
#if defined(I16_DOT)
      if (c8 && xinv[(size_t)t * (nc + 1) + nc] != 0.0f) {
        block64_i16(blk, NULL, NULL, c8, xi + (size_t)t * k_pad, xinv + (size_t)t * (nc + 1), xst, yt, k_pad, group,
                    0);
        continue;
      }
#endif
      if (!s) s = block_scales(L, b, &zc, &gs);
      if (b == nb)
        block_rest(blk, rem, s, zc, xt, xst, yt, k_pad, group, gs);
#if defined(I16_DOT)
      else if (i16 && xinv[(size_t)t * (nc + 1) + nc] != 0.0f)
        block64_i16(blk, s, zc, NULL, xi + (size_t)t * k_pad, xinv + (size_t)t * (nc + 1), xst, yt, k_pad, group, gs);
#elif defined(I16_AVX2)
      else if (i16 && xinv[(size_t)t * (nc + 1) + nc] != 0.0f)
        block32_i16(blk, s, zc, xi + (size_t)t * k_pad, xinv + (size_t)t * (nc + 1), xst, yt, k_pad, group, gs);
#endif
      else if (block == 64)
        block64(blk, s, zc, xt, xst, yt, k_pad, group, gs);
      else
        block32(blk, s, zc, xt, xst, yt, k_pad, group, gs);
    }
  }
  if (failed) return 2;
  for (int t = 0; t < m; t++) {
    const float *src = yf + (size_t)t * n_pad;
    if (y_bf16) {
      uint16_t *dst = (uint16_t *)y + (size_t)t * n;
      for (int j = 0; j < n; j++) dst[j] = f32_to_bf16(src[j]);
    } else {
      memcpy((float *)y + (size_t)t * n, src, sizeof(float) * n);
    }
  }
  return 0;
}

/* int4_unpack_t: an int4_layer's weight read out of its packing, transposed, into out[k_pad, n_pad], one pass over the
 * packed bytes (row k of a block of B features is B / 2 bytes, so each row's output is contiguous: low nibbles to
 * features 0..B/2-1 of the block, high ones to B/2..B-1; blocks split over threads). `form`:
 *   UNPACK_F32, UNPACK_BF16: the weight q * s + zc per group as one fused multiply-add in float32 (as torch's
 *     vectorized addcmul), rounded once to bf16 (nearest even) for the latter: the values
 *     lrq.cpu_kernels.Int4Weights.dequantized_t_torch computes, bit for bit; a 4-bit prefill call multiplies by this
 *     transient operand (torch's GEMM, far faster there than its int4 GEMM);
 *   UNPACK_I8: the levels less 8 (int8): W4A8's prefill operand for the int8 GEMM (Int4Int8Weights.mm);
 *   UNPACK_BF16_BLOCKED, UNPACK_BF16_BLOCKED64: UNPACK_BF16's values, not transposed, in oneDNN's blocked layout for
 *     a bf16 inner product (what torch.ops.mkldnn._reorder_linear_weight makes of an [n, k] weight for a batch above
 *     one, read off by lrq.cpu_kernels.OneDNNOperand before it is used): [n_pad / W][k_pad / 2][W][2], the two
 *     values of each pair rows k and k + 1 of one feature, W = 32 (oneDNN's blocking on an Intel Xeon with AMX) or
 *     64 (the latter form: its blocking with AVX512-BF16 and no AMX, an AMD Zen 4). A prefill call's GEMM then reads
 *     it as the prepacked dense model's does, without oneDNN reordering a plain operand first. n_pad must be a
 *     multiple of W.
 *   UNPACK_I8_BLOCKED: UNPACK_I8's levels in oneDNN's blocked int8 layout for its quantized inner product (what
 *     torch.ops.onednn.qlinear_prepack makes of an [n, k] int8 weight; lrq.cpu_kernels.OneDNNOperand checks it):
 *     [n_pad / 64][k_pad / 4][64][4] bytes, the four of a feature rows 4i..4i+3, then int32 [n_pad] the negated
 *     sums of each feature's levels (oneDNN's compensation for its u8 x s8 products); n_pad a multiple of 64 and
 *     k_pad of 4. */
enum { UNPACK_F32 = 0, UNPACK_BF16 = 1, UNPACK_I8 = 2, UNPACK_BF16_BLOCKED = 3, UNPACK_I8_BLOCKED = 4,
       UNPACK_BF16_BLOCKED64 = 5 };

#if defined(__AVX512BW__)
/* 32 bf16 values of row k (a) and of row k + 1 (b), one per feature, as the 32 pairs (a[i], b[i]) at dst */
static inline void store_pairs(uint16_t *dst, __m512i a, __m512i b) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo, b));
  _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, _mm512_add_epi16(lo, _mm512_set1_epi16(16)), b));
}
#endif

/* rows k and k + 1 of `width` features (bf16, t0 and t1) into the blocked layout of W features a block (32 or 64)
 * of features c0.. (c0 % 32 == 0) */
static void put_blocked(uint16_t *out, const uint16_t *t0, const uint16_t *t1, int c0, int width, int k, int k_pad,
                        int W) {
  for (int sb = 0; sb < width; sb += 32) {
    int c = c0 + sb;
    uint16_t *dst = out + (size_t)(c / W) * W * k_pad + (size_t)(k / 2) * 2 * W + (size_t)(c % W) * 2;
#if defined(__AVX512BW__)
    store_pairs(dst, _mm512_loadu_si512(t0 + sb), _mm512_loadu_si512(t1 + sb));
#else
    for (int i = 0; i < 32; i++) { dst[2 * i] = t0[sb + i]; dst[2 * i + 1] = t1[sb + i]; }
#endif
  }
}

static void unpack_row(const uint8_t *r, const float *sg, const float *zg, void *out, size_t row, int half, int form) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  /* bf16 out, 32 features a step: the two float32 halves rounded by one vcvtne2ps2bf16 (nearest even, NaN quiet,
   * as f32_to_bf16; it reads a float32 denormal, |v| < 2^-126, as 0: a weight q * s + zc that small is 0 to any
   * use) instead of eight integer operations a vector: 197 -> 130 us for 1536 x 576 on an Intel Xeon with AMX */
  if (form == UNPACK_BF16 && half % 32 == 0) {
    for (int c = 0; c < half; c += 32) {
      b16 v0 = bload(r + c), v1 = bload(r + c + 16);
      __m512 lo0 = vfmav(lo_f(v0), vload(sg + c), vload(zg + c));
      __m512 lo1 = vfmav(lo_f(v1), vload(sg + c + 16), vload(zg + c + 16));
      __m512 hi0 = vfmav(hi_f(v0), vload(sg + half + c), vload(zg + half + c));
      __m512 hi1 = vfmav(hi_f(v1), vload(sg + half + c + 16), vload(zg + half + c + 16));
      _mm512_storeu_si512((uint16_t *)out + row + c, (__m512i)_mm512_cvtne2ps_pbh(lo1, lo0));
      _mm512_storeu_si512((uint16_t *)out + row + half + c, (__m512i)_mm512_cvtne2ps_pbh(hi1, hi0));
    }
    return;
  }
#endif
#ifdef NIBBLES
  if (form == UNPACK_I8) {
    const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
    int8_t *o = (int8_t *)out + row;
    for (int j = 0; j < half; j += 16) {
      __m128i v = _mm_loadu_si128((const __m128i *)(r + j));
      _mm_storeu_si128((__m128i *)(o + j), _mm_sub_epi8(_mm_and_si128(v, low), eight));
      _mm_storeu_si128((__m128i *)(o + half + j), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), low), eight));
    }
    return;
  }
#else
  if (form == UNPACK_I8) {
    int8_t *o = (int8_t *)out + row;
    for (int j = 0; j < half; j++) {
      o[j] = (int8_t)((r[j] & 15) - 8);
      o[half + j] = (int8_t)((r[j] >> 4) - 8);
    }
    return;
  }
#endif
  for (int c = 0; c < half; c += 16) {
    b16 v = bload(r + c);
    v16 lo = vfmav(lo_f(v), vload(sg + c), vload(zg + c));
    v16 hi = vfmav(hi_f(v), vload(sg + half + c), vload(zg + half + c));
    if (form == UNPACK_BF16) {
      vstore_bf16((uint16_t *)out + row + c, lo);
      vstore_bf16((uint16_t *)out + row + half + c, hi);
    } else {
      vstore((float *)out + row + c, lo);
      vstore((float *)out + row + half + c, hi);
    }
  }
}

/* one block of 64 features of a 4-bit packing (block 64: k_pad rows of 32 bytes, feature j in byte j's low nibble
 * and feature j + 32 in its high one) as int8 levels less 8 in oneDNN's and AMX's blocked order, [k_pad / 4][64][4]
 * (the four bytes of a feature rows 4i..4i+3), and comp[64] = the negated sum of each feature's levels
 * (UNPACK_I8_BLOCKED; comp NULL: not summed, the AMX W4A8 prefill's weight panel) */
static void i8_levels_block(const uint8_t *blk, int k_pad, int8_t *dst, int32_t *comp) {
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
  /* the byte placement: output byte 4f + e of features 0-15 (place0) or 16-31 (place1) from row e's byte f (or
   * f + 16) of the two 64-byte loads (rows k, k+1 | rows k+2, k+3): (e & 1) * 32 + (e >> 1) * 64 + f */
  static const uint8_t place0[64] = {0, 32, 64, 96, 1, 33, 65, 97, 2, 34, 66, 98, 3, 35, 67, 99, 4, 36, 68, 100, 5,
      37, 69, 101, 6, 38, 70, 102, 7, 39, 71, 103, 8, 40, 72, 104, 9, 41, 73, 105, 10, 42, 74, 106, 11, 43, 75, 107,
      12, 44, 76, 108, 13, 45, 77, 109, 14, 46, 78, 110, 15, 47, 79, 111};
  static const uint8_t place1[64] = {16, 48, 80, 112, 17, 49, 81, 113, 18, 50, 82, 114, 19, 51, 83, 115, 20, 52, 84,
      116, 21, 53, 85, 117, 22, 54, 86, 118, 23, 55, 87, 119, 24, 56, 88, 120, 25, 57, 89, 121, 26, 58, 90, 122, 27,
      59, 91, 123, 28, 60, 92, 124, 29, 61, 93, 125, 30, 62, 94, 126, 31, 63, 95, 127};
  const __m512i idx0 = _mm512_loadu_si512(place0), idx1 = _mm512_loadu_si512(place1);
  /* four rows a step: lane bytes [row k, k+1, k+2, k+3] of one feature, features 0-15, 16-31 (low nibbles) and
   * 32-47, 48-63 (high), the levels less 8; their sums by vpdpbusd with ones */
  const __m512i low = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8), ones = _mm512_set1_epi8(1);
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  for (int k = 0; k < k_pad; k += 4) {
    __m512i A = _mm512_loadu_si512(blk + (size_t)k * 32), B = _mm512_loadu_si512(blk + (size_t)k * 32 + 64);
    __m512i LA = _mm512_and_si512(A, low), LB = _mm512_and_si512(B, low);
    __m512i HA = _mm512_and_si512(_mm512_srli_epi16(A, 4), low), HB = _mm512_and_si512(_mm512_srli_epi16(B, 4), low);
    __m512i v0 = _mm512_sub_epi8(_mm512_permutex2var_epi8(LA, idx0, LB), eight);
    __m512i v1 = _mm512_sub_epi8(_mm512_permutex2var_epi8(LA, idx1, LB), eight);
    __m512i v2 = _mm512_sub_epi8(_mm512_permutex2var_epi8(HA, idx0, HB), eight);
    __m512i v3 = _mm512_sub_epi8(_mm512_permutex2var_epi8(HA, idx1, HB), eight);
    int8_t *d = dst + (size_t)(k / 4) * 256;
    _mm512_storeu_si512(d, v0); _mm512_storeu_si512(d + 64, v1);
    _mm512_storeu_si512(d + 128, v2); _mm512_storeu_si512(d + 192, v3);
    if (comp) {
      s0 = _mm512_dpbusd_epi32(s0, ones, v0); s1 = _mm512_dpbusd_epi32(s1, ones, v1);
      s2 = _mm512_dpbusd_epi32(s2, ones, v2); s3 = _mm512_dpbusd_epi32(s3, ones, v3);
    }
  }
  if (!comp) return;
  const __m512i zero = _mm512_setzero_si512();
  _mm512_storeu_si512(comp, _mm512_sub_epi32(zero, s0)); _mm512_storeu_si512(comp + 16, _mm512_sub_epi32(zero, s1));
  _mm512_storeu_si512(comp + 32, _mm512_sub_epi32(zero, s2)); _mm512_storeu_si512(comp + 48, _mm512_sub_epi32(zero, s3));
#else
  for (int f = 0; f < 64; f++) {
    int32_t sum = 0;
    for (int k = 0; k < k_pad; k++) {
      uint8_t byte = blk[(size_t)k * 32 + f % 32];
      int8_t v = (int8_t)((f < 32 ? byte & 15 : byte >> 4) - 8);
      dst[(size_t)(k / 4) * 256 + f * 4 + k % 4] = v;
      sum += v;
    }
    if (comp) comp[f] = -sum;
  }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* one block of 64 features of a 4-bit packing (block 64) dequantized to bf16 (UNPACK_BF16's values) in the blocked
 * order [k_pad / 2][32][2] of features c0..c0+31 at d0 and c0+32..c0+63 at d1, each pair of rows `pitch` values
 * after the last (64: UNPACK_BF16_BLOCKED, the AMX weight-only prefill's panel; 128 with d1 = d0 + 64:
 * UNPACK_BF16_BLOCKED64): both rows' 64 values a step in registers, the group's scales kept (group even) */
static void bf16_levels_block(const uint8_t *blk, const float *s, const float *zc, int gstride, int c0, int k_pad,
                              int group, uint16_t *d0, uint16_t *d1, size_t pitch) {
  for (int g0 = 0; g0 < k_pad; g0 += group) {
    const float *sg = s + (size_t)(g0 / group) * gstride + c0, *zg = zc + (size_t)(g0 / group) * gstride + c0;
    __m512 s0 = vload(sg), s1 = vload(sg + 16), s2 = vload(sg + 32), s3 = vload(sg + 48);
    __m512 z0 = vload(zg), z1 = vload(zg + 16), z2 = vload(zg + 32), z3 = vload(zg + 48);
    for (int k = g0, ke = g0 + group < k_pad ? g0 + group : k_pad; k < ke; k += 2) {
      const uint8_t *r = blk + (size_t)k * 32;
      b16 a0 = bload(r), a1 = bload(r + 16), e0 = bload(r + 32), e1 = bload(r + 48);   /* rows k, k + 1 */
      __m512i ka = (__m512i)_mm512_cvtne2ps_pbh(vfmav(lo_f(a1), s1, z1), vfmav(lo_f(a0), s0, z0));
      __m512i kb = (__m512i)_mm512_cvtne2ps_pbh(vfmav(lo_f(e1), s1, z1), vfmav(lo_f(e0), s0, z0));
      __m512i ha = (__m512i)_mm512_cvtne2ps_pbh(vfmav(hi_f(a1), s3, z3), vfmav(hi_f(a0), s2, z2));
      __m512i hb = (__m512i)_mm512_cvtne2ps_pbh(vfmav(hi_f(e1), s3, z3), vfmav(hi_f(e0), s2, z2));
      store_pairs(d0 + (size_t)(k / 2) * pitch, ka, kb);
      store_pairs(d1 + (size_t)(k / 2) * pitch, ha, hb);
    }
  }
}
#endif

int lrq_int4_unpack_t(const int4_layer *L, void *out, int form, int nthreads) {
  const uint8_t *packed = L->packed;
  int n_pad = L->n_pad, k_pad = L->k_pad, group = L->group, block = L->block;
  if ((block != 64 && block != 32) || group <= 0 || n_pad % 16 || k_pad % 2 || form < 0 ||
      form > UNPACK_BF16_BLOCKED64 || (form == UNPACK_BF16_BLOCKED && n_pad % 32) ||
      (form == UNPACK_BF16_BLOCKED64 && n_pad % 64) ||
      (form == UNPACK_I8_BLOCKED && (n_pad % 64 || k_pad % 4 || block != 64)))
    return 1;
  int nb = n_pad / block, rem = n_pad - nb * block, half = block / 2, units = nb + (rem > 0);
  if (form == UNPACK_I8_BLOCKED) {
    int32_t *comp = (int32_t *)((int8_t *)out + (size_t)n_pad * k_pad);
    #pragma omp parallel for num_threads(nthreads) schedule(static) \
        if (nthreads > 1 && nb > 1 && (size_t)n_pad * k_pad >= PARALLEL_FROM)
    for (int b = 0; b < nb; b++)
      i8_levels_block(packed + (size_t)b * 64 * k_pad / 2, k_pad, (int8_t *)out + (size_t)b * 64 * k_pad,
                      comp + (size_t)b * 64);
    return 0;
  }
  int failed = 0;
  if (form == UNPACK_BF16_BLOCKED || form == UNPACK_BF16_BLOCKED64) {
    int W = form == UNPACK_BF16_BLOCKED64 ? 64 : 32;
    #pragma omp parallel for num_threads(nthreads) schedule(static) \
        if (nthreads > 1 && units > 1 && (size_t)n_pad * k_pad >= PARALLEL_FROM)
    for (int b = 0; b < units; b++) {
      if (!scales_ready(L)) {
        #pragma omp atomic write
        failed = 1;
        continue;
      }
      const uint8_t *blk = packed + (size_t)b * block * k_pad / 2;
      int c0 = b * block, width = b < nb ? block : rem, gs;
      const float *zc, *s = block_scales(L, b, &zc, &gs);
      uint16_t t[2][64];
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if (b < nb && block == 64 && group % 2 == 0) {   /* in registers */
        uint16_t *d0 = (uint16_t *)out + (size_t)(c0 / W) * W * k_pad + (size_t)(c0 % W) * 2;
        bf16_levels_block(blk, s, zc, gs, 0, k_pad, group, d0, W == 64 ? d0 + 64 : d0 + (size_t)32 * k_pad,
                          (size_t)2 * W);
        continue;
      }
#endif
      for (int k = 0; k < k_pad; k += 2) {
        for (int r = 0; r < 2; r++) {
          const float *sg = s + (size_t)((k + r) / group) * gs, *zg = zc + (size_t)((k + r) / group) * gs;
          if (b < nb) {
            unpack_row(blk + (size_t)(k + r) * half, sg, zg, t[r], 0, half, UNPACK_BF16);
          } else {
            for (int j = 0; j < rem; j++) {
              uint8_t byte = blk[(size_t)(k + r) * (rem / 2) + j / 2], q = (j & 1) ? byte >> 4 : byte & 15;
              t[r][j] = f32_to_bf16(fmaf((float)q, sg[j], zg[j]));
            }
          }
        }
        put_blocked(out, t[0], t[1], c0, width, k, k_pad, W);
      }
    }
    return failed ? 2 : 0;
  }
  #pragma omp parallel for num_threads(nthreads) schedule(static) \
      if (nthreads > 1 && units > 1 && (size_t)n_pad * k_pad >= PARALLEL_FROM)
  for (int b = 0; b < units; b++) {
    if (!scales_ready(L)) {
      #pragma omp atomic write
      failed = 1;
      continue;
    }
    const uint8_t *blk = packed + (size_t)b * block * k_pad / 2;
    int c0 = b * block, gs;
    const float *zc, *s = block_scales(L, b, &zc, &gs);
    for (int k = 0; k < k_pad; k++) {
      const float *sg = s + (size_t)(k / group) * gs, *zg = zc + (size_t)(k / group) * gs;
      size_t row = (size_t)k * n_pad + c0;
      if (b < nb) {
        unpack_row(blk + (size_t)k * half, sg, zg, out, row, half, form);
        continue;
      }
      for (int j = 0; j < rem; j++) {   /* the remainder block: bytes of features 2j (low nibble) and 2j + 1 (high) */
        uint8_t byte = blk[(size_t)k * (rem / 2) + j / 2], q = (j & 1) ? byte >> 4 : byte & 15;
        float v = fmaf((float)q, sg[j], zg[j]);
        if (form == UNPACK_I8) ((int8_t *)out)[row + j] = (int8_t)(q - 8);
        else if (form == UNPACK_BF16) ((uint16_t *)out)[row + j] = f32_to_bf16(v);
        else ((float *)out)[row + j] = v;
      }
    }
  }
  return failed ? 2 : 0;
}

/* dot_row: one weight row's exact int32 product with one token's activation levels (int8_gemv below): with
 * AVX-512 VNNI vpdpbusd's u8 x s8 on the levels themselves (xa + 128) less 128 * wsum; with AVX2 int16 products
 * summed in int32 (exact: no saturating step); elsewhere plain C. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline int32_t dot_row(const uint8_t *xu, const int8_t *w, int k, int32_t wsum) {
  __m512i acc = _mm512_setzero_si512();
  int i = 0;
  for (; i + 64 <= k; i += 64)
    acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(xu + i), _mm512_loadu_si512(w + i));
  if (i < k) {
    __mmask64 mask = (k - i) == 64 ? ~0ULL : ((1ULL << (k - i)) - 1);
    acc = _mm512_dpbusd_epi32(acc, _mm512_maskz_loadu_epi8(mask, xu + i), _mm512_maskz_loadu_epi8(mask, w + i));
  }
  return _mm512_reduce_add_epi32(acc) - 128 * wsum;
}
#define UNSIGNED_X 1
#elif defined(__AVX2__)
/* an AVX2 dot product's eight int32 lanes summed, plus the levels i..k-1 past its last 16 (plain products) */
static inline int32_t lanes_and_tail(__m256i acc, const int8_t *x, const int8_t *w, int i, int k) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  int32_t r = _mm_cvtsi128_si32(h);
  for (; i < k; i++) r += (int32_t)x[i] * w[i];
  return r;
}
static inline int32_t dot_row(const int8_t *x, const int8_t *w, int k, int32_t wsum) {
  (void)wsum;
  __m256i acc = _mm256_setzero_si256();
  int i = 0;
  for (; i + 16 <= k; i += 16) {
    __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + i)));
    __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + i))), p = _mm256_madd_epi16(a, b);
    ADD_I32_IN_PLACE(acc, p);
  }
  return lanes_and_tail(acc, x, w, i, k);
}
#else
static inline int32_t dot_row(const int8_t *x, const int8_t *w, int k, int32_t wsum) {
  (void)wsum;
  int32_t r = 0;
  for (int i = 0; i < k; i++) r += (int32_t)x[i] * w[i];
  return r;
}
#endif

static inline void store_any(void *p, int bf16, size_t i, float v);   /* below */

/* one output's float32 corrections, in lrq.cpu_kernels._int8_corrected's order */
static inline float int8_corrected(int32_t dot, float xz, float rowsum, float xsc, const float *col_term,
                                   const float *zero_term, int asymmetric, const float *scale, int j) {
  float v = (float)dot - xz * col_term[j];
  if (asymmetric) v += rowsum * zero_term[j];
  return v * xsc * scale[j];
}

#ifdef UNSIGNED_X
/* 16 vectors' int32 lane sums as one vector (lane i: the sum of a[i]'s lanes): sum16x16's unpacks and block
 * shuffles on integers */
static inline __m512i isum16x16(const __m512i *a) {
  __m512i t[8], u[4];
  for (int i = 0; i < 8; i++)
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
  const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
  __m512i w0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], even), _mm512_shuffle_i32x4(u[0], u[1], odd));
  __m512i w1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], even), _mm512_shuffle_i32x4(u[2], u[3], odd));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(w0, w1, even), _mm512_shuffle_i32x4(w0, w1, odd));
}

/* 16 weight rows (j0..j0 + 15, contiguous) against one token's unsigned levels: a row at a time (two accumulators,
 * x re-read from L1), the block's stream fetched ahead (ROW16_AHEAD), the 16 sums reduced together (isum16x16), then
 * the corrections in 16 lanes, written as float32 or rounded to bf16 */
static void int8_rows16(const uint8_t *xu, float rowsum, float xz, float xsc, const int8_t *w, const int32_t *wsum,
                        const float *col_term, const float *zero_term, int asymmetric, const float *scale, void *y,
                        int y_bf16, int j0, int k) {
  const int8_t *w0 = w + (size_t)j0 * k;
  __builtin_prefetch(wsum + j0 + 16, 0, 3); __builtin_prefetch(col_term + j0 + 16, 0, 3);   /* the next 16's */
  __builtin_prefetch(scale + j0 + 16, 0, 3);
  if (asymmetric) __builtin_prefetch(zero_term + j0 + 16, 0, 3);
  __m512i a[16];
  const int whole = k / 64 * 64;
  const __mmask64 m = (k - whole) ? (1ULL << (k - whole)) - 1 : 0;
  for (int r = 0; r < 16; r++) {   /* a row at a time: the block read in memory order */
    const int8_t *wr = w0 + (size_t)r * k;
    __m512i p = _mm512_setzero_si512(), q = p;
    int i = 0;
    for (; i + 128 <= whole; i += 128) {
      PREFETCH_STREAM_AT(wr, i, 2, ROW16_AHEAD, ROW16_HINT);
      DPBUSD_IN_PLACE(p, _mm512_loadu_si512(xu + i), _mm512_loadu_si512(wr + i));
      DPBUSD_IN_PLACE(q, _mm512_loadu_si512(xu + i + 64), _mm512_loadu_si512(wr + i + 64));
    }
    if (i < whole) {
      PREFETCH_STREAM_AT(wr, i, 1, ROW16_AHEAD, ROW16_HINT);
      DPBUSD_IN_PLACE(p, _mm512_loadu_si512(xu + i), _mm512_loadu_si512(wr + i));
    }
    if (m) DPBUSD_IN_PLACE(q, _mm512_maskz_loadu_epi8(m, xu + whole), _mm512_maskz_loadu_epi8(m, wr + whole));
    a[r] = _mm512_add_epi32(p, q);
  }
  __m512i dot = _mm512_sub_epi32(isum16x16(a), _mm512_slli_epi32(_mm512_loadu_si512(wsum + j0), 7));
  __m512 v = _mm512_sub_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(xz), _mm512_loadu_ps(col_term + j0)));
  if (asymmetric)
    v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(rowsum), _mm512_loadu_ps(zero_term + j0)));
  v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(xsc)), _mm512_loadu_ps(scale + j0));
  if (y_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)y + j0), bf16_round16(v));
  else _mm512_storeu_ps((float *)y + j0, v);
}
#endif

#if !defined(UNSIGNED_X) && defined(__AVX2__)
/* AVX2: four weight rows (j0..j0 + 3) against one token's levels, each 16 levels of x widened once for the four,
 * the block's stream fetched ahead (PREFETCH_STREAM); int16 products summed in pairs into int32 (exact) */
static void int8_rows4(const int8_t *x, const int8_t *w, int j0, int k, int32_t *dot) {
  const int8_t *w0 = w + (size_t)j0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int i = 0;
  for (; i + 16 <= k; i += 16) {
    if (i % 64 == 0) PREFETCH_STREAM(w0, (size_t)i * 4, 4);
    __m256i xv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + i)));
#define ROW_STEP(a, wr)                                                                                      \
  do {                                                                                                        \
    __m256i p_ = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((wr) + i))), xv);  \
    ADD_I32_IN_PLACE(a, p_);                                                                                  \
  } while (0)
    ROW_STEP(a0, w0); ROW_STEP(a1, w1); ROW_STEP(a2, w2); ROW_STEP(a3, w3);
#undef ROW_STEP
  }
  dot[0] = lanes_and_tail(a0, x, w0, i, k);
  dot[1] = lanes_and_tail(a1, x, w1, i, k);
  dot[2] = lanes_and_tail(a2, x, w2, i, k);
  dot[3] = lanes_and_tail(a3, x, w3, i, k);
}
#endif

/* one token's outputs y[n] (float32, or bf16 where y_bf16) from its levels xt (unsigned with UNSIGNED_X, as
 * dot_row reads them) and their sum less 128 a level (rowsum); output rows split over threads */
static void int8_token(const void *xt, float rowsum, float xz, float xsc, const int8_t *w, const int32_t *wsum,
                       const float *col_term, const float *zero_term, int asymmetric, const float *scale, void *y,
                       int y_bf16, int n, int k, int nthreads) {
  int done = 0;
#ifdef UNSIGNED_X
  done = n / 16 * 16;
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (size_t)n * k >= PARALLEL_FROM)
  for (int u = 0; u < n / 16; u++)
    int8_rows16(xt, rowsum, xz, xsc, w, wsum, col_term, zero_term, asymmetric, scale, y, y_bf16, 16 * u, k);
#elif defined(__AVX2__)
  done = n / 4 * 4;
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (size_t)n * k >= PARALLEL_FROM)
  for (int u = 0; u < n / 4; u++) {
    int32_t dot[4];
    int8_rows4(xt, w, 4 * u, k, dot);
    for (int r = 0; r < 4; r++)
      store_any(y, y_bf16, 4 * u + r, int8_corrected(dot[r], xz, rowsum, xsc, col_term, zero_term, asymmetric,
                                                      scale, 4 * u + r));
  }
#endif
  #pragma omp parallel for num_threads(nthreads) schedule(static) \
      if (nthreads > 1 && (size_t)(n - done) * k >= PARALLEL_FROM)
  for (int j = done; j < n; j++)
    store_any(y, y_bf16, j, int8_corrected(dot_row(xt, w + (size_t)j * k, k, wsum[j]), xz, rowsum, xsc, col_term,
                                            zero_term, asymmetric, scale, j));
}

/* the levels of m tokens (rows x_stride apart) as int8_token reads them, and the rows' step there: with UNSIGNED_X
 * made unsigned into the calling thread's scratch (rows k apart), elsewhere xa itself; their row sums into rowsum */
static const uint8_t *int8_operand(const int8_t *xa, long x_stride, int m, int k, float *rowsum, long *step) {
  for (int t = 0; t < m; t++) {
    int32_t rs = 0;
    for (int i = 0; i < k; i++) rs += xa[(size_t)t * x_stride + i];
    rowsum[t] = (float)rs;
  }
#ifdef UNSIGNED_X
  uint8_t *xs = scratch_get((size_t)m * k);
  if (!xs) return NULL;
  for (int t = 0; t < m; t++)
    for (int i = 0; i < k; i++) xs[(size_t)t * k + i] = (uint8_t)(xa[(size_t)t * x_stride + i] ^ 0x80);
  *step = k;
  return xs;
#else
  *step = x_stride;
  return (const uint8_t *)xa;
#endif
}

/* int8_gemv: the W8A8 decode step. y[m, n] (float32) from the activation levels xa = level - 128 (int8 [m, k], rows
 * x_stride apart) and the weight levels w = q - offset (int8 [n, k], contiguous): the exact int32 product
 * acc = sum_k xa w, then lrq.cpu_kernels._int8_corrected's corrections in float32,
 *     y = ((acc - x_zero * col_term) + rowsum * zero_term) * x_scale * scale      (rowsum = sum_k xa, exact)
 * (the zero_term product only where `asymmetric`). x_zero and x_scale: one value, or one per row where their
 * *_per_row flag is set. With AVX-512 VNNI the products are vpdpbusd's u8 x s8 on the levels themselves
 * (xa + 128) less 128 * wsum (wsum = sum_k w per output, exact), 16 outputs at a time; with AVX2 int16 products
 * summed in int32 (exact: no saturating step); elsewhere plain C. */
int lrq_int8_gemv(const int8_t *w, const int32_t *wsum, const int8_t *xa, long x_stride, const float *x_zero,
                  int zero_per_row, const float *x_scale, int scale_per_row, const float *col_term,
                  const float *zero_term, int asymmetric, const float *scale, float *y, int m, int n, int k,
                  int nthreads) {
  if (m < 1 || n < 1 || k < 1) return 1;
  float *rowsum = malloc(sizeof(float) * (size_t)m);
  long step;
  const uint8_t *xs = rowsum ? int8_operand(xa, x_stride, m, k, rowsum, &step) : NULL;
  if (!xs) {
    free(rowsum);
    return 2;
  }
  for (int t = 0; t < m; t++)
    int8_token(xs + (size_t)t * step, rowsum[t], x_zero[zero_per_row ? t : 0], x_scale[scale_per_row ? t : 0], w, wsum,
               col_term, zero_term, asymmetric, scale, y + (size_t)t * n, 0, n, k, nthreads);
  free(rowsum);
  return 0;
}

/* w8a8: the same from floating-point activations on a static grid, quantized here exactly as the fake-quant path
 * does (lrq.packed.PackedLinear._int8_activations): xa = clamp(round_half_even(x / a_scale) + a_zero, -128, a_hi),
 * in float32, then int8_gemv's product with x_zero = a_zero and x_scale = a_scale; y float32 or, where y_bf16, in
 * bf16 (rounded to nearest even: the fused step's output in the model's dtype). */
static int32_t grid_levels_row(const void *x, int bf16, size_t o, int k, float scale, float zero, float hi,
                               int8_t *out);   /* below, beside int8_activations */
static int w8a8_rows(const int8_t *w, const int32_t *wsum, const void *x, int x_bf16, long x_stride, float a_scale,
                     float a_zero, float a_hi, const float *col_term, const float *zero_term, int asymmetric,
                     const float *scale, void *y, int y_bf16, int m, int n, int k, int nthreads) {
  if (m < 1 || n < 1 || k < 1 || !(a_scale > 0)) return 1;
  int8_t *xa = scratch_get((size_t)m * k);
  if (!xa) return 2;
  for (int t = 0; t < m; t++) {
    int8_t *xt = xa + (size_t)t * k;
    float rowsum = (float)grid_levels_row(x, x_bf16, (size_t)t * x_stride, k, a_scale, a_zero, a_hi, xt);
#ifdef UNSIGNED_X
    for (int i = 0; i < k; i++) xt[i] ^= (int8_t)0x80;
#endif
    int8_token(xt, rowsum, a_zero, a_scale, w, wsum, col_term, zero_term, asymmetric, scale,
               (char *)y + (size_t)t * n * (y_bf16 ? 2 : 4), y_bf16, n, k, nthreads);
  }
  return 0;
}

int lrq_w8a8_gemv(const int8_t *w, const int32_t *wsum, const void *x, int x_bf16, long x_stride, float a_scale,
                  float a_zero, float a_hi, const float *col_term, const float *zero_term, int asymmetric,
                  const float *scale, float *y, int m, int n, int k, int nthreads) {
  return w8a8_rows(w, wsum, x, x_bf16, x_stride, a_scale, a_zero, a_hi, col_term, zero_term, asymmetric, scale, y, 0,
                   m, n, k, nthreads);
}

/* ---- the lean runtime's one-token steps (lrq.runtime.LeanDecoder): what torch runs as many small operations ---- */

static inline float load_any(const void *p, int bf16, size_t i) {
  return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void store_any(void *p, int bf16, size_t i, float v) {
  if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v); else ((float *)p)[i] = v;
}

/* rms_norm: y = x / sqrt(mean(x^2) + eps) * w per row of n, in float32, rounded once to x's dtype (torch's fused
 * rms_norm computes the same in float32 and rounds once); w in the model's dtype. */
void lrq_rms_norm(const void *x, const void *w, void *y, int bf16, int rows, int n, float eps) {
  for (int r = 0; r < rows; r++) {
    float ss = 0;
    for (int i = 0; i < n; i++) { float v = load_any(x, bf16, (size_t)r * n + i); ss += v * v; }
    float inv = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++)
      store_any(y, bf16, (size_t)r * n + i, load_any(x, bf16, (size_t)r * n + i) * inv * load_any(w, bf16, i));
  }
}

/* rope_cache: one token's rotary embedding and key/value cache write, as lrq.runtime.LeanDecoder computes them
 * (x cos + roll(x, hd / 2) sin', sin' carrying rotate_half's sign): q [heads, hd] in place, k [kv_heads, hd] roped
 * into the key cache and v [kv_heads, hd] copied into the value cache at `pos` (caches [kv_heads, max_len, hd], head
 * kv_stride apart); cos and sin' are the rows of position `pos` ([hd]). In float32, rounded once. rope_row with
 * torch_order: torch's addcmul(x * cos, roll(x), sin') instead (x cos rounded to the dtype, then r sin' added in one
 * fused multiply-add: the prefill's rope_cache_rows). */
static void rope_row(const void *x, void *dst, const void *cos, const void *sin, int bf16, size_t xo, size_t dsto,
                     int hd, int torch_order) {
  int half = hd / 2;
  float tmp[1024];
  for (int d = 0; d < hd; d++) {
    float r = load_any(x, bf16, xo + (size_t)((d + half) % hd)), a = load_any(x, bf16, xo + d) * load_any(cos, bf16, d);
    if (!torch_order) {
      tmp[d] = a + r * load_any(sin, bf16, d);
      continue;
    }
    if (bf16) a = bf16_to_f32(f32_to_bf16(a));
    tmp[d] = fmaf(r, load_any(sin, bf16, d), a);
  }
  for (int d = 0; d < hd; d++) store_any(dst, bf16, dsto + d, tmp[d]);
}

/* per_token_dequant: lrq.quant.per_token_dequantized's values, bit for bit (the same float32 operations in the same
 * order; this file is compiled with -ffp-contract=off so none is fused): per row, lo = min(min x, 0),
 * hi = max(max x, 0), scale = max((hi - lo) / qmax, eps), zero = clamp(round(-(lo / scale)), 0, qmax), then
 * (clamp(round(x / scale) + zero, 0, qmax) - zero) * scale, rounded once to the row's dtype. Rounding is half to
 * even (nearbyintf in the default mode), as torch.round. */
static void grid_from_range(float lo, float hi, float qmax, float eps, float *scale_out, float *zero_out) {
  hi = hi < 0 ? 0 : hi;
  lo = lo > 0 ? 0 : lo;
  float scale = (hi - lo) / qmax;
  scale = scale < eps ? eps : scale;
  float zero = nearbyintf(-(lo / scale));
  *zero_out = zero < 0 ? 0 : (zero > qmax ? qmax : zero);
  *scale_out = scale;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ROWS_AVX512 1
/* 16 values (fewer where the mask says; the rest 0) of a bf16 or float32 row, as float32 */
static inline __m512 load16(const void *x, int bf16, size_t i, __mmask16 m) {
  if (bf16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x + i)), 16));
  return _mm512_maskz_loadu_ps(m, (const float *)x + i);
}
/* 16 float32 values (those the mask says) written to a bf16 (rounded to nearest even) or float32 row */
static inline void store16(void *p, int bf16, size_t i, __mmask16 m, __m512 v) {
  if (bf16) _mm256_mask_storeu_epi16((uint16_t *)p + i, m, bf16_round16_fast(v));
  else _mm512_mask_storeu_ps((float *)p + i, m, v);
}
/* v as stored in the dtype (bf16: rounded to nearest even) and read back as float32 */
static inline __m512 rounded16(__m512 v, int bf16) {
  return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_round16_fast(v)), 16)) : v;
}
/* nearbyint(x / scale) + zero for 16 values of a row: their unclamped position on the grid */
static inline __m512 grid16(const void *x, int bf16, size_t i, __mmask16 m, __m512 scale, __m512 zero) {
  return _mm512_add_ps(_mm512_roundscale_ps(_mm512_div_ps(load16(x, bf16, i, m), scale),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zero);
}
#elif defined(__AVX2__)
#define ROWS_AVX2 1
/* 8 values of a bf16 or float32 row, as float32 */
static inline __m256 load8(const void *x, int bf16, size_t i) {
  if (bf16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
  return _mm256_loadu_ps((const float *)x + i);
}
/* grid_levels_row's level of 8 values as int32: nearbyint(x / scale) + zero clamped to [-128, hi], a NaN to 0 (the
 * scalar loop's operations: the division and rounding are IEEE's in both) */
static inline __m256i levels8(const void *x, int bf16, size_t i, __m256 scale, __m256 zero, __m256 lo, __m256 hi) {
  __m256 v = _mm256_add_ps(_mm256_round_ps(_mm256_div_ps(load8(x, bf16, i), scale),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zero);
  __m256 bad = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
  return _mm256_cvtps_epi32(_mm256_blendv_ps(v, _mm256_setzero_ps(), bad));
}
#endif

/* one row's per-token grid as lrq.quant.per_token_qparams makes it (a NaN anywhere in the row makes both NaN, as
 * torch's amin/amax propagate it); AVX-512 vectors where built */
static void row_grid(const void *x, int bf16, size_t o, int k, float qmax, float eps, float *scale_out,
                     float *zero_out) {
  float lo = INFINITY, hi = -INFINITY;
  int nan = 0, i = 0;
#ifdef ROWS_AVX512
  __m512 vlo = _mm512_set1_ps(INFINITY), vhi = _mm512_set1_ps(-INFINITY);
  __mmask16 vnan = 0;
  for (; i < k; i += 16) {
    __mmask16 m = tail16(k - i);
    __m512 v = load16(x, bf16, o + i, m);
    vnan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    vlo = _mm512_mask_min_ps(vlo, m, vlo, v);
    vhi = _mm512_mask_max_ps(vhi, m, vhi, v);
  }
  lo = _mm512_reduce_min_ps(vlo), hi = _mm512_reduce_max_ps(vhi);
  nan = vnan != 0;
#elif defined(ROWS_AVX2)
  /* 8 lanes (a lane that met a NaN may lose its extreme: the row's grid is NaN then anyway), the rest below */
  __m256 vlo = _mm256_set1_ps(INFINITY), vhi = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    __m256 v = load8(x, bf16, o + i);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vlo = _mm256_min_ps(vlo, v);
    vhi = _mm256_max_ps(vhi, v);
  }
  float l8[8], h8[8];
  _mm256_storeu_ps(l8, vlo);
  _mm256_storeu_ps(h8, vhi);
  for (int j = 0; j < 8; j++) {
    lo = l8[j] < lo ? l8[j] : lo;
    hi = h8[j] > hi ? h8[j] : hi;
  }
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < k; i++) {   /* what the vectors left (plain C: the whole row) */
    float v = load_any(x, bf16, o + i);
    nan |= v != v;
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  if (nan) lo = hi = NAN;
  grid_from_range(lo, hi, qmax, eps, scale_out, zero_out);
}

void lrq_per_token_dequant(const void *x, void *y, int bf16, int rows, int k, int bits, float eps) {
  float qmax = (float)((1 << bits) - 1);
  for (int r = 0; r < rows; r++) {
    size_t o = (size_t)r * k;
    float scale, zero;
    row_grid(x, bf16, o, k, qmax, eps, &scale, &zero);
#ifdef ROWS_AVX512
    const __m512 vs = _mm512_set1_ps(scale), vz = _mm512_set1_ps(zero), top = _mm512_set1_ps(qmax);
    for (int i = 0; i < k; i += 16) {
      __mmask16 m = tail16(k - i);
      __m512 q = grid16(x, bf16, o + i, m, vs, vz);
      /* clamped to [0, qmax], a NaN kept (max/min would replace it) */
      q = _mm512_mask_mov_ps(_mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), top),
                             _mm512_cmp_ps_mask(q, q, _CMP_UNORD_Q), q);
      __m512 v = _mm512_mul_ps(_mm512_sub_ps(q, vz), vs);
      store16(y, bf16, o + i, m, v);
    }
    continue;
#endif
    for (int i = 0; i < k; i++) {
      float q = nearbyintf(load_any(x, bf16, o + i) / scale) + zero;
      q = q < 0 ? 0 : (q > qmax ? qmax : q);
      store_any(y, bf16, o + i, (q - zero) * scale);
    }
  }
}

/* ---- the lean runtime's rows of several tokens (a prefill): the operations between its linears ----
 * torch's CPU rms_norm on bf16 is about twenty operations (1.0 ms for 512 x 576 on one Intel Xeon thread, 61 a
 * prefill of SmolLM2-135M: 15 % of it), its SiLU and the product with the up projection two passes more. */
#ifdef ROWS_AVX512
/* e^x for 16 float32 values: x = n ln2 + r (n nearest, ln2 in two parts, |r| <= ln2 / 2), e^r = 1 + r + r^2 P(r)
 * with Cephes' degree-5 coefficients for expf (about 1e-7 relative), times 2^n by vscalefps (inf above about 88.7,
 * 0 below about -103.3, as expf); x clamped to [-110, 100] first (NaN kept: the second operand of vmaxps/vminps) */
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(100.f), _mm512_max_ps(_mm512_set1_ps(-110.f), x));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

#ifdef ROWS_AVX512
/* 16 vectors' lane sums as one vector: lane i the sum of a[i]'s 16 lanes (pairs of unpacks, then 128-bit blocks:
 * 45 operations where 16 reductions are about 130) */
static inline __m512 sum16x16(const __m512 *a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; i++)   /* lanes 0, 2 of each block: position 2i's partials; 1, 3: 2i + 1's */
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++) {   /* lane p of block b: position 4i + p's sum over block b */
    __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
  __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], even), _mm512_shuffle_f32x4(u[0], u[1], odd));
  __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], even), _mm512_shuffle_f32x4(u[2], u[3], odd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, even), _mm512_shuffle_f32x4(w0, w1, odd));
}

/* attend_group: lrq_attend for HN (1-4) query heads of one key/value head, each key and value row read once for
 * all of them (grouped-query attention: SmolLM2's 9 query heads read 3 key/value heads). s: HN x (len + 16) float32
 * scratch for the scores; hd a multiple of 16. The scores 16 positions at a time (sum16x16), the softmax with exp16
 * and its quotients by vdivps, the weighted values 64 features at a time in 4 x HN registers. */
static inline __attribute__((always_inline)) void attend_group(
    const float *qf, const void *kc, const void *vc, size_t kvh, void *out, size_t out0, int bf16, int len, int hd,
    float scale, float *s, const int HN) {
  const size_t ss = (size_t)len + 16;
  for (int j0 = 0; j0 < len; j0 += 16) {
    __m512 part[4][16];
    for (int jj = 0; jj < 16; jj++) {
      __m512 acc[4];
      for (int h = 0; h < HN; h++) acc[h] = _mm512_setzero_ps();
      if (j0 + jj < len) {
        size_t row = kvh + (size_t)(j0 + jj) * hd;
        /* the key row 16 positions on, and the value row as far on (read after the softmax, from L2 then) */
        const char *kn = (const char *)kc + (row + (size_t)16 * hd) * (bf16 ? 2 : 4);
        const char *vn = (const char *)vc + row * (bf16 ? 2 : 4);
        for (int b = 0; b < hd * (bf16 ? 2 : 4); b += 64) {
          _mm_prefetch(kn + b, _MM_HINT_T0);
          _mm_prefetch(vn + b, _MM_HINT_T1);
        }
        for (int d = 0; d < hd; d += 16) {
          __m512 kv = load16(kc, bf16, row + d, 0xFFFF);
          for (int h = 0; h < HN; h++) acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + (size_t)h * hd + d), kv, acc[h]);
        }
      }
      for (int h = 0; h < HN; h++) part[h][jj] = acc[h];
    }
    for (int h = 0; h < HN; h++)
      _mm512_storeu_ps(s + h * ss + j0, _mm512_mul_ps(sum16x16(part[h]), _mm512_set1_ps(scale)));
  }
  for (int h = 0; h < HN; h++) {
    float *sh = s + h * ss;
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int j = 0; j < len; j += 16) mx = _mm512_mask_max_ps(mx, tail16(len - j), mx, _mm512_loadu_ps(sh + j));
    __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int j = 0; j < len; j += 16) {
      __m512 e = _mm512_maskz_mov_ps(tail16(len - j), exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + j), m)));
      _mm512_storeu_ps(sh + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
    for (int j = 0; j < len; j += 16) _mm512_storeu_ps(sh + j, _mm512_div_ps(_mm512_loadu_ps(sh + j), total));
  }
  for (int d0 = 0; d0 < hd; d0 += 64) {
    __m512 acc[4][4];
    __mmask16 mk[4];
    for (int c = 0; c < 4; c++) {
      mk[c] = d0 + 16 * c < hd ? 0xFFFF : 0;
      for (int h = 0; h < HN; h++) acc[h][c] = _mm512_setzero_ps();
    }
    for (int j = 0; j < len; j++) {
      size_t row = kvh + (size_t)j * hd + d0;
      __m512 v[4];
      for (int c = 0; c < 4; c++) v[c] = load16(vc, bf16, row + 16 * c, mk[c]);
      for (int h = 0; h < HN; h++) {
        __m512 p = _mm512_set1_ps(s[h * ss + j]);
        for (int c = 0; c < 4; c++) acc[h][c] = _mm512_fmadd_ps(v[c], p, acc[h][c]);
      }
    }
    for (int h = 0; h < HN; h++)
      for (int c = 0; c < 4; c++)
        if (mk[c]) store16(out, bf16, out0 + (size_t)h * hd + d0 + 16 * c, 0xFFFF, acc[h][c]);
  }
}
#endif

/* attend: one query token against `len` cached positions. q [heads, hd] (rows q_stride apart), caches [kv_heads,
 * max_len, hd] (head kv_stride apart), head h reads key/value head h / (heads / kv_heads); out [heads, hd]
 * contiguous (the o_proj input as is). Scores, softmax and the weighted sum in float32, rounded once. */
int lrq_attend(const void *q, long q_stride, const void *kc, const void *vc, long kv_stride, void *out, int bf16,
               int len, int heads, int kv_heads, int hd, float scale) {
  if (len < 1 || kv_heads < 1 || heads % kv_heads) return 1;
  /* the query heads of each key/value head four at a time, each key and value row read once for them: in AVX-512
   * builds attend_group (hd a multiple of 16), elsewhere the loop below (AVX2, plain C, other head sizes: a score's
   * lanes summed on their own, the softmax by expf) */
  int G = heads / kv_heads, vec = hd % 16 == 0;   /* 16 float32 lanes at a time (every head size in use: 64, 128) */
  size_t ss = (size_t)len + 16;   /* a head's scores (attend_group scores 16 positions at a time) */
  float *buf = scratch_get(sizeof(float) * (4 * ss + 8 * (size_t)hd));
  if (!buf) return 2;
  float *qf = buf + 4 * ss, *acc = qf + 4 * (size_t)hd;
  for (int g = 0; g < kv_heads; g++)
    for (int h0 = 0; h0 < G; h0 += 4) {
      int hn = G - h0 < 4 ? G - h0 : 4, hq = g * G + h0;
      size_t kvh = (size_t)g * kv_stride;
      for (int h = 0; h < hn; h++)
        for (int d = 0; d < hd; d++) qf[(size_t)h * hd + d] = load_any(q, bf16, (size_t)(hq + h) * q_stride + d);
#ifdef ROWS_AVX512
      if (vec) {
        size_t o0 = (size_t)hq * hd;
        switch (hn) {
          case 1: attend_group(qf, kc, vc, kvh, out, o0, bf16, len, hd, scale, buf, 1); break;
          case 2: attend_group(qf, kc, vc, kvh, out, o0, bf16, len, hd, scale, buf, 2); break;
          case 3: attend_group(qf, kc, vc, kvh, out, o0, bf16, len, hd, scale, buf, 3); break;
          default: attend_group(qf, kc, vc, kvh, out, o0, bf16, len, hd, scale, buf, 4);
        }
        continue;
      }
#endif
      for (int j = 0; j < len; j++) {
        size_t row = kvh + (size_t)j * hd;
        if (vec) {
          v16 sc[4] = {vzero(), vzero(), vzero(), vzero()};
          for (int d = 0; d < hd; d += 16) {
            v16 kv = bf16 ? vload_bf16((const uint16_t *)kc + row + d) : vload((const float *)kc + row + d);
            for (int h = 0; h < hn; h++) sc[h] = vfmav(vload(qf + (size_t)h * hd + d), kv, sc[h]);
          }
          for (int h = 0; h < hn; h++) buf[h * ss + j] = vsum(sc[h]) * scale;
        } else {
          for (int h = 0; h < hn; h++) {
            float sc = 0;
            for (int d = 0; d < hd; d++) sc += qf[(size_t)h * hd + d] * load_any(kc, bf16, row + d);
            buf[h * ss + j] = sc * scale;
          }
        }
      }
      for (int h = 0; h < hn; h++) {
        float *sh = buf + h * ss, mx = -INFINITY, sum = 0;
        for (int j = 0; j < len; j++) if (sh[j] > mx) mx = sh[j];
        for (int j = 0; j < len; j++) { sh[j] = expf(sh[j] - mx); sum += sh[j]; }
        for (int j = 0; j < len; j++) sh[j] /= sum;
      }
      if (vec) {
        for (int d = 0; d < hd; d += 16) {
          v16 a[4] = {vzero(), vzero(), vzero(), vzero()};
          for (int j = 0; j < len; j++) {
            size_t at = kvh + (size_t)j * hd + d;
            v16 vv = bf16 ? vload_bf16((const uint16_t *)vc + at) : vload((const float *)vc + at);
            for (int h = 0; h < hn; h++) a[h] = vfma(vv, buf[h * ss + j], a[h]);
          }
          for (int h = 0; h < hn; h++) vstore(acc + (size_t)h * hd + d, a[h]);
        }
      } else {
        for (int i = 0; i < hn * hd; i++) acc[i] = 0;
        for (int j = 0; j < len; j++)
          for (int h = 0; h < hn; h++)
            for (int d = 0; d < hd; d++)
              acc[(size_t)h * hd + d] += buf[h * ss + j] * load_any(vc, bf16, kvh + (size_t)j * hd + d);
      }
      for (int h = 0; h < hn; h++)
        for (int d = 0; d < hd; d++) store_any(out, bf16, (size_t)(hq + h) * hd + d, acc[(size_t)h * hd + d]);
    }
  return 0;
}

/* rms_norm_rows: rows [rows, n] of x (contiguous, bf16 or float32). With res: x += res first, in place, rounded to
 * x's dtype (the residual add: torch's x + res), then y = rms_norm(x) * w (rms_norm's float32 computation and its
 * one rounding, as lrq_rms_norm; the sum of squares in 16 lanes where built with AVX-512); y NULL: the add only.
 * Rows split over threads. */
void lrq_rms_norm_rows(void *x, const void *res, const void *w, void *y, int bf16, int rows, int n, float eps,
                       int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (size_t)rows * n >= PARALLEL_FROM)
  for (int r = 0; r < rows; r++) {
    size_t o = (size_t)r * n;
#ifdef ROWS_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
      __mmask16 m = tail16(n - i);
      __m512 v = load16(x, bf16, o + i, m);
      if (res) {
        v = rounded16(_mm512_add_ps(v, load16(res, bf16, o + i, m)), bf16);
        store16(x, bf16, o + i, m, v);
      }
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    if (!y) continue;
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / n + eps));
    for (int i = 0; i < n; i += 16) {
      __mmask16 m = tail16(n - i);
      store16(y, bf16, o + i, m, _mm512_mul_ps(_mm512_mul_ps(load16(x, bf16, o + i, m), inv), load16(w, bf16, i, m)));
    }
    continue;
#endif
    if (res)
      for (int i = 0; i < n; i++) store_any(x, bf16, o + i, load_any(x, bf16, o + i) + load_any(res, bf16, o + i));
    if (y) lrq_rms_norm((const char *)x + o * (bf16 ? 2 : 4), w, (char *)y + o * (bf16 ? 2 : 4), bf16, 1, n, eps);
  }
}

/* rope_row in 16 lanes where built with AVX-512 and hd / 2 is a multiple of 16 (the same float32 operations, so the
 * same bits: x cos + r sin' each product rounded, or torch's order), rope_row itself elsewhere */
static void rope_row_fast(const void *x, void *dst, const void *cos, const void *sin, int bf16, size_t xo,
                          size_t dsto, int hd, int torch_order) {
#ifdef ROWS_AVX512
  int half = hd / 2;
  if (half % 16 == 0) {
    for (int d = 0; d < half; d += 16) {
      __m512 x0 = load16(x, bf16, xo + d, 0xFFFF), x1 = load16(x, bf16, xo + d + half, 0xFFFF);
      __m512 c0 = load16(cos, bf16, d, 0xFFFF), c1 = load16(cos, bf16, d + half, 0xFFFF);
      __m512 s0 = load16(sin, bf16, d, 0xFFFF), s1 = load16(sin, bf16, d + half, 0xFFFF), o0, o1;
      if (torch_order) {
        o0 = _mm512_fmadd_ps(x1, s0, rounded16(_mm512_mul_ps(x0, c0), bf16));
        o1 = _mm512_fmadd_ps(x0, s1, rounded16(_mm512_mul_ps(x1, c1), bf16));
      } else {
        o0 = _mm512_add_ps(_mm512_mul_ps(x0, c0), _mm512_mul_ps(x1, s0));
        o1 = _mm512_add_ps(_mm512_mul_ps(x1, c1), _mm512_mul_ps(x0, s1));
      }
      store16(dst, bf16, dsto + d, 0xFFFF, o0);   /* x read whole before: q is roped in place */
      store16(dst, bf16, dsto + d + half, 0xFFFF, o1);
    }
    return;
  }
#endif
  rope_row(x, dst, cos, sin, bf16, xo, dsto, hd, torch_order);
}

/* rope_cache: see rope_row above (rope_row_fast's lanes) */
int lrq_rope_cache(void *q, const void *k, const void *v, const void *cos, const void *sin, void *kc, void *vc,
                   long kv_stride, int pos, int heads, int kv_heads, int hd, int bf16) {
  if (hd < 2 || hd > 1024 || hd % 2) return 1;
  for (int h = 0; h < heads; h++) rope_row_fast(q, q, cos, sin, bf16, (size_t)h * hd, (size_t)h * hd, hd, 0);
  size_t elem = bf16 ? 2 : 4;
  for (int h = 0; h < kv_heads; h++) {
    size_t at = (size_t)h * kv_stride + (size_t)pos * hd;
    rope_row_fast(k, kc, cos, sin, bf16, (size_t)h * hd, at, hd, 0);
    memcpy((char *)vc + at * elem, (const char *)v + (size_t)h * hd * elem, hd * elem);
  }
  return 0;
}

/* rope_cache_rows: rope_cache for t tokens at positions pos.. (batch 1): q [t, heads, hd] roped in place, k [t,
 * kv_heads, hd] roped into the key cache and v copied into the value cache at rows pos + j; cos and sin' [max_len,
 * hd] (row pos + j for token j). In 16 lanes where built with AVX-512 and hd / 2 is a multiple of 16, the values of
 * torch's addcmul(x * cos, roll(x), sin') the prefill ran before (x cos rounded to the dtype, then r sin' added to it
 * in one fused multiply-add, rounded: bit for bit, a test checks), in plain C elsewhere. Tokens split over threads. */
int lrq_rope_cache_rows(void *q, const void *k, const void *v, const void *cos, const void *sin, void *kc, void *vc,
                        long kv_stride, int pos, int t, int heads, int kv_heads, int hd, int bf16, int nthreads) {
  if (hd < 2 || hd > 1024 || hd % 2 || t < 1) return 1;
  size_t elem = bf16 ? 2 : 4;
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (size_t)t * (heads + kv_heads) * hd >= PARALLEL_FROM / 4)
  for (int j = 0; j < t; j++) {
    const char *cj = (const char *)cos + elem * (size_t)(pos + j) * hd, *sj = (const char *)sin + elem * (size_t)(pos + j) * hd;
    for (int h = 0; h < heads; h++) {
      size_t o = ((size_t)j * heads + h) * hd;
      rope_row_fast(q, q, cj, sj, bf16, o, o, hd, 1);
    }
    for (int h = 0; h < kv_heads; h++) {
      size_t src = ((size_t)j * kv_heads + h) * hd, at = (size_t)h * kv_stride + (size_t)(pos + j) * hd;
      rope_row_fast(k, kc, cj, sj, bf16, src, at, hd, 1);
      memcpy((char *)vc + at * elem, (const char *)v + src * elem, hd * elem);
    }
  }
  return 0;
}

/* silu_mul: y = act(g) * u over `count` values (bf16 or float32), the MLP's two operations with their two roundings:
 * act(g) = g / (1 + e^-g) in float32 rounded to the dtype, then its product with u rounded (exp16 where built with
 * AVX-512, else expf). Split over threads in pieces of 4096. */
void lrq_silu_mul(const void *g, const void *u, void *y, int bf16, long count, int nthreads) {
  long pieces = (count + 4095) / 4096;
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && count >= (long)PARALLEL_FROM)
  for (long c = 0; c < pieces; c++) {
    size_t i0 = (size_t)c * 4096, i1 = i0 + 4096 < (size_t)count ? i0 + 4096 : (size_t)count;
#ifdef ROWS_AVX512
    for (size_t i = i0; i < i1; i += 16) {
      __mmask16 m = tail16((int)(i1 - i));
      __m512 gv = load16(g, bf16, i, m);
      __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
      /* g / d as g times 1 / d (vrcp14ps and one Newton step: within an ulp or two of the quotient, a vdivps costing
       * about as much as the rest of the loop); where d is over 2^126 (its reciprocal would be a denormal, or d is
       * inf) the division itself */
      __m512 r = _mm512_rcp14_ps(d);
      r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.f)), r);
      __m512 a = _mm512_mul_ps(gv, r);
      __mmask16 big = _mm512_cmp_ps_mask(d, _mm512_set1_ps(0x1p126f), _CMP_GT_OQ);
      if (big) a = _mm512_mask_div_ps(a, big, gv, d);
      store16(y, bf16, i, m, _mm512_mul_ps(rounded16(a, bf16), load16(u, bf16, i, m)));
    }
    continue;
#endif
    for (size_t i = i0; i < i1; i++) {
      float gv = load_any(g, bf16, i);
      store_any(y, bf16, i, gv / (1.0f + expf(-gv)));
      store_any(y, bf16, i, load_any(y, bf16, i) * load_any(u, bf16, i));
    }
  }
}

/* int8_activations: a prefill call's activations on their 8-bit grid, as lrq.packed.PackedLinear._int8_activations
 * computes them with torch's ops (one pass instead of about eight): per row of x [m, k] (bf16 or float32, rows
 * x_stride apart) the levels less 128, xa = clamp(nearbyint(x / scale) + zero, -128, 2^bits - 129) (int8, NaN to
 * level 0 as the decode kernel does), their sum (exact in float32) and, where per_token, the row's grid as
 * lrq.quant.per_token_qparams makes it (scale, zero point less 128); else the static grid given (a_scale, a_zero
 * = zero point less 128). Rows split over threads. */
void lrq_int8_activations(const void *x, int bf16, long x_stride, int m, int k, int per_token, int bits,
                          float a_scale, float a_zero, float eps, int8_t *xa, float *zero_out, float *scale_out,
                          float *rowsum, int nthreads) {
  float qmax = (float)((1 << bits) - 1), hi_level = (float)((1 << bits) - 129);
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (size_t)m * k >= PARALLEL_FROM)
  for (int r = 0; r < m; r++) {
    size_t o = (size_t)r * x_stride;
    float scale = a_scale, zero = a_zero;
    if (per_token) {
      row_grid(x, bf16, o, k, qmax, eps, &scale, &zero);
      zero -= 128.f;
      zero_out[r] = zero;
      scale_out[r] = scale;
    }
    rowsum[r] = (float)grid_levels_row(x, bf16, o, k, scale, zero, hi_level, xa + (size_t)r * k);
  }
}

/* one row's levels on a grid (less 128): clamp(nearbyint(x / scale) + zero, -128, hi), a NaN to level 0, into
 * out[k] (16 at a time where built with AVX-512); returns their sum. The prefill's int8_activations and the
 * one-token W8A8 kernel's static grid. */
static int32_t grid_levels_row(const void *x, int bf16, size_t o, int k, float scale, float zero, float hi,
                               int8_t *out) {
#ifdef ROWS_AVX512
  const __m512 vs = _mm512_set1_ps(scale), vz = _mm512_set1_ps(zero), lo = _mm512_set1_ps(-128.f),
               vhi = _mm512_set1_ps(hi);
  __m512i sum = _mm512_setzero_si512();
  int i = 0;
#define LEVELS16(at, m)                                                                                            \
  ({ __m512 v_ = grid16(x, bf16, o + (at), (m), vs, vz);                                                          \
     __mmask16 bad_ = _mm512_cmp_ps_mask(v_, v_, _CMP_UNORD_Q);                                                   \
     _mm512_cvtps_epi32(_mm512_mask_mov_ps(_mm512_min_ps(_mm512_max_ps(v_, lo), vhi), bad_, _mm512_setzero_ps())); })
  /* 64 at a time: four vectors of levels (in -128..127) packed to bytes by two saturating packs (exact here) and
   * one permutation into order, one 64-byte store (a masked vpmovdb store of 16 costs several cycles) */
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (; i + 64 <= k; i += 64) {
    __m512i a = LEVELS16(i, 0xFFFF), b = LEVELS16(i + 16, 0xFFFF), c = LEVELS16(i + 32, 0xFFFF),
            d = LEVELS16(i + 48, 0xFFFF);
    sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_add_epi32(a, b), _mm512_add_epi32(c, d)));
    __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(a, b), _mm512_packs_epi32(c, d));
    _mm512_storeu_si512(out + i, _mm512_permutexvar_epi32(order, bytes));
  }
  for (; i < k; i += 16) {
    __mmask16 m = tail16(k - i);
    __m512i iv = LEVELS16(i, m);
    sum = _mm512_mask_add_epi32(sum, m, sum, iv);
    _mm512_mask_cvtepi32_storeu_epi8(out + i, m, iv);
  }
#undef LEVELS16
  return _mm512_reduce_add_epi32(sum);
#else
  int32_t sum = 0;
  int i = 0;
#ifdef ROWS_AVX2
  /* 32 at a time: four vectors of levels packed to bytes by two saturating packs (exact here), put in order */
  const __m256 vs = _mm256_set1_ps(scale), vz = _mm256_set1_ps(zero), vlo = _mm256_set1_ps(-128.f),
               vhi = _mm256_set1_ps(hi);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i vsum = _mm256_setzero_si256();
  for (; i + 32 <= k; i += 32) {
    __m256i a = levels8(x, bf16, o + i, vs, vz, vlo, vhi), b = levels8(x, bf16, o + i + 8, vs, vz, vlo, vhi);
    __m256i c = levels8(x, bf16, o + i + 16, vs, vz, vlo, vhi), d = levels8(x, bf16, o + i + 24, vs, vz, vlo, vhi);
    vsum = _mm256_add_epi32(vsum, _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d)));
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256((__m256i *)(out + i), _mm256_permutevar8x32_epi32(bytes, order));
  }
  int32_t s8[8];
  _mm256_storeu_si256((__m256i *)s8, vsum);
  for (int j = 0; j < 8; j++) sum += s8[j];
#endif
  for (; i < k; i++) {
    float v = nearbyintf(load_any(x, bf16, o + i) / scale) + zero;
    v = v < -128.f ? -128.f : (v > hi ? hi : v);
    if (v != v) v = 0;   /* NaN: a defined level (an int8 path cannot carry it; torch's cast gives 0 on x86) */
    out[i] = (int8_t)v;
    sum += out[i];
  }
  return sum;
#endif
}

/* whether int8_activations runs in vectors here (AVX-512 or AVX2): its plain-C loop is slower than torch's
 * vectorized ops (445 against 360 us for 512 x 576 at W8A8, 736 against 439 at W4A8), so the caller takes torch's
 * there */
int lrq_int8_activations_vectorized(void) {
#if defined(ROWS_AVX512) || defined(ROWS_AVX2)
  return 1;
#else
  return 0;
#endif
}

/* 64 rows of an int8 weight [n, k] (from w, k apart) in the blocked order [k / 4][64][4] (k % 4 == 0): each 64-byte
 * piece holds 16 features' 4 bytes, one gather of 16 int32 from 16 rows (lrq_int8_blocked, the AMX W8A8 panel) */
static void int8_levels_block(const int8_t *w, int k, int8_t *dst) {
  int kq = k / 4;
  for (int g = 0; g < 64; g += 16) {
    const int8_t *src = w + (size_t)g * k;
#if defined(__AVX512F__)
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kq));
    for (int q = 0; q < kq; q++)
      _mm512_storeu_si512(dst + (size_t)q * 256 + g * 4, _mm512_i32gather_epi32(rows, (const void *)(src + (size_t)q * 4), 4));
#else
    for (int q = 0; q < kq; q++)
      for (int f = 0; f < 16; f++) memcpy(dst + (size_t)q * 256 + (g + f) * 4, src + (size_t)f * k + q * 4, 4);
#endif
  }
}

/* int8_blocked: W8A8's int8 weight w [n, k] (levels less the offset) in oneDNN's blocked int8 layout, as
 * UNPACK_I8_BLOCKED writes a 4-bit one: [n / 64][k / 4][64][4] bytes, then int32 [n] = -wsum (n % 64 == 0,
 * k % 4 == 0). Each 64-byte piece holds 16 features' 4 bytes: one gather of 16 int32 from 16 rows. */
int lrq_int8_blocked(const int8_t *w, const int32_t *wsum, int n, int k, int8_t *out, int nthreads) {
  if (n % 64 || k % 4 || n < 1 || k < 1) return 1;
  int nb = n / 64;
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && nb > 1 && (size_t)n * k >= PARALLEL_FROM)
  for (int b = 0; b < nb; b++) int8_levels_block(w + (size_t)b * 64 * k, k, out + (size_t)b * 64 * k);
  int32_t *comp = (int32_t *)(out + (size_t)n * k);
  for (int j = 0; j < n; j++) comp[j] = -wsum[j];
  return 0;
}

#ifdef ROWS_AVX512
/* int8_correct's operations, in their order, on 16 outputs of one row from their float32 product av: the product
 * x_zero * col_term of the row's x_zero and the features' col_term (xzc: a caller whose x_zero is one for the call
 * makes it once), the row's x_scale and row sum broadcast (vxsc, vrs), the features' zero_term and scale (zt, sc).
 * lrq_int8_correct and the AMX kernel both compute it here, so their values agree to the bit. */
static inline __m512 corrected16(__m512 av, __m512 xzc, __m512 vxsc, __m512 vrs, __m512 zt, __m512 sc,
                                 int asymmetric) {
  __m512 v = _mm512_sub_ps(av, xzc);
  if (asymmetric) v = _mm512_add_ps(v, _mm512_mul_ps(vrs, zt));
  return _mm512_mul_ps(_mm512_mul_ps(v, vxsc), sc);
}
#endif

/* int8_correct: lrq.cpu_kernels._int8_corrected over a prefill call's int32 product acc [m, n] (rows acc_stride
 * apart; or its float32 value, acc_f32, as oneDNN's quantized inner product returns it), in its order of float32
 * operations, y = ((acc - x_zero col_term) + rowsum zero_term) x_scale scale, written as float32 or rounded once to
 * bf16 (what the float32 result's cast gives): one pass instead of five. */
void lrq_int8_correct(const void *acc_any, long acc_stride, int m, int n, const float *rowsum, const float *x_zero,
                      int zero_per_row, const float *x_scale, int scale_per_row, const float *col_term,
                      const float *zero_term, int asymmetric, const float *scale, void *y, int y_bf16, int nthreads,
                      int acc_f32) {
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (size_t)m * n >= PARALLEL_FROM)
  for (int t = 0; t < m; t++) {
    const int32_t *a = (const int32_t *)acc_any + (size_t)t * acc_stride;
    const float *af = (const float *)acc_any + (size_t)t * acc_stride;
    float xz = x_zero[zero_per_row ? t : 0], xsc = x_scale[scale_per_row ? t : 0], rs = rowsum[t];
#ifdef ROWS_AVX512
    const __m512 vxz = _mm512_set1_ps(xz), vxsc = _mm512_set1_ps(xsc), vrs = _mm512_set1_ps(rs);
    for (int j = 0; j < n; j += 16) {
      __mmask16 m = tail16(n - j);
      __m512 av = acc_f32 ? _mm512_maskz_loadu_ps(m, af + j) : _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, a + j));
      __m512 v = corrected16(av, _mm512_mul_ps(vxz, _mm512_maskz_loadu_ps(m, col_term + j)), vxsc, vrs,
                             _mm512_maskz_loadu_ps(m, zero_term + j), _mm512_maskz_loadu_ps(m, scale + j), asymmetric);
      store16(y, y_bf16, (size_t)t * n + j, m, v);
    }
    continue;
#endif
    for (int j = 0; j < n; j++) {
      float v = (acc_f32 ? af[j] : (float)a[j]) - xz * col_term[j];
      if (asymmetric) v += rs * zero_term[j];
      store_any(y, y_bf16, (size_t)t * n + j, v * xsc * scale[j]);
    }
  }
}

/* ---- prefill int8 GEMMs by AVX2 integer products (CPUs without VNNI or AMX: AMD Zen 2 and 3, Intel before Ice
 * Lake), where oneDNN's int8 GEMM sums u8 x s8 pairs in saturating int16 and is not exact (cpu_kernels.int_mm_ok) ---
 * avx2_int8_linear: amx_int8_linear's y [m, n] (float32 or bf16; int8_correct's operations in its order, bit for
 * bit its values) from the activation levels xa (int8 [m, k], level - 128) and the weight's levels less their
 * offset, the exact int32 product made with instructions that cannot saturate:
 *   W8A8 (w: int8 [n, k]): both sides widened to int16, vpmaddwd (two products a lane, |sum| <= 2^15 fits int32);
 *   W4A8 (L: a 4-bit packing, block 32 or 64; levels less 8 in [-8, 7]): the activations as unsigned bytes
 *     (level, xa + 128) by vpmaddubsw (two products summed in int16: |.| <= 2 * 255 * 8 = 4080), eight of those sums
 *     added in int16 (<= 32640, no wrap) before vpmaddwd widens them; the 128 * sum of the levels taken off after.
 * The weight goes a panel of 64 features at a time into [k / 4][64][4] (AMX's order; int16 for W8A8), held in L2
 * while every 6 rows of x (those rows in L1) pass over its four 16-feature parts. k a multiple of 4 (W4A8: k_pad,
 * equal to k); n_pad a multiple of 64. Returns 1 for arguments it does not take or without AVX2, 2 out of memory. */
#if defined(__AVX2__)
/* rows a step, 8 features at a time (measured on an Intel Xeon held to AVX2; more accumulators than registers
 * spill, at half speed): W8A8 6 (12 int32 accumulators, 2 of the panel, the broadcast; 4 or 5 rows 7-12 % slower),
 * W4A8 6 (6 int16 sums in the loop, the panel, the broadcast; 7 or 8 rows no faster) */
#define I16_ROWS 6
#define U8_ROWS 6
#define I8A_MR 6     /* the most rows a step */
typedef struct {
  const int8_t *w; const int4_layer *L; int m, k, n, n_pad;
  const float *rowsum, *x_zero, *x_scale, *col_term, *zero_term, *scale;
  int zero_per_row, scale_per_row, asymmetric;
  void *y; int y_bf16;
} i8a_job;

/* int8_correct's operations on 8 outputs of one row (the scalar loop's order, each operation rounded once) */
static inline __m256 corrected8(__m256 av, __m256 xzc, __m256 vxsc, __m256 vrs, __m256 zt, __m256 sc, int asymmetric) {
  __m256 v = _mm256_sub_ps(av, xzc);
  if (asymmetric) v = _mm256_add_ps(v, _mm256_mul_ps(vrs, zt));
  return _mm256_mul_ps(_mm256_mul_ps(v, vxsc), sc);
}

/* a panel's per-feature terms (zero past n), loaded once a panel */
typedef struct { float col[64], zt[64], sc[64]; } i8a_terms;

static void i8a_terms_of(const i8a_job *J, int j0, i8a_terms *T) {
  int nv = J->n - j0 < 64 ? J->n - j0 : 64;
  memset(T, 0, sizeof *T);
  if (nv <= 0) return;
  memcpy(T->col, J->col_term + j0, nv * sizeof(float));
  memcpy(T->zt, J->zero_term + j0, nv * sizeof(float));
  memcpy(T->sc, J->scale + j0, nv * sizeof(float));
}

/* the outputs of rows t0.. (those below m) and the 16 features 16g.. of panel j0 (those below n) from their exact
 * int32 products acc */
static void i8a_finish(const i8a_job *J, const i8a_terms *T, __m256i acc[][2], int rows, int t0, int j0, int g) {
  for (int r = 0; r < rows && t0 + r < J->m; r++) {
    int t = t0 + r;
    const __m256 vxz = _mm256_set1_ps(J->x_zero[J->zero_per_row ? t : 0]);
    const __m256 vxsc = _mm256_set1_ps(J->x_scale[J->scale_per_row ? t : 0]), vrs = _mm256_set1_ps(J->rowsum[t]);
    for (int c = 0; c < 2; c++) {
      int f = 16 * g + 8 * c, nv = J->n - (j0 + f) < 8 ? J->n - (j0 + f) : 8;
      if (nv <= 0) break;
      __m256 v = corrected8(_mm256_cvtepi32_ps(acc[r][c]), _mm256_mul_ps(vxz, _mm256_loadu_ps(T->col + f)), vxsc, vrs,
                            _mm256_loadu_ps(T->zt + f), _mm256_loadu_ps(T->sc + f), J->asymmetric);
      size_t o = (size_t)t * J->n + j0 + f;
      if (!J->y_bf16 && nv == 8) {
        _mm256_storeu_ps((float *)J->y + o, v);
      } else {
        float out[8];
        _mm256_storeu_ps(out, v);
        for (int i = 0; i < nv; i++) store_any(J->y, J->y_bf16, o + i, out[i]);
      }
    }
  }
}

/* W8A8's panel: 64 rows of w [n, k] (k apart) as int16 [k / 4][64][4]; 4 features x 4 quads of k a step, a 4 x 4
 * transpose of int32 quads, each quad's bytes widened */
static void i16_panel(const int8_t *w, int k, int16_t *dst) {
  int kq = k / 4;
  for (int f = 0; f < 64; f += 4) {
    const int8_t *r0 = w + (size_t)f * k, *r1 = r0 + k, *r2 = r1 + k, *r3 = r2 + k;
    int q = 0;
    for (; q + 4 <= kq; q += 4) {
      __m128i a0 = _mm_loadu_si128((const __m128i *)(r0 + 4 * q)), a1 = _mm_loadu_si128((const __m128i *)(r1 + 4 * q));
      __m128i a2 = _mm_loadu_si128((const __m128i *)(r2 + 4 * q)), a3 = _mm_loadu_si128((const __m128i *)(r3 + 4 * q));
      __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpacklo_epi32(a2, a3);
      __m128i t2 = _mm_unpackhi_epi32(a0, a1), t3 = _mm_unpackhi_epi32(a2, a3);
      __m128i o[4] = {_mm_unpacklo_epi64(t0, t1), _mm_unpackhi_epi64(t0, t1), _mm_unpacklo_epi64(t2, t3),
                      _mm_unpackhi_epi64(t2, t3)};
      for (int i = 0; i < 4; i++)
        _mm256_store_si256((__m256i *)(dst + (size_t)(q + i) * 256 + f * 4), _mm256_cvtepi8_epi16(o[i]));
    }
    for (; q < kq; q++)
      for (int e = 0; e < 4; e++) {
        int16_t *d = dst + (size_t)q * 256 + f * 4 + e;
        d[0] = r0[4 * q + e], d[4] = r1[4 * q + e], d[8] = r2[4 * q + e], d[12] = r3[4 * q + e];
      }
  }
}

/* 16 bytes of k_pad rows `half` bytes apart (rows from `r`) as the levels less 8 of 16 features (low nibbles, to
 * features flo..) and 16 more (high nibbles, fhi..) in the order [k_pad / 4][64][4]: 4 rows a step, a 4 x 16 byte
 * transpose */
static void u4_segment(const uint8_t *r, int half, int k, int flo, int fhi, int8_t *dst) {
  const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
  for (int q = 0; q < k / 4; q++, r += 4 * (size_t)half) {
    __m128i R0 = _mm_loadu_si128((const __m128i *)r), R1 = _mm_loadu_si128((const __m128i *)(r + half));
    __m128i R2 = _mm_loadu_si128((const __m128i *)(r + 2 * half)), R3 = _mm_loadu_si128((const __m128i *)(r + 3 * half));
    __m128i u0 = _mm_unpacklo_epi8(R0, R1), u1 = _mm_unpacklo_epi8(R2, R3);
    __m128i u2 = _mm_unpackhi_epi8(R0, R1), u3 = _mm_unpackhi_epi8(R2, R3);
    __m128i v[4] = {_mm_unpacklo_epi16(u0, u1), _mm_unpackhi_epi16(u0, u1), _mm_unpacklo_epi16(u2, u3),
                    _mm_unpackhi_epi16(u2, u3)};
    int8_t *d = dst + (size_t)q * 256;
    for (int i = 0; i < 4; i++) {
      _mm_storeu_si128((__m128i *)(d + flo * 4 + 16 * i), _mm_sub_epi8(_mm_and_si128(v[i], low), eight));
      _mm_storeu_si128((__m128i *)(d + fhi * 4 + 16 * i), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v[i], 4), low), eight));
    }
  }
}

/* W4A8's panel: the 64 features 64p.. of a 4-bit packing as int8 levels less 8, [k_pad / 4][64][4] (i8_levels_block's
 * order, from block 64: rows of 32 bytes, byte j features j and j + 32; or two blocks of 32: rows of 16 bytes, byte j
 * features j and j + 16), and each feature's sum of them (wsum[64]) */
static void u4_panel(const int4_layer *L, int p, int8_t *dst, int32_t *wsum) {
  int k = L->k_pad;
  if (L->block == 64) {
    const uint8_t *blk = L->packed + (size_t)p * 32 * k;
    u4_segment(blk, 32, k, 0, 32, dst);
    u4_segment(blk + 16, 32, k, 16, 48, dst);
  } else {
    u4_segment(L->packed + (size_t)(2 * p) * 16 * k, 16, k, 0, 16, dst);
    u4_segment(L->packed + (size_t)(2 * p + 1) * 16 * k, 16, k, 32, 48, dst);
  }
  /* the sums: byte pairs by vpmaddubsw with ones, then pairs of those by vpmaddwd */
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  __m256i s[8];
  for (int g = 0; g < 8; g++) s[g] = _mm256_setzero_si256();
  for (int q = 0; q < k / 4; q++)
    for (int g = 0; g < 8; g++)
      s[g] = _mm256_add_epi32(s[g], _mm256_madd_epi16(
          _mm256_maddubs_epi16(ones8, _mm256_load_si256((const __m256i *)(dst + (size_t)q * 256 + 32 * g))), ones16));
  for (int g = 0; g < 8; g++) _mm256_storeu_si256((__m256i *)(wsum + 8 * g), s[g]);
}

/* W8A8: rows x (int16, rows k apart, I16_ROWS of them) times 16 features of an int16 panel (b: their first quad's
 * 64 int16 of 256, quads 256 apart), 8 features at a time: 8 sums of feature x (pair of k) per register, paired up
 * at the end */
static inline void i16_tile(const int16_t *x, int k, const int16_t *b, __m256i out[I16_ROWS][2]) {
  for (int h = 0; h < 2; h++) {
    __m256i acc[I16_ROWS][2];
    for (int r = 0; r < I16_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int16_t *bq = b + 32 * h;
    for (int q = 0; q < k / 4; q++, bq += 256) {
      __m256i b0 = _mm256_load_si256((const __m256i *)bq), b1 = _mm256_load_si256((const __m256i *)(bq + 16));
      for (int r = 0; r < I16_ROWS; r++) {
        int64_t a8;
        memcpy(&a8, x + (size_t)r * k + 4 * q, 8);
        __m256i a = _mm256_set1_epi64x(a8), p0 = _mm256_madd_epi16(a, b0), p1 = _mm256_madd_epi16(a, b1);
        ADD_I32_IN_PLACE(acc[r][0], p0);
        ADD_I32_IN_PLACE(acc[r][1], p1);
      }
    }
    /* acc[r][c]: features 4c, 4c + 1 | 4c + 2, 4c + 3, each as two lanes (quads' halves): summed, in order */
    for (int r = 0; r < I16_ROWS; r++)
      out[r][h] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][0], acc[r][1]), 0xD8);
  }
}

/* W4A8: rows x (unsigned bytes, rows k apart, U8_ROWS of them) times 16 features of an int8 panel (b: their 64
 * bytes of a quad's 256, quads 256 bytes apart), 8 features at a time: int16 sums of eight quads, then widened */
static inline void u8s8_tile(const uint8_t *x, int k, const int8_t *b, __m256i out[U8_ROWS][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  int kq = k / 4;
  for (int h = 0; h < 2; h++) {
    __m256i acc[U8_ROWS];
    for (int r = 0; r < U8_ROWS; r++) acc[r] = _mm256_setzero_si256();
    for (int q0 = 0; q0 < kq; q0 += 8) {
      int q1 = q0 + 8 < kq ? q0 + 8 : kq;
      __m256i t[U8_ROWS];
      for (int r = 0; r < U8_ROWS; r++) t[r] = _mm256_setzero_si256();
      for (int q = q0; q < q1; q++) {
        __m256i bq = _mm256_load_si256((const __m256i *)(b + (size_t)q * 256 + 32 * h));
        for (int r = 0; r < U8_ROWS; r++) {
          int32_t a4;
          memcpy(&a4, x + (size_t)r * k + 4 * q, 4);
          __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi32(a4), bq);
          ADD_I16_IN_PLACE(t[r], p);
        }
      }
      for (int r = 0; r < U8_ROWS; r++) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(t[r], ones));
    }
    for (int r = 0; r < U8_ROWS; r++) out[r][h] = acc[r];
  }
}

static int i8a_run(const i8a_job *J, const void *xc, int nthreads) {
  int m = J->m, k = J->k, panels = J->n_pad / 64, failed = 0, w4 = J->L != NULL;
  #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && panels > 1 && (size_t)m * J->n * k >= PARALLEL_FROM)
  {
    void *panel = aligned_alloc(64, (size_t)k * 64 * (w4 ? 1 : 2));
    int32_t wsum[64];
    if (!panel) {
      #pragma omp atomic write
      failed = 1;
    }
    #pragma omp for schedule(static)
    for (int p = 0; p < panels; p++) {
      if (!panel) continue;
      i8a_terms T;
      i8a_terms_of(J, 64 * p, &T);
      if (w4) u4_panel(J->L, p, (int8_t *)panel, wsum);
      else i16_panel(J->w + (size_t)p * 64 * k, k, (int16_t *)panel);
      for (int t0 = 0, step = w4 ? U8_ROWS : I16_ROWS; t0 < m; t0 += step)
        for (int g = 0; g < 4 && 64 * p + 16 * g < J->n; g++) {
          __m256i acc[I8A_MR][2];
          if (w4) {
            u8s8_tile((const uint8_t *)xc + (size_t)t0 * k, k, (const int8_t *)panel + 64 * g, acc);
            for (int r = 0; r < U8_ROWS; r++)   /* the levels' sums at 128 times: x was xa + 128 */
              for (int c = 0; c < 2; c++)
                acc[r][c] = _mm256_sub_epi32(acc[r][c], _mm256_slli_epi32(
                    _mm256_loadu_si256((const __m256i *)(wsum + 16 * g + 8 * c)), 7));
          } else {
            i16_tile((const int16_t *)xc + (size_t)t0 * k, k, (const int16_t *)panel + 64 * g, acc);
          }
          i8a_finish(J, &T, acc, w4 ? U8_ROWS : I16_ROWS, t0, 64 * p, g);
        }
    }
    free(panel);
  }
  return failed ? 2 : 0;
}
#endif

/* the int8 prefill kernels' arguments, unused where the build has no such kernel */
#define INT8_LINEAR_UNUSED()                                                                                      \
  ((void)xa, (void)x_stride, (void)m, (void)k, (void)w, (void)L, (void)n, (void)rowsum, (void)x_zero,              \
   (void)zero_per_row, (void)x_scale, (void)scale_per_row, (void)col_term, (void)zero_term, (void)asymmetric,      \
   (void)scale, (void)y, (void)y_bf16, (void)nthreads)

int lrq_avx2_int8_linear(const int8_t *xa, long x_stride, int m, int k, const int8_t *w, const int4_layer *L, int n,
                         const float *rowsum, const float *x_zero, int zero_per_row, const float *x_scale,
                         int scale_per_row, const float *col_term, const float *zero_term, int asymmetric,
                         const float *scale, void *y, int y_bf16, int nthreads) {
#if defined(__AVX2__)
  int n_pad = L ? L->n_pad : n;
  if (m < 1 || k < 4 || k % 4 || n < 1 || n_pad % 64 || n > n_pad || (!L && !w) ||
      (L && (L->k_pad != k || (L->block != 32 && L->block != 64))))
    return 1;
  /* x once in the kernel's form: int16 (W8A8) or unsigned bytes xa + 128 (W4A8), rows padded to a whole step */
  int rows = (m + I8A_MR - 1) / I8A_MR * I8A_MR, esize = L ? 1 : 2;   /* I16_ROWS and U8_ROWS divide I8A_MR */
  void *xc = aligned_alloc(64, ((size_t)rows * k * esize + 63) / 64 * 64);
  if (!xc) return 2;
  for (int t = 0; t < rows; t++) {
    const int8_t *src = xa + (size_t)t * x_stride;
    if (L) {
      uint8_t *d = (uint8_t *)xc + (size_t)t * k;
      if (t >= m) { memset(d, 0, k); continue; }
      int i = 0;
      for (; i + 32 <= k; i += 32)
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(src + i)),
                                                                  _mm256_set1_epi8((char)0x80)));
      for (; i < k; i++) d[i] = (uint8_t)(src[i] + 128);
    } else {
      int16_t *d = (int16_t *)xc + (size_t)t * k;
      if (t >= m) { memset(d, 0, (size_t)k * 2); continue; }
      int i = 0;
      for (; i + 16 <= k; i += 16)
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + i))));
      for (; i < k; i++) d[i] = src[i];
    }
  }
  i8a_job J = {w, L, m, k, n, n_pad, rowsum, x_zero, x_scale, col_term, zero_term, scale, zero_per_row, scale_per_row,
               asymmetric, y, y_bf16};
  int rc = i8a_run(&J, xc, nthreads);
  free(xc);
  return rc;
#else
  INT8_LINEAR_UNUSED();
  return 1;
#endif
}

/* ---- prefill GEMMs on AMX tiles (Intel Xeon 4th generation and later: AMX-INT8, AMX-BF16) ----
 * A prefill call of a packed layer computed in one call over the weight as held, one panel of 64 output features at
 * a time written into the tiles' order (in L1/L2 while every 32 rows of x pass over it; 2 x 2 tiles of 16 rows x
 * 16 features, 64 bytes of k a step), its outputs finished in the core's cache while the tiles compute the next
 * block: no per-call copy of the whole weight in a GEMM library's layout, no float32 product in memory. Panels split
 * over threads; m any (the last rows' block through a zero-padded copy). Two kinds:
 *
 * amx_int8_linear (W8A8, W4A8): int8_correct's y [m, n] (float32 or bf16) from the activation levels xa (int8 [m,
 *   k], rows x_stride apart; level - 128, as int8_activations writes them) and the weight's levels less their offset:
 *   the exact int32 product by signed int8 tile products (tdpbssd), then int8_correct's float32 operations in its
 *   order (bit for bit its values). The weight is W8A8's int8 levels w [n, k] (`w`; L NULL: int8_levels_block) or a
 *   4-bit packing (L: W4A8's levels less 8, i8_levels_block), panels [k / 4][64][4]. k a multiple of 64.
 * amx_bf16_linear (4-bit weight-only, bf16): y [m, n] bf16 = x [m, k_pad] (bf16, rows x_stride apart) times the
 *   packing's dequantized weight (UNPACK_BF16's values, bf16_levels_block: panels [2][k_pad / 2][32][2]) by bf16
 *   tile products summed in float32 (tdpbf16ps), rounded once (nearest even); the product oneDNN's bf16 GEMM makes
 *   of the same operand, summed in another order. block 64, group even, k_pad a multiple of 32.
 *
 * Both need the packing's n_pad (or W8A8's n) a multiple of 64. They return 1 for arguments they do not take or
 * where the CPU or the kernel lets no AMX run (lrq_amx_ready), 2 out of memory. */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(ROWS_AVX512) && \
    defined(__AVX512BF16__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TILES 1
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_config;
#ifndef AMX_CHUNK
#define AMX_CHUNK 1024   /* bytes of k a row a pass (a half panel's 32 KB of the 48 KB L1) */
#endif
#ifndef AMX_X_BYTES
#define AMX_X_BYTES (1280 * 1024)   /* x's rows a pass over the panels and a panel (of the 2 MB L2 every AMX CPU has) */
#endif
#ifndef AMX_WHOLE
#define AMX_WHOLE 1536   /* rows of at most these bytes in one pass */
#endif

typedef struct {
  int bf16;                                 /* amx_bf16_linear; else amx_int8_linear */
  const void *x; long x_stride; int m, k;   /* x: int8 levels or bf16 values, rows x_stride elements apart */
  const int8_t *w; const int4_layer *L; int n, n_pad;
  const float *rowsum, *x_zero, *x_scale, *col_term, *zero_term, *scale;   /* amx_int8_linear's corrections */
  int zero_per_row, scale_per_row, asymmetric;
  void *y; int y_bf16;
  const int8_t *w8; long w8_stride; const float *s8, *zt8;   /* amx_bf16_int8w_linear: an 8-bit weight-only layer */
} amx_job;

static void int8w_block32(const int8_t *w, long w_stride, const float *scale, const float *zero_term, int j0, int k,
                          uint32_t *dst, size_t pitch);   /* below, beside int8w_unpack */

/* the outputs of rows r0..r1 of a 32 x 32 block of products acc (rows t0 + r, features j0.., those below n
 * written): amx_int8_linear's int8_correct operations (corrected16; the features' terms loaded once a call) or
 * amx_bf16_linear's rounding */
static void amx_finish_rows(const amx_job *J, const int32_t *acc, int r0, int r1, int t0, int j0) {
  int n = J->n;
  __mmask16 mk[2] = {tail16(n - j0), j0 + 16 < n ? tail16(n - j0 - 16) : 0};
  if (J->bf16) {
    for (int r = r0; r < r1; r++)
      for (int c = 0; c < 2 && mk[c]; c++)
        store16(J->y, 1, (size_t)(t0 + r) * n + j0 + 16 * c, mk[c], _mm512_load_ps((const float *)acc + r * 32 + 16 * c));
    return;
  }
  __m512 col[2], zt[2], sc[2];
  for (int c = 0; c < 2; c++) {
    col[c] = _mm512_maskz_loadu_ps(mk[c], J->col_term + j0 + 16 * c);
    zt[c] = _mm512_maskz_loadu_ps(mk[c], J->zero_term + j0 + 16 * c);
    sc[c] = _mm512_maskz_loadu_ps(mk[c], J->scale + j0 + 16 * c);
  }
  /* what is the same for every row made once: x_zero * col_term and the broadcast x_scale where the grid is one for
   * the call (a static grid, W8A8) */
  const int zero_per_row = J->zero_per_row, scale_per_row = J->scale_per_row, asymmetric = J->asymmetric;
  __m512 vxsc = _mm512_set1_ps(J->x_scale[0]), xzc[2];
  for (int c = 0; c < 2; c++) xzc[c] = _mm512_mul_ps(_mm512_set1_ps(J->x_zero[0]), col[c]);
  for (int r = r0; r < r1; r++) {
    int t = t0 + r;
    const __m512 vrs = _mm512_set1_ps(J->rowsum[t]);
    if (zero_per_row) {
      const __m512 vxz = _mm512_set1_ps(J->x_zero[t]);
      xzc[0] = _mm512_mul_ps(vxz, col[0]);
      xzc[1] = _mm512_mul_ps(vxz, col[1]);
    }
    if (scale_per_row) vxsc = _mm512_set1_ps(J->x_scale[t]);
    for (int c = 0; c < 2 && mk[c]; c++) {
      __m512 v = corrected16(_mm512_cvtepi32_ps(_mm512_load_si512(acc + r * 32 + 16 * c)), xzc[c], vxsc, vrs, zt[c],
                             sc[c], asymmetric);
      store16(J->y, J->y_bf16, (size_t)t * n + j0 + 16 * c, mk[c], v);
    }
  }
}

/* panel p (features 64p..) of the job's weight in the tiles' order */
static void amx_panel(const amx_job *J, int p, uint8_t *panel) {
  int k = J->k;
  if (J->bf16 && J->w8) {   /* its two halves of 32 features dequantized into the tiles' order (int8w_unpack's) */
    int8w_block32(J->w8, J->w8_stride, J->s8, J->zt8, 64 * p, k, (uint32_t *)panel, 32);
    int8w_block32(J->w8, J->w8_stride, J->s8, J->zt8, 64 * p + 32, k, (uint32_t *)panel + (size_t)16 * k, 32);
  } else if (J->bf16) {
    const int4_layer *L = J->L;   /* a packing of 64-feature blocks (lrq_amx_bf16_linear checks): panel p is block p */
    int gs;
    const float *zc, *s = block_scales(L, p, &zc, &gs);
    bf16_levels_block((const uint8_t *)L->packed + (size_t)p * 32 * k, s, zc, gs, 0, k, L->group,
                      (uint16_t *)panel, (uint16_t *)panel + (size_t)32 * k, 64);
  } else if (J->L) {
    i8_levels_block((const uint8_t *)J->L->packed + (size_t)p * 32 * k, k, (int8_t *)panel, NULL);
  } else {
    int8_levels_block(J->w + (size_t)p * 64 * k, k, (int8_t *)panel);
  }
}

static int amx_run(const amx_job *J, int nthreads) {
  int m = J->m, k = J->k, panels = J->n_pad / 64, failed = 0, esize = J->bf16 ? 2 : 1;
  size_t row_bytes = (size_t)k * esize;
  /* k in chunks of at most AMX_CHUNK bytes a row (equal, 64-byte steps): a half panel's chunk (32 features) stays in
   * L1 while every block of rows passes over it, the blocks' sums kept in `part` between chunks */
  size_t chunks = row_bytes <= AMX_WHOLE ? 1 : (row_bytes + AMX_CHUNK - 1) / AMX_CHUNK;
  size_t chunk = (row_bytes / 64 + chunks - 1) / chunks * 64;
  #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && panels > 1 && (size_t)m * J->n * k >= PARALLEL_FROM)
  {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    uint8_t *panel = aligned_alloc(64, row_bytes * 64), *tail = m % 32 ? aligned_alloc(64, row_bytes * 32) : NULL;
    /* the 32 x 32 sums of every block of rows between chunks of k (4 KB a block) */
    int32_t *part = chunk < row_bytes ? aligned_alloc(64, (size_t)(m + 31) / 32 * 4096) : NULL;
    int32_t acc[2 * 32 * 32] __attribute__((aligned(64)));
    int ok = panel && (m % 32 == 0 || tail) && (chunk == row_bytes || part) && (!J->L || scales_ready(J->L)),
        last = m - m % 32;
    if (tail) {   /* the last rows, zero-padded to a block of 32: copied once, read by every panel */
      const uint8_t *src = (const uint8_t *)J->x + (size_t)last * J->x_stride * esize;
      for (int r = 0; r < 32; r++)
        if (last + r < m) memcpy(tail + r * row_bytes, src + (size_t)r * J->x_stride * esize, row_bytes);
        else memset(tail + r * row_bytes, 0, row_bytes);
    }
    if (!ok) {
      #pragma omp atomic write
      failed = 1;
    } else {
      _tile_loadconfig(&cfg);
    }
    /* rows in passes of at most AMX_X_BYTES of x and a panel (32 rows at least; passes of equal size),
     * each pass's x in L2 while every panel goes over it (a panel dequantized again for each pass): x read from
     * beyond L2 by each half panel made a bf16 576 x 1536 layer take 2.6 ms for 1024 rows against 1.6 in passes
     * (0.89 against 0.79 for 512; 1536 x 576, 2048 rows: 5.2 against 3.0) */
    int most = 64 * row_bytes < AMX_X_BYTES ? (int)((AMX_X_BYTES - 64 * row_bytes) / row_bytes) / 32 * 32 : 32, mb;
    if (most < 32) most = 32;
    mb = (m + most - 1) / most;            /* passes */
    mb = ((m + mb - 1) / mb + 31) / 32 * 32;   /* rows a pass, the passes alike */
    for (int m0 = 0; m0 < m; m0 += mb) {
    int m1 = m0 + mb < m ? m0 + mb : m;
    #pragma omp for schedule(static)
    for (int p = 0; p < panels; p++) {
      if (!ok) continue;
      amx_panel(J, p, panel);
      /* each 32 x 32 block's outputs are finished while the tiles compute the next block (two product buffers):
       * int8's rows spread over the next block's steps of k (on this CPU the two units did not overlap much: 438
       * -> 410 us for 1536 x 576 x 512, the corrections alone 93), bf16's at its first step (its rounding is short:
       * spread, 1536 x 576 x 512 took 590 us, at once 565) */
      int pend_t0 = 0, pend_rows = 0, pend_j0 = 0, cur = 0, steps = (int)(chunk / 64);
      for (int h = 0; h < 2; h++)   /* features 32h.. of the panel: their part of it stays in L1 for every block */
      for (size_t k0 = 0; k0 < row_bytes; k0 += chunk) {
        /* int8 [k / 4][64][4]: rows 256 bytes apart, features 32h at byte 128h; bf16 [2][k / 2][32][2]: half h after
         * 64 k bytes a feature row, rows 128 bytes apart. A step of 64 bytes of k is 16 rows of either. */
        const uint8_t *b = J->bf16 ? panel + (size_t)h * 64 * k : panel + 128 * h;
        long bs = J->bf16 ? 128 : 256;
        size_t k1 = k0 + chunk < row_bytes ? k0 + chunk : row_bytes;
        for (int t0 = m0; t0 < m1; t0 += 32) {   /* tiles 0-3 the 2 x 2 outputs, 4-5 x, 6-7 w */
          int rows = m - t0 < 32 ? m - t0 : 32;
          const uint8_t *a = rows < 32 ? tail : (const uint8_t *)J->x + (size_t)t0 * J->x_stride * esize;
          long as = rows < 32 ? (long)row_bytes : J->x_stride * esize;
          int32_t *sums = part ? part + (size_t)t0 * 32 : NULL;
          if (k0 == 0) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          } else {
            _tile_loadd(0, sums, 128); _tile_loadd(1, sums + 16, 128);
            _tile_loadd(2, sums + 16 * 32, 128); _tile_loadd(3, sums + 16 * 32 + 16, 128);
          }
          const int32_t *prev = acc + (cur ^ 1) * 1024;
          int done = 0, per = J->bf16 ? pend_rows : (pend_rows + steps - 1) / steps;
          for (size_t kb = k0; kb < k1; kb += 64) {   /* x's tiles streamed past L1 (the panel's stay there) */
            _tile_stream_loadd(4, a + kb, as);
            _tile_stream_loadd(5, a + 16 * as + kb, as);
            _tile_loadd(6, b + kb / 64 * 16 * bs, bs);
            _tile_loadd(7, b + kb / 64 * 16 * bs + 64, bs);
            if (J->bf16) {
              _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            } else {
              _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
            }
            if (done < pend_rows) {
              int e = done + per < pend_rows ? done + per : pend_rows;
              amx_finish_rows(J, prev, done, e, pend_t0, pend_j0);
              done = e;
            }
          }
          if (done < pend_rows) {   /* a chunk shorter than the steps the spread assumed */
            amx_finish_rows(J, prev, done, pend_rows, pend_t0, pend_j0);
            done = pend_rows;
          }
          if (k1 < row_bytes) {   /* a partial sum: kept for the next chunk */
            _tile_stored(0, sums, 128); _tile_stored(1, sums + 16, 128);
            _tile_stored(2, sums + 16 * 32, 128); _tile_stored(3, sums + 16 * 32 + 16, 128);
            pend_rows = 0;
            continue;
          }
          int32_t *out = acc + cur * 1024;
          _tile_stored(0, out, 128); _tile_stored(1, out + 16, 128);
          _tile_stored(2, out + 16 * 32, 128); _tile_stored(3, out + 16 * 32 + 16, 128);
          pend_t0 = t0, pend_j0 = p * 64 + 32 * h, pend_rows = pend_j0 < J->n ? rows : 0, cur ^= 1;
        }
      }
      amx_finish_rows(J, acc + (cur ^ 1) * 1024, 0, pend_rows, pend_t0, pend_j0);
    }
    }
    if (ok) _tile_release();
    free(panel);
    free(tail);
    free(part);
  }
  return failed ? 2 : 0;
}
#endif

/* whether this build and CPU run the AMX kernels: AMX-TILE, AMX-INT8 and AMX-BF16 in CPUID and the kernel's
 * permission for the process's tile data (Linux's arch_prctl ARCH_REQ_XCOMP_PERM; asked once) */
int lrq_amx_ready(void) {
#ifdef AMX_TILES
  static int ready = -1;
  if (ready < 0) {
    unsigned a, b, c, d;
    ready = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) && (d >> 22 & 1) &&
            syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }
  return ready;
#else
  return 0;
#endif
}

int lrq_amx_int8_linear(const int8_t *xa, long x_stride, int m, int k, const int8_t *w, const int4_layer *L, int n,
                        const float *rowsum, const float *x_zero, int zero_per_row, const float *x_scale,
                        int scale_per_row, const float *col_term, const float *zero_term, int asymmetric,
                        const float *scale, void *y, int y_bf16, int nthreads) {
#ifdef AMX_TILES
  int n_pad = L ? L->n_pad : n;
  if (!lrq_amx_ready() || m < 1 || k < 64 || k % 64 || n < 1 || n_pad % 64 || n > n_pad || (!L && !w) ||
      (L && (L->block != 64 || L->k_pad != k)))
    return 1;
  amx_job J = {0, xa, x_stride, m, k, w, L, n, n_pad, rowsum, x_zero, x_scale, col_term, zero_term, scale,
               zero_per_row, scale_per_row, asymmetric, y, y_bf16};
  return amx_run(&J, nthreads);
#else
  INT8_LINEAR_UNUSED();
  return 1;
#endif
}

int lrq_amx_bf16_linear(const int4_layer *L, const uint16_t *x, long x_stride, int m, int n, void *y, int nthreads) {
#ifdef AMX_TILES
  if (!lrq_amx_ready() || m < 1 || n < 1 || L->block != 64 || L->group % 2 || L->n_pad % 64 || L->k_pad % 32 ||
      n > L->n_pad)
    return 1;
  amx_job J = {1, x, x_stride, m, L->k_pad, NULL, L, n, L->n_pad, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, 0, y, 1};
  return amx_run(&J, nthreads);
#else
  (void)L, (void)x, (void)x_stride, (void)m, (void)n, (void)y, (void)nthreads;
  return 1;
#endif
}

/* amx_bf16_int8w_linear: y [m, n] bf16 = x [m, k] (bf16, rows x_stride apart) times an 8-bit weight-only layer's
 * weight (int8w_gemv's levels, scale and zero_term) dequantized a panel at a time into the tiles' order as
 * int8w_unpack's bf16 values, bf16 tile products summed in float32, rounded once. n a multiple of 64, k of 32. */
int lrq_amx_bf16_int8w_linear(const int8_t *w, long w_stride, const float *scale, const float *zero_term,
                              const uint16_t *x, long x_stride, int m, int n, int k, void *y, int nthreads) {
#ifdef AMX_TILES
  if (!lrq_amx_ready() || m < 1 || n < 1 || n % 64 || k < 32 || k % 32 || w_stride < k) return 1;
  amx_job J = {.bf16 = 1, .x = x, .x_stride = x_stride, .m = m, .k = k, .n = n, .n_pad = n, .y = y, .y_bf16 = 1,
               .w8 = w, .w8_stride = w_stride, .s8 = scale, .zt8 = zero_term};
  return amx_run(&J, nthreads);
#else
  (void)w, (void)w_stride, (void)scale, (void)zero_term, (void)x, (void)x_stride, (void)m, (void)n, (void)k, (void)y;
  (void)nthreads;
  return 1;
#endif
}

/* how the 4-bit kernel multiplies bf16 activations (lrq.native.status names it) */
const char *lrq_int4_bf16_products(void) {
#if defined(I16_DOT)
  return "int16 VNNI";
#elif defined(I16_AVX2)
  return "int16 AVX2";
#else
  return "float32";
#endif
}

/* argmax: the index of the largest of x[0..n) (bf16 or float32) as torch.argmax gives it: the first of equal largest
 * values, the first NaN where there is one. A greedy decode step's last operation over the vocabulary: torch's CPU
 * argmax takes about 200 us over 49,152 bf16 logits on an AMD Zen 4 (4 ns a value), 4 % of a 4-bit SmolLM2-135M's
 * step; here two vectorized passes over them (the largest, then where it first is). */
long lrq_argmax(const void *x, int bf16, long n) {
  if (n < 1) return -1;
#ifdef ROWS_AVX512
  __m512 m = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (long i = 0; i < n; i += 16) {   /* the largest, and whether there is a NaN */
    __mmask16 k = tail16(n - i < 16 ? (int)(n - i) : 16);
    __m512 v = load16(x, bf16, i, k);
    nan |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
    m = _mm512_mask_max_ps(m, k, m, v);
  }
  const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  for (long i = 0; i < n; i += 16) {   /* where it (or the first NaN) first is */
    __mmask16 k = tail16(n - i < 16 ? (int)(n - i) : 16);
    __m512 v = load16(x, bf16, i, k);
    __mmask16 at = nan ? _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q)
                       : _mm512_mask_cmp_ps_mask(k, v, best, _CMP_EQ_OQ);
    if (at) return i + __builtin_ctz(at);
  }
  return 0;   /* not reached: the largest is one of the values */
#else
  long at = 0;
  float best = load_any(x, bf16, 0);
  if (best != best) return 0;
  for (long i = 1; i < n; i++) {   /* one pass: the first NaN ends it */
    float v = load_any(x, bf16, i);
    if (v != v) return i;
    if (v > best) best = v, at = i;
  }
  return at;
#endif
}

/* how the int8 weight-only kernel (w8a16, an int8 head) multiplies bf16 activations */
const char *lrq_int8w_bf16_products(void) {
#if defined(I16_DOT)
  return "int16 VNNI";
#else
  return "float32";
#endif
}

/* the instruction set the compiler targeted */
const char *lrq_isa(void) {
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(__SSE2__)
  return "sse2";
#else
  return "generic";
#endif
}

/* ---- a whole decoder layer's one-token step in one call (lrq.runtime.LeanDecoder's fused path) ----
 * What the lean runtime's Python does per layer with about 15 calls (norms, seven linears, RoPE and the cache write,
 * attention, SiLU, residual adds), with the same roundings: every linear's output, the norms, SiLU, its product
 * and each residual sum rounded to the model's dtype as the module path rounds them. At one token a step of a small
 * model is mostly such calls (about 100 us a layer of Python and dispatch on a Zen 5, most of a 4-bit model's
 * step besides its weights), which is what this saves. */

/* dense_gemv: y[n] = W[n, k] x[k] (W rows contiguous, the nn.Linear weight as held), W and x in the model's dtype,
 * summed in float32 and rounded once. bf16 through AVX512-BF16 dot products where the CPU has them, else widened
 * to float32; four rows at a time; rows split over threads. */

static void dense_rows(const void *w, const void *x, const float *xf, void *y, int wb, int bf16, int j0, int j1,
                       int k) {
#if defined(BF16_DOT)
  if (wb && bf16 && k % 32 == 0) {   /* four rows at a time: each x piece loaded once for four weight rows */
    const uint16_t *xb = x;
    for (; j0 + 4 <= j1; j0 += 4) {
      const uint16_t *w0 = (const uint16_t *)w + (size_t)j0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int i = 0; i < k; i += 32) {
        PREFETCH_STREAM(w0, (size_t)i * 8, 4);   /* 4 rows x 32 bf16: 4 lines a step */
        __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + i);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w0 + i), xv);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w1 + i), xv);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w2 + i), xv);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w3 + i), xv);
      }
      store_any(y, 1, j0, _mm512_reduce_add_ps(a0));
      store_any(y, 1, j0 + 1, _mm512_reduce_add_ps(a1));
      store_any(y, 1, j0 + 2, _mm512_reduce_add_ps(a2));
      store_any(y, 1, j0 + 3, _mm512_reduce_add_ps(a3));
    }
  }
#endif
  if (k % 16 == 0) {   /* four rows at a time, widened to float32 (float32 weights; bf16 ones without AVX512-BF16) */
    for (; j0 + 4 <= j1; j0 += 4) {
      v16 a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
      if (wb) {
        const uint16_t *w0 = (const uint16_t *)w + (size_t)j0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        for (int i = 0; i < k; i += 16) {
          if (i % 32 == 0) PREFETCH_STREAM(w0, (size_t)i * 8, 4);
          v16 xv = vload(xf + i);
          a0 = vfmav(vload_bf16(w0 + i), xv, a0); a1 = vfmav(vload_bf16(w1 + i), xv, a1);
          a2 = vfmav(vload_bf16(w2 + i), xv, a2); a3 = vfmav(vload_bf16(w3 + i), xv, a3);
        }
      } else {
        const float *w0 = (const float *)w + (size_t)j0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        for (int i = 0; i < k; i += 16) {
          PREFETCH_STREAM(w0, (size_t)i * 16, 4);   /* 4 rows x 16 floats */
          v16 xv = vload(xf + i);
          a0 = vfmav(vload(w0 + i), xv, a0); a1 = vfmav(vload(w1 + i), xv, a1);
          a2 = vfmav(vload(w2 + i), xv, a2); a3 = vfmav(vload(w3 + i), xv, a3);
        }
      }
      store_any(y, bf16, j0, vsum(a0)); store_any(y, bf16, j0 + 1, vsum(a1));
      store_any(y, bf16, j0 + 2, vsum(a2)); store_any(y, bf16, j0 + 3, vsum(a3));
    }
  }
  for (int j = j0; j < j1; j++) {
    float out;
#if defined(BF16_DOT)
    if (wb && bf16) {
      const uint16_t *wr = (const uint16_t *)w + (size_t)j * k, *xb = x;
      __m512 a = _mm512_setzero_ps(), b = a;
      int i = 0;
      for (; i + 64 <= k; i += 64) {
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(wr + i), (__m512bh)_mm512_loadu_si512(xb + i));
        b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(wr + i + 32), (__m512bh)_mm512_loadu_si512(xb + i + 32));
      }
      for (; i < k; i += 32) {
        __mmask32 m = (k - i) >= 32 ? 0xffffffffu : ((1u << (k - i)) - 1);
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(m, wr + i), (__m512bh)_mm512_maskz_loadu_epi16(m, xb + i));
      }
      out = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    } else
#endif
    {
      v16 a = vzero(), b = a;
      int i = 0;
      if (wb) {
        const uint16_t *wr = (const uint16_t *)w + (size_t)j * k;
        for (; i + 32 <= k; i += 32) {
          a = vfmav(vload_bf16(wr + i), vload(xf + i), a);
          b = vfmav(vload_bf16(wr + i + 16), vload(xf + i + 16), b);
        }
        out = vsum(a) + vsum(b);
        for (; i < k; i++) out += bf16_to_f32(wr[i]) * xf[i];
      } else {
        const float *wr = (const float *)w + (size_t)j * k;
        for (; i + 32 <= k; i += 32) {
          a = vfmav(vload(wr + i), vload(xf + i), a);
          b = vfmav(vload(wr + i + 16), vload(xf + i + 16), b);
        }
        out = vsum(a) + vsum(b);
        for (; i < k; i++) out += wr[i] * xf[i];
      }
    }
    store_any(y, bf16, j, out);
  }
}

/* dense_gemv: y [n] = w [n, k] x [k]; `dtypes` 0: all float32, 1: all bf16, 2: the weight bf16, x and y float32 (a
 * float32 model's table held in bf16: lrq.packed.quantize_head(model, "bf16"); the weight widened exactly, the sums
 * those of a float32 weight of the same values) */
int lrq_dense_gemv(const void *w, const void *x, void *y, int dtypes, int n, int k, int nthreads) {
  if (n < 1 || k < 1 || dtypes < 0 || dtypes > 2) return 1;
  int bf16 = dtypes == 1, wb = dtypes != 0;
  float *xf = scratch_get(sizeof(float) * (size_t)k);
  if (!xf) return 2;
  for (int i = 0; i < k; i++) xf[i] = load_any(x, bf16, i);
  int chunk = 16, units = (n + chunk - 1) / chunk;
  #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (size_t)n * k >= PARALLEL_FROM)
  for (int u = 0; u < units; u++)
    dense_rows(w, x, xf, y, wb, bf16, u * chunk, u * chunk + chunk < n ? u * chunk + chunk : n, k);
  return 0;
}

/* int8w_gemv: the decode step of an 8-bit weight-only layer held per channel (lrq.cpu_kernels.Int8Weights: an
 * int8 output head, w8a16): per token
 *     y[j] = scale[j] * sum_k w[j, k] x[k] + zero_term[j] * sum_k x[k]
 * with w = q - offset (int8 [n, w_stride], the columns from k on zero; w_stride a multiple of 16 at least k), x in the
 * model's dtype (rows x_stride apart), the levels widened to float32 and multiplied with x in float32 vectors of 16
 * inputs, summed in float32 and rounded once to the model's dtype (y [m, n] contiguous). Four rows at a time, the
 * block's stream fetched ahead (PREFETCH_STREAM); rows split over threads. */
#if defined(__AVX512F__)
static inline v16 vload_i8(const int8_t *p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline v16 vload_i8(const int8_t *p) {
  v16 r = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))))};
  return r;
}
#else
static inline v16 vload_i8(const int8_t *p) { v16 r; for (int i = 0; i < 16; i++) r.f[i] = p[i]; return r; }
#endif

static void int8w_rows(const int8_t *w, long ws, const float *scale, const float *zero_term, const float *xf,
                       float xsum, void *y, int bf16, int j0, int j1, int kp) {
  for (; j0 + 4 <= j1; j0 += 4) {
    const int8_t *w0 = w + (size_t)j0 * ws, *w1 = w0 + ws, *w2 = w1 + ws, *w3 = w2 + ws;
    v16 a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < kp; i += 16) {
      if (i % 64 == 0) PREFETCH_STREAM(w0, (size_t)i * 4, 4);   /* 4 rows x 64 levels */
      v16 xv = vload(xf + i);
      a0 = vfmav(vload_i8(w0 + i), xv, a0); a1 = vfmav(vload_i8(w1 + i), xv, a1);
      a2 = vfmav(vload_i8(w2 + i), xv, a2); a3 = vfmav(vload_i8(w3 + i), xv, a3);
    }
    store_any(y, bf16, j0, vsum(a0) * scale[j0] + zero_term[j0] * xsum);
    store_any(y, bf16, j0 + 1, vsum(a1) * scale[j0 + 1] + zero_term[j0 + 1] * xsum);
    store_any(y, bf16, j0 + 2, vsum(a2) * scale[j0 + 2] + zero_term[j0 + 2] * xsum);
    store_any(y, bf16, j0 + 3, vsum(a3) * scale[j0 + 3] + zero_term[j0 + 3] * xsum);
  }
  for (; j0 < j1; j0++) {
    const int8_t *wr = w + (size_t)j0 * ws;
    v16 a = vzero();
    for (int i = 0; i < kp; i += 16) a = vfmav(vload_i8(wr + i), vload(xf + i), a);
    store_any(y, bf16, j0, vsum(a) * scale[j0] + zero_term[j0] * xsum);
  }
}

#if defined(I16_DOT)
/* int8w_rows for bf16 activations where the CPU has AVX512-VNNI: the activations as block64_i16's 16-bit integers per
 * chunk of I16_CHUNK inputs (i16_chunks; a bf16 value held exactly unless it is more than 2^7 below its chunk's
 * largest), the levels widened to 16 bits (32 a load) and vpdpwssd's pairs summed into int32 lanes, exact (|x| < 2^15,
 * |w| <= 128: a chunk's sums below 2^31), then float32 per chunk. Two instructions per 32 levels where the float32
 * kernel takes six per 16 (widen, convert, multiply-add): that one runs a 1536 x 576 weight in L2 at about 21 GB/s on
 * an AMD Zen 4, below what the core streams from memory, so an int8 head read at 16-20 GB/s */
static void int8w_rows_i16(const int8_t *w, long ws, const float *scale, const float *zero_term, const int16_t *xi,
                           const float *xinv, float xsum, void *y, int bf16, int j0, int j1, int kp) {
  for (int r4; j0 < j1; j0 += r4 ? 4 : 1) {   /* four rows at a time, the last few one at a time */
    r4 = j1 - j0 >= 4;
    const long step = r4 ? ws : 0;   /* one row: the other three pointers alias it, unread */
    const int8_t *w0 = w + (size_t)j0 * ws, *w1 = w0 + step, *w2 = w1 + step, *w3 = w2 + step;
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    for (int c0 = 0, ci = 0; c0 < kp; c0 += I16_CHUNK, ci++) {
      const int ce = c0 + I16_CHUNK < kp ? c0 + I16_CHUNK : kp;
      __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
      int i = c0;
      for (; i + 32 <= ce; i += 32) {
        if (i % 64 == 0) PREFETCH_STREAM(w0, (size_t)i * 4, 4);   /* 4 rows x 64 levels */
        const __m512i xv = _mm512_loadu_si512(xi + i);
        DPWSSD_IN_PLACE(a0, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w0 + i))), xv);
        if (r4) {
          DPWSSD_IN_PLACE(a1, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w1 + i))), xv);
          DPWSSD_IN_PLACE(a2, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w2 + i))), xv);
          DPWSSD_IN_PLACE(a3, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w3 + i))), xv);
        }
      }
      if (i < ce) {   /* 16 left (kp is a multiple of 16) */
        const __m512i xv = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(xi + i)));
#define TAIL16(a, wr) \
  DPWSSD_IN_PLACE(a, _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((wr) + i)))), xv)
        TAIL16(a0, w0);
        if (r4) { TAIL16(a1, w1); TAIL16(a2, w2); TAIL16(a3, w3); }
#undef TAIL16
      }
      const __m512 inv = _mm512_set1_ps(xinv[ci]);
      f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), inv, f0);
      if (r4) {
        f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), inv, f1);
        f2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2), inv, f2);
        f3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a3), inv, f3);
      }
    }
    store_any(y, bf16, j0, _mm512_reduce_add_ps(f0) * scale[j0] + zero_term[j0] * xsum);
    if (r4) {
      store_any(y, bf16, j0 + 1, _mm512_reduce_add_ps(f1) * scale[j0 + 1] + zero_term[j0 + 1] * xsum);
      store_any(y, bf16, j0 + 2, _mm512_reduce_add_ps(f2) * scale[j0 + 2] + zero_term[j0 + 2] * xsum);
      store_any(y, bf16, j0 + 3, _mm512_reduce_add_ps(f3) * scale[j0 + 3] + zero_term[j0 + 3] * xsum);
    }
  }
}
#endif

int lrq_int8w_gemv(const int8_t *w, long w_stride, const float *scale, const float *zero_term, const void *x,
                   int bf16, long x_stride, void *y, int m, int n, int k, int nthreads) {
  int kp = (k + 15) / 16 * 16;
  if (m < 1 || n < 1 || k < 1 || w_stride < kp || w_stride % 16) return 1;
  int nc = (kp + I16_CHUNK - 1) / I16_CHUNK;
  float *xf = scratch_get(sizeof(float) * ((size_t)kp + nc) + sizeof(int16_t) * (size_t)kp);
  if (!xf) return 2;
  float *xinv = xf + kp;
  int16_t *xi = (int16_t *)(xinv + nc);
  (void)xi;
  for (int t = 0; t < m; t++) {
    float xsum = 0;
    for (int i = 0; i < k; i++) xsum += xf[i] = load_any(x, bf16, (size_t)t * x_stride + i);
    for (int i = k; i < kp; i++) xf[i] = 0;
    void *yt = (char *)y + (size_t)t * n * (bf16 ? 2 : 4);
    int chunk = 16, units = (n + chunk - 1) / chunk, i16 = 0;
    (void)i16;
#if defined(I16_DOT)
    i16 = bf16 && i16_chunks(xf, kp, kp, xi, xinv);   /* 0 where an activation is not finite: the float32 kernel */
#endif
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (size_t)n * k >= PARALLEL_FROM)
    for (int u = 0; u < units; u++) {
      int j0 = u * chunk, j1 = u * chunk + chunk < n ? u * chunk + chunk : n;
#if defined(I16_DOT)
      if (i16) {
        int8w_rows_i16(w, w_stride, scale, zero_term, xi, xinv, xsum, yt, bf16, j0, j1, kp);
        continue;
      }
#endif
      int8w_rows(w, w_stride, scale, zero_term, xf, xsum, yt, bf16, j0, j1, kp);
    }
  }
  return 0;
}

/* int8w_unpack: an 8-bit weight-only layer's weight (int8w_gemv's levels w [n, w_stride], scale, zero_term) as the
 * dense operand of a prefill call, (q - offset) * s + zero_term in float32 (a multiplication, then an addition: the
 * values lrq.cpu_kernels.Int8Weights.dequantized makes with torch's ops), rounded once to bf16 where asked:
 *   form 0: float32 [n, k]; form 1: bf16 [n, k]; form 2: bf16 in oneDNN's blocked order [n / 32][k / 2][32][2] (what
 *   OneDNNOperand's "bf16" kind lays out: n a multiple of 32, k even), each pair of a feature's values one 32-bit
 *   unit, 32 features' units a 128-byte row, written through 16 x 16 transposes of those units. */
static inline void int8w_row(const int8_t *wr, float s, float z, int k, float *out) {
  int i = 0;
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
  for (; i + 16 <= k; i += 16)
    _mm512_storeu_ps(out + i, _mm512_add_ps(_mm512_mul_ps(vload_i8(wr + i), vs), vz));
#endif
  for (; i < k; i++) out[i] = (float)wr[i] * s + z;
}
static inline void row_to_bf16(const float *row, int k, uint16_t *o) {   /* rounded to nearest even */
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= k; i += 16) _mm256_storeu_si256((__m256i *)(o + i), bf16_round16(_mm512_loadu_ps(row + i)));
#endif
  for (; i < k; i++) o[i] = f32_to_bf16(row[i]);
}
#if defined(__AVX512F__)
static inline void transpose16_epi32(__m512i r[16]) {   /* r[i] lane j <- r[j] lane i */
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]); r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]); r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88); t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88); t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88); r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88); r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}
#endif

/* 32 features j0.. of int8w_unpack's forms 2 and 3: their [k / 2][32] units (a feature's values 2i, 2i + 1 in unit
 * i's low and high halves), each pair of rows `pitch` units after the last (32; 64 in form 3's blocks of 64), 32
 * values of k of 16 features dequantized, rounded and transposed at a time */
static void int8w_block32(const int8_t *w, long w_stride, const float *scale, const float *zero_term, int j0, int k,
                          uint32_t *dst, size_t pitch) {
  int kh = k / 2, i0 = 0;
#if defined(__AVX512F__)
  for (; i0 + 16 <= kh; i0 += 16)
    for (int f0 = 0; f0 < 32; f0 += 16) {
      __m512i r[16];
      for (int f = 0; f < 16; f++) {
        int j = j0 + f0 + f;
        const int8_t *wr = w + (size_t)j * w_stride + 2 * i0;
        const __m512 vs = _mm512_set1_ps(scale[j]), vz = _mm512_set1_ps(zero_term[j]);
        __m512 lo = _mm512_add_ps(_mm512_mul_ps(vload_i8(wr), vs), vz);
        __m512 hi = _mm512_add_ps(_mm512_mul_ps(vload_i8(wr + 16), vs), vz);
#if defined(__AVX512BF16__)   /* one instruction for both where neither holds a denormal (bf16_round16_fast's rule) */
        if (!(_mm512_fpclass_ps_mask(lo, 0x30) | _mm512_fpclass_ps_mask(hi, 0x30))) {
          r[f] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
          continue;
        }
#endif
        r[f] = _mm512_inserti64x4(_mm512_castsi256_si512(bf16_round16(lo)), bf16_round16(hi), 1);
      }
      transpose16_epi32(r);
      for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + (size_t)(i0 + i) * pitch + f0, r[i]);
    }
#endif
  for (int f = 0; f < 32; f++) {
    const int8_t *wr = w + (size_t)(j0 + f) * w_stride;
    float sc = scale[j0 + f], z = zero_term[j0 + f];
    for (int i = i0; i < kh; i++)
      dst[(size_t)i * pitch + f] = f32_to_bf16((float)wr[2 * i] * sc + z) |
                                   (uint32_t)f32_to_bf16((float)wr[2 * i + 1] * sc + z) << 16;
  }
}

int lrq_int8w_unpack(const int8_t *w, long w_stride, const float *scale, const float *zero_term, int n, int k,
                     void *out, int form, int nthreads) {
  if (n < 1 || k < 1 || w_stride < k || form < 0 || form > 3 || (form >= 2 && (n % (form == 3 ? 64 : 32) || k % 2)))
    return 1;
  if (form >= 2) {   /* oneDNN's blocks of W = 32 (form 2) or 64 (form 3) features: [n / W][k / 2][W] units */
    size_t W = form == 3 ? 64 : 32;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && n > 32 && (size_t)n * k >= PARALLEL_FROM)
    for (int b = 0; b < n / 32; b++)
      int8w_block32(w, w_stride, scale, zero_term, b * 32, k,
                    (uint32_t *)out + (size_t)(b * 32 / W) * W * (k / 2) + (size_t)(b * 32) % W, W);
    return 0;
  }
  int failed = 0;
  #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && (size_t)n * k >= PARALLEL_FROM)
  {
    float *row = form ? malloc(sizeof(float) * (size_t)k) : NULL;
    if (form && !row) {
      #pragma omp atomic write
      failed = 1;
    }
    #pragma omp for schedule(static)
    for (int j = 0; j < n; j++) {
      if (form && !row) continue;
      float *dst = form ? row : (float *)out + (size_t)j * k;
      int8w_row(w + (size_t)j * w_stride, scale[j], zero_term[j], k, dst);
      if (form) row_to_bf16(row, k, (uint16_t *)out + (size_t)j * k);
    }
    free(row);
  }
  return failed ? 2 : 0;
}

typedef struct {
  int32_t kind;        /* 1: 4-bit (an int4_layer, k == k_pad), 2: dense (weight [n, k] in the model's dtype),
                        * 3: W8A8 on a static grid (int8 weight levels [n, k], lrq_w8a8_gemv's arguments below),
                        * 4: 8-bit weight-only per channel (int8w_gemv: levels [n, k rounded up to 16] in w, scale and
                        *    zero_term [n]) */
  int32_t act_bits;    /* 0, or the bits of its input's per-token fake quantization (W4A8: 8) */
  int32_t n, k;
  const int4_layer *q4;
  const void *w;
  const void *bias;    /* NULL, or [n] in the model's dtype */
  const int32_t *wsum;
  const float *col_term, *zero_term, *scale;
  int32_t asymmetric;
  float a_scale, a_zero, a_hi;
} lrq_linear;

typedef struct {
  lrq_linear q, k, v, o, gate, up, down;
  const void *in_norm, *post_norm, *q_norm, *k_norm;   /* [hidden], [hidden], [hd] or NULL (Qwen3's per-head norms) */
  float eps, q_eps, k_eps, scale, act_eps;
  void *kc, *vc;                                      /* this layer's caches [kv_heads, max_len, hd] */
  long kv_stride;
  const void *cos, *sin;                              /* [max_len, hd]: cos and sin' (rotate_half's sign) */
  int32_t hidden, heads, kv_heads, hd, inter, bf16, max_len;
} lrq_decoder_layer;

static __thread void *layer_scratch;
static __thread size_t layer_scratch_size;

static int linear_apply(const lrq_linear *L, const void *x, void *y, int bf16, float act_eps, void *tmp,
                        int nthreads) {
  int rc;
  if (L->act_bits) {
    lrq_per_token_dequant(x, tmp, bf16, 1, L->k, L->act_bits, act_eps);
    x = tmp;
  }
  if (L->kind == 1) {
    if (L->q4->k != L->k || L->q4->k_pad != L->k || L->q4->n != L->n) return 1;
    rc = lrq_int4_gemv(L->q4, x, bf16, L->k, y, 1, nthreads);
  } else if (L->kind == 2) {
    rc = lrq_dense_gemv(L->w, x, y, bf16, L->n, L->k, nthreads);
  } else if (L->kind == 4) {   /* rounded once to the model's dtype, as the module's own call */
    rc = lrq_int8w_gemv(L->w, (L->k + 15) / 16 * 16, L->scale, L->zero_term, x, bf16, L->k, y, 1, L->n, L->k, nthreads);
  } else if (L->kind == 3) {   /* float32 sums rounded once to the model's dtype (the module's .to) */
    rc = w8a8_rows(L->w, L->wsum, x, bf16, L->k, L->a_scale, L->a_zero, L->a_hi, L->col_term, L->zero_term,
                   L->asymmetric, L->scale, y, bf16, 1, L->n, L->k, nthreads);
  } else {
    return 1;
  }
  if (rc) return rc;
  if (L->bias)
    for (int j = 0; j < L->n; j++) store_any(y, bf16, j, load_any(y, bf16, j) + load_any(L->bias, bf16, j));
  return 0;
}

/* x [hidden] (the model's dtype) is the layer's input and becomes its output; pos: the token's position (the
 * cache holds pos earlier ones). Returns 0, 1 for arguments it does not take, 2 when memory runs out. */
int lrq_decoder_layer_step(const lrq_decoder_layer *L, void *x, int pos, int nthreads) {
  int bf16 = L->bf16, H = L->hidden, hd = L->hd, qn = L->heads * hd, kvn = L->kv_heads * hd, I = L->inter;
  if (pos < 0 || pos >= L->max_len || L->q.n != qn || L->k.n != kvn || L->v.n != kvn || L->o.n != H ||
      L->gate.n != I || L->up.n != I || L->down.n != H || L->q.k != H || L->o.k != qn || L->down.k != I)
    return 1;
  size_t widest = (size_t)(I > H ? I : H) > (size_t)qn ? (size_t)(I > H ? I : H) : (size_t)qn;
  size_t elem = bf16 ? 2 : 4, need = elem * ((size_t)H * 2 + (size_t)qn * 2 + (size_t)kvn * 2 + (size_t)I * 3) +
                                     sizeof(float) * widest + 64;
  if (need > layer_scratch_size) {
    void *p = realloc(layer_scratch, need);
    if (!p) return 2;
    layer_scratch = p;
    layer_scratch_size = need;
  }
  char *b = layer_scratch;
  void *h = b; b += elem * H;
  void *q = b; b += elem * qn;
  void *k = b; b += elem * kvn;
  void *v = b; b += elem * kvn;
  void *att = b; b += elem * qn;
  void *o = b; b += elem * H;
  void *g = b; b += elem * I;
  void *u = b; b += elem * I;
  void *a = b; b += elem * I;
  void *tmp = b;   /* a linear's quantized input or float32 output: up to max(I, H, qn) float32 values */
  int rc;
  lrq_rms_norm_rows(x, NULL, L->in_norm, h, bf16, 1, H, L->eps, 1);
  if ((rc = linear_apply(&L->q, h, q, bf16, L->act_eps, tmp, nthreads)) ||
      (rc = linear_apply(&L->k, h, k, bf16, L->act_eps, tmp, nthreads)) ||
      (rc = linear_apply(&L->v, h, v, bf16, L->act_eps, tmp, nthreads)))
    return rc;
  if (L->q_norm) lrq_rms_norm_rows(q, NULL, L->q_norm, q, bf16, L->heads, hd, L->q_eps, 1);
  if (L->k_norm) lrq_rms_norm_rows(k, NULL, L->k_norm, k, bf16, L->kv_heads, hd, L->k_eps, 1);
  const char *cos = (const char *)L->cos + elem * (size_t)pos * hd, *sin = (const char *)L->sin + elem * (size_t)pos * hd;
  if ((rc = lrq_rope_cache(q, k, v, cos, sin, L->kc, L->vc, L->kv_stride, pos, L->heads, L->kv_heads, hd, bf16)) ||
      (rc = lrq_attend(q, hd, L->kc, L->vc, L->kv_stride, att, bf16, pos + 1, L->heads, L->kv_heads, hd, L->scale)) ||
      (rc = linear_apply(&L->o, att, o, bf16, L->act_eps, tmp, nthreads)))
    return rc;
  lrq_rms_norm_rows(x, o, L->post_norm, h, bf16, 1, H, L->eps, 1);   /* x += o, then its norm */
  if ((rc = linear_apply(&L->gate, h, g, bf16, L->act_eps, tmp, nthreads)) ||
      (rc = linear_apply(&L->up, h, u, bf16, L->act_eps, tmp, nthreads)))
    return rc;
  lrq_silu_mul(g, u, a, bf16, I, 1);   /* act_fn(gate) rounded, then its product with up rounded */
  if ((rc = linear_apply(&L->down, a, o, bf16, L->act_eps, tmp, nthreads))) return rc;
  lrq_rms_norm_rows(x, o, NULL, NULL, bf16, 1, H, 0.0f, 1);   /* x += o */
  return 0;
}

/* lrq_decoder_layer_step for layers[0..count) in turn (a one-token step's whole stack, one call instead of one a
 * layer from Python: about 5 us a layer of the interpreter and ctypes). Returns the first non-zero code. */
int lrq_decoder_layers_step(const lrq_decoder_layer *const *layers, int count, void *x, int pos, int nthreads) {
  for (int i = 0; i < count; i++) {
    int rc = lrq_decoder_layer_step(layers[i], x, pos, nthreads);
    if (rc) return rc;
  }
  return 0;
}
