// Round 32: does compute-sanitizer's racecheck follow an mbarrier handoff? Four minimal
// handoffs and one racy one, each one CTA of two warps: warp 0 produces 32 floats in SMEM,
// warp 1 waits on an mbarrier and reads them. Variants 0-3 are ordered by the PTX memory
// model; variant 4 is not. Build and run (sm_90a):
//   nvcc -arch=sm_90a -o /tmp/rc racecheck_mbarrier.cu
//   for v in 0 1 2 3 4; do compute-sanitizer --tool racecheck /tmp/rc $v; done
// 0 parity: lane 0 of warp 0 stores, arrives; warp 1 waits on the phase's parity (try_wait.parity)
// 1 token: as 0, but the readers arrive too and wait with their own arrival's token
// 2 bulk: lane 0 arms the barrier with expect_tx and issues one cp.async.bulk global->shared;
//         warp 1 waits on the parity (the pattern of the backward's LSE2/Delta copies)
// 3 warp: all 32 lanes of warp 0 store, __syncwarp, lane 0 arrives; parity wait (a RAW
//         handoff released by one lane; the backward's reports are its mirror, a WAR: all
//         lanes read, one lane releases, the next write lands)
// 4 none: as 0 without the wait: a real race, for the form of racecheck's report
#include <cstdio>
#include <cstdlib>
#include <cstdint>

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ uint64_t mbar_arrive(uint64_t* bar) {
    uint64_t state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];" : "=l"(state) : "r"(smem_addr(bar)) : "memory");
    return state;
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait_parity(uint64_t* bar, uint32_t parity) {
    asm volatile("{\n .reg .pred p;\n LAB_WAIT:\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 " @!p bra LAB_WAIT;\n}" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_wait_token(uint64_t* bar, uint64_t state) {
    asm volatile("{\n .reg .pred p;\n LAB_WAIT_T:\n"
                 " mbarrier.try_wait.shared::cta.b64 p, [%0], %1;\n"
                 " @!p bra LAB_WAIT_T;\n}" :: "r"(smem_addr(bar)), "l"(state) : "memory");
}

__global__ void handoff(const float* src, float* dst, int variant) {
    __shared__ alignas(128) float buf[32];
    __shared__ alignas(8) uint64_t bar;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) mbar_init(&bar, variant == 1 ? 33 : 1);
    __syncthreads();
    if (warp == 0) {
        if (variant == 2) {
            if (lane == 0) {
                mbar_arrive_expect_tx(&bar, sizeof(buf));
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                             " [%0], [%1], %2, [%3];"
                             :: "r"(smem_addr(buf)), "l"(src), "r"((uint32_t)sizeof(buf)),
                                "r"(smem_addr(&bar)) : "memory");
            }
        } else if (variant == 3) {
            buf[lane] = src[lane];
            __syncwarp();
            if (lane == 0) mbar_arrive(&bar);
        } else if (lane == 0) {
            for (int i = 0; i < 32; ++i) buf[i] = src[i];
            mbar_arrive(&bar);
        }
    } else {
        if (variant == 1) {
            mbar_wait_token(&bar, mbar_arrive(&bar));
        } else if (variant == 4) {
            // no wait
        } else {
            mbar_wait_parity(&bar, 0);
        }
        dst[lane] = buf[lane];
    }
}

int main(int argc, char** argv) {
    int variant = argc > 1 ? atoi(argv[1]) : 0;
    float *src, *dst, host[32];
    cudaMalloc(&src, sizeof(host));
    cudaMalloc(&dst, sizeof(host));
    for (int i = 0; i < 32; ++i) host[i] = float(i) + 0.5f;
    cudaMemcpy(src, host, sizeof(host), cudaMemcpyHostToDevice);
    handoff<<<1, 64>>>(src, dst, variant);
    cudaError_t err = cudaDeviceSynchronize();
    cudaMemcpy(host, dst, sizeof(host), cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int i = 0; i < 32; ++i) bad += host[i] != float(i) + 0.5f;
    printf("variant %d: %s, %d wrong values\n", variant, cudaGetErrorString(err), bad);
    return err != cudaSuccess || bad;
}
