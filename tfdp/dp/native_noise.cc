// TfdpNormalHalves: the Box-Muller draw of tfdp/dp/noise.py, as one CPU op;
// TfdpNoisyDivided: the same draws added to a tensor and divided, in one pass.
//
// It reads the same Philox-4x32-10 words as TensorFlow's
// `stateless_uniform([3, padded], seed, dtype=uint32)` (key and counter from
// `StatelessRandomGetKeyCounter`), and maps pair k's three words
// (hi = row 0, lo = row 1, angle = row 2) to r sin(theta) and r cos(theta)
// exactly as `noise.box_muller` defines them:
//   u1 = (hi + (lo + 1/2) 2^-32) 2^-32, r = sigma sqrt(-2 ln u1),
//   theta = 2 pi (angle + 1/2) 2^-32.
// What differs is only how the float32 values are computed: eight lanes at a
// time, ln u1 from its exponent (an integer) plus a polynomial in the
// mantissa, and sin and cos from the angle's octant (its top three bits)
// plus a polynomial on (0, pi/4). Against a float64 evaluation of the same
// words, over 16.8 M normals, the values were within 1.8e-5 sigma and
// TensorFlow's own ops within 1.2e-3 sigma (their ln x - 32 ln 2 cancels near
// u1 = 1); tests/dp/test_native_noise.py checks 3e-5 and 3e-3.
//
// Built and loaded by tfdp/dp/native_noise.py; nothing else includes it.

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tfdp {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

typedef uint64_t V8U __attribute__((vector_size(64)));
typedef uint32_t V8W __attribute__((vector_size(32)));
typedef int32_t V8S __attribute__((vector_size(32)));
typedef float V8F __attribute__((vector_size(32)));

#if defined(__clang__)
#define TFDP_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define TFDP_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (V8S){__VA_ARGS__})
#endif

constexpr int kLanes = 8;
// Pairs per group: kLanes Philox blocks of four words, per row.
constexpr int64_t kPairsPerGroup = 4 * kLanes;

inline V8F Select(V8S mask, V8F if_true, V8F if_false) {
  V8S a, b, r;
  std::memcpy(&a, &if_true, sizeof a);
  std::memcpy(&b, &if_false, sizeof b);
  r = (a & mask) | (b & ~mask);
  V8F out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

inline V8F Splat(float x) { return V8F{} + x; }

inline V8U MulLow32(V8U x, uint64_t m) {
#if defined(__AVX512F__)
  return (V8U)_mm512_mul_epu32((__m512i)x, _mm512_set1_epi64((long long)m));
#elif defined(__AVX2__)
  // A 64-bit lane product is three multiplies in AVX2; this is one.
  __m256i halves[2];
  std::memcpy(halves, &x, sizeof x);
  const __m256i factor = _mm256_set1_epi64x((long long)m);
  halves[0] = _mm256_mul_epu32(halves[0], factor);
  halves[1] = _mm256_mul_epu32(halves[1], factor);
  V8U out;
  std::memcpy(&out, halves, sizeof out);
  return out;
#else
  return x * m;  // Lanes hold 32-bit values: the product fits.
#endif
}

// Philox-4x32-10 blocks at counter + first ... counter + first + 7, as TF's
// PhiloxRandom computes them: lane j of words[e] is word e of block first + j.
inline void Philox8(uint32_t k0, uint32_t k1, uint64_t counter_lo, uint64_t counter_hi,
                    uint64_t first, V8W words[4]) {
  // The 128-bit counters counter + first + j, j = 0..7, as 32-bit words.
  const V8U lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const V8U lo = counter_lo + first + lane;
  const V8U carry = (V8U)(lo < counter_lo);  // All ones where the low half wrapped.
  const V8U hi = counter_hi - carry;
  V8U x0 = lo & 0xffffffffu, x1 = lo >> 32, x2 = hi & 0xffffffffu, x3 = hi >> 32;
  uint32_t a = k0, b = k1;
  for (int round = 0; round < 10; round++) {
    const V8U p0 = MulLow32(x0, 0xD2511F53u);
    const V8U p1 = MulLow32(x2, 0xCD9E8D57u);
    const V8U n0 = (p1 >> 32) ^ x1 ^ static_cast<uint64_t>(a);
    const V8U n2 = (p0 >> 32) ^ x3 ^ static_cast<uint64_t>(b);
    x1 = p1 & 0xffffffffu;
    x3 = p0 & 0xffffffffu;
    x0 = n0;
    x2 = n2;
    a += 0x9E3779B9u;
    b += 0xBB67AE85u;
  }
  words[0] = __builtin_convertvector(x0, V8W);
  words[1] = __builtin_convertvector(x1, V8W);
  words[2] = __builtin_convertvector(x2, V8W);
  words[3] = __builtin_convertvector(x3, V8W);
}

// ln u1 <= 0. x = hi + (lo + 1/2) 2^-32 is formed in float32 as in
// noise.box_muller; then ln u1 = (exponent of x - 32) ln 2 + ln(mantissa),
// which keeps full precision both in the tail (x small) and near u1 = 1,
// where ln x - 32 ln 2 would cancel.
inline V8F LogU1(V8W hi, V8W lo) {
  const V8F x = __builtin_convertvector(hi, V8F) +
                (__builtin_convertvector(lo, V8F) + 0.5f) * 2.3283064365386963e-10f;
  V8W bits;
  std::memcpy(&bits, &x, sizeof bits);
  V8S exponent = (V8S)(bits >> 23) - (127 + 32);
  const V8W mantissa_bits = (bits & 0x007fffffu) | 0x3f800000u;
  V8F m;
  std::memcpy(&m, &mantissa_bits, sizeof m);
  // Mantissa in [sqrt(1/2), sqrt(2)): the polynomial's range (Cephes logf).
  const V8S high = m > 1.41421356f;  // -1 where true.
  m = Select(high, m * 0.5f, m);
  exponent = exponent - high;
  const V8F f = m - 1.0f;
  const V8F z = f * f;
  V8F p = Splat(7.0376836292e-2f);
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  const V8F e = __builtin_convertvector(exponent, V8F);
  // ln 2 = 0.693359375 - 2.12194440e-4, the first part exact in float32.
  const V8F log_u1 = f + (p * f * z + e * -2.12194440e-4f - 0.5f * z) + e * 0.693359375f;
  return Select(log_u1 > 0.0f, V8F{}, log_u1);
}

// sin and cos of 2 pi (w + 1/2) 2^-32. The top three bits are the octant;
// the rest, counted from the octant's start (even octants) or end (odd
// ones), is t in (0, pi/4), where Cephes' sinf and cosf polynomials hold.
inline void SinCosOfWord(V8W w, V8F* sin_out, V8F* cos_out) {
  const V8W octant = w >> 29;
  const V8S odd = (V8S)(octant & 1u) != 0;
  V8F r = __builtin_convertvector(w & 0x1fffffffu, V8F) + 0.5f;
  r = Select(odd, 536870912.0f - r, r);
  const V8F t = r * (0.78539816339744831f / 536870912.0f);
  const V8F z = t * t;
  const V8F s = ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * t + t;
  const V8F c =
      ((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z + 4.166664568298827e-2f) * z * z -
      0.5f * z + 1.0f;
  // theta = octant pi/4 + t (even) or (octant + 1) pi/4 - t (odd): octants
  // 1, 2, 5 and 6 swap sin and cos; sin < 0 in 4-7 and cos < 0 in 2-5.
  const V8S swap = (V8S)(((octant + 1u) >> 1) & 1u) != 0;
  const V8F sin_t = Select(swap, c, s);
  const V8F cos_t = Select(swap, s, c);
  const V8S sin_negative = (V8S)(octant >> 2) != 0;
  const V8S cos_negative = (V8S)((octant - 2u) < 4u);
  *sin_out = Select(sin_negative, -sin_t, sin_t);
  *cos_out = Select(cos_negative, -cos_t, cos_t);
}

// out[4 j + e] = words[e][j].
inline void Interleave4(const V8F words[4], float out[kPairsPerGroup]) {
  // [w0_0 w1_0 w0_1 w1_1 w0_2 w1_2 w0_3 w1_3], and the same for lanes 4-7.
  const V8F a_lo = TFDP_SHUFFLE(words[0], words[1], 0, 8, 1, 9, 2, 10, 3, 11);
  const V8F a_hi = TFDP_SHUFFLE(words[0], words[1], 4, 12, 5, 13, 6, 14, 7, 15);
  const V8F b_lo = TFDP_SHUFFLE(words[2], words[3], 0, 8, 1, 9, 2, 10, 3, 11);
  const V8F b_hi = TFDP_SHUFFLE(words[2], words[3], 4, 12, 5, 13, 6, 14, 7, 15);
  const V8F o0 = TFDP_SHUFFLE(a_lo, b_lo, 0, 1, 8, 9, 2, 3, 10, 11);
  const V8F o1 = TFDP_SHUFFLE(a_lo, b_lo, 4, 5, 12, 13, 6, 7, 14, 15);
  const V8F o2 = TFDP_SHUFFLE(a_hi, b_hi, 0, 1, 8, 9, 2, 3, 10, 11);
  const V8F o3 = TFDP_SHUFFLE(a_hi, b_hi, 4, 5, 12, 13, 6, 7, 14, 15);
  std::memcpy(out, &o0, sizeof o0);
  std::memcpy(out + 8, &o1, sizeof o1);
  std::memcpy(out + 16, &o2, sizeof o2);
  std::memcpy(out + 24, &o3, sizeof o3);
}

// The Box-Muller pairs first_pair ... first_pair + 31 of a draw whose rows
// are blocks_per_row Philox blocks long; pair i of the group is
// (sin_values[i], cos_values[i]).
inline void PairGroup(uint64_t k, uint64_t counter_lo, uint64_t counter_hi,
                      uint64_t blocks_per_row, uint64_t first_pair, float scale,
                      float sin_values[kPairsPerGroup], float cos_values[kPairsPerGroup]) {
  V8W hi[4], lo[4], angle[4];
  const uint32_t k0 = static_cast<uint32_t>(k), k1 = static_cast<uint32_t>(k >> 32);
  const uint64_t first = first_pair / 4;
  V8F sin_words[4], cos_words[4];
  Philox8(k0, k1, counter_lo, counter_hi, first, hi);
  Philox8(k0, k1, counter_lo, counter_hi, blocks_per_row + first, lo);
  Philox8(k0, k1, counter_lo, counter_hi, 2 * blocks_per_row + first, angle);
  for (int e = 0; e < 4; e++) {
    const V8F radius_sq = LogU1(hi[e], lo[e]) * scale;
    V8F radius;
    for (int j = 0; j < kLanes; j++) radius[j] = __builtin_sqrtf(radius_sq[j]);
    V8F s, c;
    SinCosOfWord(angle[e], &s, &c);
    s *= radius;
    c *= radius;
    sin_words[e] = s;
    cos_words[e] = c;
  }
  // Lane j of word e is pair 4 j + e of the group: a 4 x 8 transpose.
  Interleave4(sin_words, sin_values);
  Interleave4(cos_words, cos_values);
}

inline int64_t Groups(int64_t pairs) { return (pairs + kPairsPerGroup - 1) / kPairsPerGroup; }

// About 60 ns of one core per pair, for the work sharder.
constexpr int64_t kCostPerGroup = kPairsPerGroup * 60;

class NormalHalvesOp : public OpKernel {
 public:
  explicit NormalHalvesOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("pairs", &pairs_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& key = ctx->input(0);
    const Tensor& counter = ctx->input(1);
    const Tensor& stddev = ctx->input(2);
    OP_REQUIRES(ctx, key.NumElements() == 1 && counter.NumElements() == 2 &&
                         stddev.NumElements() == 1,
                tensorflow::errors::InvalidArgument(
                    "TfdpNormalHalves needs a Philox key [1], counter [2] and a scalar stddev."));
    const uint64_t k = key.flat<uint64_t>()(0);
    const uint64_t counter_lo = counter.flat<uint64_t>()(0);
    const uint64_t counter_hi = counter.flat<uint64_t>()(1);
    const float scale = -2.0f * stddev.flat<float>()(0) * stddev.flat<float>()(0);

    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({2, pairs_}), &out));
    float* sin_half = out->flat<float>().data();
    float* cos_half = sin_half + pairs_;
    const int64_t pairs = pairs_;
    const int64_t groups = Groups(pairs);
    // A row of the word draw is a whole number of groups.
    const uint64_t blocks_per_row = static_cast<uint64_t>(groups) * kLanes;

    auto draw = [&](int64_t begin, int64_t end) {
      float sin_values[kPairsPerGroup], cos_values[kPairsPerGroup];
      for (int64_t g = begin; g < end; g++) {
        PairGroup(k, counter_lo, counter_hi, blocks_per_row, g * kPairsPerGroup, scale,
                  sin_values, cos_values);
        const int64_t start = g * kPairsPerGroup;
        const int64_t count = std::min<int64_t>(kPairsPerGroup, pairs - start);
        std::memcpy(sin_half + start, sin_values, count * sizeof(float));
        std::memcpy(cos_half + start, cos_values, count * sizeof(float));
      }
    };
    const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(workers->num_threads, workers->workers, groups, kCostPerGroup, draw);
  }

 private:
  int64_t pairs_;
};

// (grads + noise) / divisor for one tensor, the noise being the values of
// one or more draws that `noise.noisy_divided` would add to it. Piece i of
// the tensor, flat elements [piece_start[i], piece_start[i] + piece_size[i]),
// takes the values [piece_offset[i], piece_offset[i] + piece_size[i]) of draw
// piece_draw[i] (key keys[d], counter counters[d]), whose values are its
// piece_pairs[i] sin values, then its cos values. One pass over the tensor,
// with no noise tensor in between.
class NoisyDividedOp : public OpKernel {
 public:
  explicit NoisyDividedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("piece_draw", &piece_draw_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("piece_pairs", &piece_pairs_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("piece_offset", &piece_offset_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("piece_start", &piece_start_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("piece_size", &piece_size_));
    const size_t n = piece_draw_.size();
    OP_REQUIRES(ctx, piece_pairs_.size() == n && piece_offset_.size() == n &&
                         piece_start_.size() == n && piece_size_.size() == n,
                tensorflow::errors::InvalidArgument("TfdpNoisyDivided: piece lists differ in length."));
    // Work units: the groups of pairs each piece needs, its sin values and
    // its cos values together.
    for (size_t i = 0; i < n; i++) {
      const int64_t pairs = piece_pairs_[i], first = piece_offset_[i];
      const int64_t last = first + piece_size_[i];  // Exclusive.
      OP_REQUIRES(ctx, pairs >= 1 && first >= 0 && last <= 2 * pairs && piece_size_[i] >= 1,
                  tensorflow::errors::InvalidArgument("TfdpNoisyDivided: bad piece ", i));
      int64_t lo_pair = pairs, hi_pair = 0;
      if (first < pairs) {
        lo_pair = std::min(lo_pair, first);
        hi_pair = std::max(hi_pair, std::min(last, pairs));
      }
      if (last > pairs) {
        lo_pair = std::min(lo_pair, std::max(first, pairs) - pairs);
        hi_pair = std::max(hi_pair, last - pairs);
      }
      for (int64_t g = lo_pair / kPairsPerGroup; g * kPairsPerGroup < hi_pair; g++) {
        units_.push_back({static_cast<int64_t>(i), g});
      }
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grads = ctx->input(0);
    const Tensor& keys = ctx->input(1);
    const Tensor& counters = ctx->input(2);
    const float stddev = ctx->input(3).scalar<float>()();
    const float divisor = ctx->input(4).scalar<float>()();
    const int64_t draws = keys.NumElements();
    OP_REQUIRES(ctx, counters.NumElements() == 2 * draws,
                tensorflow::errors::InvalidArgument("TfdpNoisyDivided: counters must be [draws, 2]."));
    for (size_t i = 0; i < piece_draw_.size(); i++) {
      OP_REQUIRES(ctx, piece_draw_[i] >= 0 && piece_draw_[i] < draws &&
                           piece_start_[i] + piece_size_[i] <= grads.NumElements(),
                  tensorflow::errors::InvalidArgument("TfdpNoisyDivided: piece ", i,
                                                      " is outside the draws or the tensor."));
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, grads.shape(), &out));
    const float* g = grads.flat<float>().data();
    float* o = out->flat<float>().data();
    const uint64_t* key = keys.flat<uint64_t>().data();
    const uint64_t* counter = counters.flat<uint64_t>().data();
    const float scale = -2.0f * stddev * stddev;

    auto work = [&](int64_t begin, int64_t end) {
      float sin_values[kPairsPerGroup], cos_values[kPairsPerGroup];
      for (int64_t u = begin; u < end; u++) {
        const int64_t i = units_[u].piece, group = units_[u].group;
        const int64_t d = piece_draw_[i], pairs = piece_pairs_[i];
        const int64_t first = piece_offset_[i], last = first + piece_size_[i];
        const int64_t base = piece_start_[i] - first;  // Element of draw value 0.
        PairGroup(key[d], counter[2 * d], counter[2 * d + 1],
                  static_cast<uint64_t>(Groups(pairs)) * kLanes, group * kPairsPerGroup, scale,
                  sin_values, cos_values);
        const int64_t p0 = group * kPairsPerGroup;
        const int64_t p1 = std::min(p0 + kPairsPerGroup, pairs);
        // Sin values are draw values p; cos values are pairs + p.
        for (int64_t v = std::max(p0, first); v < std::min(p1, last); v++) {
          o[base + v] = (g[base + v] + sin_values[v - p0]) / divisor;
        }
        for (int64_t v = std::max(pairs + p0, first); v < std::min(pairs + p1, last); v++) {
          o[base + v] = (g[base + v] + cos_values[v - pairs - p0]) / divisor;
        }
      }
    };
    const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(workers->num_threads, workers->workers, static_cast<int64_t>(units_.size()),
                      kCostPerGroup, work);
  }

 private:
  struct Unit {
    int64_t piece;
    int64_t group;
  };
  std::vector<int64_t> piece_draw_, piece_pairs_, piece_offset_, piece_start_, piece_size_;
  std::vector<Unit> units_;
};

REGISTER_OP("TfdpNoisyDivided")
    .Input("grads: float")
    .Input("keys: uint64")
    .Input("counters: uint64")
    .Input("stddev: float")
    .Input("divisor: float")
    .Attr("piece_draw: list(int)")
    .Attr("piece_pairs: list(int)")
    .Attr("piece_offset: list(int)")
    .Attr("piece_start: list(int)")
    .Attr("piece_size: list(int)")
    .Output("noisy: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("TfdpNoisyDivided").Device(tensorflow::DEVICE_CPU), NoisyDividedOp);

REGISTER_OP("TfdpNormalHalves")
    .Input("key: uint64")
    .Input("counter: uint64")
    .Input("stddev: float")
    .Attr("pairs: int >= 1")
    .Output("halves: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t pairs;
      TF_RETURN_IF_ERROR(c->GetAttr("pairs", &pairs));
      c->set_output(0, c->MakeShape({2, pairs}));
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("TfdpNormalHalves").Device(tensorflow::DEVICE_CPU), NormalHalvesOp);

}  // namespace
}  // namespace tfdp

// The vector instructions this build uses. The loader uses the op only with
// AVX2 or AVX-512: the generic build was slower than TensorFlow's ops.
extern "C" const char* TfdpNativeNoiseIsa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}
