// The small operators of a Llama layer for the CPU, each fused into one native loop (float32).
//
// Why: on the CPU a one-token decode step of SmolLM2 ran ~1,800 eager torch operators, and their
// dispatch (2 to 5 us each) cost about a third of the step. Four functions replace the norms, the rotary
// embedding with its KV-cache store, SiLU-and-multiply and one-token paged attention, one call each; a
// fifth, `one_token_layer`, chains them with the projections into a whole decoder layer for a single
// token (single-stream decode), so no Python runs between a layer's operators. The pure-torch references
// are `TorchOps` and `TorchAttentionBackend` (models/ops.py, attention.py); tests/test_cpu_ops.py
// compares every function with its reference on random data.
//
// NOTE: built with -ffp-contract=off (and -fno-math-errno -fno-trapping-math, which change no result but
// let the compiler vectorise loops with branches and floor), so `a * b + c * d` rounds each product as
// torch does: the rotary embedding and the KV store are bit-identical to the reference. The norm's and
// attention's sums run in another order than torch's (a few ulps apart).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int kLanes = 8;  // partial sums kept apart so the compiler vectorises the loops (AVX2: 8 floats)

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float total = 0.f;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// e^x in float32 (Cephes' polynomial, within 2 ulp of the correctly rounded result for |x| < 87), written so
// the compiler vectorises the loops that call it: libm's scalar expf made SiLU and the softmax 5x slower.
inline float vector_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);  // x = n ln2 + r, |r| <= ln2 / 2
  const float r = x - n * 0.693359375f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

// (rms_norm(x + residual) * weight, x + residual); without a residual, (rms_norm(x) * weight, x).
// x, residual: [num_tokens, hidden]; weight: [hidden].
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const std::optional<at::Tensor>& residual_in,
                                                const at::Tensor& weight_in, double eps) {
  check_float(x_in, "x");
  auto x = x_in.contiguous();
  auto weight = weight_in.contiguous();
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor total = x;
  if (residual_in.has_value()) {
    auto residual = residual_in->contiguous();
    total = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
    float* tp = total.data_ptr<float>();
    for (int64_t i = 0; i < rows * hidden; ++i) tp[i] = rp[i] + xp[i];  // NOTE: transformers' order
  }
  auto out = at::empty_like(x);
  const float* wp = weight.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* t = total.data_ptr<float>() + r * hidden;
    float* o = out.data_ptr<float>() + r * hidden;
    const float inv = 1.f / std::sqrt(dot(t, t, hidden) / static_cast<float>(hidden) + static_cast<float>(eps));
    for (int64_t i = 0; i < hidden; ++i) o[i] = wp[i] * (t[i] * inv);
  }
  return {out, total};
}

// x * cos + roll(x, half) * sin_signed for one head (the rotate-half convention with sin's sign folded).
inline void rotate(const float* x, const float* cos, const float* sin_signed, float* out, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + x[d + half] * sin_signed[d];
  for (int64_t d = half; d < head_dim; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin_signed[d];
}

// Rotates q and k, stores k and v in their cache slots (a negative slot stores nothing); returns the
// rotated q [num_tokens, num_heads, head_dim]. q, k, v: [num_tokens, heads, head_dim] views whose heads are
// contiguous (the split columns of the fused qkv product); cos, sin_signed: [num_tokens, head_dim];
// caches: [num_blocks, block_size, num_kv_heads, head_dim].
at::Tensor rotary_and_store_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                               at::Tensor v_cache, const at::Tensor& slot_mapping_in, const at::Tensor& cos_in,
                               const at::Tensor& sin_in) {
  for (auto* t : {&q, &k, &v}) {
    check_float(*t, "q, k and v");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "q, k, v: each row's heads must be contiguous");
  }
  check_float(k_cache, "k_cache");
  check_float(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  auto cos = cos_in.contiguous(), sin_signed = sin_in.contiguous();
  auto slot_mapping = slot_mapping_in.to(at::kLong).contiguous();
  const int64_t tokens = q.size(0), num_heads = q.size(1), num_kv_heads = k.size(1), head_dim = q.size(2);
  const int64_t slots = k_cache.numel() / (num_kv_heads * head_dim);
  auto q_out = at::empty({tokens, num_heads, head_dim}, q.options());
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos.data_ptr<float>() + t * head_dim;
    const float* s = sin_signed.data_ptr<float>() + t * head_dim;
    const float* qt = q.data_ptr<float>() + t * q.stride(0);
    for (int64_t h = 0; h < num_heads; ++h)
      rotate(qt + h * head_dim, c, s, q_out.data_ptr<float>() + (t * num_heads + h) * head_dim, head_dim);
    if (slot[t] < 0) continue;  // padding
    TORCH_CHECK(slot[t] < slots, "slot ", slot[t], " is outside the cache");
    float* kc = k_cache.data_ptr<float>() + slot[t] * num_kv_heads * head_dim;
    float* vc = v_cache.data_ptr<float>() + slot[t] * num_kv_heads * head_dim;
    const float* kt = k.data_ptr<float>() + t * k.stride(0);
    const float* vt = v.data_ptr<float>() + t * v.stride(0);
    for (int64_t h = 0; h < num_kv_heads; ++h) rotate(kt + h * head_dim, c, s, kc + h * head_dim, head_dim);
    std::copy(vt, vt + num_kv_heads * head_dim, vc);
  }
  return q_out;
}

// silu(gate) * up for x = [gate | up]: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate].
at::Tensor silu_and_mul(const at::Tensor& x_in) {
  check_float(x_in, "x");
  auto x = x_in.contiguous();
  const int64_t tokens = x.size(0), width = x.size(1) / 2;
  auto out = at::empty({tokens, width}, x.options());
  for (int64_t t = 0; t < tokens; ++t) {
    const float* gate = x.data_ptr<float>() + t * 2 * width;
    const float* up = gate + width;
    float* o = out.data_ptr<float>() + t * width;
    for (int64_t i = 0; i < width; ++i) o[i] = gate[i] / (1.f + vector_exp(-gate[i])) * up[i];
  }
  return out;
}

// One new token per sequence attending to its whole cached context, read through its block table.
// q: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs]
// int32 (context length including the new token, already stored). Returns [num_seqs, num_heads, head_dim].
// NOTE: grouped-query aware: each cached key and value is read once for all the query heads it serves.
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in, double scale) {
  check_float(q_in, "q");
  check_float(k_cache, "k_cache");
  check_float(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  auto q = q_in.contiguous();
  auto block_tables = block_tables_in.to(at::kInt).contiguous();
  auto seq_lens = seq_lens_in.to(at::kInt).contiguous();
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim;
  auto out = at::empty_like(q);
  const int* lens = seq_lens.data_ptr<int>();
  int64_t work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size, "seq_len ", lens[s], " does not fit its block table");
    work += lens[s];
  }
  // NOTE: threads only pay off for a few thousand context tokens a step (a fork costs a few us)
  const int64_t grain = work * num_kv_heads < 16384 ? num_seqs * num_kv_heads : 1;
  at::parallel_for(0, num_seqs * num_kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, g = item % num_kv_heads, len = lens[s];
      const int* table = block_tables.data_ptr<int>() + s * max_blocks;
      const float* qs = q.data_ptr<float>() + (s * num_heads + g * group) * head_dim;  // the group's heads
      float* os = out.data_ptr<float>() + (s * num_heads + g * group) * head_dim;
      scores.assign(group * len, 0.f);  // [group, len]
      // NOTE: walk the context a block at a time: one table lookup per block, not a division per token
      for (int64_t start = 0; start < len; start += block_size) {
        const float* keys = k_cache.data_ptr<float>() + table[start / block_size] * block_size * token_stride + g * head_dim;
        for (int64_t p = start; p < std::min(start + block_size, len); ++p) {
          const float* key = keys + (p - start) * token_stride;
          for (int64_t h = 0; h < group; ++h) scores[h * len + p] = dot(qs + h * head_dim, key, head_dim) * scale;
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* row = scores.data() + h * len;
        const float peak = *std::max_element(row, row + len);
        for (int64_t p = 0; p < len; ++p) row[p] = vector_exp(row[p] - peak);
        float lanes[kLanes] = {0.f};
        int64_t p = 0;
        for (; p + kLanes <= len; p += kLanes)
          for (int l = 0; l < kLanes; ++l) lanes[l] += row[p + l];
        float sum = 0.f;
        for (int l = 0; l < kLanes; ++l) sum += lanes[l];
        for (; p < len; ++p) sum += row[p];
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < len; ++p) row[p] *= inv;
        std::fill(os + h * head_dim, os + (h + 1) * head_dim, 0.f);
      }
      for (int64_t start = 0; start < len; start += block_size) {
        const float* values = v_cache.data_ptr<float>() + table[start / block_size] * block_size * token_stride + g * head_dim;
        for (int64_t p = start; p < std::min(start + block_size, len); ++p) {
          const float* value = values + (p - start) * token_stride;
          for (int64_t h = 0; h < group; ++h) {
            const float w = scores[h * len + p];
            float* o = os + h * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) o[d] += w * value[d];
          }
        }
      }
    }
  });
  return out;
}

// x [1, in] @ W^T for W stored as one column block per thread ([parts, in, out / parts], see
// models/cpu_linear.py): one batched product, each block streamed by its own core.
at::Tensor one_token_linear(const at::Tensor& x, const at::Tensor& blocks) {
  const int64_t parts = blocks.size(0), in = blocks.size(1);
  return at::bmm(x.expand({parts, 1, in}), blocks).view({1, parts * blocks.size(2)});
}

// A whole decoder layer for one token of one sequence, the model's LlamaDecoderLayer.forward operator for
// operator (the same kernels in the same order, so the same bits), without the ~150 us of Python and
// dispatch a layer otherwise costs between its operators. weights: input norm [hidden], q/k/v column
// blocks, o blocks, post-attention norm [hidden], gate/up blocks, down blocks. Returns (hidden, residual).
std::tuple<at::Tensor, at::Tensor> one_token_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual, at::TensorList weights, double eps,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& cos, const at::Tensor& sin_signed,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(hidden.size(0) == 1 && weights.size() == 6, "one token and six weights");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  auto [normed, total] = add_rms_norm(hidden, residual, weights[0], eps);
  auto qkv = one_token_linear(normed, weights[1]);  // [1, q_size + 2 * kv_size]
  auto q = qkv.narrow(1, 0, q_size).view({1, num_heads, head_dim});
  auto k = qkv.narrow(1, q_size, kv_size).view({1, num_kv_heads, head_dim});
  auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({1, num_kv_heads, head_dim});
  q = rotary_and_store_kv(q, k, v, k_cache, v_cache, slot_mapping, cos, sin_signed);
  auto attn = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale);  // [1, heads, head_dim]
  auto out = one_token_linear(attn.view({1, q_size}), weights[2]);
  auto [normed2, total2] = add_rms_norm(out, total, weights[3], eps);
  auto mlp = one_token_linear(silu_and_mul(one_token_linear(normed2, weights[4])), weights[5]);
  return {mlp, total2};
}

}  // namespace

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_and_store_kv(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor cos, Tensor sin_signed) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("one_token_layer(Tensor hidden, Tensor? residual, Tensor[] weights, float eps, int num_heads, "
        "int num_kv_heads, int head_dim, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor cos, "
        "Tensor sin_signed, Tensor block_tables, Tensor seq_lens, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_and_store_kv", &rotary_and_store_kv);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("decode_attention", &decode_attention);
  m.impl("one_token_layer", &one_token_layer);
}
