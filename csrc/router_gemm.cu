// The router's logits GEMM: logits[t, e] = sum_h x[t, h] * w[e, h], 16-bit inputs, fp32 out.
//
// Legend: T tokens, H hidden, E experts.
//
// Why a kernel of our own for a GEMM cuBLAS does well: the router's GEMM is the first call of
// every MoE layer's step, and in a step that starts after a host synchronisation (every step of
// the benchmark protocol, every step after an optimizer sync in training) the device waits for
// the host to reach it. Measured on the H200 right after a synchronised step: a cold cuBLAS call
// costs ~100 us of host time more than a plain kernel launch (its handle, heuristics and
// workspace paths are out of the CPU caches), and the device idles for all of it. A plain launch
// of this kernel pays only the launch. Its GPU time is bounded by reading x once (x is
// T*H*2 bytes; w, E*H*2 bytes, stays in L2 for all blocks).
//
// Tiling: a 64 or 128 (tokens) x 128 (experts) block tile, 32-wide k steps, 8 warps as 2 x 4
// (each warp 32 or 64 tokens x 32 experts), mma.sync m16n8k16 with fp32 accumulators; operands stream through a 3-stage
// cp.async ring in shared memory (12 or 16 KB a stage). 64-token tiles are the default: twice
// the blocks (Qwen3-30B-A3B's 16384 tokens make 128 blocks of 128 for 132 SMs, one wave with one
// block an SM and little to hide each block's load latency). Each 64-byte smem row of 32 values is split
// into four 16-byte chunks whose order is XOR-swizzled by the row (chunk ^ ((row >> 1) & 3)),
// so the eight rows one ldmatrix phase reads fall into eight different bank groups. Rows past
// T or E and k past H are zero-filled by the copies (cp.async with a zero source size), so
// every size works as long as H % 8 == 0 (a 16-byte chunk never straddles the end of a row).
// Blocks are ordered expert-tile-fastest, so the blocks sharing a slab of x run together and
// read it from L2 once it is fetched.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moe_kernels.cuh"

namespace lightning_moe {
namespace {

constexpr int kTileE = 128;
constexpr int kTileK = 32;
constexpr int kStages = 3;
constexpr int kGemmThreads = 256;
constexpr int kChunks = kTileK / 8;  // 16-byte chunks a smem row

// Offset (in elements) of chunk `chunk` of smem row `row` in a [rows, kTileK] operand tile.
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kTileK + ((chunk ^ ((row >> 1) & 3)) * 8);
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; `valid` false copies nothing and zero-fills the destination.
__device__ __forceinline__ void copy_chunk(void* dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void load_matrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}

template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Rows [r0, r0 + kRows) of a [rows, H] operand, columns k0 .. k0+31 -> a swizzled smem tile.
// kRows * 4 chunks, dealt over the block's threads. A chunk past the operand's rows or past H is
// zero-filled; its source address stays the operand's first element (mapped memory).
template <int kRows, class T>
__device__ __forceinline__ void load_tile(T* tile, const T* __restrict__ src, int64_t rows, int64_t H, int64_t r0,
                                          int64_t k0) {
#pragma unroll
  for (int i = 0; i < kRows * kChunks / kGemmThreads; ++i) {
    const int c = threadIdx.x + i * kGemmThreads;
    const int row = c / kChunks, chunk = c % kChunks;
    const int64_t k = k0 + chunk * 8, r = r0 + row;
    const bool valid = r < rows && k < H;
    copy_chunk(tile + swizzled(row, chunk), src + (valid ? r * H + k : 0), valid);
  }
}

// kTileT tokens x 128 experts a block; the 8 warps as 2 (tokens) x 4 (experts), each warp
// kTileT/2 tokens x 32 experts.
template <class T, int kTileT>
__global__ void __launch_bounds__(kGemmThreads) router_logits_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                                    float* __restrict__ out, int64_t T_, int64_t H,
                                                                    int64_t E) {
  constexpr int kStageElems = (kTileT + kTileE) * kTileK;
  constexpr int kFragsT = kTileT / 2 / 16;  // 16-token mma fragments a warp
  __shared__ __align__(128) T smem[kStages * kStageElems];
  const int64_t e0 = static_cast<int64_t>(blockIdx.x) * kTileE;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTileT;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_t = (warp / 4) * (kTileT / 2);  // this warp's tokens of the tile
  const int warp_e = (warp % 4) * 32;            // and its 32 experts
  const int64_t k_steps = (H + kTileK - 1) / kTileK;
  auto load_stage = [&](int stage, int64_t k0) {
    T* xs = smem + stage * kStageElems;
    load_tile<kTileT>(xs, x, T_, H, t0, k0);
    load_tile<kTileE>(xs + kTileT * kTileK, w, E, H, e0, k0);
  };

  float acc[kFragsT][4][4] = {};  // [token 16-block][expert 8-block][mma fragment]

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_steps) load_stage(s, s * kTileK);
    commit_copies();
  }
  for (int64_t ks = 0; ks < k_steps; ++ks) {
    wait_copies<kStages - 2>();
    __syncthreads();  // stage ks landed for every thread; stage ks-1 is no longer read
    const int64_t next = ks + kStages - 1;
    if (next < k_steps) load_stage(static_cast<int>(next % kStages), next * kTileK);
    commit_copies();

    const T* xs = smem + (ks % kStages) * kStageElems;
    const T* ws = xs + kTileT * kTileK;
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      uint32_t a[kFragsT][4], b[2][4];
#pragma unroll
      for (int i = 0; i < kFragsT; ++i) {  // lanes 0-15: rows 0-15 at chunk 2kk; 16-31: the same rows at 2kk+1
        const int row = warp_t + i * 16 + (lane % 16);
        load_matrix_x4(a[i], xs + swizzled(row, kk * 2 + lane / 16));
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {  // matrices: (e 0-7, k lo), (e 0-7, k hi), (e 8-15, k lo), (e 8-15, k hi)
        const int m = lane / 8;
        const int row = warp_e + j * 16 + (m / 2) * 8 + (lane % 8);
        load_matrix_x4(b[j], ws + swizzled(row, kk * 2 + (m % 2)));
      }
#pragma unroll
      for (int i = 0; i < kFragsT; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          mma_16816<T>(acc[i][j], a[i], b[j / 2][(j % 2) * 2], b[j / 2][(j % 2) * 2 + 1]);
        }
      }
    }
  }
  wait_copies<0>();

  // Fragment (i, j): rows t0 + warp_t + 16i + lane/4 (+8), experts e0 + warp_e + 8j + 2(lane%4) (+1).
  const bool pairs = (E % 2) == 0;  // 8-byte stores stay aligned
#pragma unroll
  for (int i = 0; i < kFragsT; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t t = t0 + warp_t + i * 16 + lane / 4 + half * 8;
      if (t >= T_) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t e = e0 + warp_e + j * 8 + (lane % 4) * 2;
        const float v0 = acc[i][j][half * 2], v1 = acc[i][j][half * 2 + 1];
        float* dst = out + t * E + e;
        if (pairs && e + 1 < E) {
          *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
        } else {
          if (e < E) dst[0] = v0;
          if (e + 1 < E) dst[1] = v1;
        }
      }
    }
  }
}

template <class T, int kTileT>
cudaError_t launch_tiled(const void* x, const void* w, float* out, int64_t T_, int64_t H, int64_t E,
                         cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((E + kTileE - 1) / kTileE), static_cast<unsigned>((T_ + kTileT - 1) / kTileT));
  router_logits_kernel<T, kTileT><<<grid, kGemmThreads, 0, stream>>>(static_cast<const T*>(x),
                                                                    static_cast<const T*>(w), out, T_, H, E);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch(const void* x, const void* w, float* out, int64_t T_, int64_t H, int64_t E, int tile_tokens,
                   cudaStream_t stream) {
  return tile_tokens == 128 ? launch_tiled<T, 128>(x, w, out, T_, H, E, stream)
                            : launch_tiled<T, 64>(x, w, out, T_, H, E, stream);
}

}  // namespace

cudaError_t router_logits(const void* x, const void* w, float* out, int64_t num_tokens, int64_t hidden,
                          int64_t num_experts, DType dtype, int tile_tokens, cudaStream_t stream) {
  if (num_tokens == 0 || num_experts == 0) return cudaSuccess;
  if (hidden % 8 != 0 || dtype == DType::kFloat32) return cudaErrorInvalidValue;  // checked by bindings.cpp
  if (tile_tokens != 0 && tile_tokens != 64 && tile_tokens != 128) return cudaErrorInvalidValue;
  if (hidden == 0) return cudaMemsetAsync(out, 0, sizeof(float) * num_tokens * num_experts, stream);
  return dtype == DType::kBFloat16
             ? launch<__nv_bfloat16>(x, w, out, num_tokens, hidden, num_experts, tile_tokens, stream)
             : launch<__half>(x, w, out, num_tokens, hidden, num_experts, tile_tokens, stream);
}

}  // namespace lightning_moe
