#include <cstdint>

__global__ void scale_kernel(float* data, int64_t n, float factor) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) data[i] *= factor;
}

void launch_scale(float* data, int64_t n, float factor) {
  scale_kernel<<<(n + 255) / 256, 256>>>(data, n, factor);
}
