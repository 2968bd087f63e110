// Routing bookkeeping on the device: the router's top-k selection and the expert permutation.
//
// Legend: T tokens, E experts, K top-k slots per token, N = T*K flattened slots s = t*K + k,
// G expert groups, W warps.
//
// build_permutation is a stable counting sort of the N slots by expert id in four launches,
// none of which uses order-dependent atomics (the result is bitwise reproducible):
//   1. count:   each warp owns a chunk of consecutive slots and histograms it in its own slice
//               of shared memory -> chunk_hist[e][chunk] (expert-major, so that step 2 reads
//               each expert's chunks contiguously).
//   2. scan:    one block per expert scans its row of chunk_hist in place (exclusive: the
//               expert's slots before each chunk) and writes counts[e], the row total.
//   3. offsets: one small block scans counts -> offsets (inclusive, grouped_mm's `offs`).
//   4. scatter: each warp walks its chunk again in slot order; a slot's row is
//               offsets[e] - counts[e] + chunk prefix + the number of earlier slots of the same
//               expert in the chunk (match_any + popc within 32 slots, a running per-expert
//               count in shared memory across steps of 32).
// Rows of expert e are therefore in increasing slot order: the same order as
// torch.argsort(ids.flatten(), stable=True). Splitting the scan per expert keeps every load
// coalesced and spreads it over E blocks; a single-block scan of all E * chunks entries measured
// as the slowest part of routing.
//
// router_topk: one warp per token; lane l holds experts l, l + 32, ... (coalesced loads,
// E <= 1024 means <= 32 values per lane in registers). Every selection is a warp arg-max
// with ties to the lower expert index, repeated K times.

#include <climits>
#include <cmath>

#include "moe_kernels.cuh"

namespace lightning_moe {
namespace {

constexpr int kPermWarps = 8;          // warps per block for count / scatter
constexpr int kScanThreads = 256;      // one block per expert row of chunk_hist
constexpr int kOffsetThreads = 1024;   // the single offsets block: E <= 8192 -> <= 8 per thread
constexpr int64_t kTargetEntries = 131072;  // E * chunks: bounds the workspace and scan work
constexpr int64_t kMaxChunks = 2048;        // per expert row: <= 8 scan tiles of 256

// ---------------------------------------------------------------------------------------------
// build_permutation

struct ChunkPlan {
  int64_t chunk_slots;  // multiple of 32
  int64_t num_chunks;   // >= 1
  int warps_per_block;  // shared memory: warps_per_block * E ints
};

// Chunks are as small as possible (more warps in flight, shorter serial walks) while the
// number of chunks stays within kTargetEntries / E and kMaxChunks: at the qwen3 shape
// (N = 131072, E = 128) that is 1024 chunks of 128 slots.
ChunkPlan plan_chunks(int64_t num_slots, int64_t num_experts) {
  ChunkPlan p;
  int64_t max_chunks = kTargetEntries / num_experts;
  if (max_chunks < 64) max_chunks = 64;
  if (max_chunks > kMaxChunks) max_chunks = kMaxChunks;
  const int64_t steps = (num_slots + 32 * max_chunks - 1) / (32 * max_chunks);
  p.chunk_slots = 32 * (steps > 0 ? steps : 1);
  p.num_chunks = (num_slots + p.chunk_slots - 1) / p.chunk_slots;
  if (p.num_chunks < 1) p.num_chunks = 1;
  // 48 KiB of static-limit shared memory per block: fewer warps per block for large E.
  const int64_t fit = (48 * 1024) / (4 * num_experts);
  p.warps_per_block = static_cast<int>(fit < kPermWarps ? (fit > 0 ? fit : 1) : kPermWarps);
  return p;
}

// Inclusive scan of one value per thread over the block (blockDim.x a multiple of 32). Every
// thread of the block must call it (it holds barriers). `total` is the block's sum.
__device__ __forceinline__ int32_t block_inclusive_scan(int32_t v, int32_t (&sums)[33],
                                                        int32_t& total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  int32_t incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  if (lane == 31) sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int32_t ws = lane < num_warps ? sums[lane] : 0;
    int32_t wincl = ws;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t up = __shfl_up_sync(0xffffffffu, wincl, o);
      if (lane >= o) wincl += up;
    }
    sums[lane] = wincl - ws;  // exclusive prefix of each warp
    if (lane == 31) sums[32] = wincl;
  }
  __syncthreads();
  const int32_t result = incl + sums[warp];
  total = sums[32];
  __syncthreads();  // sums is reused by the next call
  return result;
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Expert of slot s, or -1 when the slot is past the chunk or its id is outside [0, E).
template <typename IdT>
__device__ __forceinline__ int slot_expert(const IdT* ids, int64_t s, int64_t end, int num_experts) {
  if (s >= end) return -1;
  const IdT v = ids[s];
  return (v >= 0 && v < num_experts) ? static_cast<int>(v) : -1;
}

template <typename IdT>
__global__ void __launch_bounds__(kPermWarps * 32, detail::kMinBlocks)
    perm_count_kernel(const IdT* __restrict__ ids, int64_t num_slots, int num_experts,
                      int64_t chunk_slots, int64_t num_chunks, int32_t* __restrict__ chunk_hist) {
  extern __shared__ int32_t smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int32_t* hist = smem + static_cast<int64_t>(warp) * num_experts;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp; c < num_chunks;
       c += warps_total) {
    for (int e = lane; e < num_experts; e += 32) hist[e] = 0;
    __syncwarp();
    const int64_t begin = c * chunk_slots;
    const int64_t end = begin + chunk_slots < num_slots ? begin + chunk_slots : num_slots;
    int e_next = slot_expert(ids, begin + lane, end, num_experts);
    for (int64_t s0 = begin; s0 < end; s0 += 32) {
      const int e = e_next;
      e_next = slot_expert(ids, s0 + 32 + lane, end, num_experts);  // prefetch the next step
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      // One writer per expert per step (the lowest lane of its peers): no atomics needed.
      if (e >= 0 && lane == __ffs(peers) - 1) hist[e] += __popc(peers);
      __syncwarp();
    }
    for (int e = lane; e < num_experts; e += 32) chunk_hist[e * num_chunks + c] = hist[e];
    __syncwarp();
  }
}

// Row e of chunk_hist (its chunks' counts) becomes the exclusive prefix within expert e, in
// tiles of blockDim.x coalesced entries with a running carry; counts[e] is the row's total.
__global__ void __launch_bounds__(kScanThreads)
    perm_expert_scan_kernel(int32_t* chunk_hist, int num_experts, int64_t num_chunks,
                            int32_t* __restrict__ counts) {
  __shared__ int32_t sums[33];
  for (int e = blockIdx.x; e < num_experts; e += gridDim.x) {  // uniform across the block
    int32_t* row = chunk_hist + static_cast<int64_t>(e) * num_chunks;
    int32_t carry = 0;
    for (int64_t base = 0; base < num_chunks; base += blockDim.x) {
      const int64_t c = base + threadIdx.x;
      const int32_t v = c < num_chunks ? row[c] : 0;
      int32_t total;
      const int32_t incl = block_inclusive_scan(v, sums, total);
      if (c < num_chunks) row[c] = carry + incl - v;
      carry += total;
    }
    if (threadIdx.x == 0) counts[e] = carry;
  }
}

// offsets[e] = counts[0] + ... + counts[e], by one block (E <= 8192: at most 8 contiguous
// entries per thread).
__global__ void __launch_bounds__(kOffsetThreads)
    perm_offsets_kernel(const int32_t* __restrict__ counts, int num_experts,
                        int32_t* __restrict__ offsets) {
  __shared__ int32_t sums[33];
  const int per = (num_experts + kOffsetThreads - 1) / kOffsetThreads;
  const int lo = min(static_cast<int>(threadIdx.x) * per, num_experts);
  const int hi = min(lo + per, num_experts);
  int32_t seg = 0;
  for (int e = lo; e < hi; ++e) seg += counts[e];
  int32_t total;
  int32_t run = block_inclusive_scan(seg, sums, total) - seg;
  for (int e = lo; e < hi; ++e) {
    run += counts[e];
    offsets[e] = run;
  }
}

template <typename IdT>
__global__ void __launch_bounds__(kPermWarps * 32, detail::kMinBlocks)
    perm_scatter_kernel(const IdT* __restrict__ ids, int64_t num_slots, int64_t top_k,
                        int num_experts, int64_t chunk_slots, int64_t num_chunks,
                        const int32_t* __restrict__ chunk_prefix, const int32_t* __restrict__ counts,
                        const int32_t* __restrict__ offsets, int32_t* __restrict__ src_idx,
                        int32_t* __restrict__ slot_row) {
  extern __shared__ int32_t smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int32_t* next_row = smem + static_cast<int64_t>(warp) * num_experts;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp; c < num_chunks;
       c += warps_total) {
    for (int e = lane; e < num_experts; e += 32) {
      next_row[e] = offsets[e] - counts[e] + chunk_prefix[e * num_chunks + c];
    }
    __syncwarp();
    const int64_t begin = c * chunk_slots;
    const int64_t end = begin + chunk_slots < num_slots ? begin + chunk_slots : num_slots;
    int e_next = slot_expert(ids, begin + lane, end, num_experts);
    for (int64_t s0 = begin; s0 < end; s0 += 32) {
      const int64_t s = s0 + lane;
      const int e = e_next;
      e_next = slot_expert(ids, s0 + 32 + lane, end, num_experts);
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      if (s < end) {
        if (e >= 0) {
          // Rank among this step's slots of expert e that come before s (stable).
          const int32_t r = next_row[e] + __popc(peers & lanemask_lt());
          slot_row[s] = r;
          src_idx[r] = static_cast<int32_t>(s / top_k);
        } else {
          slot_row[s] = -1;
        }
      }
      __syncwarp();  // every peer has read next_row[e] before it moves on
      if (e >= 0 && lane == __ffs(peers) - 1) next_row[e] += __popc(peers);
      __syncwarp();
    }
  }
  // Rows past the kept ones (dropped slots take none) are marked "none" so that nothing in
  // src_idx is left unwritten.
  const int64_t kept = offsets[num_experts - 1];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = kept + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < num_slots; r += stride) {
    src_idx[r] = -1;
  }
}

// ---------------------------------------------------------------------------------------------
// router_topk

// Best (value, index) in the warp among candidates, carrying a payload (the unbiased score);
// ties go to the lower expert index, and idx == INT_MAX means "no candidate". The comparison
// is a total order on distinct indices, so every lane ends with the same winner regardless of
// the butterfly's order.
__device__ __forceinline__ void warp_argmax(float& v, int& idx, float& payload) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    const float op = __shfl_xor_sync(0xffffffffu, payload, o);
    const bool better = oi != INT_MAX && (idx == INT_MAX || ov > v || (ov == v && oi < idx));
    if (better) {
      v = ov;
      idx = oi;
      payload = op;
    }
  }
}

// This lane's best eligible selection score (lane holds experts lane + 32*i, increasing in i,
// so a strict `>` keeps the lowest index among equals), then the warp's. The winner's unbiased
// score travels with it: reading it back as score[idx / 32] afterwards would be a dynamic
// register index, which nvcc turns into a local-memory copy of the whole array.
template <int kVpl>
__device__ __forceinline__ void select_best(const float (&score)[kVpl], const float (&bias)[kVpl],
                                            unsigned eligible, int lane, float& best_v,
                                            int& best_i, float& best_score) {
  best_v = -INFINITY;
  best_i = INT_MAX;
  best_score = 0.0f;
#pragma unroll
  for (int i = 0; i < kVpl; ++i) {
    const float sel = score[i] + bias[i];
    if (((eligible >> i) & 1u) && (best_i == INT_MAX || sel > best_v)) {
      best_v = sel;
      best_i = lane + 32 * i;
      best_score = score[i];
    }
  }
  warp_argmax(best_v, best_i, best_score);
}

// One token per warp. The steps, in the words of moe/router.py:
//   1. scores: logits (softmax without pre_softmax), softmax over all E (pre_softmax), or
//      sigmoid(logits) (sigmoid).
//   2. selection scores = scores + bias (bias only steers selection, never the weights).
//   3. group limiting (num_groups > 0): a group's score is the sum of its top K/group_topk
//      selection scores; experts outside the best group_topk groups are not selectable.
//   4. top-K of the selection scores -> topk_ids, in decreasing order.
//   5. weights from the unbiased scores of the chosen experts: softmax over the K chosen logits
//      (softmax), or the scores themselves, divided by their sum when norm_topk_prob (always
//      for pre_softmax, K > 1 for sigmoid); times scaling_factor.
template <int kVpl>
__global__ void __launch_bounds__(256)
    router_topk_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                       int64_t num_tokens, int num_experts, int top_k, int score_func,
                       bool pre_softmax, bool norm_topk_prob, float scaling_factor,
                       int num_groups, int group_topk, int64_t* __restrict__ topk_ids,
                       float* __restrict__ topk_weights) {
  constexpr int kWarps = 256 / 32;
  const int lane = threadIdx.x & 31;
  unsigned valid = 0;  // bit i: expert lane + 32*i exists
  float b[kVpl];
#pragma unroll
  for (int i = 0; i < kVpl; ++i) {
    const int e = lane + 32 * i;
    if (e < num_experts) valid |= 1u << i;
    b[i] = (bias != nullptr && e < num_experts) ? bias[e] : 0.0f;
  }
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); t < num_tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    const float* row = logits + t * num_experts;
    float s[kVpl];  // step 1: unbiased scores
#pragma unroll
    for (int i = 0; i < kVpl; ++i) s[i] = ((valid >> i) & 1u) ? row[lane + 32 * i] : -INFINITY;
    if (score_func == static_cast<int>(ScoreFunc::kSigmoid)) {
#pragma unroll
      for (int i = 0; i < kVpl; ++i) s[i] = 1.0f / (1.0f + expf(-s[i]));
    } else if (pre_softmax) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < kVpl; ++i) mx = fmaxf(mx, s[i]);
      mx = detail::warp_max(mx);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kVpl; ++i) {
        s[i] = ((valid >> i) & 1u) ? expf(s[i] - mx) : 0.0f;
        sum += s[i];
      }
      sum = detail::warp_sum(sum);
      const float inv = 1.0f / sum;
#pragma unroll
      for (int i = 0; i < kVpl; ++i) s[i] *= inv;
    }

    unsigned eligible = valid;
    if (num_groups > 0) {  // step 3
      const int group_size = num_experts / num_groups;
      const int per_group = top_k / group_topk;
      float my_group_score = -INFINITY;  // lane g keeps group g's score (G <= 32)
      for (int g = 0; g < num_groups; ++g) {
        unsigned in_group = 0;
#pragma unroll
        for (int i = 0; i < kVpl; ++i) {
          const int e = lane + 32 * i;
          if (e >= g * group_size && e < (g + 1) * group_size) in_group |= 1u << i;
        }
        float acc = 0.0f;  // summed in decreasing order, as topk(...).values.sum()
        for (int j = 0; j < per_group; ++j) {
          float v, unused;
          int idx;
          select_best<kVpl>(s, b, in_group, lane, v, idx, unused);
          acc += v;
          if ((idx & 31) == lane) in_group &= ~(1u << (idx >> 5));
        }
        if (lane == g) my_group_score = acc;
      }
      unsigned keep = 0;  // bit g: group g stays selectable
      bool lane_open = lane < num_groups;
      for (int j = 0; j < group_topk; ++j) {
        float v = lane_open ? my_group_score : -INFINITY;
        int idx = lane_open ? lane : INT_MAX;
        float unused = 0.0f;
        warp_argmax(v, idx, unused);
        keep |= 1u << idx;
        if (idx == lane) lane_open = false;
      }
#pragma unroll
      for (int i = 0; i < kVpl; ++i) {
        const int e = lane + 32 * i;
        if (e < num_experts && !((keep >> (e / group_size)) & 1u)) eligible &= ~(1u << i);
      }
    }

    // Step 4: lane k ends up holding the k-th choice and its unbiased score.
    int my_id = 0;
    float my_score = 0.0f;
    for (int k = 0; k < top_k; ++k) {
      float v, unbiased;
      int idx;
      select_best<kVpl>(s, b, eligible, lane, v, idx, unbiased);
      if ((idx & 31) == lane) eligible &= ~(1u << (idx >> 5));
      if (lane == k) {
        my_id = idx;
        my_score = unbiased;
      }
    }

    // Step 5.
    const bool mine = lane < top_k;
    float weight;
    if (score_func == static_cast<int>(ScoreFunc::kSoftmax) && !pre_softmax) {
      const float mx = detail::warp_max(mine ? my_score : -INFINITY);
      const float ex = mine ? expf(my_score - mx) : 0.0f;
      weight = ex / detail::warp_sum(ex);
    } else {
      weight = my_score;
      const bool renorm = norm_topk_prob &&
                          (score_func == static_cast<int>(ScoreFunc::kSoftmax) || top_k > 1);
      if (renorm) weight = weight / detail::warp_sum(mine ? my_score : 0.0f);
    }
    if (mine) {
      topk_ids[t * top_k + lane] = my_id;
      topk_weights[t * top_k + lane] = weight * scaling_factor;
    }
  }
}

}  // namespace

size_t build_permutation_workspace_bytes(int64_t num_slots, int64_t num_experts) {
  if (num_experts < 1) num_experts = 1;
  const ChunkPlan p = plan_chunks(num_slots, num_experts);
  const size_t bytes = sizeof(int32_t) * static_cast<size_t>(num_experts * p.num_chunks);
  return (bytes + 15) / 16 * 16;
}

cudaError_t build_permutation(const void* topk_ids, bool ids_are_int64, int64_t num_tokens,
                              int64_t top_k, int64_t num_experts, int32_t* src_idx,
                              int32_t* slot_row, int32_t* counts, int32_t* offsets, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kMaxPermuteExperts) return cudaErrorInvalidValue;
  const int64_t num_slots = num_tokens * top_k;
  if (workspace_bytes < build_permutation_workspace_bytes(num_slots, num_experts)) {
    return cudaErrorInvalidValue;
  }
  const ChunkPlan p = plan_chunks(num_slots, num_experts);
  auto* chunk_hist = static_cast<int32_t*>(workspace);
  const int threads = p.warps_per_block * 32;
  const size_t smem = sizeof(int32_t) * static_cast<size_t>(p.warps_per_block * num_experts);
  const int64_t blocks_needed = (p.num_chunks + p.warps_per_block - 1) / p.warps_per_block;
  const int grid = detail::grid_size(blocks_needed);
  const int e = static_cast<int>(num_experts);
  if (ids_are_int64) {
    perm_count_kernel<int64_t><<<grid, threads, smem, stream>>>(
        static_cast<const int64_t*>(topk_ids), num_slots, e, p.chunk_slots, p.num_chunks, chunk_hist);
  } else {
    perm_count_kernel<int32_t><<<grid, threads, smem, stream>>>(
        static_cast<const int32_t*>(topk_ids), num_slots, e, p.chunk_slots, p.num_chunks, chunk_hist);
  }
  const int scan_grid = detail::grid_size(num_experts);
  perm_expert_scan_kernel<<<scan_grid, kScanThreads, 0, stream>>>(chunk_hist, e, p.num_chunks, counts);
  perm_offsets_kernel<<<1, kOffsetThreads, 0, stream>>>(counts, e, offsets);
  if (ids_are_int64) {
    perm_scatter_kernel<int64_t><<<grid, threads, smem, stream>>>(
        static_cast<const int64_t*>(topk_ids), num_slots, top_k, e, p.chunk_slots, p.num_chunks,
        chunk_hist, counts, offsets, src_idx, slot_row);
  } else {
    perm_scatter_kernel<int32_t><<<grid, threads, smem, stream>>>(
        static_cast<const int32_t*>(topk_ids), num_slots, top_k, e, p.chunk_slots, p.num_chunks,
        chunk_hist, counts, offsets, src_idx, slot_row);
  }
  return cudaGetLastError();
}

cudaError_t router_topk(const float* logits, const float* bias, int64_t num_tokens,
                        int64_t num_experts, int64_t top_k, ScoreFunc score_func, bool pre_softmax,
                        bool norm_topk_prob, float scaling_factor, int64_t num_groups,
                        int64_t group_topk, int64_t* topk_ids, float* topk_weights,
                        cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kMaxRouterExperts || top_k < 1 || top_k > kMaxRouterTopK ||
      top_k > num_experts || num_groups < 0 || num_groups > kMaxRouterGroups) {
    return cudaErrorInvalidValue;
  }
  if (num_groups > 0 && (num_experts % num_groups != 0 || group_topk < 1 ||
                         group_topk > num_groups || top_k < group_topk ||
                         top_k > group_topk * (num_experts / num_groups))) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens <= 0) return cudaSuccess;
  const int grid = detail::grid_size((num_tokens + 7) / 8);
  const int e = static_cast<int>(num_experts);
  const int k = static_cast<int>(top_k);
  const int sf = static_cast<int>(score_func);
  const int g = static_cast<int>(num_groups);
  const int gk = static_cast<int>(group_topk);
#define LMOE_ROUTER_LAUNCH(VPL)                                                                \
  router_topk_kernel<VPL><<<grid, 256, 0, stream>>>(logits, bias, num_tokens, e, k, sf,        \
                                                    pre_softmax, norm_topk_prob, scaling_factor, \
                                                    g, gk, topk_ids, topk_weights)
  // Values per lane, rounded up to a power of two: six instantiations cover E <= 1024.
  if (num_experts <= 32) {
    LMOE_ROUTER_LAUNCH(1);
  } else if (num_experts <= 64) {
    LMOE_ROUTER_LAUNCH(2);
  } else if (num_experts <= 128) {
    LMOE_ROUTER_LAUNCH(4);
  } else if (num_experts <= 256) {
    LMOE_ROUTER_LAUNCH(8);
  } else if (num_experts <= 512) {
    LMOE_ROUTER_LAUNCH(16);
  } else {
    LMOE_ROUTER_LAUNCH(32);
  }
#undef LMOE_ROUTER_LAUNCH
  return cudaGetLastError();
}

}  // namespace lightning_moe
