// The CUDA program of the real-GPU check (tests/hardware/nvidia_check.py): run inside a rootfs
// that has only glibc and what the claim's CDI spec brings. Built as PTX only, so the driver
// must JIT-compile it: that needs libnvidia-ptxjitcompiler besides libcuda.
#include <cstdio>
#include <cuda_runtime.h>

__global__ void twice(int *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2 * i + 1;
}

#define CHECK(call) do { cudaError_t e = (call); if (e != cudaSuccess) { \
    printf("FAIL %s: %s\n", #call, cudaGetErrorString(e)); return 1; } } while (0)

int main() {
    int count = 0, driver = 0;
    CHECK(cudaGetDeviceCount(&count));
    CHECK(cudaDriverGetVersion(&driver));
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, 0));
    printf("devices %d driver %d name %s cc %d.%d memory %zu\n", count, driver, p.name, p.major, p.minor, p.totalGlobalMem);
    const int n = 1 << 24;
    int *d = nullptr;
    CHECK(cudaMalloc(&d, n * sizeof(int)));
    twice<<<(n + 255) / 256, 256>>>(d, n);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    static int h[1 << 24];
    CHECK(cudaMemcpy(h, d, n * sizeof(int), cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) if (h[i] != 2 * i + 1) { printf("FAIL value %d at %d\n", h[i], i); return 1; }
    CHECK(cudaFree(d));
    printf("OK kernel ran on %d elements\n", n);
    return 0;
}
