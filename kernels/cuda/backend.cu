// The CUDA backend's memory ops, stream, scratch area and factory. Buffers come from cudaMalloc
// while the run is planned (the trainer allocates arenas up front; nothing is allocated in the
// step loop), every copy and fill is enqueued on the compute stream, and copy_to_host waits for
// the stream so the host sees every earlier op's result.
#include <mutex>
#include <unordered_map>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/scratch.cuh"

namespace tetra {

void CudaScratchDeleter::operator()(CudaScratch* s) const {
  if (s->data) cudaFree(s->data);
  delete s;
}

namespace {
// Sizes of live allocations, for the allocated/peak figures (free() gets only the pointer).
std::mutex g_sizes_mutex;
std::unordered_map<void*, size_t> g_sizes;
}  // namespace

CudaBackend::CudaBackend(int device, AttentionPath attention) : device_(device), attention_path_(attention) {
  int count = 0;
  TETRA_CUDA_CHECK(cudaGetDeviceCount(&count));
  TETRA_CHECK(device >= 0 && device < count, "CUDA device {} requested, {} present", device, count);
  TETRA_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t s = nullptr;
  TETRA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
}

std::string CudaBackend::kernel_report() const {
  std::string out;
  for (const std::string& part : {attention_report(), gemm_report()})
    if (!part.empty()) out += (out.empty() ? "" : "; ") + part;
  return out;
}

CudaBackend::~CudaBackend() {
  // Kernel-file state first (it may hold device memory and handles bound to the stream).
  if (stream_) cudaStreamSynchronize(cuda::as_stream(stream_));
  gemm_.reset();
  attention_.reset();
  scratch_.reset();
  if (stream_) cudaStreamDestroy(cuda::as_stream(stream_));
}

CudaScratch& CudaBackend::scratch() {
  if (!scratch_) {
    auto s = std::unique_ptr<CudaScratch, CudaScratchDeleter>(new CudaScratch);
    s->floats = size_t{1} << 20;  // 4 MiB: partials of any reduction the kernels launch
    TETRA_CUDA_CHECK(cudaMalloc(&s->data, s->floats * sizeof(float)));
    scratch_ = std::move(s);
  }
  return *scratch_;
}

void* CudaBackend::alloc(size_t bytes) {
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, bytes == 0 ? 256 : bytes);
  if (err != cudaSuccess) {
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    throw Error(fmt::format("cuda alloc of {} bytes failed ({}): {} of {} bytes free on device {}, "
                            "{} allocated by this run",
                            bytes, cudaGetErrorString(err), free_b, total_b, device_, allocated_));
  }
  {
    std::lock_guard<std::mutex> lock(g_sizes_mutex);
    g_sizes[ptr] = bytes;
  }
  allocated_ += bytes;
  if (allocated_ > peak_allocated_) peak_allocated_ = allocated_;
  return ptr;
}

void CudaBackend::free(void* ptr) {
  if (!ptr) return;
  {
    std::lock_guard<std::mutex> lock(g_sizes_mutex);
    auto it = g_sizes.find(ptr);
    if (it != g_sizes.end()) {
      allocated_ -= it->second;
      g_sizes.erase(it);
    }
  }
  // cudaFree synchronises the device: buffers are freed when the run ends, never in the step loop.
  TETRA_CUDA_CHECK(cudaFree(ptr));
}

void CudaBackend::memset_zero(void* ptr, size_t bytes) {
  if (bytes == 0) return;
  TETRA_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, cuda::as_stream(stream_)));
}

void CudaBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  TETRA_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, cuda::as_stream(stream_)));
  TETRA_CUDA_CHECK(cudaStreamSynchronize(cuda::as_stream(stream_)));
}

void CudaBackend::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  if (bytes == 0) return;
  // The host buffer may be reused as soon as this returns (pageable memory is staged by the
  // driver before cudaMemcpyAsync returns; pinned memory would not be): wait to be safe.
  TETRA_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, cuda::as_stream(stream_)));
  TETRA_CUDA_CHECK(cudaStreamSynchronize(cuda::as_stream(stream_)));
}

void CudaBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  TETRA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda::as_stream(stream_)));
}

void CudaBackend::synchronize() { TETRA_CUDA_CHECK(cudaStreamSynchronize(cuda::as_stream(stream_))); }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

std::unique_ptr<Backend> make_cuda_backend(int device, AttentionPath attention) {
  return std::make_unique<CudaBackend>(device, attention);
}

}  // namespace tetra
